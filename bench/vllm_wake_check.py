"""Does a woken vLLM serve what it served before it slept, and still apply the adapter? A fixed-seed
check for the first CUDA machine with vLLM: vLLM has had releases where a woken engine silently
stopped applying LoRA, and at sleep level 2 the weights come back only through our re-read.

With the embedded SmolLM2-135M, the real `VLLMEngine` (sleep mode on) and an adapter of seeded
random LoRA weights:

1. one greedy, seeded prompt on the base ("policy") and on the adapter ("policy@1"): they must differ;
2. the engine sleeps; this process (the trainer's place) fills most of what vLLM freed with one
   allocation, drops it, and returns its cached memory (`handoff.return_cached_memory`);
3. the engine wakes in stages with the adapter loaded between weights and KV cache (as a training
   step's end does), then sleeps and wakes once more with no new adapter (a skipped step);
4. after each wake, the same prompt on base and adapter: the same tokens as in 1 (logprobs within
   1e-2), and the adapter's still differ from the base's.

    uv run python bench/vllm_wake_check.py --python VENV/bin/python [--sleep-level 1] [--json out.json]

Where vLLM or CUDA is missing it prints `SKIP: <why>` and exits 0; a failed check exits 1.
`bench/gpu_check.py` calls `wake_check()` (and `skip_reason()`) directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel

PROMPT = "The three most useful things to pack for a week of hiking are"
LOGPROB_TOLERANCE = 1e-2  # bf16 serving: the same batch gives the same numbers; a margin for kernels


class Completion(BaseModel):
    token_ids: list[int]
    logprobs: list[float]


class WakeCheck(BaseModel):
    """What the check saw: each named check's outcome, and the handoff's figures."""

    passed: bool
    checks: dict[str, bool]
    sleep_level: int
    freed_gib: float | None  # what the sleep gave back on this process's GPU
    filled_gib: float | None  # what the stand-in trainer allocation took while vLLM slept
    returned_gib: float  # the trainer's cache given back before the wake
    wake_seconds: dict[str, float]
    tokens: dict[str, list[int]]


def skip_reason(python: str | None = None) -> str | None:
    """Why the check cannot run here (no CUDA, no vLLM), or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (vLLM's CPU build has no sleep mode; the stand-in tests cover the protocol)"
    from journeyman.engine.vllm_server import VLLMConfig, resolve_python
    from journeyman.errors import InvalidFieldError

    try:
        resolve_python(VLLMConfig(python=python))
    except InvalidFieldError as e:
        return f"no vLLM to run: {e}"
    return None


def _adapter(weights: Path, out: Path, seed: int = 0) -> Path:
    """An adapter whose LoRA B matrices are seeded random (PEFT starts them at zero: no change)."""
    import torch
    from journeyman.policy.lora import LoraPolicy

    policy = LoraPolicy(weights, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    policy.save(out)
    return out


async def _complete(engine: Any, model: str, prompt: list[int], max_tokens: int) -> Completion:
    """One greedy, seeded completion from `model` (a name vLLM serves), bypassing the engine's choice."""
    from journeyman.engine.base import SamplingParams

    body = engine.request_body(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0))
    body["model"] = model
    async with httpx.AsyncClient(base_url=engine.base_url, headers=engine.server.headers, timeout=120) as c:
        resp = await c.post("/v1/completions", json=body)
        resp.raise_for_status()
    choice = resp.json()["choices"][0]
    return Completion(token_ids=choice["token_ids"], logprobs=choice["logprobs"]["token_logprobs"])


def _same(a: Completion, b: Completion) -> bool:
    close = all(abs(x - y) <= LOGPROB_TOLERANCE for x, y in zip(a.logprobs, b.logprobs, strict=True))
    return a.token_ids == b.token_ids and close


async def _run(python: str | None, sleep_level: Literal[1, 2], max_tokens: int, work: Path) -> WakeCheck:
    import torch
    from journeyman.data.config import DEFAULT_BASE_MODEL
    from journeyman.engine import handoff
    from journeyman.engine.vllm_engine import VLLMEngine
    from journeyman.engine.vllm_server import VLLMConfig
    from journeyman.policy.weights import resolve_base_model
    from transformers import AutoTokenizer

    torch.cuda.init()  # this process is the trainer: its GPU memory is part of the picture
    weights = resolve_base_model(DEFAULT_BASE_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(weights)
    prompt = list(tokenizer.encode(PROMPT))
    adapter = _adapter(weights, work / "adapter")
    config = VLLMConfig(
        python=python,
        sleep_mode=True,
        sleep_level=sleep_level,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
    )
    engine = await asyncio.to_thread(
        VLLMEngine, weights, {int(tokenizer.eos_token_id or 0)}, config, dtype="bfloat16", lora_rank=8
    )
    checks: dict[str, bool] = {}
    tokens: dict[str, list[int]] = {}
    freed: int | None = None
    filled: float | None = None
    returned = 0
    try:
        await engine.load_adapter(adapter, 1)
        base0 = await _complete(engine, "policy", prompt, max_tokens)
        lora0 = await _complete(engine, "policy@1", prompt, max_tokens)
        tokens.update(base=base0.token_ids, adapter=lora0.token_ids)
        checks["adapter differs from base before sleep"] = lora0.token_ids != base0.token_ids

        before = handoff.cuda_memory()
        await engine.sleep()
        after = handoff.cuda_memory()
        freed = (after.free_bytes - before.free_bytes) if before and after else None
        if after is not None:  # the trainer's turn: take most of what vLLM let go, then give it back
            n = int(after.free_bytes * 0.8)
            block = torch.empty(n, dtype=torch.uint8, device="cuda")
            block.fill_(1)
            torch.cuda.synchronize()
            filled = n / handoff.GiB
            del block
        returned = handoff.return_cached_memory()
        await engine.load_adapter(adapter, 2)  # the staged wake: weights, this adapter, KV cache
        base1 = await _complete(engine, "policy", prompt, max_tokens)
        lora1 = await _complete(engine, "policy@2", prompt, max_tokens)
        checks["base unchanged after a wake with a new adapter"] = _same(base0, base1)
        checks["adapter applied after a wake with a new adapter"] = _same(lora0, lora1)

        await engine.sleep()
        await engine.wake()  # a skipped step: the served adapter is loaded again, in place
        base2 = await _complete(engine, "policy", prompt, max_tokens)
        lora2 = await _complete(engine, "policy@2", prompt, max_tokens)
        checks["base unchanged after a plain wake"] = _same(base0, base2)
        checks["adapter applied after a plain wake"] = _same(lora0, lora2)
        tokens.update(base_after=base2.token_ids, adapter_after=lora2.token_ids)
    finally:
        engine.close()
    return WakeCheck(
        passed=all(checks.values()),
        checks=checks,
        sleep_level=sleep_level,
        freed_gib=None if freed is None else freed / handoff.GiB,
        filled_gib=filled,
        returned_gib=returned / handoff.GiB,
        wake_seconds=dict(engine.wake_seconds),
        tokens=tokens,
    )


def wake_check(
    python: str | None = None, *, sleep_level: Literal[1, 2] = 2, max_tokens: int = 16
) -> WakeCheck:
    """Run the check (see the module docstring); call `skip_reason()` first."""
    with tempfile.TemporaryDirectory(prefix="journeyman-wake-check-") as work:
        return asyncio.run(_run(python, sleep_level, max_tokens, Path(work)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fixed-seed check on a CUDA machine with vLLM: after sleep and a staged wake, vLLM "
        "serves the same base tokens and still applies the adapter. Prints SKIP without CUDA or vLLM."
    )
    parser.add_argument("--python", default=None, help="interpreter that runs vLLM (VLLMConfig.python)")
    parser.add_argument("--sleep-level", type=int, choices=(1, 2), default=2, help="VLLMConfig.sleep_level")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per greedy completion")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    reason = skip_reason(args.python)
    if reason is not None:
        print(f"SKIP: {reason}")
        return 0
    t0 = time.perf_counter()
    result = wake_check(args.python, sleep_level=args.sleep_level, max_tokens=args.max_tokens)
    for name, ok in result.checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(
        f"sleep level {result.sleep_level}: freed {result.freed_gib or 0:.2f} GiB, trainer filled "
        f"{result.filled_gib or 0:.2f} GiB and returned {result.returned_gib:.2f} GiB; wake stages "
        + ", ".join(f"{k} {v:.2f} s" for k, v in result.wake_seconds.items())
        + f"; {time.perf_counter() - t0:.0f} s in all"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result.model_dump(), indent=2))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
