"""Agent rollouts on the in-process engine: this tree's slot engine against the engine of an earlier
revision (static batching, by default the last one before the slot engine) and vLLM serving a LoRA
adapter, one run, same machine.

Every engine serves the embedded SmolLM2-135M-Instruct in fp32 with a LoRA r8 adapter on all linear
layers (vLLM hot-loads it through `/v1/load_lora_adapter`, as after a training step), behind the same
endpoint. A rollout is an agent's four turns: three forced tool calls (`tool_choice="required"`),
each answered by a tool that takes `--tool-seconds` (a seeded draw between 0 and twice it, the same
for every engine), then a free answer; each turn up to `--max-tokens`. For each concurrency every
engine runs a warm-up round, then `--rounds` timed rounds. Reported: completion tokens/s, each
rollout's latency (p50 / p99: does a rollout wait for unrelated ones?), and prompt tokens prefilled
per rollout (the earlier turns' KV reused, or not). The earlier revision runs in a child process from
a `git worktree` of it; the engines run one after the other, never at once.

    uv run python bench/engine_throughput.py            # provisions the vLLM CPU environment if absent
    uv run python bench/engine_throughput.py --concurrency 8 32 --max-tokens 48 --rounds 1
    uv run python bench/engine_throughput.py --no-vllm --baseline none   # this tree's engine only
    uv run python bench/engine_throughput.py --step-boundary  # batches before and after a training step

`--step-boundary` times something else: batches of 32 of the built-in task's rollouts, three before
a real training step and three after it, each batch's seconds printed, for this tree's engine and
the baseline's: does the first batch after a step run slower than the later ones?
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import journeyman as jm
from _task import nonzero_adapter, rollout_step, vllm_model  # bench/ is on sys.path when a bench runs

BASELINE = "bc34e73"  # the last revision with the static-batching engine
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
SYSTEM = (
    "You are a research agent. Use the lookup tool to gather facts, one topic at a time, before you "
    "answer. Cite what the tool returned. Keep answers short and factual. " * 3
)


async def rollout(
    client: Any, name: str, i: int, max_tokens: int, tool_seconds: float
) -> tuple[int, int, float]:
    """One four-turn rollout: (completion tokens, prompt tokens sent, seconds)."""
    t0 = time.perf_counter()
    delay = random.Random(i)
    topic = TOPICS[i % len(TOPICS)]
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Find three facts about the {topic}, then write a short essay on it."},
    ]
    tokens = prompt_tokens = 0
    for turn in range(4):
        out = await client.chat.completions.create(
            model=name,
            messages=messages,
            tools=TOOLS,
            tool_choice="required" if turn < 3 else "auto",
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i * 10 + turn,
        )
        record = jm.record_of(out.choices[0])
        tokens += len(record.token_ids)
        prompt_tokens += len(record.prompt_token_ids)
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for c in message.tool_calls or []:
            await asyncio.sleep(delay.uniform(0, 2 * tool_seconds))  # the tool's own latency
            messages.append(
                {"role": "tool", "tool_call_id": c.id, "content": f"The {topic} is old and vast ({turn})."}
            )
    return tokens, prompt_tokens, time.perf_counter() - t0


async def rounds(
    model: jm.TrainableModel, concurrency: int, args: argparse.Namespace, counters: Any
) -> dict[str, float]:
    client = model.openai_client()

    async def batch(base: int) -> list[tuple[int, int, float]]:
        return await asyncio.gather(
            *[
                rollout(client, model.name, base + i, args.max_tokens, args.tool_seconds)
                for i in range(concurrency)
            ]
        )

    await batch(0)  # warm-up
    before = counters()
    t0 = time.perf_counter()
    runs = [r for k in range(args.rounds) for r in await batch(1000 * (k + 1))]
    seconds = time.perf_counter() - t0
    after = counters()
    latencies = sorted(r[2] for r in runs)
    prompts = sum(r[1] for r in runs)
    if "prefill_tokens" in after:
        prefilled = after["prefill_tokens"] - before.get("prefill_tokens", 0)
    elif "prefix_tokens_saved" in after:  # the earlier engine counted only what its shared prefix spared
        prefilled = prompts - (after["prefix_tokens_saved"] - before.get("prefix_tokens_saved", 0))
    else:  # vLLM: its prefix cache's hits are not read here
        prefilled = float("nan")
    extra = {}
    if "decode_rows" in after:
        steps = after["decode_steps"] - before["decode_steps"]
        extra = {
            "rows_per_step": (after["decode_rows"] - before["decode_rows"]) / max(1, steps),
            "ms_per_step": (after["decode_ms"] - before["decode_ms"]) / max(1, steps),
            "prefill_s": (after["prefill_ms"] - before["prefill_ms"]) / 1000,
            "decode_s": (after["decode_ms"] - before["decode_ms"]) / 1000,
        }
    return {
        **extra,
        "seconds": seconds,
        "tok_s": sum(r[0] for r in runs) / seconds,
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        "prefill_per_rollout": prefilled / len(runs),
        "prompt_per_rollout": prompts / len(runs),
    }


def engine_counters(engine: Any) -> dict[str, int]:
    if hasattr(engine, "counters") and engine.counters():
        return engine.counters()
    return {"prefix_tokens_saved": getattr(engine, "prefix_tokens_saved", 0)}


async def torch_arm(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """This process's journeyman (whichever tree it was imported from), in-process engine."""
    root = Path(tempfile.mkdtemp(prefix="jm-bench-"))
    backend = jm.LocalBackend(path=root / "torch")
    model = jm.TrainableModel(name="bench-torch", project="bench")
    await model.register(backend)
    nonzero_adapter(backend, model)  # the torch engine samples through the live adapter
    engine = backend.service(model).engine
    try:
        return {c: await rounds(model, c, args, lambda: engine_counters(engine)) for c in args.concurrency}
    finally:
        backend.close()


async def step_boundary() -> list[float]:
    """Seconds of each of six rollout batches, a training step after the third."""
    from journeyman.app import tasks

    root = Path(tempfile.mkdtemp(prefix="jm-bench-"))
    backend = jm.LocalBackend(path=root / "torch")
    model = jm.TrainableModel(name="bench-boundary", project="bench")
    await model.register(backend)
    client = model.openai_client()
    scenarios = tasks.scenarios("train", 8 * 7, seed=3)
    seconds: list[float] = []
    try:
        groups, _ = await rollout_step(model, client, scenarios[:8], 4, 40)  # warm-up
        for k in range(6):
            if k == 3:
                await model.train(groups, config=jm.TrainConfig(learning_rate=1e-4))
            t0 = time.perf_counter()
            groups, _ = await rollout_step(model, client, scenarios[8 * (k + 1) : 8 * (k + 2)], 4, 40)
            seconds.append(time.perf_counter() - t0)
    finally:
        backend.close()
    return seconds


def baseline_arm(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """The engine of revision `args.baseline`, run from a worktree of it in a child process."""
    repo = Path(__file__).resolve().parents[1]
    tree = Path(tempfile.gettempdir()) / f"jm-baseline-{args.baseline}"
    if not tree.exists():
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), args.baseline],
            check=True,
            capture_output=True,
        )
    cmd = [sys.executable, __file__, "--arm-only", "--concurrency", *map(str, args.concurrency)]
    cmd += ["--step-boundary"] if args.step_boundary else []
    cmd += [
        "--max-tokens",
        str(args.max_tokens),
        "--rounds",
        str(args.rounds),
        "--tool-seconds",
        str(args.tool_seconds),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree / "packages" / "core" / "src")}
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=3600).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result if isinstance(result, list) else {int(c): r for c, r in result.items()}


async def vllm_arm(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    root = Path(tempfile.mkdtemp(prefix="jm-bench-"))
    backend, model, engine, register_s = await vllm_model(root / "vllm", "bench-vllm", args.vllm_python)
    print(
        f"vLLM: server ready in {engine.server.startup_seconds:.1f} s (register {register_s:.1f} s)",
        flush=True,
    )
    try:
        return {c: await rounds(model, c, args, dict) for c in args.concurrency}
    finally:
        backend.close()


def show(label: str, c: int, r: dict[str, float]) -> None:
    print(
        f"  {label:16s} {c:3d} rollouts: {r['tok_s']:7.1f} tok/s, latency p50 {r['p50']:6.1f} s p99 {r['p99']:6.1f} s, "
        f"prefilled {r['prefill_per_rollout']:7.0f} of {r['prompt_per_rollout']:7.0f} prompt tokens a rollout",
        flush=True,
    )


async def main(args: argparse.Namespace) -> None:
    if args.arm_only:
        print(json.dumps(await (step_boundary() if args.step_boundary else torch_arm(args))))
        return
    if args.step_boundary:
        runs = {"slots (this tree)": await step_boundary()}
        if args.baseline != "none":
            runs[f"static@{args.baseline}"] = baseline_arm(args)  # type: ignore[assignment]
        print("\nseconds per batch of 32 rollouts (8 prompts x 4), a training step between batches 3 and 4")
        for label, secs in runs.items():
            print(f"  {label:18s} " + "  ".join(f"{t:5.1f}" for t in secs))
        return
    results: dict[str, dict[int, dict[str, float]]] = {}
    if args.baseline != "none":
        print(f"baseline: the engine at {args.baseline} (child process) ...", flush=True)
        results[f"static@{args.baseline}"] = baseline_arm(args)
    print("this tree's engine ...", flush=True)
    results["slots (this tree)"] = await torch_arm(args)
    if not args.no_vllm:
        results["vLLM+LoRA"] = await vllm_arm(args)
    print(
        f"\nfour-turn tool rollouts (3 forced calls, tools {args.tool_seconds:g} s on average, then an answer), "
        f"fp32, LoRA r8, max_tokens={args.max_tokens}, {args.rounds} round(s), {os.cpu_count()} CPUs"
    )
    for label, by_c in results.items():
        for c, r in by_c.items():
            show(label, c, r)
    ours = results["slots (this tree)"]
    for label, by_c in results.items():
        if label.startswith("slots"):
            continue
        for c in args.concurrency:
            print(f"  slots / {label} at {c}: {ours[c]['tok_s'] / by_c[c]['tok_s']:.2f}x tokens/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tool-seconds", type=float, default=0.5, help="a tool call's mean latency")
    parser.add_argument(
        "--baseline", default=BASELINE, help="git revision of the engine to compare with, or none"
    )
    parser.add_argument("--no-vllm", action="store_true", help="no vLLM arm")
    parser.add_argument("--step-boundary", action="store_true", help="batch seconds across a training step")
    parser.add_argument("--arm-only", action="store_true", help=argparse.SUPPRESS)  # a child's run
    parser.add_argument(
        "--vllm-python", default=None, help="vLLM interpreter (default: provision the CPU env)"
    )
    asyncio.run(main(parser.parse_args()))
