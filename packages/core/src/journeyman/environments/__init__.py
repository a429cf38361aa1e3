"""Bring your environment: train and evaluate on environments people already have.

    import journeyman as jm

    env = jm.environments.load("gym:textarena:GuessTheNumber-v0")   # or verifiers:..., openenv:..., module:function
    report = await jm.environments.evaluate(model, env, steps=[0, "latest"], k=4)
    print("\\n".join(report.lines()))
    await jm.environments.train(model, env, steps=10, groups_per_step=8, group_size=4)

One seam (`Environment`: tasks for a split, one task rolled out through `model.openai_client()`),
bridges to gym-style text games, verifiers and OpenEnv, and `journeyman train|eval --env SPEC`
on top. `docs/environments.md` has the SPEC forms and measured runs.
"""

from __future__ import annotations

from journeyman.environments._evaluate import Difference, EvalReport, Failure, StepResult, evaluate
from journeyman.environments._gym import GymEnvironment
from journeyman.environments._openenv import OpenEnvEnvironment
from journeyman.environments._protocol import Environment, Sampling, Split, Task, from_function, run_task
from journeyman.environments._spec import load
from journeyman.environments._train import TrainStep, train
from journeyman.environments._verifiers import VerifiersEnvironment, verifiers

__all__ = [
    "Difference",
    "Environment",
    "EvalReport",
    "Failure",
    "GymEnvironment",
    "OpenEnvEnvironment",
    "Sampling",
    "Split",
    "StepResult",
    "Task",
    "TrainStep",
    "VerifiersEnvironment",
    "evaluate",
    "from_function",
    "load",
    "run_task",
    "train",
    "verifiers",
]
