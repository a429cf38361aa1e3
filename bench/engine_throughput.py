"""Rollout tokens/s: the in-process torch engine (continuous vs static batching) vs vLLM serving a
LoRA adapter, one run, same machine.

Every engine serves the embedded SmolLM2-135M-Instruct in fp32 with a LoRA r8 adapter on all linear
layers (vLLM hot-loads it through `/v1/load_lora_adapter`, as after a training step), behind the same
endpoint. A rollout is an agent's two turns: a forced tool call (`tool_choice="required"`), the tool's
result, then a free answer, each turn up to `--max-tokens`. For each concurrency (8 and 32 rollouts in
flight) every engine runs a warm-up round, then `--rounds` timed rounds; tokens/s counts the
completion tokens the engine sampled. Static batching is the same engine with `continuous=False`:
a batch admits nothing once it samples, so a rollout whose tool call returned mid-batch waits for
the whole batch. The engines run one after the other, never at once.

    uv run python bench/engine_throughput.py            # provisions the vLLM CPU environment if absent
    uv run python bench/engine_throughput.py --concurrency 8 32 --max-tokens 64 --rounds 2
    uv run python bench/engine_throughput.py --no-vllm  # the in-process engine only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import journeyman as jm
from _task import group_pids, nonzero_adapter, vllm_model  # bench/ is on sys.path when a bench runs
from journeyman.engine.torch_engine import TorchEngine
from journeyman.engine.vllm_engine import VLLMEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up facts about a topic",
            "parameters": {
                "type": "object",
                "properties": {"topic": {"type": "string"}},
                "required": ["topic"],
            },
        },
    }
]
TOPICS = ["ocean", "mountain", "violin", "rocket", "garden", "castle", "glacier", "lantern"]


async def rounds(
    model: jm.TrainableModel, concurrency: int, n_rounds: int, max_tokens: int
) -> tuple[int, float]:
    """Run one warm-up round, then `n_rounds` timed rounds of `concurrency` two-turn tool rollouts;
    return (completion tokens, seconds)."""
    client = model.openai_client()

    async def one(i: int) -> int:
        topic = TOPICS[i % len(TOPICS)]
        messages: list[dict] = [
            {"role": "user", "content": f"Find facts about the {topic}, then write a long essay on it."}
        ]
        first = await client.chat.completions.create(
            model=model.name,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
        )
        call = first.choices[0].message
        messages.append(call.model_dump(exclude_none=True))
        for c in call.tool_calls or []:
            messages.append(
                {"role": "tool", "tool_call_id": c.id, "content": f"The {topic} is old and vast."}
            )
        second = await client.chat.completions.create(
            model=model.name,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i + 1,
        )
        return sum(len(jm.record_of(c.choices[0]).token_ids) for c in (first, second))

    await asyncio.gather(*[one(i) for i in range(concurrency)])  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for r in range(n_rounds):
        tokens += sum(await asyncio.gather(*[one(1000 * (r + 1) + i) for i in range(concurrency)]))
    return tokens, time.perf_counter() - t0


def rss_gib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total / 2**20


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="jm-bench-"))
    results: dict[tuple[str, int], float] = {}

    torch_backend = jm.LocalBackend(path=root / "torch")
    torch_model = jm.TrainableModel(name="bench-torch", project="bench")
    await torch_model.register(torch_backend)
    nonzero_adapter(torch_backend, torch_model)  # the torch engine samples through the live adapter
    torch_engine = torch_backend.service(torch_model).engine
    assert isinstance(torch_engine, TorchEngine)
    arms: list[tuple[str, jm.TrainableModel]] = [("static", torch_model), ("continuous", torch_model)]

    vllm_backend: jm.LocalBackend | None = None
    engine: VLLMEngine | None = None
    if not args.no_vllm:
        vllm_backend, vllm, engine, register_s = await vllm_model(
            root / "vllm", "bench-vllm", args.vllm_python
        )
        arms.append(("vllm+lora", vllm))
        print(
            f"vLLM: server ready in {engine.server.startup_seconds:.1f} s (register {register_s:.1f} s); "
            f"adapter hot-load {engine.adapter_load_seconds[-1]:.3f} s; serving {engine.served_model}"
        )
    try:
        for c in args.concurrency:
            for label, model in arms:
                torch_engine.continuous = label != "static"
                joined = torch_engine.rows_joined
                tokens, seconds = await rounds(model, c, args.rounds, args.max_tokens)
                results[(label, c)] = tokens / seconds
                print(
                    f"  {label:10s} concurrency {c:3d}: {tokens:6d} tokens in {seconds:6.1f} s = "
                    f"{tokens / seconds:7.1f} tok/s"
                    + (
                        f" ({torch_engine.rows_joined - joined} rows joined a running batch)"
                        if label != "vllm+lora"
                        else ""
                    )
                )
        vllm_rss = rss_gib(group_pids(engine.server.pid or 0)) if engine is not None else 0.0
        self_rss = rss_gib([os.getpid()])
    finally:
        if vllm_backend is not None:
            vllm_backend.close()
        torch_backend.close()

    print(
        f"\ntwo-turn tool rollouts, tokens/s, fp32, LoRA r8, max_tokens={args.max_tokens}, {os.cpu_count()} CPUs"
    )
    head = f"{'concurrency':>11}  {'static':>8}  {'continuous':>10}  {'continuous/static':>17}"
    print(head + (f"  {'vLLM+LoRA':>10}  {'continuous/vLLM':>15}" if engine is not None else ""))
    for c in args.concurrency:
        st, co = results[("static", c)], results[("continuous", c)]
        line = f"{c:>11}  {st:>8.1f}  {co:>10.1f}  {co / st:>17.2f}"
        if engine is not None:
            v = results[("vllm+lora", c)]
            line += f"  {v:>10.1f}  {co / v:>15.2f}"
        print(line)
    print(
        f"RSS: vLLM server processes {vllm_rss:.2f} GiB; this process (both policies + torch engine) {self_rss:.2f} GiB"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-vllm", action="store_true", help="the in-process engine only")
    parser.add_argument(
        "--vllm-python", default=None, help="vLLM interpreter (default: provision the CPU env)"
    )
    asyncio.run(main(parser.parse_args()))
