"""Synchronous loop vs `PipelineTrainer`: wall clock for the same number of trained steps, held-out
reward of both, staleness and importance weights, and a timeline picture.

The task is the demo's (short on-topic answers, the embedded SmolLM2-135M on the CPU), made an
agent's: each rollout calls its environment `--tool-calls` times, each call taking 0.5-2 s (seeded),
as a web API would, around its model call. Both runs start from the base model, see the same
scenarios in the same order and train the same number of steps with the same settings
(`PipelineConfig().train`: tis_cap=2.0, so both use the same loss) and fill a step the same way:
by default with groups whose rewards differ, as the pipeline does (DAPO's dynamic sampling: the
synchronous loop rolls a replacement wave for the groups of a wave that had no reward spread), or
with every group (`--keep-zero-variance`, both). Only the schedule differs.

    uv run python bench/pipeline.py                  # slow tools
    uv run python bench/pipeline.py --tool-calls 0   # fast tools: where the pipeline's time goes
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import journeyman as jm
from journeyman.app import tasks
from journeyman.app.demo import evaluate
from journeyman.client.pipeline_trainer import RolloutFn

MAX_WAVES = 4  # the synchronous loop's replacement waves per step, at most


def make_rollout(tool_calls: int, seed: int, max_tokens: int) -> RolloutFn[tasks.Scenario]:
    rng = random.Random(seed)

    async def rollout(model: jm.TrainableModel, scenario: tasks.Scenario) -> jm.Trajectory:
        latencies = [rng.uniform(0.5, 2.0) for _ in range(tool_calls)]
        half = len(latencies) // 2
        for s in latencies[:half]:  # the environment before the model's turn (search, fetch, ...)
            await asyncio.sleep(s)
        t = await tasks.rollout(model, model.openai_client(), scenario, max_tokens=max_tokens)
        for s in latencies[half:]:  # and after it (the tool the answer calls, the check)
            await asyncio.sleep(s)
        return t

    return rollout


async def synchronous(
    model: jm.TrainableModel,
    rollout: RolloutFn[tasks.Scenario],
    scenarios: list[tasks.Scenario],
    args: argparse.Namespace,
) -> tuple[float, list[tuple[str, float, float]]]:
    config = jm.PipelineConfig().train.model_copy(update={"learning_rate": args.lr})
    spans: list[tuple[str, float, float]] = []
    stream = itertools.cycle(scenarios)  # the pipeline's order, replacements included
    rolled = 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        groups: list[jm.TrajectoryGroup] = []
        wave: list[jm.TrajectoryGroup] = []
        waves = 0
        r0 = time.perf_counter() - t0
        while len(groups) < args.groups and waves < MAX_WAVES:
            wave = await jm.gather_trajectory_groups(
                (
                    jm.TrajectoryGroup(rollout(model, s) for _ in range(args.group_size))
                    for s in itertools.islice(stream, args.groups - len(groups))
                ),
                pbar_desc=None,
            )
            waves += 1
            rolled += len(wave)
            groups += [g for g in wave if args.keep_zero_variance or g.has_signal(config.min_reward_spread)]
        r1 = time.perf_counter() - t0
        spans.append(("rollout", r0, r1))
        await model.train(groups or wave, config)  # no wave had signal: a skipped step, as it comes
        spans.append(("train", r1, time.perf_counter() - t0))
    print(f"sync: {rolled} groups rolled for {args.steps * args.groups} places", flush=True)
    return time.perf_counter() - t0, spans


async def pipelined(
    model: jm.TrainableModel,
    rollout: RolloutFn[tasks.Scenario],
    scenarios: list[tasks.Scenario],
    args: argparse.Namespace,
) -> tuple[float, jm.PipelineResult]:
    train = jm.PipelineConfig().train.model_copy(update={"learning_rate": args.lr})
    config = jm.PipelineConfig(
        group_size=args.group_size,
        groups_per_step=args.groups,
        max_in_flight=args.max_in_flight,
        skip_zero_variance=not args.keep_zero_variance,
        train=train,
        progress=False,
    )
    t0 = time.perf_counter()
    result = await jm.PipelineTrainer(model, rollout, itertools.cycle(scenarios), config).train(args.steps)
    return time.perf_counter() - t0, result


def picture(path: Path, sync_spans, pipe: jm.PipelineResult, sync_s: float, pipe_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
    colours = {"rollout": "tab:blue", "train": "tab:orange", "eval": "tab:green"}
    for ax, title, spans in (
        (axes[0], f"synchronous loop: {sync_s:.0f} s", sync_spans),
        (axes[1], f"pipeline: {pipe_s:.0f} s", [(e.kind, e.start, e.end) for e in pipe.timeline]),
    ):
        lanes: list[float] = []  # each lane's end; rollouts stack into the first free lane
        for kind, start, end in sorted(spans, key=lambda x: x[1]):
            if kind == "train":
                lane = -1
            else:
                lane = next((i for i, e in enumerate(lanes) if e <= start), len(lanes))
                if lane == len(lanes):
                    lanes.append(end)
                lanes[lane] = end
            ax.barh(lane, end - start, left=start, color=colours[kind], edgecolor="white")
        ax.set_title(title, loc="left")
        ax.set_yticks([-1, *range(len(lanes))], ["trainer", *[f"groups {i}" for i in range(len(lanes))]])
    axes[1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    return path


async def main(args: argparse.Namespace) -> None:
    scenarios = tasks.scenarios("train", args.groups * args.steps, seed=1)
    root = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    results = {}
    for kind in ("sync", "pipeline"):
        # the synchronous loop keeps the in-process engine (sampling and training take turns on all
        # cores: nothing would overlap); the pipeline may split the cores (`--engine-threads`)
        threads = args.engine_threads if kind == "pipeline" else None
        backend = jm.LocalBackend(path=root, engine_threads=threads)
        model = jm.TrainableModel(name=kind, project="bench")
        await model.register(backend)
        rollout = make_rollout(args.tool_calls, args.seed, args.max_tokens)
        if kind == "sync":
            seconds, spans = await synchronous(model, rollout, scenarios, args)
            extra = spans
        else:
            seconds, extra = await pipelined(model, rollout, scenarios, args)
        held_out, _ = await evaluate(model, args.eval_prompts)
        history = [r for r in await model.history() if r.get("split") == "train"]
        results[kind] = (seconds, held_out, history, extra)
        backend.close()
        print(
            f"{kind}: {seconds:.1f} s for {args.steps} steps; held-out reward {held_out.mean:.3f} "
            f"± {held_out.sem:.3f}",
            flush=True,
        )
    (sync_s, sync_eval, _, sync_spans), (pipe_s, pipe_eval, pipe_hist, pipe) = (
        results["sync"],
        results["pipeline"],
    )
    gap = (pipe_eval.mean - sync_eval.mean) / math.hypot(sync_eval.sem, pipe_eval.sem)
    print(f"\nwall-clock ratio (sync / pipeline): {sync_s / pipe_s:.2f}x")
    print(f"held-out reward, pipeline - sync: {pipe_eval.mean - sync_eval.mean:+.3f} ({gap:+.1f} SE)")
    mean = lambda key: statistics.mean(r.get(f"train/{key}", math.nan) for r in pipe_hist)  # noqa: E731
    print(
        f"pipeline: {pipe.trained_groups} groups trained, {pipe.stale_groups} stale, "
        f"{pipe.zero_variance_groups} without signal, {pipe.rollouts} rollouts; per step "
        f"staleness mean {mean('staleness_mean'):.2f} (tokens 0/1/2 behind: "
        f"{mean('staleness/0'):.2f}/{mean('staleness/1'):.2f}/{mean('staleness/2'):.2f}), "
        f"importance weight mean {mean('is_weight_mean'):.3f}, outside [0.5, 2] {mean('is_weight_outside_2x'):.4f}, "
        f"truncated {mean('is_truncated'):.4f}"
    )
    busy = sum(e.end - e.start for e in pipe.timeline if e.kind == "train")
    print(f"pipeline: the trainer was busy {busy:.0f} of {pipe_s:.0f} s ({busy / pipe_s:.0%})")
    png = picture(Path(args.picture), sync_spans, pipe, sync_s, pipe_s)
    print(f"timeline: {png}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--groups", type=int, default=4, help="groups (scenarios) per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--tool-calls", type=int, default=4, help="environment calls per rollout, 0.5-2 s each")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-in-flight", type=int, default=None, help="PipelineConfig.max_in_flight (default: its own)"
    )
    p.add_argument(
        "--keep-zero-variance",
        action="store_true",
        help="both loops train groups without reward spread too (default: both replace them)",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="the pipeline's engine in a worker process of this many threads, sampling while the "
        "trainer trains on the other cores (LocalBackend(engine_threads=...)); default: in process",
    )
    p.add_argument("--picture", default="docs/pipeline-timeline.png")
    asyncio.run(main(p.parse_args()))
