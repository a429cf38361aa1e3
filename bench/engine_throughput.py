"""Rollout tokens/s: the in-process torch engine vs vLLM serving a LoRA adapter, one run, same machine.

Both engines serve the embedded SmolLM2-135M-Instruct in fp32 with a LoRA r8 adapter on all linear
layers (vLLM hot-loads it through `/v1/load_lora_adapter`, as after a training step), behind the same
endpoint. For each concurrency (8 and 32 rollouts in flight) every engine runs a warm-up round, then
`--rounds` timed rounds of chat completions at temperature 1 with `--max-tokens` new tokens; tokens/s
counts the completion tokens the engines sampled. The engines run one after the other, never at once.

    uv run python bench/engine_throughput.py            # provisions the vLLM CPU environment if absent
    uv run python bench/engine_throughput.py --concurrency 8 32 --max-tokens 128 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import journeyman as jm
import torch
from journeyman.engine import vllm_env
from journeyman.engine.vllm_engine import VLLMEngine
from journeyman.engine.vllm_server import VLLMConfig

PROMPTS = [
    "Tell me a long story about a {t}.",
    "Describe everything you know about the {t}, in detail.",
    "Write an essay about a {t}.",
    "Explain the history of the {t}.",
]
TOPICS = ["ocean", "mountain", "violin", "rocket", "garden", "castle", "glacier", "lantern"]


async def rounds(
    model: jm.TrainableModel, concurrency: int, n_rounds: int, max_tokens: int
) -> tuple[int, float]:
    """Run one warm-up round, then `n_rounds` timed rounds; return (completion tokens, seconds)."""
    client = model.openai_client()

    async def one(i: int) -> int:
        prompt = PROMPTS[i % len(PROMPTS)].format(t=TOPICS[i % len(TOPICS)])
        out = await client.chat.completions.create(
            model=model.name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
        )
        return len(jm.record_of(out.choices[0]).token_ids)

    await asyncio.gather(*[one(i) for i in range(concurrency)])  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for r in range(n_rounds):
        tokens += sum(await asyncio.gather(*[one(1000 * (r + 1) + i) for i in range(concurrency)]))
    return tokens, time.perf_counter() - t0


def nonzero_adapter(backend: jm.LocalBackend, model: jm.TrainableModel) -> Path:
    """Give the LoRA B matrices small random values (fresh LoRA is a no-op) and save it in PEFT format."""
    policy = backend.service(model).policy
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    path = Path(tempfile.mkdtemp(prefix="jm-bench-adapter-"))
    policy.save(path)
    return path


def rss_gib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total / 2**20


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().split(")")[-1].split()[2]) == pgid:
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


async def main(args: argparse.Namespace) -> None:
    python = args.vllm_python or str(vllm_env.provision())
    root = Path(tempfile.mkdtemp(prefix="jm-bench-"))
    results: dict[tuple[str, int], float] = {}

    torch_backend = jm.LocalBackend(path=root / "torch")
    torch_model = jm.TrainableModel(name="bench-torch", project="bench")
    await torch_model.register(torch_backend)
    nonzero_adapter(torch_backend, torch_model)  # the torch engine samples through the live adapter

    t0 = time.perf_counter()
    vllm_backend = jm.LocalBackend(path=root / "vllm", engine=VLLMConfig(python=python))
    vllm_model = jm.TrainableModel(name="bench-vllm", project="bench")
    await vllm_model.register(vllm_backend)
    engine = vllm_backend.service(vllm_model).engine
    assert isinstance(engine, VLLMEngine)
    register_s = time.perf_counter() - t0
    adapter = nonzero_adapter(vllm_backend, vllm_model)
    await engine.load_adapter(adapter, 1)
    print(
        f"vLLM: server ready in {engine.server.startup_seconds:.1f} s (register {register_s:.1f} s); "
        f"adapter hot-load {engine.adapter_load_seconds[-1]:.3f} s; serving {engine.served_model}"
    )
    try:
        for c in args.concurrency:
            for label, model in (("torch", torch_model), ("vllm+lora", vllm_model)):
                tokens, seconds = await rounds(model, c, args.rounds, args.max_tokens)
                results[(label, c)] = tokens / seconds
                print(
                    f"  {label:10s} concurrency {c:3d}: {tokens:6d} tokens in {seconds:6.1f} s = {tokens / seconds:7.1f} tok/s"
                )
        vllm_rss = rss_gib(group_pids(engine.server.pid or 0))
        self_rss = rss_gib([os.getpid()])
    finally:
        vllm_backend.close()
        torch_backend.close()

    print(f"\nrollout tokens/s, fp32, LoRA r8, max_tokens={args.max_tokens}, {os.cpu_count()} CPUs")
    print(f"{'concurrency':>11}  {'in-process':>10}  {'vLLM+LoRA':>10}  {'in-process / vLLM':>17}")
    for c in args.concurrency:
        t, v = results[("torch", c)], results[("vllm+lora", c)]
        print(f"{c:>11}  {t:>10.1f}  {v:>10.1f}  {t / v:>17.2f}")
    print(
        f"RSS: vLLM server processes {vllm_rss:.2f} GiB; this process (both policies + torch engine) {self_rss:.2f} GiB"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--vllm-python", default=None, help="vLLM interpreter (default: provision the CPU env)"
    )
    asyncio.run(main(parser.parse_args()))
