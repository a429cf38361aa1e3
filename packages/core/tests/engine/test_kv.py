"""The in-process engine's slots and KV reuse: a row that joins running rows samples what it would
alone; a turn served from an earlier turn's KV equals a cold prefill; eviction keeps it exact; a long
prompt is prefilled in chunks while other rows decode."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from _support import embedded_policy_with_adapter
from journeyman.engine.base import Sample, SamplingParams
from journeyman.engine.torch_engine import TorchEngine

pytestmark = pytest.mark.integration

SYSTEM = "You are a careful assistant. You answer in one short sentence and never more. " * 4


@pytest.fixture(scope="module")
def policy() -> Iterator[Any]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each xdist worker gets (conftest.py)
    try:
        yield embedded_policy_with_adapter()
    finally:
        torch.set_num_threads(threads)


def _chat(policy: Any, turns: list[dict[str, str]]) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, *turns]
    return list(policy.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def _same(a: Sample, b: Sample) -> None:
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_row_joining_running_rows_samples_what_it_would_alone(
    policy: Any, temperature: float
) -> None:
    engine = TorchEngine(policy, stop_ids=set())
    try:
        short = _chat(policy, [{"role": "user", "content": "Say hi."}])
        params = SamplingParams(max_tokens=6, seed=4, temperature=temperature)
        [alone] = await engine.generate(short, params)
        engine.runner.cache.clear(policy.version)  # the joining row is prefilled, not served from its twin
        steps = engine.runner.decode_steps
        long = asyncio.create_task(
            engine.generate(
                _chat(policy, [{"role": "user", "content": "Tell me a story."}]),
                SamplingParams(max_tokens=40, seed=1),
            )
        )
        while engine.runner.decode_steps < steps + 3:  # the long row is decoding
            await asyncio.sleep(0.01)
        joined = engine.rows_joined
        [mid] = await engine.generate(short, params)
        assert engine.rows_joined == joined + 1 and not long.done()
        _same(mid, alone)
        await long
    finally:
        engine.close()


async def test_a_later_turn_from_reused_kv_equals_a_cold_prefill_and_eviction_stays_exact(
    policy: Any,
) -> None:
    """Turns 2 and 3 of a conversation extend the last turn's prompt and answer: their prefill runs
    only the new tokens, and what they sample is what a cold engine samples. With a cache too small
    to keep every turn (three conversations at once), entries are evicted (counted) and the samples
    stay the same."""
    tok = policy.tokenizer

    async def conversation(engine: TorchEngine) -> list[Sample]:
        prompt = _chat(policy, [{"role": "user", "content": "Name a river."}])
        out: list[Sample] = []
        for turn in range(3):
            [s] = await engine.generate(prompt, SamplingParams(max_tokens=10, seed=turn))
            out.append(s)
            follow = f"<|im_end|>\n<|im_start|>user\nAnd another, number {turn + 2}?<|im_end|>\n<|im_start|>assistant\n"
            prompt = prompt + s.token_ids + list(tok.encode(follow, add_special_tokens=False))
        return out

    warm = TorchEngine(policy, stop_ids=set())
    try:
        turns = await conversation(warm)
        counts = warm.counters()
        assert counts["prefix_cache_hits"] == 2  # turns 2 and 3
    finally:
        warm.close()
    cold = TorchEngine(policy, stop_ids=set(), prefix_cache_bytes=0)  # nothing kept: every prefill cold
    try:
        again = await conversation(cold)
        cold_counts = cold.counters()
        assert cold_counts["prefix_cache_hits"] == 0
        # each later turn prefilled only the tokens after the earlier turn's answer
        assert counts["prefill_tokens"] + 2 * 9 <= cold_counts["prefill_tokens"]
    finally:
        cold.close()
    for a, b in zip(turns, again, strict=True):
        _same(a, b)
    # a cache that holds about one first turn at a time: the oldest are evicted
    config = policy.model.get_base_model().config
    head_dim = config.hidden_size // config.num_attention_heads
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # fp32 K and V
    runner_bytes = token_bytes * 12
    tight = TorchEngine(policy, stop_ids=set(), prefix_cache_bytes=runner_bytes)
    try:
        results = await asyncio.gather(*(conversation(tight) for _ in range(3)))
        assert tight.counters()["prefix_cache_evictions"] > 0
        assert tight.runner.cache.nbytes <= runner_bytes
    finally:
        tight.close()
    for got in results:
        for a, b in zip(turns, got, strict=True):
            _same(a, b)


async def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(policy: Any) -> None:
    """A prompt longer than a prefill pass is split over several passes, with decode steps of the
    running rows between them; its samples are those of a one-pass prefill."""
    long_prompt = _chat(
        policy, [{"role": "user", "content": "Summarise: " + "the quick brown fox jumps. " * 40}]
    )
    params = SamplingParams(max_tokens=5, seed=2)
    one_pass = TorchEngine(policy, stop_ids=set(), prefill_chunk_tokens=4096)
    try:
        [want] = await one_pass.generate(long_prompt, params)
    finally:
        one_pass.close()
    engine = TorchEngine(policy, stop_ids=set(), prefill_chunk_tokens=64)
    try:
        other = asyncio.create_task(
            engine.generate(
                _chat(policy, [{"role": "user", "content": "Count to ten."}]),
                SamplingParams(max_tokens=30, seed=1),
            )
        )
        while engine.runner.decode_steps < 1:
            await asyncio.sleep(0.01)
        steps = engine.runner.decode_steps
        [got] = await engine.generate(long_prompt, params)
        # the other row kept decoding while the long prompt's ~250 own tokens went through in passes
        assert engine.runner.decode_steps - steps > 250 // 64
        _same(got, want)
        await other
    finally:
        engine.close()


async def test_a_decode_step_of_fixed_shape_samples_what_the_eager_one_does(policy: Any) -> None:
    """The bucketed decode step (`decode_graph`, replayed on CUDA, eager here) pads the rows and
    the attended slots and reads the whole shared-prefix buffer under masks: three rows of a group
    (two of one prompt) and a long prompt joining mid-decode, prefilled in chunks in the slot under
    the padding, sample what the eager step samples."""
    # another system prompt: the long prompt cannot become the shared prefix the group reads
    long_prompt = list(
        policy.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Summarise: " + "a red fox ran. " * 20}],
            add_generation_prompt=True,
            return_dict=False,
        )
    )

    async def scenario(engine: TorchEngine) -> list[list[Sample]]:
        group = [
            engine.generate(
                _chat(policy, [{"role": "user", "content": "Say hi."}]),
                SamplingParams(max_tokens=12, temperature=0.0),
            ),
            engine.generate(
                _chat(policy, [{"role": "user", "content": "Name a colour."}]),
                SamplingParams(max_tokens=16, n=2, seed=3, temperature=1.0),
            ),
        ]
        running = asyncio.gather(*group)
        while engine.runner.decode_steps < 2:
            await asyncio.sleep(0.01)
        late = await engine.generate(long_prompt, SamplingParams(max_tokens=6, seed=5, temperature=1.0))
        return [*await running, late]

    eager = TorchEngine(policy, stop_ids=set(), prefill_chunk_tokens=64, decode="eager")
    try:
        want = await scenario(eager)
    finally:
        eager.close()
    fixed = TorchEngine(policy, stop_ids=set(), prefill_chunk_tokens=64, decode="fixed")
    try:
        got = await scenario(fixed)
        assert fixed.runner.graphs is not None and fixed.runner.prefix_tokens_saved > 0
    finally:
        fixed.close()
    for a_samples, b_samples in zip(want, got, strict=True):
        for a, b in zip(a_samples, b_samples, strict=True):
            _same(a, b)


def test_decode_steps_pad_to_few_shapes() -> None:
    from journeyman.engine.decode_graph import kv_bucket, row_bucket

    assert [row_bucket(n) for n in (1, 3, 8, 33, 128, 129)] == [1, 4, 8, 48, 128, 192]
    assert [kv_bucket(n) for n in (1, 64, 65, 1024, 1025)] == [64, 64, 128, 1024, 2048]
