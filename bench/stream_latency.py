"""Time to first token against the whole completion, streamed through the OpenAI route.

`stream=True` chat completions of 96 tokens (greedy, a story prompt) at 1 and 32 concurrent streams:
per stream the seconds to its first content delta and to its last chunk, medians over the streams.
Arms: the in-process torch engine and vLLM CPU + LoRA (its own stream feeding the endpoint's),
through the same endpoint.

    uv run python bench/stream_latency.py
    uv run python bench/stream_latency.py --no-vllm --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import journeyman as jm
from _task import nonzero_adapter, vllm_model  # bench/ is on sys.path when a bench runs

PROMPT = [{"role": "user", "content": "Tell me a long story about a dog who learns to sail."}]


async def one(model: jm.TrainableModel, tokens: int) -> tuple[float, float, int]:
    """(seconds to the first content delta, seconds to the end, content deltas) of one stream."""
    client = model.openai_client()
    t0 = time.perf_counter()
    first, deltas = float("nan"), 0
    stream = await client.chat.completions.create(
        model=model.name,
        messages=PROMPT,
        max_tokens=tokens,
        temperature=0.0,
        stream=True,  # pyright: ignore[reportArgumentType]
    )
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                deltas += 1
                if deltas == 1:
                    first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, deltas


async def arm(label: str, model: jm.TrainableModel, args: argparse.Namespace) -> None:
    await one(model, 8)  # warm-up
    for c in args.concurrency:
        runs = await asyncio.gather(*(one(model, args.tokens) for _ in range(c)))
        ttft = statistics.median(r[0] for r in runs)
        total = statistics.median(r[1] for r in runs)
        deltas = statistics.median(r[2] for r in runs)
        print(
            f"  {label:10s} {c:3d} streams: first token {ttft:6.2f} s, whole {total:6.2f} s "
            f"(ratio {ttft / total:4.2f}), {deltas:.0f} content deltas a stream",
            flush=True,
        )


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="jm-bench-"))
    backend = jm.LocalBackend(path=root / "torch")
    model = jm.TrainableModel(name="bench-stream", project="bench")
    await model.register(backend)
    nonzero_adapter(backend, model)
    try:
        await arm("torch", model, args)
    finally:
        backend.close()
    if args.no_vllm:
        return
    backend, model, _, _ = await vllm_model(root / "vllm", "bench-stream-vllm", args.vllm_python)
    try:
        await arm("vLLM", model, args)
    finally:
        backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM arm")
    parser.add_argument(
        "--vllm-python", default=None, help="vLLM interpreter (default: provision the CPU env)"
    )
    asyncio.run(main(parser.parse_args()))
