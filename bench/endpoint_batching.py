"""Batched vs sequential: 32 chat requests through the endpoint, concurrently and one at a time.

Same model (embedded SmolLM2-135M, fp32, in-process engine), same prompts, same seeds, same
`--max-tokens`; prints completion tokens/s for each and their ratio.

    uv run python bench/endpoint_batching.py --requests 32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import journeyman as jm
from journeyman.app import tasks
from openai import AsyncOpenAI


async def one(client: AsyncOpenAI, model: str, prompt: str, seed: int, max_tokens: int) -> int:
    out = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
    )
    return out.usage.completion_tokens if out.usage else 0


async def main(args: argparse.Namespace) -> None:
    async with jm.LocalBackend(path=tempfile.mkdtemp(prefix="jm-bench-")) as backend:
        model = jm.TrainableModel(name="bench", project="bench")
        await model.register(backend)
        client = model.openai_client()
        prompts = [s.prompt for s in tasks.scenarios("train", args.requests, seed=3)]
        await one(client, model.name, prompts[0], 0, 4)  # warm-up

        t0 = time.perf_counter()
        seq = [await one(client, model.name, p, i, args.max_tokens) for i, p in enumerate(prompts)]
        t_seq = time.perf_counter() - t0

        t0 = time.perf_counter()
        conc = await asyncio.gather(
            *(one(client, model.name, p, i, args.max_tokens) for i, p in enumerate(prompts))
        )
        t_conc = time.perf_counter() - t0

    rate_seq, rate_conc = sum(seq) / t_seq, sum(conc) / t_conc
    print(f"{args.requests} requests x <= {args.max_tokens} tokens")
    print(f"sequential : {sum(seq):5d} tokens in {t_seq:6.1f}s = {rate_seq:7.1f} tokens/s")
    print(f"concurrent : {sum(conc):5d} tokens in {t_conc:6.1f}s = {rate_conc:7.1f} tokens/s")
    print(f"batched / sequential throughput: {rate_conc / rate_seq:.2f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(main(ap.parse_args()))
