"""On-policy distillation against RL alone, on the embedded model, in one run.

A teacher is made first: the embedded model after `--teacher-steps` GRPO steps on the built-in task
(answer briefly and on topic, `journeyman.app.tasks`), registered on the same backend. Then three
fresh students of the same base train `--steps` steps each, one after the other, on the same
scenarios:

- `rl`: GRPO on the task's reward alone;
- `distill`: on-policy distillation alone (`DistillConfig(reward_weight=0)`): the teacher scores every
  token the student sampled, and the per-token advantage is log π_teacher - log π_student;
- `mix`: both (`reward_weight=1`).

Every `--eval-every` steps each student's held-out reward (32 greedy answers) is measured, against
its training wall time (rollouts, teacher scoring and steps; evaluations not counted). Printed: the
reward curves with standard errors, each student's time to reach the target (by default the reward
RL alone ends at), and the ratio of RL's time to it. Written: `--json` and a plot.

    uv run python bench/distill.py                           # ~25 min on 2 cores
    uv run python bench/distill.py --teacher-steps 4 --steps 4 --eval-every 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import tempfile
import time
from pathlib import Path

import journeyman as jm
from journeyman.app import tasks
from journeyman.app.demo import evaluate
from journeyman.app.plot import save_figure
from pydantic import BaseModel

ARMS = ("rl", "distill", "mix")


class Point(BaseModel):
    step: int
    train_seconds: float
    mean: float
    sem: float
    teacher_kl: float | None = None


class Arm(BaseModel):
    name: str
    points: list[Point]
    seconds_to_target: float | None = None


async def groups_of(
    model: jm.TrainableModel, scenarios: list[tasks.Scenario], size: int
) -> list[jm.TrajectoryGroup]:
    client = model.openai_client()
    return await jm.gather_trajectory_groups(
        (
            jm.TrajectoryGroup(tasks.rollout(model, client, s, max_tokens=40) for _ in range(size))
            for s in scenarios
        ),
        pbar_desc=None,
    )


async def train(
    model: jm.TrainableModel,
    config: jm.TrainConfig,
    steps: int,
    prompts: int,
    size: int,
    eval_every: int,
    eval_prompts: int,
    label: str,
) -> list[Point]:
    train_scenarios = tasks.scenarios("train", prompts * steps, seed=1)
    first, _ = await evaluate(model, eval_prompts)
    points = [Point(step=0, train_seconds=0.0, mean=first.mean, sem=first.sem)]
    spent, kl = 0.0, None
    for step in range(steps):
        t0 = time.perf_counter()
        groups = await groups_of(model, train_scenarios[step * prompts : (step + 1) * prompts], size)
        result = await model.train(groups, config=config)
        spent += time.perf_counter() - t0
        kl = result.metrics.get("teacher_kl", kl)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            ev, _ = await evaluate(model, eval_prompts)
            points.append(Point(step=step + 1, train_seconds=spent, mean=ev.mean, sem=ev.sem, teacher_kl=kl))
            print(
                f"  {label:8s} step {step + 1:2d}  {spent:6.0f} s  held-out {ev.mean:.3f} ± {ev.sem:.3f}"
                + (f"  teacher_kl {kl:.3f}" if kl is not None else ""),
                flush=True,
            )
    return points


def time_to(points: list[Point], target: float) -> float | None:
    """Training seconds at which the held-out reward first reaches `target` (linear between evals)."""
    for a, b in itertools.pairwise(points):
        if b.mean >= target:
            if a.mean >= target:
                return a.train_seconds
            return a.train_seconds + (target - a.mean) / (b.mean - a.mean) * (
                b.train_seconds - a.train_seconds
            )
    return None


def plot(arms: list[Arm], teacher: float, target: float, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in arms:
        xs = [p.train_seconds for p in arm.points]
        ys = [p.mean for p in arm.points]
        ax.errorbar(xs, ys, yerr=[p.sem for p in arm.points], marker="o", capsize=3, label=arm.name)
    ax.axhline(teacher, color="grey", linestyle="--", label="teacher")
    ax.axhline(target, color="grey", linestyle=":", label="target")
    ax.set_xlabel("training wall time (s): rollouts, teacher scoring, steps")
    ax.set_ylabel("held-out reward (32 greedy answers)")
    ax.set_title("on-policy distillation vs RL alone (SmolLM2-135M, CPU)")
    return save_figure(fig, ax, out)


async def main(args: argparse.Namespace) -> None:
    root = Path(args.path or tempfile.mkdtemp(prefix="distill-"))
    async with jm.LocalBackend(root) as backend:
        teacher = jm.TrainableModel(name="teacher", project="distill")
        await teacher.register(backend)
        print(f"teacher: {args.teacher_steps} GRPO steps", flush=True)
        rl = jm.TrainConfig(learning_rate=args.lr)
        t_points = await train(
            teacher,
            rl,
            args.teacher_steps,
            args.prompts,
            args.group_size,
            args.teacher_steps,
            args.eval_prompts,
            "teacher",
        )
        teacher_reward = t_points[-1].mean
        source = jm.Teacher(model="teacher")
        configs = {
            "rl": rl,
            "distill": jm.TrainConfig(learning_rate=args.lr, distill=jm.DistillConfig(teacher=source)),
            "mix": jm.TrainConfig(
                learning_rate=args.lr, distill=jm.DistillConfig(teacher=source, reward_weight=1.0)
            ),
        }
        arms: list[Arm] = []
        for name in ARMS:
            student = jm.TrainableModel(name=f"student-{name}", project="distill")
            await student.register(backend)
            print(f"student {name}: {args.steps} steps", flush=True)
            points = await train(
                student,
                configs[name],
                args.steps,
                args.prompts,
                args.group_size,
                args.eval_every,
                args.eval_prompts,
                name,
            )
            arms.append(Arm(name=name, points=points))
    base = arms[0].points[0]
    target = args.target if args.target is not None else arms[0].points[-1].mean
    for arm in arms:
        arm.seconds_to_target = time_to(arm.points, target)
    rl_time = arms[0].seconds_to_target
    print(
        f"\nbase {base.mean:.3f} ± {base.sem:.3f}; teacher {teacher_reward:.3f} ± {t_points[-1].sem:.3f}; target {target:.3f}"
    )
    print(f"{'arm':8s} {'final':>15s} {'gain (SE)':>9s} {'s to target':>11s} {'RL time / its':>13s}")
    for arm in arms:
        last = arm.points[-1]
        gain = (last.mean - base.mean) / max(math.hypot(last.sem, base.sem), 1e-9)
        t = arm.seconds_to_target
        ratio = f"{rl_time / t:.2f}x" if t and rl_time else "-"
        print(
            f"{arm.name:8s} {last.mean:7.3f} ± {last.sem:.3f} {gain:9.1f} {t if t is not None else float('nan'):11.0f} {ratio:>13s}"
        )
    png = plot(arms, teacher_reward, target, Path(args.plot))
    print(f"plot: {png}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "teacher": [p.model_dump() for p in t_points],
                    "target": target,
                    "arms": [a.model_dump() for a in arms],
                    "args": vars(args),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher-steps", type=int, default=10)
    p.add_argument("--steps", type=int, default=8, help="steps of each student")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--target", type=float, default=None, help="held-out reward to time (default: RL's final)")
    p.add_argument("--path", default=None, help="run directory (default: a temporary one)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default="distill.png")
    asyncio.run(main(p.parse_args()))
