"""`evaluate`: an environment's eval split at one or more steps, k samples a task.

Each task's k rewards are averaged first, so the standard error is over tasks (the unit that was
drawn), and two steps are compared task by task: the paired difference has a smaller SE than the
two means' SEs combined whenever tasks differ in difficulty. pass@k is reported where every reward
is 0 or 1: the share of tasks with at least one success in k samples (pass@1: the mean).
A rollout that fails is counted against its task and named in `failures`; nothing else is lost.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from journeyman.data.types import TrajectoryGroup
from journeyman.environments._protocol import Environment, Sampling, Task, run_task
from journeyman.environments._spec import load
from journeyman.errors import EnvironmentRolloutError, InvalidFieldError

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel

StepRef = int | Literal["latest"]


class Failure(BaseModel):
    task: str
    error: str


class StepResult(BaseModel):
    """One step's evaluation: mean reward ± SE over tasks, pass@k where rewards are binary."""

    step: int
    mean: float
    sem: float
    k: int
    tasks: int
    episodes: int
    pass_at_k: float | None = Field(default=None, description="None: some reward is not 0 or 1")
    metrics: dict[str, float] = Field(default_factory=dict, description="each metric's mean over episodes")
    task_rewards: dict[str, float] = Field(default_factory=dict, description="each task's mean reward")
    failures: list[Failure] = Field(default_factory=list)
    seconds: float


class Difference(BaseModel):
    """`later` minus `earlier`, task by task over the tasks both evaluated."""

    earlier: int
    later: int
    mean: float
    sem: float
    tasks: int

    @property
    def in_sems(self) -> float:
        return (
            self.mean / self.sem
            if self.sem > 0
            else (0.0 if self.mean == 0 else math.copysign(math.inf, self.mean))
        )


class EvalReport(BaseModel):
    environment: str
    model: str
    sampling: Sampling
    steps: list[StepResult]
    differences: list[Difference] = Field(default_factory=list)

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1) + "\n")
        return path

    def lines(self) -> list[str]:
        """The report as a person reads it: one line a step, one a difference."""
        out = []
        for s in self.steps:
            passk = f", pass@{s.k} {s.pass_at_k:.3f}" if s.pass_at_k is not None else ""
            failed = f", {len(s.failures)} failed" if s.failures else ""
            out.append(
                f"step {s.step}: reward {s.mean:.3f} ± {s.sem:.3f} over {s.tasks} tasks x {s.k}{passk}{failed} "
                f"({s.seconds:.0f} s)"
            )
        for d in self.differences:
            out.append(
                f"step {d.later} - step {d.earlier}: {d.mean:+.3f} ± {d.sem:.3f} ({d.in_sems:+.1f} SE, paired over "
                f"{d.tasks} tasks)"
            )
        return out


def mean_sem(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def paired(earlier: StepResult, later: StepResult) -> Difference:
    both = sorted(set(earlier.task_rewards) & set(later.task_rewards))
    mean, sem = mean_sem([later.task_rewards[t] - earlier.task_rewards[t] for t in both])
    return Difference(earlier=earlier.step, later=later.step, mean=mean, sem=sem, tasks=len(both))


async def evaluate(
    model: TrainableModel,
    env: Environment | str,
    *,
    steps: Sequence[StepRef] = ("latest",),
    k: int = 1,
    tasks: int | None = None,
    sampling: Sampling | None = None,
    log: bool = True,
    on_episode: Callable[[], None] | None = None,
) -> EvalReport:
    """Evaluate `model` at each of `steps` (0 = the base model, "latest") on the eval split of `env`
    (the first `tasks` of it), `k` samples a task. `sampling`: default greedy for k=1, else
    temperature 1. The latest step is served again afterwards. `log`: the latest step's episodes
    go into the run's history as the `val` split, beside training."""
    environment = load(env)
    if k < 1:
        raise InvalidFieldError("k", k, "use 1 or more samples a task")
    if tasks is not None and tasks < 1:
        raise InvalidFieldError("tasks", tasks, "use 1 or more tasks, or None for the whole eval split")
    chosen = list(environment.tasks("eval"))[:tasks]
    if not chosen:
        raise InvalidFieldError("env", environment.name, "its eval split has no tasks")
    sampling = sampling or Sampling(temperature=0.0 if k == 1 else 1.0)
    latest = await model.get_step()
    resolved = [latest if s == "latest" else int(s) for s in steps]
    for s in resolved:
        if not 0 <= s <= latest:
            raise InvalidFieldError("steps", s, f"the model has steps 0..{latest}")
    results: list[StepResult] = []
    try:
        for step in resolved:
            if step != latest or len(resolved) > 1:
                await model.serve_step(step)
            result, groups = await _one_step(model, environment, chosen, k, sampling, step, on_episode)
            results.append(result)
            if log and step == latest and groups:
                await model.log(groups, split="val", metrics={"reward_sem": result.sem})
    finally:
        if resolved != [latest]:
            await model.serve_step(latest)
    differences = [paired(a, b) for a, b in itertools.pairwise(results)]
    return EvalReport(
        environment=environment.name,
        model=model.name,
        sampling=sampling,
        steps=results,
        differences=differences,
    )


async def _one_step(
    model: TrainableModel,
    env: Environment,
    chosen: list[Task],
    k: int,
    sampling: Sampling,
    step: int,
    on_episode: Callable[[], None] | None,
) -> tuple[StepResult, list[TrajectoryGroup]]:
    t0 = time.perf_counter()

    async def one(task: Task) -> object:
        try:
            return await run_task(env, model, task, sampling)
        except EnvironmentRolloutError as e:
            return e
        finally:
            if on_episode is not None:
                on_episode()

    outcomes = await asyncio.gather(*(one(t) for t in chosen for _ in range(k)))
    groups: list[TrajectoryGroup] = []
    task_rewards: dict[str, float] = {}
    failures: list[Failure] = []
    every: list[float] = []
    metrics: dict[str, list[float]] = {}
    passed: list[bool] = []
    for i, task in enumerate(chosen):
        mine = outcomes[i * k : (i + 1) * k]
        done = [o for o in mine if not isinstance(o, EnvironmentRolloutError)]
        failures += [
            Failure(task=task.id, error=str(o)) for o in mine if isinstance(o, EnvironmentRolloutError)
        ]
        if not done:
            continue
        rewards = [t.reward for t in done]  # pyright: ignore[reportAttributeAccessIssue]
        task_rewards[task.id] = statistics.fmean(rewards)
        every += rewards
        passed.append(any(r == 1.0 for r in rewards))
        for t in done:
            for name, value in t.metrics.items():  # pyright: ignore[reportAttributeAccessIssue]
                metrics.setdefault(name, []).append(float(value))
        groups.append(TrajectoryGroup(done))  # pyright: ignore[reportArgumentType]
    mean, sem = mean_sem(list(task_rewards.values()))
    binary = bool(every) and all(r in (0.0, 1.0) for r in every)
    return StepResult(
        step=step,
        mean=mean,
        sem=sem,
        k=k,
        tasks=len(task_rewards),
        episodes=len(every),
        pass_at_k=statistics.fmean(passed) if binary else None,
        metrics={name: statistics.fmean(v) for name, v in metrics.items()},
        task_rewards=task_rewards,
        failures=failures,
        seconds=time.perf_counter() - t0,
    ), groups
