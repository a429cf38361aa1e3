"""The asynchronous pipeline on the embedded model: per-token policy provenance through a step that
lands mid-rollout, the staleness bound, the journal a restart trains from (in process, and after a
`kill -9` of a client driving `journeyman serve`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
from journeyman.data.provenance import staleness_metrics
from journeyman.training.trainer import build_rows

pytestmark = pytest.mark.integration


async def _ask(model: jm.TrainableModel, messages: list[dict[str, Any]], max_tokens: int = 6) -> Any:
    client = model.openai_client()
    out = await client.chat.completions.create(
        model=model.name,
        messages=messages,  # pyright: ignore[reportArgumentType]
        max_tokens=max_tokens,
        temperature=1.0,
    )
    return out.choices[0]


async def two_turns(model: jm.TrainableModel, topic: str) -> jm.Trajectory:
    """A turn, a tool that takes a while, a second turn; the reward carries no meaning but spread."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Name a {topic}."}]
    first = await _ask(model, messages)
    await asyncio.sleep(0.05)  # the tool
    messages2 = [
        *messages,
        first.message.model_dump(exclude_none=True),
        {"role": "user", "content": "Again."},
    ]
    second = await _ask(model, messages2)
    return jm.Trajectory(
        messages_and_choices=[*messages, first, messages2[-1], second], reward=random.random()
    )


async def test_too_many_exceptions_carry_what_the_rollouts_raised(scripted: Any, tmp_path: Path) -> None:
    model, _ = scripted

    async def rollout(model: jm.TrainableModel, scenario: int) -> jm.Trajectory:
        raise RuntimeError(f"tool server down ({scenario})")

    config = jm.PipelineConfig(group_size=2, groups_per_step=1, journal=tmp_path, progress=False)
    with pytest.raises(jm.TooManyExceptionsError) as e:
        await jm.PipelineTrainer(model, rollout, range(100), config).train(1)
    raised = e.value.exceptions
    assert len(raised) >= 2 and all(isinstance(x, RuntimeError) for x in raised)
    assert e.value.__cause__ is raised[0] and f"the first: RuntimeError: {raised[0]} (at " in str(e.value)


@pytest.fixture(scope="module")
async def local(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[jm.TrainableModel]:
    backend = jm.LocalBackend(path=tmp_path_factory.mktemp("pipeline-runs"))
    model = jm.TrainableModel(name="pipe", project="tests")
    await asyncio.create_task(model.register(backend))
    yield model
    backend.close()


async def _group(model: jm.TrainableModel, n: int = 2) -> jm.TrajectoryGroup:
    return await jm.TrajectoryGroup(two_turns(model, "fruit") for _ in range(n))


async def test_a_step_that_lands_mid_rollout_gives_each_turn_its_own_step(local: jm.TrainableModel) -> None:
    model = local
    step = await model.get_step()
    # turn 1 of a rollout at `step`, then a step lands, then its turn 2
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a colour."}]
    first = await _ask(model, messages)
    training = asyncio.create_task(model.train([await _group(model)], jm.TrainConfig(learning_rate=1e-4)))
    await asyncio.sleep(0.3)  # the step is running on the engine's thread
    follow = [*messages, first.message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    second = await _ask(model, follow)  # queued behind the step: sampled by its weights
    result = await training
    assert result.step == step + 1
    r1, r2 = jm.record_of(first), jm.record_of(second)
    assert r1 is not None and r2 is not None
    # the label is the step whose weights sampled the turn, stamped as it was sampled (not the one
    # the endpoint announced when the step's checkpoint was written, later)
    assert (r1.step, r2.step) == (step, step + 1)

    turns = [*messages, first, follow[-1], second]
    group = jm.TrajectoryGroup(jm.Trajectory(messages_and_choices=turns, reward=r) for r in (1.0, 0.0))
    # staleness per token: turn 1's tokens one step behind, turn 2's none
    m = staleness_metrics([group], step + 1)
    n1, n2 = len(r1.token_ids), len(r2.token_ids)
    assert m["staleness/1"] == pytest.approx(n1 / (n1 + n2))
    assert m["staleness/0"] == pytest.approx(n2 / (n1 + n2))
    # the loss's behaviour logprobs are each turn's own, token by token
    fmt = model.backend.service(model).chat_format  # pyright: ignore[reportAttributeAccessIssue]
    rows, _ = build_rows([group], fmt, jm.TrainConfig())
    trained = [lp for lp, on in zip(rows[0].rollout_logprobs, rows[0].trained, strict=True) if on]
    assert trained == pytest.approx(r1.logprobs + r2.logprobs)

    done = await model.train([group], jm.TrainConfig(learning_rate=1e-4))
    assert done.metrics["staleness/1"] > 0
    for key in ("is_weight_mean", "is_weight_outside_2x", "is_truncated"):
        assert key in done.metrics


def _config(journal: Path, **settings: Any) -> jm.PipelineConfig:
    """The pipeline settings of these tests: groups of two, journaled, no progress bar."""
    return jm.PipelineConfig(group_size=2, journal=journal, progress=False, **settings)


def _rollout(model: jm.TrainableModel, topic: str) -> Any:
    return two_turns(model, topic)


async def test_stale_groups_are_dropped_and_finished_groups_survive_a_restart(
    local: jm.TrainableModel, tmp_path: Path
) -> None:
    model = local
    journal = tmp_path / "journal"
    # three groups start together at step s; one trains, so the other two are one step behind
    strict = _config(journal, groups_per_step=1, max_in_flight=3, max_steps_off_policy=0)
    result = await jm.PipelineTrainer(model, _rollout, ["a", "b", "c", "d", "e"], strict).train(2)
    assert result.steps == 2
    assert result.stale_groups >= 2, result
    settled = [json.loads(x) for x in (journal / "settled.jsonl").read_text().splitlines()]
    assert sum(len(x["ids"]) for x in settled if x["how"] == "stale") == result.stale_groups
    assert [x["step"] for x in settled if x["how"] == "trained"] == [result.final_step - 1, result.final_step]

    # the same, tolerant of one step: the two left after one step wait in the journal
    journal2 = tmp_path / "journal2"
    loose = strict.model_copy(update={"max_steps_off_policy": 2, "journal": journal2})
    first = await jm.PipelineTrainer(model, _rollout, ["a", "b", "c"], loose).train(1)
    assert first.trained_groups == 1
    waiting = len((journal2 / "groups.jsonl").read_text().splitlines()) - 1
    assert waiting == 2
    again = loose.model_copy(update={"groups_per_step": 2})
    second = await jm.PipelineTrainer(model, _rollout, [], again).train(1)
    assert (second.resumed_groups, second.trained_groups, second.stale_groups) == (2, 2, 0)
    history = await model.history()
    row = history[-1]
    assert row["train/staleness/1"] > 0  # trained one step after they were sampled
    assert "train/is_weight_mean" in row


async def test_the_old_groups_of_a_wave_train_before_they_go_stale(
    local: jm.TrainableModel, tmp_path: Path
) -> None:
    """Four groups start together at step s; two come back at once and train. The two that replace
    them come back long before the wave's slow two, which would be two steps behind a step later:
    the trainer waits for those and takes the oldest first, so no group is wasted and three steps
    train from six groups (taking groups as they come, the slow two went stale and the run ended
    after two steps, the scenarios spent)."""
    delays = {"a": 0.0, "b": 0.0, "c": 5.0, "d": 5.0, "e": 0.0, "f": 0.0}

    async def rollout(model: jm.TrainableModel, name: str) -> jm.Trajectory:
        messages = [{"role": "user", "content": f"Say {name}."}]
        choice = await _ask(model, messages, max_tokens=2)
        await asyncio.sleep(delays[name])  # the environment, after the model's turn
        return jm.Trajectory(messages_and_choices=[*messages, choice], reward=random.random())

    config = _config(tmp_path / "j", groups_per_step=2, max_steps_off_policy=1)
    start = await local.get_step()
    result = await jm.PipelineTrainer(local, rollout, list(delays), config).train(3)
    assert (result.steps, result.trained_groups, result.stale_groups) == (3, 6, 0), result
    assert result.final_step == start + 3


_CLIENT = textwrap.dedent(
    """
    import asyncio, itertools, os, random, sys
    import journeyman as jm

    async def rollout(model, topic):
        client = model.openai_client()
        out = await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": f"Name a {topic}."}],
            max_tokens=4, temperature=1.0)
        await asyncio.sleep(0.2)  # a slow tool
        return jm.Trajectory(messages_and_choices=[{"role": "user", "content": topic}, out.choices[0]],
                             reward=random.random())

    async def main():
        backend = jm.RemoteBackend(os.environ["SERVER_URL"], token=os.environ["SERVER_TOKEN"], progress=False)
        model = jm.TrainableModel(name="pipe-remote", project="tests")
        await model.register(backend)
        config = jm.PipelineConfig(group_size=2, groups_per_step=1, max_in_flight=4,
                                   max_steps_off_policy=10, journal=sys.argv[1], progress=False)
        await jm.PipelineTrainer(model, rollout, itertools.cycle("xyz"), config).train(1000)

    asyncio.run(main())
    """
)


async def test_kill_9_mid_pipeline_loses_no_finished_group(remote_server: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    env = {**os.environ, "SERVER_URL": remote_server.url, "SERVER_TOKEN": remote_server.token}
    child = subprocess.Popen([sys.executable, "-c", _CLIENT, str(journal)], env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # a step committed, and groups finished beyond it
            settled = journal / "settled.jsonl"
            if settled.exists() and settled.read_text().count('"trained"') >= 1:
                done = len((journal / "groups.jsonl").read_text().splitlines())
                if done - settled.read_text().count('"trained"') >= 2:
                    break
            assert child.poll() is None, "the pipeline client exited early"
            await asyncio.sleep(0.2)
        else:
            pytest.fail("the pipeline made no progress in 240 s")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finished = set()
    for line in (journal / "groups.jsonl").read_text().splitlines():
        try:
            finished.add(json.loads(line)["id"])
        except json.JSONDecodeError:  # the line the kill cut short was never a finished group
            continue
    settled = [json.loads(x) for x in (journal / "settled.jsonl").read_text().splitlines()]
    trained = {i for row in settled if row["how"] == "trained" for i in row["ids"]}
    pending = finished - trained
    assert pending

    backend = jm.RemoteBackend(remote_server.url, token=remote_server.token, progress=False)
    model = jm.TrainableModel(name="pipe-remote", project="tests")
    await model.register(backend)
    config = _config(journal, groups_per_step=len(pending), max_steps_off_policy=10)
    # a train call the kill cut off goes first, again with its key; then the rest
    result = await jm.PipelineTrainer(model, _rollout, [], config).train(2)
    assert (result.resumed_groups, result.trained_groups) == (len(pending), len(pending))
    settled = [json.loads(x) for x in (journal / "settled.jsonl").read_text().splitlines()]
    assert finished <= {i for row in settled if row["how"] == "trained" for i in row["ids"]}
    # every call sent, retried or not, trained one step: none twice, none lost
    sent = {row["key"] for row in settled if row["how"] == "training"}
    assert await model.get_step() == len(sent)
