"""verifiers environments: a module (or `.py` file) exposing `load_environment(**kwargs)`, the
Environments Hub convention.

What `load_environment` returns is used as it is when it is a Journeyman `Environment`; otherwise
it is driven through verifiers' classic surface, read by duck typing: its dataset
(`get_dataset()` / `get_eval_dataset()`, rows with `prompt`, `answer`, `task`, `info`), `rollout(client,
model, prompt, answer=, task=, info=, sampling_args=)` (single-turn, multi-turn and tool
environments alike), and `rubric.score_rollout(...)`, whose reward and every metric go onto the
trajectory. The rollout runs inside an `Episode`, so every completion it makes through the model's
client is captured token-exactly whatever the environment does with the answers.

Not bridged: verifiers 0.4's `verifiers.v1` stack (tasksets, harnesses, runtimes), which has no
`load_environment`; see docs/environments.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from journeyman.data.types import Trajectory
from journeyman.environments._protocol import Environment, Sampling, Split, Task, check_split, finite_reward
from journeyman.errors import InvalidFieldError
from journeyman.rollout.episode import Episode

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel


def load_verifiers(module: Any, target: str, args: dict[str, Any], *, spec: str) -> Environment:
    """The environment `module`'s `load_environment(**args)` makes (`module`: `target` imported)."""
    load_environment = getattr(module, "load_environment", None)
    if not callable(load_environment):
        raise InvalidFieldError(
            "spec",
            spec,
            f"{target!r} has no load_environment(**kwargs): a verifiers environment module defines one",
        )
    made = load_environment(**args)
    if isinstance(made, Environment):
        return made
    for needed in ("rollout", "rubric"):
        if not hasattr(made, needed):
            raise InvalidFieldError(
                "spec", spec, f"load_environment() returned {type(made).__name__}, which has no {needed!r}"
            )
    return VerifiersEnvironment(made, name=f"verifiers:{target}")


class VerifiersEnvironment:
    """A classic verifiers environment object behind the seam."""

    def __init__(self, env: Any, *, name: str) -> None:
        self.env = env
        self.name = name
        self._rows: dict[str, list[dict[str, Any]]] = {}

    def tasks(self, split: Split) -> Sequence[Task]:
        rows = self._split(check_split(split))
        return [Task(id=f"{split}-{i}", input={"split": split, "index": i}) for i in range(len(rows))]

    def _split(self, split: Split) -> list[dict[str, Any]]:
        """The environment's own split: its eval dataset for eval, its dataset for train (an env that
        declares no eval dataset is evaluated on the last fifth of its dataset, never trained on it)."""
        if split not in self._rows:
            train = _rows(_dataset(self.env, "get_dataset", "dataset"))
            held = _rows(_dataset(self.env, "get_eval_dataset", "eval_dataset"))
            if not held and len(train) > 1:
                cut = len(train) - max(1, len(train) // 5)
                train, held = train[:cut], train[cut:]
            self._rows = {"train": train, "eval": held}
        return self._rows[split]

    async def rollout(self, model: TrainableModel, task: Task, sampling: Sampling) -> Trajectory:
        row = self._split(task.input["split"])[int(task.input["index"])]
        client = model.openai_client()
        episode = Episode(model, on_error="raise")
        kwargs = {
            "answer": row.get("answer", ""),
            "task": row.get("task", "default"),
            "info": row.get("info") or {},
        }
        sampling_args = {"temperature": sampling.temperature, "max_tokens": sampling.max_tokens}
        with episode.running():
            completion, state = await self.env.rollout(
                client, model.name, row["prompt"], sampling_args=sampling_args, **kwargs
            )
        trajectory = await episode.finish()
        score = self.env.rubric.score_rollout(row["prompt"], completion, state=state, **kwargs)
        if inspect.isawaitable(score):
            score = await score
        trajectory.reward = finite_reward(getattr(score, "reward", score))
        for key, value in (getattr(score, "metrics", None) or {}).items():
            trajectory.metrics[str(key)] = finite_reward(value, f"metrics.{key}")
        return trajectory


def _dataset(env: Any, method: str, attribute: str) -> Any:
    getter = getattr(env, method, None)
    if callable(getter):
        try:
            return getter()
        except (ValueError, TypeError):
            return None  # classic verifiers: get_eval_dataset() raises when none is declared
    return getattr(env, attribute, None)


def _rows(dataset: Any) -> list[dict[str, Any]]:
    if dataset is None:
        return []
    return [dict(row) for row in dataset]
