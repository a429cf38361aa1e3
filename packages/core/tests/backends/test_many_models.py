"""Many models on one base: models registered on one `LocalBackend` share one copy of the base's
weights, each keeps its own adapter, and training one leaves the others' answers as they were."""

from __future__ import annotations

import asyncio
import itertools
import random
import shutil
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
import torch
from _support import tiny_model_dir

pytestmark = pytest.mark.integration

PROMPTS = ["Name a color.", "What is two plus two?"]


@dataclass
class Pair:
    backend: jm.LocalBackend
    a: jm.TrainableModel
    b: jm.TrainableModel


async def _greedy(model: jm.TrainableModel) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy completion: its recorded token ids and logprobs."""
    out = []
    for prompt in PROMPTS:
        done = await model.openai_client().chat.completions.create(
            model=model.name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
            temperature=0.0,
        )
        record = jm.record_of(done.choices[0])
        assert record is not None
        out.append((record.token_ids, record.logprobs))
    return out


@pytest.fixture(scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pair]:
    backend = jm.LocalBackend(path=tmp_path_factory.mktemp("many"))
    a = jm.TrainableModel(name="support", project="many", max_tokens=12)
    b = jm.TrainableModel(name="triage", project="many", max_tokens=12)
    await a.register(backend)
    await b.register(backend)
    yield Pair(backend, a, b)
    backend.close()


def _base_params(policy: Any) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.model.named_parameters() if "lora_" not in n}


async def test_models_on_one_base_hold_one_copy_of_its_weights(pair: Pair) -> None:
    pa, pb = pair.backend.service(pair.a).policy, pair.backend.service(pair.b).policy
    assert pa.base is pb.base and pa.base.shared and pa.base.users() == [pa, pb]
    a_params, b_params = _base_params(pa), _base_params(pb)
    assert a_params.keys() == b_params.keys() and len(a_params) > 100
    assert all(a_params[n].data_ptr() == b_params[n].data_ptr() for n in a_params)
    # each its own adapter
    lora_a = {n: p for n, p in pa.model.named_parameters() if "lora_" in n}
    lora_b = {n: p for n, p in pb.model.named_parameters() if "lora_" in n}
    assert lora_a and all(lora_a[n].data_ptr() != lora_b[n].data_ptr() for n in lora_a)
    # shared weights stay read-only: neither folds its adapter into them to sample
    await _greedy(pair.a)
    assert not pa.merge.merged and not pb.merge.merged


async def test_training_one_model_leaves_the_others_answers_exactly_as_they_were(
    pair: Pair, tmp_path: Path
) -> None:
    b_before = await _greedy(pair.b)
    client = pair.a.openai_client()
    groups = []
    for prompt in PROMPTS:
        ask: list[Any] = [{"role": "user", "content": prompt}]
        done = await client.chat.completions.create(
            model=pair.a.name, messages=ask, max_tokens=8, n=4, temperature=1.0
        )
        groups.append(
            jm.TrajectoryGroup(
                jm.Trajectory(messages_and_choices=[*ask, c], reward=float(len(c.message.content or "")))
                for c in done.choices
            )
        )
    result = await pair.a.train(groups, config=jm.TrainConfig(learning_rate=5e-3))
    assert result.step == 1 and not result.skipped
    assert await pair.b.get_step() == 0
    assert await _greedy(pair.b) == b_before  # token ids and logprobs, bit for bit

    # The trained model, served on the shared base, answers as it does served alone (merged, on a
    # base of its own): the same tokens, the logprobs within float rounding.
    a_shared = await _greedy(pair.a)
    run = pair.backend.run_dir(pair.a)
    alone_path = tmp_path / "alone"
    shutil.copytree(run, alone_path / run.relative_to(pair.backend.path))
    alone = jm.LocalBackend(path=alone_path)
    try:
        copy = jm.TrainableModel(name=pair.a.name, project=pair.a.project, max_tokens=12)
        await copy.register(alone)
        assert await copy.get_step() == 1 and not alone.service(copy).policy.base.shared
        a_alone = await _greedy(copy)
    finally:
        alone.close()
    for (ids, lps), (ids_alone, lps_alone) in zip(a_shared, a_alone, strict=True):
        assert ids == ids_alone
        assert max(abs(x - y) for x, y in zip(lps, lps_alone, strict=True)) < 1e-3


async def test_rows_of_both_models_share_a_batch_each_through_its_own_adapter(pair: Pair) -> None:
    pb = pair.backend.service(pair.b).policy
    with pb.editing(), torch.no_grad():  # an adapter far from the other's: a swap would show
        torch.manual_seed(7)
        for name, p in pb.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
        pb.version += 1
    a_alone, b_alone = await _greedy(pair.a), await _greedy(pair.b)
    assert [ids for ids, _ in a_alone] != [ids for ids, _ in b_alone]
    runner = pair.backend.service(pair.a).engine.runner  # pyright: ignore[reportAttributeAccessIssue]
    assert runner is pair.backend.service(pair.b).engine.runner  # pyright: ignore[reportAttributeAccessIssue]
    mixed_before = runner.mixed_steps
    together = await asyncio.gather(*[_greedy(m) for m in (pair.a, pair.b, pair.a, pair.b)])
    assert runner.mixed_steps > mixed_before  # their rows were decoded in the same steps
    for got, alone in zip(together, [a_alone, b_alone, a_alone, b_alone], strict=True):
        for (ids, lps), (ids_alone, lps_alone) in zip(got, alone, strict=True):
            assert ids == ids_alone
            assert max(abs(x - y) for x, y in zip(lps, lps_alone, strict=True)) < 1e-3


async def test_a_models_training_step_holds_back_its_own_rows_alone(pair: Pair) -> None:
    pa = pair.backend.service(pair.a).policy
    entered, release = threading.Event(), threading.Event()

    def step() -> None:  # what a training step holds: the model's weights, exclusively
        with pa.editing():
            entered.set()
            release.wait(60)

    holder = threading.Thread(target=step)
    holder.start()
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        a_waits = asyncio.ensure_future(_greedy(pair.a))
        await _greedy(pair.b)  # served while a's step holds a's weights
        await asyncio.sleep(0.2)
        assert not a_waits.done()
    finally:
        release.set()
        await asyncio.to_thread(holder.join, 30)
    assert len(await asyncio.wait_for(a_waits, 60)) == len(PROMPTS)


async def _one_turn(model: jm.TrainableModel, prompt: str) -> jm.Trajectory:
    ask: list[Any] = [{"role": "user", "content": prompt}]
    done = await model.openai_client().chat.completions.create(
        model=model.name, messages=ask, max_tokens=4, temperature=1.0
    )
    return jm.Trajectory(messages_and_choices=[*ask, done.choices[0]], reward=random.random())


async def test_two_pipeline_trainers_on_one_backend_train_at_once_in_mixed_batches(tmp_path: Path) -> None:
    """Two models on one base, each driven by its own PipelineTrainer at the same time: both make
    their steps from their own rollouts, and the engine they share decoded rows of both in the same
    steps. (The tiny random base: what is tested is the sharing, not what is learned.)"""
    backend = jm.LocalBackend(path=tmp_path / "runs")
    try:
        a, b = (
            jm.TrainableModel(
                name=name,
                project="pipes",
                base_model=str(tiny_model_dir()),
                lora=jm.LoraConfig(r=4),
                max_tokens=4,
            )
            for name in ("pa", "pb")
        )
        await asyncio.gather(a.register(backend), b.register(backend))
        runner = backend.service(a).engine.runner  # pyright: ignore[reportAttributeAccessIssue]
        assert runner is backend.service(b).engine.runner  # pyright: ignore[reportAttributeAccessIssue]

        def trainer(model: jm.TrainableModel) -> jm.PipelineTrainer[str]:
            config = jm.PipelineConfig(
                group_size=2, groups_per_step=1, journal=tmp_path / model.name, progress=False
            )
            return jm.PipelineTrainer(model, _one_turn, itertools.cycle(PROMPTS), config)

        results = await asyncio.gather(trainer(a).train(2), trainer(b).train(2))
        for result, model in zip(results, (a, b), strict=True):
            assert result.steps == 2 and result.skipped_steps == 0 and result.exceptions == 0
            assert result.final_step == 2 == await model.get_step() and result.trained_groups == 2
        assert runner.mixed_steps > 0
    finally:
        backend.close()


def test_the_models_weight_changes_take_turns_first_asked_first_served() -> None:
    from journeyman.engine.tenants import Turns

    turns, order = Turns(), []
    first_in, go = threading.Event(), threading.Event()

    def first() -> None:
        with turns.turn():
            first_in.set()
            go.wait(10)
            order.append("a1")

    def later(name: str) -> None:
        with turns.turn():
            order.append(name)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_in.wait(10)
    for name in ("b1", "c1", "a2"):  # a's next step asks after b's and c's: it waits for both
        t = threading.Thread(target=later, args=(name,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 10
        while turns._next < len(threads) and time.monotonic() < deadline:  # pyright: ignore[reportPrivateUsage]
            time.sleep(0.001)  # its ticket taken before the next one asks
    go.set()
    for t in threads:
        t.join(10)
    assert order == ["a1", "b1", "c1", "a2"]
