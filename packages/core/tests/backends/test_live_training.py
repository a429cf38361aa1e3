"""Live training (docs/live.md): outcomes posted before the episode ends, twice, for an unknown
episode, after expiry; the baseline's unbiasedness on a synthetic stream and a step's advantages as
documented; gate decisions (promote, reject, rollback, by command) with their history rows; and
`kill -9` of `journeyman serve` with scored episodes waiting loses none of them.

The model is a random 2-layer Llama with the embedded tokenizer (`tiny_model_dir`): real requests
through the real endpoint, real training steps and checkpoints, in seconds; what it says is noise,
so the rewards are the test's own."""

from __future__ import annotations

import asyncio
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
    waiting; `kill -9` of `journeyman serve`; the restarted server has every one of them, knows their
    outcomes (a repeat is a duplicate), and trains them."""
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
        assert (await model.live_status()).episodes_waiting == 5
    finally:
        server.kill()  # SIGKILL: nothing is flushed or closed
    server = ServerProcess(tmp_path, token, port=server.port).start()
    try:
        status = await model.live_status()  # the server registered the model and resumed live training
        assert (status.episodes_waiting, status.counts["outcomes"]) == (5, 5)
        assert (await model.report_outcome("ep-3", 0.75)).status == "duplicate"
        config = jm.LiveConfig(episodes_per_step=5, settle_s=0.0, gate=jm.GateConfig(canary_share=0.0))
        await model.live(config)
        deadline = time.monotonic() + 120
        while (status := await model.live_status()).candidate is None:
            assert time.monotonic() < deadline and status.error is None, status
            await asyncio.sleep(0.2)
        (row,) = [r for r in await model.history() if r.get("split") == "train"]
        assert (row["parent"], row["candidate"], row["train/groups"]) == (0, 1, 4)  # ep-0 and ep-1: one group
        assert status.promoted == 0 and status.episodes_waiting == 0 and status.counts["trained"] == 5
        # the status command, as a person runs it
        cli = [sys.executable, "-m", "journeyman.app.cli", "live", "status", "tiny", "--server", server.url]
        shown = subprocess.run(
            [*cli, "--token", token], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        assert "promoted step 0, candidate 1" in shown and "5 trained in 1 steps" in shown, shown
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
