"""Capture overhead on vLLM: rollout tokens/s through Journeyman's endpoint vs the same vLLM server
queried directly, one run, interleaved.

One vLLM server (the CPU build, SmolLM2-135M-Instruct fp32) serves a nonzero LoRA r8 adapter
hot-loaded as step 1, as after a training step. Two arms send it the same rollouts:

- endpoint: Journeyman's OpenAI-compatible endpoint on the vLLM engine (LocalBackend), inside a
  `capture_scope`: it renders the prompt to ids (splicing the sampled first turn), asks vLLM's
  `/v1/completions` for token ids and logprobs, parses the turn and files a TokenRecord under the
  capture id, which the bench pops after each rollout, as a training loop does.
- direct: vLLM's own `/v1/chat/completions` with the same LoRA model name, no logprobs (what an
  agent pointed straight at vLLM asks for; `--direct-logprobs` asks for them too).

A rollout is two chat turns: a system prompt and a request for a long essay, the answer, a follow-up
user turn, the second answer, each turn at most `--max-tokens`. Same prompts and sampling params
(temperature 1) in both arms; the bench checks that both render the first prompt to the same token
ids. No seeds, so the two arms draw alike. (Seeds are safe since the CPU server runs without chunked
prefill: with it, vLLM 0.32's CPU build killed its engine on a seeded prefill split over two steps.)
No tools: Journeyman's forced-call grammar (and the rescore prefill it needs for honest
logprobs) and vLLM's own tool machinery are not the same work, so they would not compare overhead.
Neither arm ignores EOS (the endpoint does not forward vLLM's `ignore_eos`), so the completion
token counts of both arms are printed, and the share of turns cut at max_tokens (the prompt asks
for a long essay, so nearly all are).

For each concurrency (rollouts in flight), each arm runs a warm-up round, then `--rounds` timed
rounds per arm, interleaved A B, B A, A B ... (each pair alternates which arm goes first, so a
drift in the machine's load hits both alike). Tokens/s = completion tokens of an arm's rounds /
their wall time. Prints each round pair; then per concurrency each arm's tokens/s, the ratio
endpoint/direct, token counts, and CPU cost, which other load on the machine disturbs less than
wall time: milliseconds of CPU per request of the endpoint's server thread (the capture work) and of
this whole process (client included), and vLLM's processes' CPU milliseconds per completion token;
last, the median of the per-pair ratios over all concurrencies (goal: >= 0.95).

    uv run python bench/capture_overhead.py          # provisions the vLLM CPU environment if absent
    uv run python bench/capture_overhead.py --concurrency 8 32 --max-tokens 32 --rounds 3

Flags: --concurrency (default 8 32), --max-tokens per turn (32), --rounds timed rounds per arm
and concurrency (3), --direct-logprobs (the direct arm asks for logprobs too), --vllm-python
(vLLM's interpreter; default: the provisioned CPU environment).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import journeyman as jm
from _task import cpu_seconds, group_pids, vllm_model  # bench/ is on sys.path when a bench runs
from journeyman.rollout.capture import capture_scope
from openai import AsyncOpenAI

SYSTEM = "You are a knowledgeable writer. Answer at length, in full paragraphs."
TOPICS = ["ocean", "mountain", "violin", "rocket", "garden", "castle", "glacier", "lantern"]
FOLLOW_UP = "Go on: write another paragraph with more detail."
REQUEST_TIMEOUT_S = 300.0


def first_turn(i: int) -> list[dict[str, Any]]:
    topic = TOPICS[i % len(TOPICS)]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Write a long essay about the {topic}: its history, uses and meaning."},
    ]


@dataclass
class Round:
    """What one or more rounds of one arm sampled, and what they cost."""

    tokens: int = 0
    completions: int = 0
    cut: int = 0  # completions that stopped at max_tokens
    seconds: float = 0.0
    cpu_process: float = 0.0  # CPU seconds of this process: the client, and the endpoint when used
    cpu_endpoint: float = 0.0  # of the endpoint's server thread alone
    cpu_vllm: float = 0.0  # of the vLLM server's processes

    def __add__(self, o: Round) -> Round:
        return Round(*(getattr(self, f.name) + getattr(o, f.name) for f in fields(self)))

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Meters:
    """Where CPU time is read: the vLLM server's process group and the endpoint's thread."""

    vllm_pids: list[int]
    endpoint_tid: int

    def read(self) -> tuple[float, float, float]:
        return time.process_time(), cpu_seconds([], [self.endpoint_tid]), cpu_seconds(self.vllm_pids)


@dataclass
class Arm:
    """One way to reach the server: a client, the model name it asks for, and request extras."""

    label: str
    client: AsyncOpenAI
    model: str
    extra: dict[str, Any]
    backend: jm.LocalBackend | None = None  # the endpoint arm pops its captures from here
    jm_model: jm.TrainableModel | None = None

    async def turn(self, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, int, bool]:
        """(text, completion tokens, cut at max_tokens) of one chat turn."""
        r = await self.client.chat.completions.create(
            model=self.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=1.0,
            **self.extra,
        )
        assert r.usage is not None
        choice = r.choices[0]
        return choice.message.content or "", r.usage.completion_tokens, choice.finish_reason == "length"

    async def rollout(self, i: int, max_tokens: int) -> Round:
        """One two-turn rollout (tokens, completions and cuts only)."""
        with capture_scope() as cid:  # the endpoint files both turns under it; vLLM never sees it
            messages = first_turn(i)
            text, tokens, cut = await self.turn(messages, max_tokens)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
            _, tokens2, cut2 = await self.turn(messages, max_tokens)
        if self.backend is not None and self.jm_model is not None:
            calls = (await self.backend.pop_captures(self.jm_model, [cid]))[cid]
            assert len(calls) == 2 and all(
                len(c.response["choices"][0]["journeyman"]["logprobs"]) for c in calls
            ), "the endpoint did not capture both turns with their logprobs"
        return Round(tokens + tokens2, 2, int(cut) + int(cut2))

    async def round(self, concurrency: int, max_tokens: int, meters: Meters) -> Round:
        """`concurrency` rollouts at once, timed and metered."""
        t0, cpu0 = time.perf_counter(), meters.read()
        out = await asyncio.gather(*[self.rollout(i, max_tokens) for i in range(concurrency)])
        seconds, cpu1 = time.perf_counter() - t0, meters.read()
        total = sum(out, Round())
        total.seconds = seconds
        total.cpu_process, total.cpu_endpoint, total.cpu_vllm = (
            b - a for a, b in zip(cpu0, cpu1, strict=True)
        )
        return total


async def same_prompt_ids(
    backend: jm.LocalBackend, model: jm.TrainableModel, base_url: str, name: str
) -> bool:
    """Do the endpoint and vLLM's chat template render the first turn to the same token ids?"""
    messages = first_turn(0)
    ours, _ = backend.service(model).chat_format.prompt_ids(messages)
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as c:
        resp = await c.post(
            "/tokenize", json={"model": name, "messages": messages, "add_generation_prompt": True}
        )
        resp.raise_for_status()
        theirs = resp.json()["tokens"]
    return list(ours) == list(theirs)


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="jm-bench-capture-"))
    backend, model, engine, register_s = await vllm_model(root / "vllm", "bench-capture", args.vllm_python)
    summary: list[tuple[int, Round, Round]] = []
    pair_ratios: list[float] = []
    try:
        lora = engine.served_model  # "policy@1": the adapter both arms sample from
        print(
            f"vLLM: server ready in {engine.server.startup_seconds:.1f} s (register {register_s:.1f} s); "
            f"serving {lora} at {engine.base_url}"
        )
        identical = await same_prompt_ids(backend, model, engine.base_url, lora)
        print(f"first-turn prompt ids identical in both arms: {identical}")
        through = Arm(
            "endpoint",
            model.openai_client(max_retries=0, timeout=REQUEST_TIMEOUT_S),
            model.name,
            {},
            backend,
            model,
        )
        direct = Arm(
            "direct",
            AsyncOpenAI(
                base_url=f"{engine.base_url}/v1",
                api_key="unused",
                max_retries=0,
                timeout=REQUEST_TIMEOUT_S,
                http_client=httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)),
            ),
            lora,
            {"logprobs": True} if args.direct_logprobs else {},
        )
        endpoint_thread = backend.service(model).server.thread
        assert endpoint_thread.native_id is not None
        meters = Meters(group_pids(engine.server.pid or 0), endpoint_thread.native_id)
        for c in args.concurrency:
            for arm in (through, direct):  # warm-up: caches, allocators, connection pools
                await arm.round(c, args.max_tokens, meters)
            done: dict[str, Round] = {"endpoint": Round(), "direct": Round()}
            for r in range(args.rounds):
                pair: dict[str, Round] = {}
                for arm in (through, direct) if r % 2 == 0 else (direct, through):
                    pair[arm.label] = await arm.round(c, args.max_tokens, meters)
                    done[arm.label] += pair[arm.label]
                e, d = pair["endpoint"], pair["direct"]
                pair_ratios.append(e.rate / d.rate)
                print(
                    f"  concurrency {c:3d} round {r}: endpoint {e.tokens:5d} tok in {e.seconds:5.1f} s = "
                    f"{e.rate:6.1f} tok/s | direct {d.tokens:5d} tok in {d.seconds:5.1f} s = "
                    f"{d.rate:6.1f} tok/s | ratio {pair_ratios[-1]:.3f}"
                )
            summary.append((c, done["endpoint"], done["direct"]))
    finally:
        backend.close()

    print(
        f"\ntwo-turn chat rollouts on vLLM + LoRA r8 (fp32), max_tokens={args.max_tokens} per turn, "
        f"temperature 1, {args.rounds} interleaved rounds per arm, {os.cpu_count()} CPUs; the direct arm "
        + ("asks for logprobs too" if args.direct_logprobs else "asks for no logprobs")
    )
    print(
        f"{'concurrency':>11}  {'endpoint tok/s':>14}  {'direct tok/s':>12}  {'endpoint/direct':>15}  "
        f"{'tokens e/d':>11}  {'cut e/d':>9}  {'endpoint CPU ms/req':>19}  {'process ms/req e/d':>18}  "
        f"{'vLLM ms/tok e/d':>15}"
    )
    ratios = []
    for c, e, d in summary:
        ratios.append(e.rate / d.rate)
        cut = f"{e.cut / e.completions:.0%}/{d.cut / d.completions:.0%}"
        process = f"{1000 * e.cpu_process / e.completions:.1f}/{1000 * d.cpu_process / d.completions:.1f}"
        vllm = f"{1000 * e.cpu_vllm / e.tokens:.1f}/{1000 * d.cpu_vllm / d.tokens:.1f}"
        print(
            f"{c:>11}  {e.rate:>14.1f}  {d.rate:>12.1f}  {ratios[-1]:>15.3f}  {f'{e.tokens}/{d.tokens}':>11}  "
            f"{cut:>9}  {1000 * e.cpu_endpoint / e.completions:>19.1f}  {process:>18}  {vllm:>15}"
        )
        if abs(e.tokens - d.tokens) > 0.05 * d.tokens:
            print(f"  note: at concurrency {c} the arms sampled token counts more than 5% apart")
    median = statistics.median(pair_ratios)
    print(
        f"capture overhead, endpoint/direct tokens/s: median over {len(pair_ratios)} round pairs "
        f"{median:.3f} (pooled per concurrency: {', '.join(f'{r:.3f}' for r in ratios)}); goal >= 0.95: "
        + ("met" if median >= 0.95 else "NOT met")
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--direct-logprobs", action="store_true", help="the direct arm asks for logprobs too")
    ap.add_argument("--vllm-python", default=None, help="vLLM interpreter (default: provision the CPU env)")
    asyncio.run(main(ap.parse_args()))
