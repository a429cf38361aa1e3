"""The environment seam: tasks for a split, and one task rolled out through the model's OpenAI client.

Every bridge (a gym-style text game, a verifiers environment, an OpenEnv server, a plain function)
is an `Environment`; `evaluate` and `train` know nothing else. A rollout talks to the model only
through `model.openai_client()`, so the endpoint records the token ids and logprobs of every
completion, and the Trajectory it returns trains token-exactly.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from journeyman.data.types import Trajectory
from journeyman.errors import EnvironmentRolloutError, InvalidFieldError

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")


class Task(BaseModel):
    """One task of an environment: an id unique within its split, and what the environment needs to
    run it (a seed, a dataset row) as JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="unique within the split; named in errors and results")
    input: Any = Field(default=None, description="what the environment needs to run it, as JSON")


class Sampling(BaseModel):
    """How the model samples in a rollout."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, description="0 = greedy")
    max_tokens: int = Field(default=64, ge=1, description="most tokens a completion may sample")


@runtime_checkable
class Environment(Protocol):
    """What Journeyman trains and evaluates on.

        class Echo:
            name = "echo"
            def tasks(self, split):
                return [Task(id=str(i), input=f"Say {i}") for i in range(10)]
            async def rollout(self, model, task, sampling):
                messages = [{"role": "user", "content": task.input}]
                completion = await model.openai_client().chat.completions.create(
                    model=model.name, messages=messages, max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature)
                choice = completion.choices[0]
                reward = float(task.input[-1] in (choice.message.content or ""))
                return Trajectory(messages_and_choices=[*messages, choice], reward=reward)

    `rollout` may run many times at once (a group of k, many tasks): it keeps no state between calls.
    """

    name: str

    def tasks(self, split: Split) -> Sequence[Task]: ...

    async def rollout(self, model: TrainableModel, task: Task, sampling: Sampling) -> Trajectory: ...


PlainRollout = Callable[["TrainableModel", Task, Sampling], Awaitable[Trajectory]]


class FunctionEnvironment:
    """An environment made of a plain async rollout function and its tasks (`from_function`)."""

    def __init__(self, name: str, rollout: PlainRollout, tasks: Mapping[Split, Sequence[Task]]) -> None:
        self.name = name
        self._rollout = rollout
        self._tasks = {split: list(tasks.get(split, ())) for split in SPLITS}

    def tasks(self, split: Split) -> Sequence[Task]:
        return self._tasks[check_split(split)]

    async def rollout(self, model: TrainableModel, task: Task, sampling: Sampling) -> Trajectory:
        return await self._rollout(model, task, sampling)


def from_function(
    rollout: PlainRollout,
    tasks: Sequence[Any] | Mapping[str, Sequence[Any]],
    *,
    name: str | None = None,
) -> Environment:
    """An Environment of `rollout(model, task, sampling)` and its tasks: a mapping {"train": [...],
    "eval": [...]}, or one list (its last fifth held out as eval). A task that is not a `Task` becomes
    `Task(id=<its index>, input=<it>)`."""
    if not inspect.iscoroutinefunction(rollout) and not callable(rollout):
        raise InvalidFieldError("rollout", rollout, "must be an async function (model, task, sampling)")
    if isinstance(tasks, Mapping):
        unknown = sorted(set(tasks) - set(SPLITS))
        if unknown:
            raise InvalidFieldError("tasks", unknown, "splits are 'train' and 'eval'")
        by_split = {s: [_task(t, i) for i, t in enumerate(tasks.get(s, ()))] for s in SPLITS}
    else:
        every = [_task(t, i) for i, t in enumerate(tasks)]
        cut = len(every) - max(1, len(every) // 5) if len(every) > 1 else len(every)
        by_split = {"train": every[:cut], "eval": every[cut:]}
    return FunctionEnvironment(name or getattr(rollout, "__name__", "function"), rollout, by_split)  # pyright: ignore[reportArgumentType]


def _task(value: Any, index: int) -> Task:
    return value if isinstance(value, Task) else Task(id=str(index), input=value)


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise InvalidFieldError("split", split, "use 'train' or 'eval'")
    return split  # pyright: ignore[reportReturnType]


def finite_reward(value: Any, field: str = "reward") -> float:
    """`value` as a float, refused naming `field` when it is not a finite number (a bool counts as
    0 or 1; a string does not)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):  # int, float, numpy's scalars; not a string
        raise InvalidFieldError(field, value, f"must be a finite number, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidFieldError(field, value, "must be a finite number")
    return number


async def run_task(env: Environment, model: TrainableModel, task: Task, sampling: Sampling) -> Trajectory:
    """`env.rollout` of one task, its result checked: what goes wrong is an `EnvironmentRolloutError`
    naming the environment and the task. The task's id is put on the trajectory's metadata."""
    try:
        trajectory = await env.rollout(model, task, sampling)
        if not isinstance(trajectory, Trajectory):
            raise InvalidFieldError(
                "rollout", trajectory, f"must return a journeyman Trajectory, not {type(trajectory).__name__}"
            )
        finite_reward(trajectory.reward)
    except EnvironmentRolloutError:
        raise
    except Exception as e:
        raise EnvironmentRolloutError(env.name, task.id, e) from e
    trajectory.metadata.setdefault("task", task.id)
    return trajectory
