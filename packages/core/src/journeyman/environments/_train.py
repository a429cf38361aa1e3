"""`train`: GRPO on an environment's train split, a group of rollouts for each task drawn.

The synchronous loop by default (draw tasks, roll each out `group_size` times, one step); with
`pipeline=True`, `PipelineTrainer` (rollouts go on while a step trains). A rollout that fails is an
`EnvironmentRolloutError` kept on its group's `exceptions`, counted in the step's metrics, and the
rest of the step trains; more failures than `max_exceptions` raise `TooManyExceptionsError` with
every finished group on it.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from journeyman.client.pipeline_trainer import PipelineConfig, PipelineTrainer
from journeyman.data.config import TrainConfig
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.environments._protocol import Environment, Sampling, Task, run_task
from journeyman.environments._spec import load
from journeyman.errors import InvalidFieldError
from journeyman.rollout.gather import gather_trajectory_groups

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel


class TrainStep(BaseModel):
    """What one step of `train` did."""

    step: int = Field(description="the step whose weights sampled the rollouts")
    reward: float
    rollouts: int
    failed: int
    skipped: bool = Field(description="no group's rewards differed: nothing to learn, no update")
    seconds: float


async def train(
    model: TrainableModel,
    env: Environment | str,
    *,
    steps: int,
    groups_per_step: int = 8,
    group_size: int = 4,
    config: TrainConfig | None = None,
    sampling: Sampling | None = None,
    max_exceptions: float = 0.25,
    seed: int = 0,
    pipeline: bool = False,
    on_step: Callable[[TrainStep], None] | None = None,
) -> list[TrainStep]:
    """Train `model` for `steps` steps on the train split of `env`: each step draws
    `groups_per_step` tasks (seeded), rolls each out `group_size` times at `sampling` (default
    temperature 1) and trains one GRPO step. `max_exceptions`: failed rollouts a step may have
    (a count, or a fraction of its rollouts) before it raises."""
    environment = load(env)
    for field, n, least in (
        ("steps", steps, 1),
        ("groups_per_step", groups_per_step, 1),
        ("group_size", group_size, 2),
    ):
        if n < least:
            why = "GRPO compares the rollouts of one task" if field == "group_size" else "use 1 or more"
            raise InvalidFieldError(field, n, f"{why} ({least} or more)")
    pool = list(environment.tasks("train"))
    if not pool:
        raise InvalidFieldError("env", environment.name, "its train split has no tasks")
    sampling = sampling or Sampling()

    async def rollout(m: TrainableModel, task: Task) -> Trajectory:
        return await run_task(environment, m, task, sampling)

    rng = random.Random(seed)

    def draw(n: int) -> list[Task]:
        return rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]

    if pipeline:
        base = PipelineConfig().train.model_copy(
            update=(config.model_dump(exclude_unset=True) if config else {})
        )
        pipe = PipelineConfig(
            group_size=group_size, groups_per_step=groups_per_step, train=base, max_exceptions=max_exceptions
        )
        tasks = (t for _ in itertools.count() for t in draw(groups_per_step))
        result = await PipelineTrainer(model, rollout, tasks, pipe).train(steps)
        rows: list[TrainStep] = []
        failed_before = 0.0
        for i, h in enumerate(result.history):
            failed = h.get("pipeline/exceptions", 0.0)  # a running count: this step's are the increase
            rows.append(
                TrainStep(
                    step=int(h.get("step", i)),
                    reward=h.get("reward", float("nan")),
                    rollouts=int(h.get("pipeline/step_rollouts", 0)),
                    failed=int(failed - failed_before),
                    skipped=bool(h.get("pipeline/skipped", 0.0)),
                    seconds=h.get("train_seconds", 0.0),
                )
            )
            failed_before = failed
            if on_step is not None:
                on_step(rows[-1])
        return rows
    done: list[TrainStep] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step = await model.get_step()
        groups = await gather_trajectory_groups(
            (TrajectoryGroup(rollout(model, t) for _ in range(group_size)) for t in draw(groups_per_step)),
            pbar_desc=f"step {step}",
            max_exceptions=max_exceptions,
        )
        failed = groups_per_step * group_size - sum(len(g.trajectories) for g in groups)
        rewards = [t.reward for g in groups for t in g.trajectories]
        skipped = not groups  # every rollout failed, within max_exceptions: nothing to train on
        if groups:
            skipped = (await model.train(groups, config=config)).skipped
        row = TrainStep(
            step=step,
            reward=sum(rewards) / len(rewards) if rewards else float("nan"),
            rollouts=len(rewards),
            failed=failed,
            skipped=skipped,
            seconds=time.perf_counter() - t0,
        )
        done.append(row)
        if on_step is not None:
            on_step(row)
    return done
