"""Live training (docs/live.md): outcomes posted before the episode ends, twice, for an unknown
episode, after expiry; the baseline's unbiasedness on a synthetic stream and a step's advantages as
documented; gate decisions (promote, reject, rollback, by command) with their history rows; and
`kill -9` of `journeyman serve` with scored episodes waiting loses none of them.

The model is a random 2-layer Llama with the embedded tokenizer (`tiny_model_dir`): real requests
through the real endpoint, real training steps and checkpoints, in seconds; what it says is noise,
so the rewards are the test's own."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import journeyman as jm
import pytest
from _support import langfuse_receiver, tiny_model_dir, wait_until
from journeyman.backends.server import ServerProcess
from journeyman.data.live_types import EpisodeOutcome
from journeyman.rollout.baseline import RunningBaseline, advantages

pytestmark = pytest.mark.integration

QUICK = jm.LiveConfig(
    episodes_per_step=4,
    settle_s=0.2,
    gate=jm.GateConfig(canary_share=0.5, canary_episodes=3, rollback_episodes=3, rollback_drop=0.3),
)


# -- the baseline ---------------------------------------------------------------------------------


def test_a_steps_advantages_are_what_the_docs_say() -> None:
    baseline = RunningBaseline()
    assert baseline.before("a", 1.0) == 0.0  # nothing before it
    assert baseline.before("b", 0.0) == 1.0  # no "b" yet: the mean of all so far
    assert baseline.before("a", 0.0) == 1.0  # the earlier "a"
    assert baseline.value("a") == 0.5
    # "k" shared by two of the batch: leave-one-out; the lone ones: reward - baseline at arrival
    assert advantages([("k", 1.0, 9.0), ("k", 0.0, 9.0), (None, 0.5, 0.25), ("j", 2.0, 1.5)]) == [
        1.0,
        -1.0,
        0.25,
        0.5,
    ]
    # three of a key: each against the mean of the other two
    assert advantages([("k", 3.0, 0.0), ("k", 0.0, 0.0), ("k", 0.0, 0.0)]) == [3.0, -1.5, -1.5]


def test_the_baseline_keeps_the_policy_gradient_unbiased_on_a_synthetic_stream() -> None:
    """A Bernoulli policy π(a=1) = p on tasks of differing difficulty; score g = a - p (d log π / dθ
    for π = sigmoid θ). The true gradient is E[r g] = Σ_k P(k) p (1 - p) (r_k(1) - r_k(0)).
    The estimate mean(A g) over the stream matches it within 4 SE with the live baseline (earlier
    rewards of the key) and with leave-one-out groups; a baseline that includes the episode's own
    reward (the plain mean of a pair) is off by the factor (n - 1) / n = 1/2."""
    rng = random.Random(0)
    p = 0.3
    tasks = {"easy": (0.9, 0.5), "hard": (0.4, 0.0), "mid": (0.7, 0.2)}  # key: (E[r|a=1], E[r|a=0])
    true = sum(p * (1 - p) * (r1 - r0) for r1, r0 in tasks.values()) / len(tasks)
    baseline = RunningBaseline()
    lone, loo, own = [], [], []
    for _ in range(20_000):
        key = rng.choice(list(tasks))
        pair = []
        for _ in range(2):
            a = 1 if rng.random() < p else 0
            r = float(rng.random() < tasks[key][1 - a])
            pair.append((a, r))
            lone.append((r - baseline.before(key, r)) * (a - p))
        adv = advantages([(key, r, 0.0) for _, r in pair])
        loo += [x * (a - p) for x, (a, _) in zip(adv, pair, strict=True)]
        mean = sum(r for _, r in pair) / 2
        own += [(r - mean) * (a - p) for a, r in pair]

    def mean_se(xs: list[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) ** 0.5

    for name, xs in (("running mean", lone), ("leave-one-out", loo)):
        m, se = mean_se(xs)
        assert abs(m - true) < 4 * se, (name, m, true, se)
    m, se = mean_se(own)
    assert abs(m - true / 2) < 4 * se and abs(m - true) > 4 * se, (m, true, se)


# -- one model, live, in this process ---------------------------------------------------------------


@pytest.fixture(scope="module")
async def live(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[jm.TrainableModel, Any]]:
    backend = jm.LocalBackend(path=tmp_path_factory.mktemp("live"))
    model = jm.TrainableModel(
        name="tiny", project="live", base_model=str(tiny_model_dir()), lora=jm.LoraConfig(r=4), max_tokens=8
    )
    await model.register(backend)
    yield model, backend
    await model.live(jm.LiveConfig(enabled=False))  # after the step under way, if any
    backend.close()


async def _call(
    model: jm.TrainableModel, episode_id: str, text: str = "Add milk.", name: str | None = None
) -> Any:
    client = model.openai_client()
    with model.episode(episode_id):
        out = await client.chat.completions.create(
            model=name or model.name, messages=[{"role": "user", "content": text}], max_tokens=8
        )
    return out


async def test_outcomes_early_twice_unknown_and_expired(live: tuple[jm.TrainableModel, Any]) -> None:
    model, backend = live
    # settle_s: how long after the outcome a later call may still start (generous: a loaded CI machine)
    await model.live(
        QUICK.model_copy(update={"episodes_per_step": 100, "episode_ttl_s": 600, "settle_s": 3.0})
    )
    run = backend.service(model).live

    # before the episode ends: the outcome takes the first call; a call after it joins within settle_s
    await _call(model, "early")
    receipt = await model.report_outcome("early", 1.0, metrics={"latency": 2.0}, group="todo")
    assert (receipt.status, receipt.calls, receipt.step) == ("accepted", 1, 0)
    await _call(model, "early", "And eggs.")
    await wait_until(lambda: "early" in run.waiting)
    (t,) = run.waiting["early"][0].trajectories
    assert len(t.records()) + sum(len(h.records()) for h in t.additional_histories) == 2
    assert (t.reward, t.metrics["latency"], t.metadata["outcome"]["group"]) == (1.0, 2.0, "todo")

    # twice: the same outcome is a duplicate; a different one is refused, by field
    again = await model.report_outcome("early", 1.0, metrics={"latency": 2.0}, group="todo")
    assert again.status == "duplicate"
    with pytest.raises(jm.InvalidFieldError) as e:
        await model.report_outcome("early", 0.0, metrics={"latency": 2.0}, group="todo")
    assert e.value.field == "reward" and "already has an outcome" in e.value.reason

    # unknown: no request carried the id
    with pytest.raises(jm.InvalidFieldError) as e:
        await model.report_outcome("nobody-asked", 1.0)
    assert e.value.field == "episode_id" and "no request carried it" in e.value.reason

    # after expiry: an episode idle past episode_ttl_s is dropped and counted; its outcome is refused
    await model.live(QUICK.model_copy(update={"episodes_per_step": 100, "episode_ttl_s": 0.3}))
    await _call(model, "late")
    await asyncio.sleep(0.6)
    run = backend.service(model).live
    await run.tick()
    with pytest.raises(jm.InvalidFieldError) as e:
        await model.report_outcome("late", 1.0)
    assert e.value.field == "episode_id" and "expired" in e.value.reason
    status = await model.live_status()
    assert status.counts["expired"] >= 1 and status.counts["refused_expired"] == 1
    assert status.counts["duplicates"] == 1 and status.counts["unknown"] == 1
    assert status.episodes_waiting == 1  # "early", journaled, survives a reconfigure
    with pytest.raises(jm.InvalidFieldError) as e:
        await model.report_outcome("x", float("nan"))
    assert e.value.field == "reward"
    # nothing trains or serves past the gate while it decides
    with pytest.raises(jm.InvalidFieldError) as e:
        await model.serve_step(0)
    assert "live training decides" in e.value.reason


def _step_of(completion: Any) -> int:
    return int(completion.model.rsplit("@", 1)[1])  # the endpoint answers as name@<step that sampled>


async def _episodes(model: jm.TrainableModel, n: int, reward_of: Any, prefix: str) -> None:
    """`n` episodes of one call each, each scored `reward_of(the step that served it)`."""
    for i in range(n):
        eid = f"{prefix}-{i}-{secrets.token_hex(3)}"
        out = await _call(model, eid, f"Task {i}: add item {i}.")
        await model.report_outcome(eid, reward_of(_step_of(out)))


def _rows(history: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in history if all(r.get(k) == v for k, v in match.items())]


async def test_a_live_run_stops_at_its_budgets_and_keeps_its_episodes(
    live: tuple[jm.TrainableModel, Any],
) -> None:
    """Issue 57. Past its sampled-tokens budget a live model's traffic is refused (402, naming the
    budget) while the episodes already scored still train: the step commits. Past its trained-tokens
    budget the next step is refused before it trains: live training stops, `error` names the budget,
    the batch's episodes stay waiting in the journal (a higher budget and a restart train them), a
    history row says why, and `live status` shows the spend against each limit."""
    import openai

    _, backend = live
    capped = jm.TrainableModel(
        name="capped",
        project="live",
        base_model=str(tiny_model_dir()),
        lora=jm.LoraConfig(r=4),
        max_tokens=8,
        budget=jm.Budget(sampled_tokens=20),
    )
    await capped.register(backend)  # beside the module's model, on its base
    pairs = QUICK.model_copy(update={"episodes_per_step": 2, "gate": jm.GateConfig(canary_share=0)})
    try:
        await capped.live(pairs)
        run = backend.service(capped).live
        scored = 0
        with pytest.raises(openai.APIStatusError) as refused:
            for i in range(20):  # 8 tokens at most a call: refused by the fourth
                await _call(capped, f"s{i}", f"Task {i}.")
                await capped.report_outcome(f"s{i}", float(i % 2))
                scored += 1
        assert refused.value.status_code == 402 and "budget.sampled_tokens" in str(refused.value)
        spent = backend.service(capped).meter.spent()
        assert 20 <= spent["sampled_tokens"] < 28 and scored >= 2
        await wait_until(lambda: run.counts["trained"] >= scored - scored % 2)  # sampling is not training
        assert run.counts["steps"] >= 1 and run.error is None

        # past trained tokens: the next step is refused, live training stops, its episodes kept
        await capped.decide("promote")  # the candidate judged: the next one may train
        trained = backend.service(capped).meter.spent()["trained_tokens"]
        done = run.counts["trained"]
        assert trained > 0
        await capped.live(pairs.model_copy(update={"budget": jm.Budget(trained_tokens=int(trained))}))
        run = backend.service(capped).live
        assert backend.service(capped).meter.budget.sampled_tokens is None  # the live budget replaced it
        for i in range(2):
            await _call(capped, f"t{i}", f"Task {i}.")
            await capped.report_outcome(f"t{i}", float(i))
        await wait_until(lambda: run.error is not None)
        assert run.error.startswith("stopped: budget.trained_tokens: capped spent")
        status = await capped.live_status()
        assert status.episodes_waiting >= 2 and status.counts["trained"] == done  # kept, none trained
        assert status.spent["trained_tokens"] == trained and status.limits == {"trained_tokens": trained}
        (row,) = _rows(await capped.history(), split="live")[-1:]
        assert "budget.trained_tokens" in row["stopped"]
    finally:
        await capped.live(jm.LiveConfig(enabled=False))


async def test_gate_promotes_rejects_rolls_back_each_a_history_row(
    live: tuple[jm.TrainableModel, Any],
) -> None:
    model, backend = live
    await model.live(QUICK)
    run = backend.service(model).live
    p0 = run.promoted

    # a candidate trains from the promoted step once 4 scored episodes wait; the canary (half the
    # episodes, by id) does better than the promoted step: promoted
    await _episodes(model, 4, lambda step: 1.0, "warm")
    await wait_until(lambda: run.candidate is not None)
    c1 = run.candidate
    assert c1 is not None and run.parents[c1] == p0 and await model.get_step() == p0
    assert f"{model.name}@{c1}" in backend.served_names()
    while run.candidate == c1:
        await _episodes(model, 2, lambda step, c=c1: 1.0 if step == c else 0.0, "canary")
    await wait_until(lambda: run.busy is None or run.busy.done())
    assert run.promoted == c1 and await model.get_step() == c1

    # the next candidate does worse on the canary: rejected, the promoted step stays
    await wait_until(lambda: run.candidate is not None)
    c2 = run.candidate
    assert c2 is not None and run.parents[c2] == c1
    while run.candidate == c2:
        await _episodes(model, 2, lambda step, c=c2: 0.0 if step == c else 1.0, "worse")
    await wait_until(lambda: run.busy is None or run.busy.done())
    assert run.promoted == c1 and c2 in run.rejected

    # the candidate after a rejected one trains from the promoted step, not from the rejected one
    await _episodes(model, 4, lambda step: random.random(), "more")
    await wait_until(lambda: run.candidate is not None)
    c3 = run.candidate
    assert c3 is not None and run.parents[c3] == c1

    # a person rejects it by command
    decision = await model.decide("reject", reason="looks off")
    assert (decision.action, decision.step, decision.served, decision.by) == ("reject", c3, c1, "command")

    # the promoted step's live rewards fall well below its parent's: rolled back, on its own
    await model.live(QUICK.model_copy(update={"episodes_per_step": 100}))
    run = backend.service(model).live
    await _episodes(model, 3, lambda step: -1.0, "drop")
    await wait_until(lambda: run.promoted == p0)
    await wait_until(lambda: run.busy is None or run.busy.done())
    assert await model.get_step() == p0

    history = await model.history()
    promote, reject, by_hand, rollback = (
        _rows(history, split="live", step=s, decision=a)
        for s, a in ((c1, "promote"), (c2, "reject"), (c3, "reject"), (c1, "rollback"))
    )
    assert promote and "not worse" in promote[0]["reason"] and promote[0]["by"] == "gate"
    assert promote[0]["parent"] == p0 and promote[0]["served"] == c1
    assert reject and "worse by more than" in reject[0]["reason"] and reject[0]["served"] == c1
    assert by_hand and by_hand[0]["reason"] == "looks off" and by_hand[0]["by"] == "command"
    assert rollback and rollback[0]["by"] == "rollback" and rollback[0]["served"] == p0
    trained = {r["step"] + 1: r for r in _rows(history, split="train")}
    assert (trained[c1]["parent"], trained[c2]["parent"], trained[c3]["parent"]) == (p0, c1, c1)
    assert [d.action for d in (await model.live_status()).decisions][-4:] == [
        "promote",
        "reject",
        "reject",
        "rollback",
    ]


async def test_an_eval_function_gates_a_candidate_sampled_beside_the_promoted_step(
    live: tuple[jm.TrainableModel, Any],
) -> None:
    """The eval function samples `name@<candidate>` (the torch engine swaps the candidate's adapter
    in for the call) while the bare name stays on the promoted step; it finds the candidate worse."""
    model, backend = live
    seen: dict[str, int] = {}

    async def evaluate(name: str) -> float:
        out = await model.openai_client().chat.completions.create(  # a forced call: under its grammar
            model=name,
            messages=[{"role": "user", "content": "Add milk."}],
            tools=[{"type": "function", "function": {"name": "add", "parameters": NO_ARGUMENTS}}],
            tool_choice="required",
            max_tokens=96,
        )
        assert out.choices[0].message.tool_calls, out
        seen[name] = _step_of(out)
        bare = await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Add milk."}], max_tokens=4
        )
        assert _step_of(bare) == backend.service(model).live.promoted
        return 0.0 if seen[name] != backend.service(model).live.promoted else 1.0

    gate = QUICK.gate.model_copy(update={"canary_share": 0.0})
    await model.live(QUICK.model_copy(update={"gate": gate}), evaluate=evaluate)
    run = backend.service(model).live
    promoted = run.promoted
    await _episodes(model, 4, lambda step: random.random(), "eval")

    def judged() -> list[dict[str, Any]]:
        gated = _rows(run_history(backend, model), split="live", by="gate")
        return [r for r in gated if "evaluation" in r["reason"]]

    await wait_until(lambda: bool(judged()), 300)
    (row,) = judged()
    cand = row["step"]
    assert seen == {f"{model.name}@{cand}": cand, f"{model.name}@{promoted}": promoted}
    assert row["live/eval"] == 0.0 and row["live/eval_promoted"] == 1.0 and run.promoted == promoted


async def test_a_gate_against_the_best_stops_a_drift_one_margin_at_a_time(
    live: tuple[jm.TrainableModel, Any],
) -> None:
    """Evals 0.60, 0.56, 0.52 for three candidates in a row, margin 0.05: against the promoted step
    each passes (0.52 is within 0.05 of 0.56); against the best promoted eval (0.60) the third does
    not, and the reason names the bar and its step."""
    model, backend = live
    evals = iter([0.60, 0.56, 0.52])
    scored: dict[int, float] = {}

    async def evaluate(name: str) -> float:
        step = int(name.rsplit("@", 1)[1])
        if step not in scored:  # each candidate in turn (the promoted step is set below)
            scored[step] = next(evals, 0.0)
        return scored[step]

    if (await model.live_status()).candidate is not None:  # left by an earlier test: not this gate's
        await model.decide("reject", reason="another test's candidate")
    gate = QUICK.gate.model_copy(update={"canary_share": 0.0, "margin": 0.05, "against": "best"})
    await model.live(QUICK.model_copy(update={"gate": gate}), evaluate=evaluate)
    run = backend.service(model).live
    scored[run.promoted] = 0.50
    start = len(run_history(backend, model))

    def judged() -> list[dict[str, Any]]:
        return [r for r in run_history(backend, model)[start:] if "live/eval_bar" in r]

    for k in range(3):
        await _episodes(model, 4, lambda step: random.random(), f"best-{k}")
        await wait_until(lambda k=k: len(judged()) > k, 300)
    decisions = [(r["decision"], r["live/eval"]) for r in judged()[:3]]
    assert decisions == [("promote", 0.60), ("promote", 0.56), ("reject", 0.52)], decisions
    assert "vs 0.600 for step" in judged()[2]["reason"] and "best so far" in judged()[2]["reason"]
    assert run.best is not None and run.best[1] == 0.60


NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def run_history(backend: Any, model: jm.TrainableModel) -> list[dict[str, Any]]:
    return backend.service(model).store.history()


async def test_kill_9_of_the_server_with_scored_episodes_waiting_loses_none(tmp_path: Path) -> None:
    """Episodes from any language (plain HTTP: the header, then the outcome route), scored and
    waiting, and one still open (its calls made, no outcome yet); `kill -9` of `journeyman serve`;
    the restarted server has every one of them, knows their outcomes (a repeat is a duplicate),
    takes the open one's outcome with its calls, and trains them all."""
    token = secrets.token_urlsafe(24)
    server = ServerProcess(tmp_path, token).start()
    model = jm.TrainableModel(
        name="tiny", project="kill", base_model=str(tiny_model_dir()), lora=jm.LoraConfig(r=4), max_tokens=8
    )
    try:
        await model.register(jm.RemoteBackend(server.url, token=token, progress=False))
        await model.live(jm.LiveConfig(episodes_per_step=100, settle_s=0.0))
        auth = {"authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=120) as http:
            for i in range(5):
                ask = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"Add item {i}."}],
                    "max_tokens": 4,
                }
                r = await http.post(
                    "/v1/chat/completions", json=ask, headers={"x-journeyman-capture": f"ep-{i}"}
                )
                assert r.status_code == 200, r.text
                outcome = {"episode_id": f"ep-{i}", "reward": i / 4, "group": "todo" if i < 2 else None}
                r = await http.post("/journeyman/v1/models/tiny/outcome", json=outcome)
                assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
            r = await http.post(
                "/journeyman/v1/models/tiny/outcome", json={"episode_id": "ep-9", "reward": 1}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "episode_id"
            for turn in range(2):  # an episode still running when the server dies: no outcome yet
                ask = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"Turn {turn}."}],
                    "max_tokens": 4,
                }
                r = await http.post(
                    "/v1/chat/completions", json=ask, headers={"x-journeyman-capture": "ep-open"}
                )
                assert r.status_code == 200, r.text
        assert (await model.live_status()).episodes_waiting == 5
    finally:
        server.kill()  # SIGKILL: nothing is flushed or closed
    server = ServerProcess(tmp_path, token, port=server.port).start()
    try:
        status = await model.live_status()  # the server registered the model and resumed live training
        assert (status.episodes_waiting, status.counts["outcomes"]) == (5, 5)
        assert (await model.report_outcome("ep-3", 0.75)).status == "duplicate"
        opened = await model.report_outcome("ep-open", 0.5)  # its two calls, from before the kill
        assert (opened.status, opened.calls) == ("accepted", 2)
        config = jm.LiveConfig(episodes_per_step=6, settle_s=0.0, gate=jm.GateConfig(canary_share=0.0))
        await model.live(config)
        deadline = time.monotonic() + 120
        while (status := await model.live_status()).candidate is None:
            assert time.monotonic() < deadline and status.error is None, status
            await asyncio.sleep(0.2)
        (row,) = [r for r in await model.history() if r.get("split") == "train"]
        assert (row["parent"], row["candidate"], row["train/groups"]) == (0, 1, 5)  # ep-0 and ep-1: one group
        assert status.promoted == 0 and status.episodes_waiting == 0 and status.counts["trained"] == 6
        # the status command, as a person runs it
        cli = [sys.executable, "-m", "journeyman.app.cli", "live", "status", "tiny", "--server", server.url]
        shown = subprocess.run(
            [*cli, "--token", token], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        assert "promoted step 0, candidate 1" in shown and "6 trained in 1 steps" in shown, shown
        # a Langfuse score as an episode's outcome, by command (`journeyman live langfuse`)
        await _call(model, "ep-lf")
        receiver, lf = _langfuse()
        try:
            with lf.start_as_current_observation(
                name="agent", as_type="span", metadata={"ep": "ep-lf"}
            ) as root:
                pass
            lf.create_score(name="human", value=0.25, trace_id=root.trace_id)
            lf.flush()
            from journeyman.app.cli import app
            from typer.testing import CliRunner

            args = ["live", "langfuse", "tiny", "--server", server.url, "--token", token, "--score", "human"]
            args += ["--episode-from", "ep", "--public-key", receiver.public_key, "--secret-key"]
            args += [receiver.secret_key, "--host", receiver.host]
            out = await asyncio.to_thread(CliRunner().invoke, app, args)
            assert out.exit_code == 0 and "1 traces: 1 outcomes reported" in out.output, out.output
        finally:
            receiver.stop()
        assert (await model.live_status()).episodes_waiting == 1
    finally:
        server.kill()


def _langfuse() -> tuple[Any, Any]:
    """A Langfuse stand-in on 127.0.0.1 (`_support.langfuse_receiver`) and an SDK client exporting to it."""
    from langfuse import Langfuse
    from opentelemetry.sdk.trace import TracerProvider

    r = langfuse_receiver().LangfuseReceiver(f"pk-lf-{secrets.token_hex(4)}", f"sk-lf-{secrets.token_hex(4)}")
    lf = Langfuse(
        public_key=r.public_key, secret_key=r.secret_key, base_url=r.host, tracer_provider=TracerProvider()
    )
    return r, lf


async def test_langfuse_scores_become_the_outcomes_of_their_episodes(
    live: tuple[jm.TrainableModel, Any],
) -> None:
    """Traces whose session id is an episode id: a scored one is that episode's outcome (its score
    a metric too), again a duplicate; unscored, unknown and id-less traces are counted, not sent."""
    from contextlib import nullcontext

    from journeyman.integrations.langfuse import report_scored_outcomes
    from langfuse import propagate_attributes

    model, backend = live
    await model.live(QUICK.model_copy(update={"episodes_per_step": 100, "episode_ttl_s": 600}))
    run = backend.service(model).live
    ids = [f"lf-{secrets.token_hex(4)}" for _ in range(3)]
    for eid in ids:
        await _call(model, eid)
    r, lf = _langfuse()
    keys = {"public_key": r.public_key, "secret_key": r.secret_key, "host": r.host}
    try:

        def trace(session: str | None) -> str:
            with (
                propagate_attributes(session_id=session) if session else nullcontext(),
                lf.start_as_current_observation(name="agent", as_type="span") as root,
            ):
                return root.trace_id

        traces = [trace(ids[0]), trace(ids[1]), trace(ids[2]), trace("nobody-asked"), trace(None)]
        for tid, value in zip(traces, [0.9, 0.1, None, 1.0, 0.5], strict=True):
            if value is not None:
                lf.create_score(name="human", value=value, trace_id=tid)
        lf.flush()

        sync = await report_scored_outcomes(model.report_outcome, score="human", **keys)
        assert (sync.traces, sync.reported, sync.duplicates) == (5, 2, 0), sync
        assert sync.skipped == {"no score": 1, "not a live episode": 1, "no episode id": 1}
        again = await report_scored_outcomes(model.report_outcome, score="human", **keys)
        assert (again.reported, again.duplicates) == (0, 2), again
    finally:
        r.stop()
    await wait_until(lambda: ids[0] in run.waiting)
    (t,) = run.waiting[ids[0]][0].trajectories
    assert t.reward == 0.9 and t.metrics["langfuse/human"] == 0.9
    assert ids[2] not in run.waiting


# -- hostile outcomes (issue 53) ----------------------------------------------------------------------


async def test_an_outcome_is_checked_whole_and_takes_only_its_tokens_calls(
    live: tuple[jm.TrainableModel, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `journeyman serve`'s app (Guard, tokens): an outcome past a bound (a NaN or infinite
    metric, a reward of 1e308, too many metrics, a long name or group key) is a 400 naming the field
    and the bound, and a journal that cannot be written fails the outcome; neither takes the episode's
    calls nor moves the baseline, so the clean retry is accepted with them. Another `sample` token
    neither pops nor scores the calls: its own requests under the same id are its own episode."""
    from journeyman.backends.server import create_app
    from journeyman.client.wire import PREFIX
    from journeyman.serving.api_tokens import TokenBook
    from journeyman.serving.guard import Guard

    model, backend = live
    await model.live(QUICK.model_copy(update={"episodes_per_step": 100, "settle_s": 600.0}))
    run = backend.service(model).live
    book = TokenBook(tmp_path / "tokens.json")
    secrets_of = {name: book.add(name, "sample") for name in ("alice", "mallory")}
    app = Guard(create_app(backend, book), book, 2**20)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:

        async def post(who: str, path: str, **kwargs: Any) -> httpx.Response:
            headers = {"authorization": f"Bearer {secrets_of[who]}", **kwargs.pop("headers", {})}
            return await http.post(path, headers=headers, **kwargs)

        ask = {"model": model.name, "messages": [{"role": "user", "content": "Add milk."}], "max_tokens": 4}
        r = await post("alice", "/v1/chat/completions", json=ask, headers={"x-journeyman-capture": "ep-h"})
        assert r.status_code == 200, r.text
        outcome = f"{PREFIX}/models/{model.name}/outcome"
        r = await post("mallory", f"{PREFIX}/models/{model.name}/captures", json={"capture_ids": ["ep-h"]})
        assert r.json() == {"ep-h": []}
        r = await post("mallory", outcome, json={"episode_id": "ep-h", "reward": 1.0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "episode_id"

        baseline = copy.deepcopy(run.baseline)
        raw = {"content-type": "application/json"}
        refused = [
            ('{"episode_id": "ep-h", "reward": 0.5, "metrics": {"m": NaN}}', "metrics.m", "MAX_OUTCOME_METRIC"),
            ('{"episode_id": "ep-h", "reward": 0.5, "metrics": {"m": Infinity}}', "metrics.m", "MAX_OUTCOME_METRIC"),
            ('{"episode_id": "ep-h", "reward": 1e308}', "reward", "MAX_OUTCOME_REWARD"),
            (json.dumps({"episode_id": "ep-h", "reward": 0.5, "metrics": {f"m{i}": 1 for i in range(65)}}), "metrics", "MAX_OUTCOME_METRICS"),
            (json.dumps({"episode_id": "ep-h", "reward": 0.5, "metrics": {"m" * 129: 1}}), "metrics", "MAX_METRIC_NAME_CHARS"),
            (json.dumps({"episode_id": "ep-h", "reward": 0.5, "group": "g" * 257}), "group", "MAX_OUTCOME_GROUP_CHARS"),
        ]  # fmt: skip
        for body, field, bound in refused:
            r = await post("alice", outcome, content=body, headers=raw)
            error = r.json()["error"]
            assert (r.status_code, error["param"]) == (400, field) and bound in error["reason"], r.text
        with monkeypatch.context() as m:
            m.setattr(run.journal, "add", lambda *_: (_ for _ in ()).throw(OSError(28, "No space left")))
            with pytest.raises(OSError):  # ASGITransport raises what a server answers with a 500
                await post("alice", outcome, json={"episode_id": "ep-h", "reward": 0.5})
        assert vars(run.baseline) == vars(baseline) and len(run.s.captures.peek("alice/ep-h")) == 1

        r = await post("alice", outcome, json={"episode_id": "ep-h", "reward": 0.5, "metrics": {"m": 1}})
        assert r.status_code == 200 and (r.json()["status"], r.json()["calls"]) == ("accepted", 1), r.text
        baseline.add(None, 0.5)
        assert vars(run.baseline) == vars(baseline) and not run.s.captures.peek("alice/ep-h")
        r = await post("mallory", "/v1/chat/completions", json=ask, headers={"x-journeyman-capture": "ep-h"})
        r = await post("mallory", outcome, json={"episode_id": "ep-h", "reward": 0.0})
        assert r.json()["status"] == "accepted" and r.json()["calls"] == 1  # her own call, her own episode
        assert {"alice/ep-h", "mallory/ep-h"} <= set(run.known)


def _stub_services(root: Path, train_from: Any, rows: list[dict[str, Any]]) -> Any:
    """What a LiveRun needs of a served model, without one: captures, a `train_from`, a history."""
    from journeyman.backends.live_training import LiveServices
    from journeyman.rollout.capture import Captures

    async def serve(step: int) -> None:
        pass

    return LiveServices(
        name="stub",
        captures=Captures(),
        side_steps={},
        set_route=lambda route: None,
        train_from=train_from,
        serve=serve,
        checkpoint_dir=lambda step: root / f"{step:04d}",
        latest_step=lambda: 0,
        record=rows.append,
    )


def _served_call() -> jm.CapturedCall:
    from _support import captured_call

    return captured_call(
        [{"role": "user", "content": "hi"}], [1, 2], [3, 4], {"role": "assistant", "content": "x"}, None
    )


async def test_a_batch_that_cannot_train_is_set_aside_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 53: a batch whose step failed (grad_norm=nan) was retried every tick, forever. A failure
    of the batch's own (a non-finite loss, a refused field) sets it aside after MAX_BATCH_FAILURES
    calls: a history row with the reason, `set_aside` counted and journaled, never tried again (a
    restart finds nothing waiting). A failure of the server's (a disk) is tried again, later."""
    from journeyman.backends import live_training
    from journeyman.backends.live_training import MAX_BATCH_FAILURES, LiveRun

    monkeypatch.setattr(live_training, "RETRY_S", 0.0)
    calls: list[str] = []
    fault: list[Exception] = []

    async def train_from(groups: Any, config: Any, key: str, parent: int) -> jm.TrainResult:
        calls.append(key)
        if fault:
            raise fault[0]
        return jm.TrainResult(step=parent, skipped=True)

    rows: list[dict[str, Any]] = []
    config = jm.LiveConfig(episodes_per_step=2, settle_s=0.0, gate=jm.GateConfig(canary_share=0.0))
    run = LiveRun(tmp_path, _stub_services(tmp_path, train_from, rows), config)

    async def step(episodes: list[tuple[str, float]]) -> None:
        for eid, reward in episodes:
            run.s.captures.add(eid, _served_call())
            run.report(EpisodeOutcome(episode_id=eid, reward=reward))
        for _ in range(40):
            await run.tick()
            if run.busy is not None:
                await asyncio.wait([run.busy])

    fault[:] = [OSError(28, "No space left on device")]  # the server's: waits, then again
    await step([("d1", 1.0), ("d2", 0.0)])
    assert len(calls) > MAX_BATCH_FAILURES and run.counts["set_aside"] == 0 and len(run.waiting) == 2
    fault.clear()
    await step([])
    assert not run.waiting and run.counts["trained"] == 2

    calls.clear()
    fault[:] = [FloatingPointError("grad_norm=nan: the step was not applied")]  # the batch's own
    await step([("n1", 1.0), ("n2", 0.0)])
    assert len(calls) == MAX_BATCH_FAILURES and not run.waiting
    assert run.counts["set_aside"] == 2 and run.status().counts["set_aside"] == 2
    assert run.error is not None and "grad_norm=nan" in run.error
    (row,) = [r for r in rows if r.get("set_aside")]
    assert row["split"] == "live" and row["set_aside"] == 2 and "grad_norm=nan" in row["reason"]
    settled = [json.loads(x) for x in (tmp_path / "live" / "settled.jsonl").read_text().splitlines()]
    assert settled[-1]["how"] == "set_aside" and sorted(settled[-1]["ids"]) == ["n1", "n2"]
    again = LiveRun(tmp_path, _stub_services(tmp_path, train_from, rows), config)
    assert not again.waiting and again.sent is None


async def test_a_journal_from_before_rewards_were_bounded_resumes_with_a_finite_baseline(
    tmp_path: Path,
) -> None:
    """Issue 53: two outcomes of reward 1e308 made the baseline inf, journaled as null; after a restart
    every batch failed with a TypeError, forever. Now such a journal resumes with a finite baseline
    (rewards out of range move nothing) and its episodes are set aside, each with its reason."""
    from journeyman.backends.live_training import LiveRun
    from journeyman.data.journal import GroupJournal
    from journeyman.rollout.histories import join_calls, trajectory_of

    journal = GroupJournal(tmp_path / "live", fsync=True)
    for eid, reward, baseline in (("h1", 1e308, 0.0), ("h2", 1e308, 1e308), ("ok", 1.0, None)):
        outcome = {"episode_id": eid, "reward": reward, "metrics": {}, "group": None}
        meta = {"episode_id": eid, "outcome": outcome, "baseline": baseline}
        t = trajectory_of(join_calls([_served_call()]), reward=reward, metrics={}, metadata=meta)
        journal.add(eid, jm.TrajectoryGroup([t]))
    trained: list[Any] = []

    async def train_from(groups: Any, config: Any, key: str, parent: int) -> jm.TrainResult:
        trained.append(groups)
        return jm.TrainResult(step=parent, skipped=True)

    rows: list[dict[str, Any]] = []
    config = jm.LiveConfig(episodes_per_step=3, settle_s=0.0, gate=jm.GateConfig(canary_share=0.0))
    run = LiveRun(tmp_path, _stub_services(tmp_path, train_from, rows), config)
    assert run.baseline.value(None) == 1.0 and run.scored == [(0, 1.0)]
    await run.tick()
    if run.busy is not None:
        await asyncio.wait([run.busy])
    assert not trained and not run.waiting and run.counts["set_aside"] == 3
    reasons = sorted(r["reason"] for r in rows)
    assert "MAX_OUTCOME_REWARD" in reasons[1] and "its baseline None" in reasons[0], reasons
    assert run.busy is None or run.busy.exception() is None
