"""The held-out win rate against a baseline, judged by a real OpenAI-compatible rule judge on
127.0.0.1 standing in for a frontier judge, with the real embedded model playing real episodes on
the example to-do server (stdio)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, cast

import journeyman as jm
import pytest
from _support import ChatServer, ruler_request
from journeyman_mcp.players import resolve_against
from journeyman_mcp.rollout import COMPLETE_TOOL, RolloutConfig, system_prompt
from journeyman_mcp.scenarios import Scenario
from journeyman_mcp.server import ServerSpec, SessionPool
from journeyman_mcp.train import EvalSummary, McpRlSettings, TrainReport, compare, evaluate, too_easy
from journeyman_mcp.winrate import WinRate, combine, wilson, win_rate

ROOT = Path(__file__).resolve().parents[3]
TODO_SERVER = [sys.executable, str(ROOT / "examples" / "mcp_todo_server.py")]
MARKER = "zebra"  # what the rule judge prefers, and what the adapter is taught to write


class PairJudge(ChatServer):
    """A judge endpoint that reads the RULER request as any judge would (trajectories from the
    prompt, ids from the schema). Asked for model "rule": 10 for a trajectory that mentions the
    marker, 2 otherwise. Asked for "first": 10 for whichever trajectory it reads first (a pure
    position bias)."""

    async def answer(self, body: dict[str, Any]) -> str:
        ids, shown = ruler_request(body)

        def score(i: str) -> int:
            if body["model"] == "first":
                return 10 if i == "1" else 2
            return 10 if MARKER in shown[i] else 2

        scores = [{"trajectory_id": i, "explanation": "", "score": score(i)} for i in ids]
        return json.dumps({"scores": scores})


pair_judge = PairJudge.module_fixture("pair_judge")


# -- pure parts --------------------------------------------------------------------------------------


def test_wilson_interval_and_the_two_orders() -> None:
    low, high = wilson(0.5, 10)
    assert low == pytest.approx(0.2366, abs=1e-3) and high == pytest.approx(0.7634, abs=1e-3)
    assert wilson(1.0, 4)[1] == pytest.approx(1.0) and wilson(1.0, 4)[0] == pytest.approx(0.5101, abs=1e-3)
    assert wilson(0.5, 0) == (0.0, 1.0)
    # a position-biased judge (each order prefers the run shown first) scores a tie
    assert combine("win", "loss") == "tie"
    assert combine("win", "tie") == "win" and combine("tie", "loss") == "loss"


def test_the_table_names_the_judge_and_warns_on_a_saturated_task_set() -> None:
    easy = EvalSummary(
        step=0,
        scenarios=10,
        success=0.9,
        success_sem=0.1,
        reward=1.0,
        tool_calls=1,
        tool_error_rate=0,
        invalid_calls=0,
        completed=0,
        samples=2,
        sampled_success=0.55,
        sampled_success_sem=0.1,
    )
    warning = too_easy(easy)
    assert warning and "too easy to show a gain" in warning
    assert too_easy(easy.model_copy(update={"success": 0.85})) is None
    rate = WinRate(
        step=3,
        against="base (step 0)",
        judge="http://127.0.0.1:1/v1#rule",
        wins=3,
        ties=1,
        losses=0,
        unjudged=0,
        rate=0.875,
        low=0.47,
        high=0.98,
        pairs=[],
    )
    table = TrainReport(
        run_dir=Path("."),
        scenarios_file=Path("s.json"),
        evals=[easy],
        steps=[],
        win_rates=[rate],
        warnings=[warning],
    ).table()
    assert "0.90 ± 0.10" in table and "0.55 ± 0.10" in table  # greedy and sampled side by side
    assert "judge http://127.0.0.1:1/v1#rule" in table and "3 wins / 1 ties / 0 losses" in table
    assert "ties count half; 95% Wilson" in table and "warning: " in table


# -- real episodes, real judge server ----------------------------------------------------------------


def _taught(info_tools: list[dict[str, Any]], system: str, task: str) -> jm.Trajectory:
    """A demonstration: the task answered by add_task with the marker as the title."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "add_task", "arguments": json.dumps({"title": MARKER})},
    }
    return jm.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": system},
            {"role": "user", "content": task},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ],
        tools=[*info_tools, COMPLETE_TOOL],
        reward=1.0,
    )


@pytest.mark.slow
async def test_a_trained_adapter_the_judge_prefers_wins_and_the_base_ties_with_itself(
    served: tuple[object, object], pair_judge: PairJudge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = cast(jm.LocalBackend, served[1])
    model = jm.TrainableModel(name="mcp-winrate", project="tests")
    await model.register(backend)
    monkeypatch.setenv("JOURNEYMAN_CACHE", str(tmp_path))  # the judge's answers (the weights are loaded)
    scenarios = [
        Scenario(id=f"s{i}", task=f"Add '{t}' to my to-do list.", tools=["add_task"])
        for i, t in enumerate(["buy milk", "water the plants"])  # two pairs: a win needs both
    ]
    # free turns: no grammar to compile for a fresh engine (minutes on a busy 2-core CPU)
    cfg = RolloutConfig(max_turns=1, forced_turns=0, max_tokens=32)
    settings = McpRlSettings(
        server=ServerSpec.parse(TODO_SERVER), tools=["add_task"], rollout=cfg, judge_model="rule"
    )
    async with SessionPool(ServerSpec.parse(TODO_SERVER), size=2) as pool:
        # the one tool the tasks need (as `--tools add_task` would): a prompt of 350 tokens, not 589,
        # so the SFT epochs below cost a third less
        info = (await pool.describe()).select(settings.tools)
        _, base_runs = await evaluate(model, pool, info, scenarios, cfg, log=False)
        # teach the adapter the marker: one SFT step on demonstrations of other tasks. Four epochs
        # (loss 1.17 -> 0.007; 3 passed too) where ten were run: each epoch is ~6 s of a 2-core CPU
        demos = [
            _taught(info.tools, system_prompt(info), f"Put '{t}' on my list.")
            for t in ["pay rent", "walk the dog", "fix the bike"]
        ]
        sft_cfg = jm.SFTConfig(epochs=4, learning_rate=3e-3, lr_schedule="constant", warmup_ratio=0.0)
        sft = await model.train_sft(demos, config=sft_cfg)
        assert sft.step == 1
        _, trained = await evaluate(model, pool, info, scenarios, cfg, log=False)
        runs = [t.messages() for g in trained for t in g.trajectories]
        assert all(MARKER in json.dumps(m) for m in runs), runs
        # the default baseline: the base model, played by the same engine with the adapter off
        base, rerun, rate = await compare(
            settings,
            model,
            pool,
            info,
            scenarios,
            trained,
            pair_judge.base_url,
            backend,
            print,
            None,  # type: ignore[arg-type]
        )
        assert await model.get_step() == 1  # the adapter is served again afterwards
    assert rate is not None and rate.against == "base (step 0)" and base.player == "base (step 0)"
    assert rate.judge == f"{pair_judge.base_url}#rule"  # the table names the judge
    assert rate.wins > len(scenarios) / 2 and rate.losses == 0, rate.pairs
    # swapping the order does not flip the verdict
    assert all(p.forward == p.backward == p.verdict for p in rate.pairs), rate.pairs
    assert rate.rate > 0.5 and rate.low > 0.2
    # in the two orders, the judge was asked twice per pair: the second order never came from the cache
    asked = [r for r in pair_judge.requests if r["model"] == "rule"]
    assert len(asked) == 2 * len(scenarios)

    # the base model against itself (its runs before training vs the re-run with the adapter off)
    self_rate = await win_rate(
        base_runs, rerun, judge=pair_judge.base_url, judge_model="rule", step=0, against="base"
    )
    assert self_rate.ties == len(scenarios) and self_rate.wins == self_rate.losses == 0
    assert self_rate.rate == 0.5

    # a judge that only prefers whatever it reads first: both orders cancel into ties
    biased = await win_rate(
        trained, rerun, judge=pair_judge.base_url, judge_model="first", step=1, against="base"
    )
    assert [(p.forward, p.backward, p.verdict) for p in biased.pairs] == [("win", "loss", "tie")] * len(
        scenarios
    )


async def test_against_names_any_openai_compatible_server_and_checks_its_fields(
    served: tuple[object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, backend = served
    url = backend.inference(shared.name).base_url  # type: ignore[attr-defined]
    # a URL's key comes from $OPENAI_API_KEY; the backend's own endpoint demands its key
    monkeypatch.setenv("OPENAI_API_KEY", backend.inference(shared.name).api_key)  # type: ignore[attr-defined]
    player = await resolve_against(url, shared.name)  # type: ignore[attr-defined]
    assert player.model == shared.name and player.label == f"{url}#{shared.name}"  # type: ignore[attr-defined]
    reply = await player.client.chat.completions.create(
        model=player.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].message is not None
    with pytest.raises(jm.InvalidFieldError) as err:
        await resolve_against("http://127.0.0.1:9/v1")
    assert err.value.field == "against_model"
    with pytest.raises(jm.InvalidFieldError) as err:
        await resolve_against("gpt 4o")
    assert err.value.field == "against"
