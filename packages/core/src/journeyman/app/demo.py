"""The main job on the embedded default: GRPO on the built-in task, evaluated on held-out prompts."""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel

from journeyman._extras import require_backend
from journeyman.app import tasks
from journeyman.app.plot import plot_history
from journeyman.backends.local import LocalBackend
from journeyman.client.model import TrainableModel
from journeyman.client.pipeline_trainer import PipelineConfig, PipelineTrainer
from journeyman.client.protocol import Backend
from journeyman.data.budget import Budget
from journeyman.data.config import DEFAULT_BASE_MODEL, TrainConfig, TrainerConfig
from journeyman.data.paths import RunLayout
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.engine.vllm_server import VLLMConfig
from journeyman.errors import InvalidFieldError
from journeyman.rollout.gather import gather_trajectory_groups


class EvalResult(BaseModel):
    mean: float
    sem: float
    completion_tokens: float


class DemoResult(BaseModel):
    before: EvalResult
    after: EvalResult
    steps: int
    run_dir: Path
    plot: Path

    @property
    def gain_in_sems(self) -> float:
        """How many standard errors the held-out reward rose (joint SE of the two means)."""
        se = math.hypot(self.before.sem, self.after.sem)
        return (self.after.mean - self.before.mean) / se if se > 0 else math.inf


async def evaluate(
    model: TrainableModel, n: int = 32, max_tokens: int = 40
) -> tuple[EvalResult, list[TrajectoryGroup]]:
    """Greedy answers to `n` held-out prompts; mean reward with its standard error."""
    client = model.openai_client()
    val = tasks.scenarios("val", n)
    groups = await gather_trajectory_groups(
        (
            TrajectoryGroup([tasks.rollout(model, client, s, temperature=0.0, max_tokens=max_tokens)])
            for s in val
        ),
        pbar_desc=None,
    )
    rewards = [g.trajectories[0].reward for g in groups]
    tokens = [float(g.trajectories[0].metrics["completion_tokens"]) for g in groups]
    sem = statistics.stdev(rewards) / math.sqrt(len(rewards)) if len(rewards) > 1 else 0.0
    return EvalResult(
        mean=statistics.mean(rewards), sem=sem, completion_tokens=statistics.mean(tokens)
    ), groups


async def run_demo(
    *,
    path: Path = Path(".journeyman"),
    name: str = "demo",
    project: str = "journeyman-demo",
    steps: int = 10,
    prompts_per_step: int = 8,
    group_size: int = 4,
    learning_rate: float = 2e-4,
    eval_prompts: int = 32,
    max_tokens: int = 40,
    base_model: str | None = None,
    engine: str | VLLMConfig = "torch",
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    backend: Backend | None = None,
    world_size: int = 1,
    pipeline: bool = False,
    on_start: Callable[[int], None] | None = None,
    budget: Budget | None = None,
) -> DemoResult:
    """Evaluate, train, evaluate again; on `backend` (e.g. a `RemoteBackend`) when given, else on a
    `LocalBackend` at `path` with `engine` and `world_size` trainer ranks that is closed at the end.
    `pipeline`: train with `PipelineTrainer` (rollouts go on while a step trains) instead of the
    synchronous loop, on the same scenarios and settings. `on_start(step)`: the step training starts
    from (above 0: an earlier run of this name goes on)."""
    check_counts(
        steps=steps, group_size=group_size, prompts_per_step=prompts_per_step, eval_prompts=eval_prompts
    )
    require_backend("journeyman demo (its reward plot)", ("matplotlib",))  # before, not after, training
    own = backend is None
    backend = backend or LocalBackend(path=path, engine=engine, trainer=TrainerConfig(world_size=world_size))
    model = TrainableModel(
        name=name, project=project, base_model=base_model or DEFAULT_BASE_MODEL, budget=budget
    )
    await model.register(backend)
    try:
        client = model.openai_client()
        before, val_groups = await evaluate(model, eval_prompts, max_tokens)
        await _log_eval(model, val_groups, before)
        start = await model.get_step()
        if on_start is not None:
            on_start(start)
        train = tasks.scenarios("train", prompts_per_step * (start + steps), seed=1)
        config = TrainConfig(learning_rate=learning_rate)
        if pipeline:
            scenarios = itertools.cycle(train[start * prompts_per_step :])
            await _pipelined(model, scenarios, steps, prompts_per_step, group_size, config, max_tokens)
        for step in range(start, start + steps) if not pipeline else ():
            batch = train[step * prompts_per_step : (step + 1) * prompts_per_step]
            groups = await gather_trajectory_groups(
                (
                    TrajectoryGroup(
                        tasks.rollout(model, client, s, max_tokens=max_tokens) for _ in range(group_size)
                    )
                    for s in batch
                ),
                pbar_desc=None,
            )
            result = await model.train(groups, config=config)
            if on_step is not None:
                on_step(step, result.metrics)
        after, val_groups = await evaluate(model, eval_prompts, max_tokens)
        await _log_eval(model, val_groups, after)
        # a remote backend's run directory is on the server: the plot is drawn here, under `path`
        run_dir = model.run_dir if own else RunLayout.of(path, project, name).root
        plot = plot_history(
            await model.history(),
            RunLayout(run_dir).reward_plot,
            title=f"{project}/{name}: short on-topic answers",
        )
        return DemoResult(before=before, after=after, steps=steps, run_dir=run_dir, plot=plot)
    finally:
        if own:
            backend.close()


def check_counts(**counts: int) -> None:
    """Refuse, before anything loads, the counts a demo cannot learn with."""
    least = {"steps": 1, "group_size": 2, "prompts_per_step": 1, "eval_prompts": 1}
    why = {
        "steps": "the demo trains 1 step or more (0 would only evaluate the run as it is)",
        "group_size": "GRPO learns from how the rollouts of one scenario differ, so it needs 2 or more",
    }
    for name, n in counts.items():
        if n < least[name]:
            raise InvalidFieldError(name, n, why.get(name, f"use {least[name]} or more"))


async def _pipelined(
    model: TrainableModel,
    scenarios: Iterator[tasks.Scenario],
    steps: int,
    prompts_per_step: int,
    group_size: int,
    config: TrainConfig,
    max_tokens: int,
) -> None:
    """The same training, with rollouts going on while each step trains (its own progress bar)."""
    client = model.openai_client()

    async def rollout(m: TrainableModel, scenario: tasks.Scenario) -> Trajectory:
        return await tasks.rollout(m, client, scenario, max_tokens=max_tokens)

    # the pipeline's off-policy weighting (tis_cap) with the demo's learning rate
    train = PipelineConfig().train.model_copy(update={"learning_rate": config.learning_rate})
    pipe = PipelineConfig(group_size=group_size, groups_per_step=prompts_per_step, train=train)
    await PipelineTrainer(model, rollout, scenarios, pipe).train(steps)


async def _log_eval(model: TrainableModel, groups: list[TrajectoryGroup], result: EvalResult) -> None:
    # the SEM goes into the same history row, so the plot can draw error bars
    await model.log(groups, split="val", metrics={"reward_sem": result.sem})


def main_sync(**kwargs: object) -> DemoResult:
    return asyncio.run(run_demo(**kwargs))  # type: ignore[arg-type]
