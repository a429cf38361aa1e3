"""Budgets (`ModelConfig.budget`, `data/budget.py`): hard caps on what a run spends, counted across
restarts; at a limit the work that would spend more is refused before it starts, naming the budget,
the limit and how far past it the run is."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import journeyman as jm
import openai
import pytest
from _support import RuleJudge, tiny_model_dir

pytestmark = pytest.mark.integration


def _model(**budget: Any) -> jm.TrainableModel:
    return jm.TrainableModel(
        name="capped",
        project="budget",
        base_model=str(tiny_model_dir()),
        lora=jm.LoraConfig(r=4),
        max_tokens=4,
        budget=jm.Budget(**budget) if budget else None,
    )


async def _ask(model: jm.TrainableModel) -> int:
    done = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi."}], max_tokens=4, temperature=1.0
    )
    return done.usage.completion_tokens if done.usage else 0


async def _group(model: jm.TrainableModel) -> jm.TrajectoryGroup:
    client, ask = model.openai_client(), [{"role": "user", "content": "Count."}]
    done = await client.chat.completions.create(model=model.name, messages=ask, max_tokens=4, n=2)  # pyright: ignore[reportArgumentType]
    return jm.TrajectoryGroup(
        jm.Trajectory(messages_and_choices=[*ask, c], reward=float(i)) for i, c in enumerate(done.choices)
    )


async def test_sampling_past_its_budget_is_refused_and_the_spend_survives_a_restart(tmp_path: Path) -> None:
    backend = jm.LocalBackend(path=tmp_path)
    model = _model(sampled_tokens=10)
    try:
        await model.register(backend)
        spent = 0
        while spent < 10:
            spent += await _ask(model)
        with pytest.raises(openai.APIStatusError) as refused:
            await _ask(model)
        assert refused.value.status_code == 402
        assert "budget.sampled_tokens" in str(refused.value) and f"spent {spent} of its limit 10" in str(
            refused.value
        )
    finally:
        backend.close()
    # a restart goes on counting from spend.json: still refused
    again = jm.LocalBackend(path=tmp_path)
    try:
        await model.register(again)
        assert again.service(model).meter.spent()["sampled_tokens"] == spent  # pyright: ignore[reportOptionalMemberAccess]
        with pytest.raises(openai.APIStatusError, match=r"budget\.sampled_tokens"):
            await _ask(model)
        raised = _model(sampled_tokens=spent + 100)  # a person raises it: spent stays counted
        await raised.register(again)
        assert await _ask(raised) > 0
    finally:
        again.close()


async def test_a_step_past_the_trained_tokens_budget_is_refused_and_the_rows_record_the_spend(
    tmp_path: Path,
) -> None:
    backend = jm.LocalBackend(path=tmp_path)
    model = _model(trained_tokens=1)
    try:
        await model.register(backend)
        first = await model.train([await _group(model)], config=jm.TrainConfig(learning_rate=1e-3))
        assert first.step == 1  # under the limit when it began
        with pytest.raises(jm.BudgetExceededError) as e:
            await model.train([await _group(model)])
        assert e.value.budget == "trained_tokens" and e.value.limit == 1 and e.value.spent > 1
        assert await model.get_step() == 1  # nothing trained, nothing half-written
        (row,) = [r for r in await model.history() if r.get("split") == "train"]
        assert row["train/spend_trained_tokens"] == e.value.spent and row["train/spend_sampled_tokens"] > 0
    finally:
        backend.close()


async def test_wall_time_is_a_budget_too(tmp_path: Path) -> None:
    backend = jm.LocalBackend(path=tmp_path)
    try:
        unbudgeted = _model()
        await unbudgeted.register(backend)
        group = await _group(unbudgeted)  # sampled before the budget
        model = _model(wall_s=0.001)  # registered again with one: its clock began at the first
        await model.register(backend)
        with pytest.raises(openai.APIStatusError, match=r"budget\.wall_s"):
            await _ask(model)
        with pytest.raises(jm.BudgetExceededError, match=r"budget\.wall_s"):
            await model.train([group])
    finally:
        backend.close()


def test_a_bad_budget_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="sampled_tokens"):
        jm.Budget(sampled_tokens=0)
    with pytest.raises(ValueError, match="warn_at"):
        jm.Budget(warn_at=1.5)


def _judged() -> jm.TrajectoryGroup:
    ask = [{"role": "user", "content": "The capital of France?"}]
    return jm.TrajectoryGroup(
        jm.Trajectory(messages_and_choices=[*ask, {"role": "assistant", "content": text}])
        for text in ("Paris.", "Lyon.")
    )


async def test_the_judge_is_charged_to_the_model_it_scores_for_and_stops_at_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RULER checks the budget before it asks and charges the answer after: tokens for any judge,
    dollars from LiteLLM's price table for a LiteLLM one; past a limit it raises, even when told to
    swallow the judge's errors; a cached answer costs nothing."""
    from journeyman.client.protocol import charging
    from journeyman.rewards.ruler import RulerConfig, ruler_score_group

    backend = jm.LocalBackend(path=tmp_path)
    by_tokens = _model(judge_tokens=3)  # the rule judge reports 1 prompt + 1 completion token a call
    by_usd = _model(judge_usd=0.00002).model_copy(update={"name": "paid"})
    with RuleJudge() as judge:
        try:
            await by_tokens.register(backend)
            await by_usd.register(backend)
            config = RulerConfig(judge_model="rule", cache_dir=tmp_path / "ruler")
            score = functools.partial(ruler_score_group, judge=judge.base_url, config=config)
            await score(_judged(), charge_to=by_tokens)
            assert backend.service(by_tokens).meter.spent()["judge_tokens"] == 2  # pyright: ignore[reportOptionalMemberAccess]
            await score(_judged(), charge_to=by_tokens)  # cached: nothing asked, nothing charged
            with charging(by_tokens):  # as a TrainLoop charges its model
                await score(_judged(), rubric="Shorter is better.")  # 2 < 3 when asked: 4 after
            with pytest.raises(jm.BudgetExceededError) as e:
                await score(_judged(), rubric="Longer.", charge_to=by_tokens, swallow_exceptions=True)
            assert (e.value.budget, e.value.limit, e.value.spent) == ("judge_tokens", 3, 4)
            assert len(judge.requests) == 2  # the third call was never made
            assert (tmp_path / "budget/models/capped/spend.json").read_text().count('"judge_tokens": 4')
            await _charge_over_http(backend, tmp_path)

            # a paid LiteLLM judge: LiteLLM itself, its "openai/" provider pointed at the rule judge,
            # priced by the table it ships ($2.50 / $10 per 1M tokens for gpt-4o)
            monkeypatch.setenv("OPENAI_BASE_URL", judge.base_url)
            monkeypatch.setenv("OPENAI_API_KEY", "sk-local")
            paid = functools.partial(
                ruler_score_group, judge="openai/gpt-4o", use_cache=False, charge_to=by_usd
            )
            asked = len(judge.requests)
            await paid(_judged())
            await paid(_judged())  # 1 + 1 tokens a call: $0.0000125 each, under $0.00002 when asked
            with pytest.raises(
                jm.BudgetExceededError, match=r"budget\.judge_usd: paid spent 2\.5e-05 of its limit"
            ):
                await paid(_judged())
            assert len(judge.requests) == asked + 2  # through LiteLLM to the judge; the third never asked
            spent = backend.service(by_usd).meter.spent()  # pyright: ignore[reportOptionalMemberAccess]
            assert spent["judge_usd"] == pytest.approx(2.5e-5) and spent["judge_tokens"] == 4
        finally:
            backend.close()


def test_the_budget_options_build_the_model_budget() -> None:
    """`--budget-*` (every command that registers a model: demo, sft, mcp-rl train): none given is no
    budget; a refused value names its option."""
    from journeyman.app.options import BUDGET, App, budget_of, with_fields
    from typer.testing import CliRunner

    app, seen = App(), []

    @app.command()
    @with_fields(budget=BUDGET)
    def run(*, budget: dict[str, Any]) -> None:
        seen.append(budget_of(budget))

    @app.command()
    def other() -> None: ...  # two commands: `run` is named on the command line

    flags = ["--budget-sampled-tokens", "100", "--budget-judge-usd", "0.5", "--budget-wall-s", "60"]
    assert CliRunner().invoke(app, ["run", *flags]).exit_code == 0
    assert CliRunner().invoke(app, ["run"]).exit_code == 0
    assert seen == [jm.Budget(sampled_tokens=100, judge_usd=0.5, wall_s=60), None]
    bad = CliRunner().invoke(app, ["run", "--budget-judge-tokens", "0"])
    assert bad.exit_code == 2 and "--budget-judge-tokens" in bad.output


async def _charge_over_http(backend: jm.LocalBackend, tmp_path: Path) -> None:
    """`POST .../charge` (what a RemoteBackend sends): a train token's charge is added and answered with
    the spend; a check past the limit is a 402 naming the budget; a sample token may not charge."""
    import httpx
    from journeyman.backends.server import create_app
    from journeyman.client.wire import PREFIX
    from journeyman.serving.api_tokens import TokenBook
    from journeyman.serving.guard import Guard

    book = TokenBook(tmp_path / "tokens.json")
    trainer, viewer = book.add("trainer", "train"), book.add("viewer", "sample")
    app = Guard(create_app(backend, book), book, 2**20)
    url = f"{PREFIX}/models/capped/charge"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        r = await http.post(
            url, json={"judge_tokens": 1, "check": False}, headers={"authorization": f"Bearer {trainer}"}
        )
        assert r.status_code == 200 and r.json()["judge_tokens"] == 5, r.text
        r = await http.post(url, json={}, headers={"authorization": f"Bearer {trainer}"})
        assert r.status_code == 402 and r.json()["error"]["param"] == "budget.judge_tokens", r.text
        r = await http.post(url, json={"judge_usd": -1}, headers={"authorization": f"Bearer {trainer}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "judge_usd", r.text
        r = await http.post(url, json={"judge_tokens": 1}, headers={"authorization": f"Bearer {viewer}"})
        assert r.status_code == 403, r.text
