"""The in-process engine under faults: a bad request fails alone, a dead worker comes back (bounded)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _support import wait_until
from journeyman.engine.base import Sample, SamplingParams
from journeyman.engine.torch_engine import TorchEngine
from journeyman.errors import EngineDownError, InvalidFieldError
from pydantic import ValidationError


class _Crash(BaseException):
    """Escapes every `except Exception` of the engine, as a bug in torch or a signal might."""


class _Bomb(str):
    """A stop string whose length cannot be taken: a params object built unvalidated
    (`model_construct`) with it kills whichever worker checks it."""

    def __len__(self) -> int:
        raise _Crash("stop string")


@pytest.fixture(scope="module")
def policy() -> Iterator[Any]:
    import torch
    from journeyman.data.config import DEFAULT_BASE_MODEL
    from journeyman.policy.lora import LoraPolicy
    from journeyman.policy.weights import resolve_base_model

    # One thread, as each of the suite's two xdist workers gets (conftest.py): run alone (-n0) on a
    # busy 2-core machine, two spinning OpenMP threads made a decode step 4x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LoraPolicy(resolve_base_model(DEFAULT_BASE_MODEL))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def prompt(policy: Any) -> list[int]:
    return list(policy.tokenizer.encode("Count to ten:"))


def _engine(policy: Any, **kw: Any) -> TorchEngine:
    # no stop token: every row samples max_tokens; a wide gathering window, so requests sent
    # together share one batch on a loaded machine
    return TorchEngine(policy, stop_ids=set(), batch_wait_s=0.3, batch_wait_max_s=5.0, **kw)


def _close(engine: TorchEngine) -> None:
    engine.close()
    engine.join(timeout=30)


def _ids(results: list[list[Sample] | BaseException] | list[list[Sample]]) -> list[list[list[int]]]:
    """Each request's samples as token ids; a request that failed fails the test here."""
    out = []
    for r in results:
        assert not isinstance(r, BaseException), r
        out.append([s.token_ids for s in r])
    return out


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", -(2**64)),
        ("max_tokens", 10**12),
        ("max_tokens", 0),
        ("n", 10**6),
        ("temperature", float("nan")),
        ("top_p", float("inf")),
        ("top_logprobs", 10**6),
        ("stop", [""]),
        ("stop", ["x" * 257]),
        ("stop", [f"s{i}" for i in range(17)]),
        ("json_prefix", "<" * 1025),
        ("max_token", 5),  # a misspelt field is refused, not ignored
    ],
)
def test_sampling_params_refuse_out_of_range_values(field: str, value: object) -> None:
    """Every field of SamplingParams is bounded: a value an engine cannot sample with is refused
    when the params are built, by a ValidationError that names the field (the endpoint's 400)."""
    with pytest.raises(ValidationError) as e:
        SamplingParams.model_validate({field: value})
    assert e.value.errors()[0]["loc"][0] == field


def test_sampling_params_take_the_ends_of_each_range() -> None:
    """The bounds are inclusive where the value is usable: a 64-bit seed either way, 16 stops."""
    p = SamplingParams(seed=2**63 - 1, n=128, temperature=0.0, top_logprobs=20, stop=["x" * 256] * 16)
    assert p.seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_vllm_is_started_with_a_random_key_it_requires_on_every_call() -> None:
    """The vLLM server gets a fresh random API key through its environment (never on its command
    line, which any local user can read), and the engine's requests carry it as a bearer token;
    a key the user passes in `extra_args` is the one used."""
    from journeyman.data.config import DEFAULT_BASE_MODEL
    from journeyman.engine.vllm_server import VLLMConfig, VLLMServer
    from journeyman.policy.weights import resolve_base_model

    model = resolve_base_model(DEFAULT_BASE_MODEL)
    a, b = (VLLMServer(model, VLLMConfig(python=sys.executable, log_file=os.devnull)) for _ in range(2))
    assert a.api_key != b.api_key and len(a.api_key) >= 32
    assert a.environment()["VLLM_API_KEY"] == a.api_key
    assert not any(a.api_key in arg for arg in a.command())
    assert a.headers == {"Authorization": f"Bearer {a.api_key}"}
    own = VLLMServer(
        model, VLLMConfig(python=sys.executable, log_file=os.devnull, extra_args=["--api-key", "mine"])
    )
    assert own.headers["Authorization"] == "Bearer mine"


@pytest.mark.integration
async def test_a_prompt_the_model_cannot_read_is_refused_before_queueing(
    policy: Any, prompt: list[int]
) -> None:
    """Token ids outside [0, vocab), an empty prompt and a completion past the model's context are
    refused by `generate` with InvalidFieldError (a 400) before they reach a batch; a seed at
    either end of the 64-bit range samples, and reproduces."""
    engine = _engine(policy)
    vocab = policy.model.get_input_embeddings().weight.shape[0]
    try:
        for bad in ([*prompt, vocab], [-1, *prompt], []):
            with pytest.raises(InvalidFieldError) as e:
                await engine.generate(bad, SamplingParams(max_tokens=2))
            assert e.value.field == "messages"
        with pytest.raises(InvalidFieldError) as e:
            await engine.generate(
                prompt, SamplingParams(max_tokens=policy.model.config.max_position_embeddings)
            )
        assert e.value.field == "max_tokens"
        assert engine.batches == 0
        params = [SamplingParams(max_tokens=3, seed=s) for s in (2**63 - 1, -(2**63), 2**50)]
        first = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        again = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        assert [s[0].token_ids for s in first] == [s[0].token_ids for s in again]
        assert all(len(s[0].token_ids) == 3 for s in first)
    finally:
        _close(engine)


def _slipped(
    engine: TorchEngine, prompt_ids: list[int], params: SamplingParams
) -> asyncio.Future[list[Sample]]:
    """A request that got past `generate`'s checks (a caller that queued it directly), queued the
    way `generate` queues one."""
    return engine.scheduler.submit(prompt_ids, params)


@pytest.mark.integration
async def test_a_bad_request_batched_with_good_ones_fails_alone(policy: Any, prompt: list[int]) -> None:
    """A request whose prefill raises (a token id past the vocabulary) fails with its own error;
    the well-formed requests sent with it get their samples (the very ones they get alone), in one
    batch once the culprit is found."""
    engine = _engine(policy)
    good = [SamplingParams(max_tokens=4, seed=i, n=1 + i % 2) for i in range(3)]
    vocab = policy.model.get_input_embeddings().weight.shape[0]
    try:
        bad = _slipped(engine, [*prompt, vocab], SamplingParams(max_tokens=4, seed=9))
        results = await asyncio.gather(
            bad, *(engine.generate(prompt, p) for p in good), return_exceptions=True
        )
        assert isinstance(results[0], IndexError), results[0]
        # one batch: neither the one that failed nor the lone prefills that found the culprit count
        assert engine.batches == 1
        alone = [await engine.generate(prompt, p) for p in good]
        assert _ids(results[1:]) == _ids(alone)
    finally:
        _close(engine)


@pytest.mark.integration
async def test_a_row_that_fails_mid_decode_fails_only_its_request(policy: Any, prompt: list[int]) -> None:
    """A request whose rows raise while decoding (stop strings that are not strings, in params built
    unvalidated) fails with that error, all its rows leave the batch, and the rows of the other
    requests sample on to the same tokens they get alone."""
    engine = _engine(policy)
    good = [SamplingParams(max_tokens=5, seed=i, n=2) for i in range(2)]
    broken = SamplingParams.model_construct(max_tokens=5, seed=7, n=2, stop=[None])
    try:
        results = await asyncio.gather(
            engine.generate(prompt, good[0]),
            engine.generate(prompt, broken),
            engine.generate(prompt, good[1]),
            return_exceptions=True,
        )
        assert isinstance(results[1], TypeError), results[1]
        assert engine.batches == 1 and engine.requests_served == 2
        alone = [await engine.generate(prompt, p) for p in good]
        assert _ids([results[0], results[2]]) == _ids(alone)
    finally:
        _close(engine)


@pytest.mark.integration
async def test_a_dead_worker_fails_what_it_held_and_is_restarted(policy: Any, prompt: list[int]) -> None:
    """A worker killed by an exception no handler takes fails the requests of its batch with
    EngineDownError (a 503), and a fresh worker serves the next requests and training calls, while
    `alive` stays true. A call that kills it tells its caller so."""
    engine = _engine(policy)
    bomb = SamplingParams.model_construct(max_tokens=4, seed=1, stop=[_Bomb("x")])
    try:
        held = await asyncio.gather(
            engine.generate(prompt, bomb),
            engine.generate(prompt, SamplingParams(max_tokens=4, seed=2)),
            return_exceptions=True,
        )
        assert all(isinstance(r, EngineDownError) and "died" in str(r) for r in held), held
        await wait_until(lambda: engine.restarts == 1, 30)
        assert engine.alive
        [sample] = await engine.generate(prompt, SamplingParams(max_tokens=3, seed=3))
        assert len(sample.token_ids) == 3

        def crash() -> None:
            raise _Crash("in a training call")

        first = engine.scheduler.thread
        with pytest.raises(EngineDownError, match="died running this call"):
            await engine.call(crash)
        await wait_until(lambda: engine.restarts == 2, 30)
        assert engine.alive
        assert await engine.call(threading.current_thread) is engine.scheduler.thread is not first
        [sample] = await engine.generate(prompt, SamplingParams(max_tokens=3, seed=3))
        assert len(sample.token_ids) == 3
    finally:
        _close(engine)


@pytest.mark.integration
async def test_restarts_are_bounded(policy: Any, prompt: list[int]) -> None:
    """A worker that keeps dying is restarted at most `max_restarts` times within
    `restart_window_s`; then the engine stays down, says why, fails what was queued and refuses
    every later request and call at once. Deaths older than the window do not count."""

    def crash() -> None:
        raise _Crash("deterministic")

    engine = _engine(policy, max_restarts=1, restart_window_s=2.0)
    try:
        with pytest.raises(EngineDownError):
            await engine.call(crash)
        await wait_until(lambda: engine.restarts == 1, 30)
        await asyncio.sleep(2.1)  # that death leaves the window
        with pytest.raises(EngineDownError):
            await engine.call(crash)
        await wait_until(lambda: engine.restarts == 2, 30)
        assert engine.alive
        # a second death within the window: down for good; the request queued behind the call fails
        died, queued = await asyncio.gather(
            engine.call(crash), engine.generate(prompt, SamplingParams(max_tokens=2)), return_exceptions=True
        )
        assert isinstance(died, EngineDownError), died
        assert isinstance(queued, EngineDownError) and "stays down" in str(queued), queued
        assert not engine.alive
        with pytest.raises(EngineDownError, match=r"max_restarts=1\); it stays down"):
            await engine.generate(prompt, SamplingParams(max_tokens=2))
        with pytest.raises(EngineDownError, match="stays down"):
            await engine.call(time.monotonic)
        assert engine.restarts == 2
    finally:
        _close(engine)


async def _cancel_once_sampling(engine: TorchEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    """Start a request, cancel it (its caller leaves) once it has sampled a few tokens; returns the
    tokens it was told of, a list that grows for as long as the engine decodes it."""
    told: list[int] = []
    task = asyncio.ensure_future(engine.generate(prompt, params, lambda _, t: told.append(t)))
    await wait_until(lambda: len(told) >= 3, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return told


@pytest.mark.integration
@pytest.mark.parametrize("base", [False, True], ids=["batched", "aside"])
async def test_a_request_whose_caller_left_stops_at_the_next_step(
    policy: Any, prompt: list[int], base: bool
) -> None:
    """A request cancelled mid-decode (its client disconnected) leaves at the next decode step, on
    the batch and on the one-row path of the base model alike: no token is sampled for it after
    that, and torch work handed to the engine (a training step) runs at once instead of waiting for
    `max_tokens` more tokens nobody reads. Before, both decoded on to `max_tokens`."""
    engine = _engine(policy)
    try:
        told = await _cancel_once_sampling(engine, prompt, SamplingParams(max_tokens=1500, base=base))
        t0 = time.monotonic()
        assert await engine.call(time.monotonic) - t0 < 5.0  # ~1500 tokens were ~30 s here
        settled = len(told)
        await asyncio.sleep(0.3)
        assert len(told) == settled < 100, len(told)
        assert engine.scheduler.cancelled == 1 and not engine.runner.busy
        [after] = await engine.generate(prompt, SamplingParams(max_tokens=3, seed=1))
        assert len(after.token_ids) == 3  # the engine serves on
    finally:
        _close(engine)


@pytest.mark.integration
async def test_a_row_dropped_from_a_running_batch_leaves_the_others_exact(
    policy: Any, prompt: list[int]
) -> None:
    """Rows of requests that stay sample the tokens they get alone when a request between them is
    cancelled mid-batch (its row leaves a gap the others close: their logits move with them)."""
    engine = _engine(policy)
    keep = [SamplingParams(max_tokens=6, seed=i) for i in range(2)]
    try:
        alone = [await engine.generate(prompt, p) for p in keep]
        first = asyncio.ensure_future(engine.generate(prompt, keep[0]))
        told: list[int] = []
        middle = asyncio.ensure_future(
            engine.generate(prompt, SamplingParams(max_tokens=500, seed=5), lambda _, t: told.append(t))
        )
        last = asyncio.ensure_future(engine.generate(prompt, keep[1]))
        await wait_until(lambda: len(told) >= 2, 30)
        middle.cancel()
        results = await asyncio.gather(first, last)
        assert _ids(list(results)) == _ids(alone)
        assert engine.scheduler.cancelled == 1
    finally:
        _close(engine)


@pytest.mark.integration
async def test_the_served_step_takes_turns_with_requests_for_the_base(policy: Any, prompt: list[int]) -> None:
    """Three clients asking the base model back to back do not hold the served step: its request,
    sent after theirs began, runs after at most one of theirs, not after all of them (before, every
    queued base request ran first: 130 of them in 90 s and none of the served step's); so does one
    asking more rows than a batch holds (its turn starts a batch of its own)."""
    engine = _engine(policy, max_batch_rows=2)
    done: list[str] = []

    async def base_client(k: int) -> None:
        for _ in range(2):
            await engine.generate(prompt, SamplingParams(max_tokens=4, seed=k, base=True))
            done.append("base")

    try:
        clients = [asyncio.ensure_future(base_client(k)) for k in range(3)]
        await wait_until(lambda: len(done) >= 1, 30)
        served = await engine.generate(prompt, SamplingParams(max_tokens=4, seed=9, n=3))
        done.append("served")
        assert len(served) == 3
        await asyncio.gather(*clients)
        assert done.index("served") <= 3, done  # the base request running, at most one more
    finally:
        _close(engine)
