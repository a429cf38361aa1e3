"""TrainLoop: the synchronous GRPO loop, written once for the examples and for anyone's script.

Each step draws `groups_per_step` scenarios at random (seeded, so two runs see the same ones),
rolls each out `group_size` times, and trains one step on those groups; `evaluate` rolls out a
held-out set once per scenario and logs it as the `val` split. What to print, and the reward plot
(`journeyman.integrations.plot_history`), stay with the caller:

    loop = jm.TrainLoop(model, sampled_rollout, train_set, groups_per_step=3, group_size=8,
                        config=jm.TrainConfig(learning_rate=5e-4))
    groups, metrics = await loop.evaluate(eval_set, greedy_rollout)   # before
    async for s in loop.steps(10):
        print(f"step {s.step} -> {s.result.step}: reward {s.mean('reward'):.3f} "
              f"over {s.rollouts} rollouts (train {s.train_seconds:.0f} s)")
    groups, metrics = await loop.evaluate(eval_set, greedy_rollout)   # after

While a step trains no rollout advances here; `PipelineTrainer` overlaps the two (off-policy by at
most a step or so) for a shorter wall clock.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from journeyman.client.protocol import charging
from journeyman.data.config import TrainConfig, TrainResult
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.rollout.gather import AfterEach, gather_trajectory_groups

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel

__all__ = ["LoopStep", "TrainLoop"]

S = TypeVar("S")


@dataclass(frozen=True)
class LoopStep:
    """One step of a `TrainLoop`: the groups it gathered and what training on them did."""

    step: int  # the step whose weights sampled the rollouts
    groups: list[TrajectoryGroup]
    result: TrainResult
    rollout_seconds: float
    train_seconds: float

    @property
    def rollouts(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)

    def mean(self, metric: str) -> float:
        """The mean over every rollout of `reward`, or of a metric the rollouts set."""
        values = [
            t.reward if metric == "reward" else float(t.metrics[metric])
            for g in self.groups
            for t in g.trajectories
        ]
        return sum(values) / len(values) if values else float("nan")


@dataclass
class TrainLoop(Generic[S]):
    """Train `model` on groups of `rollout(scenario)` drawn from `scenarios`, a step at a time (see
    the module for an example). `after_each` may rescore each group as it is gathered (RULER, whose
    judge is charged to the model's budget)."""

    model: TrainableModel
    rollout: Callable[[S], Awaitable[Trajectory]]
    scenarios: Sequence[S]
    groups_per_step: int = 2
    group_size: int = 4
    config: TrainConfig | None = None
    seed: int = 0
    after_each: AfterEach | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)  # one stream for every `steps` call

    async def steps(self, n: int) -> AsyncIterator[LoopStep]:
        """Train `n` steps, yielding each when it is trained."""
        for _ in range(n):
            step = await self.model.get_step()
            t0 = time.perf_counter()
            with charging(self.model):  # RULER in `after_each` charges its judge to this model's budget
                groups = await gather_trajectory_groups(
                    (
                        TrajectoryGroup(self.rollout(s) for _ in range(self.group_size))
                        for s in self._rng.sample(self.scenarios, self.groups_per_step)
                    ),
                    pbar_desc=f"step {step}",
                    after_each=self.after_each,
                )
            t1 = time.perf_counter()
            result = await self.model.train(groups, config=self.config)
            yield LoopStep(step, groups, result, t1 - t0, time.perf_counter() - t1)

    async def evaluate(
        self, scenarios: Sequence[S], rollout: Callable[[S], Awaitable[Trajectory]] | None = None
    ) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """One rollout of each scenario (by `rollout`, e.g. a greedy one; default the loop's), logged
        as the `val` split: the groups, in the scenarios' order, and the metrics logged for them."""
        step = await self.model.get_step()
        roll = rollout or self.rollout
        groups = await gather_trajectory_groups(
            (TrajectoryGroup([roll(s)]) for s in scenarios), pbar_desc=f"eval {step}"
        )
        return groups, await self.model.log(groups, split="val")
