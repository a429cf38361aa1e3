"""Gym-style text environments: reset, then step with the model's answer until the game is done.

Two shapes are driven, told apart by their methods:
- Gymnasium's: `reset(seed=) -> (observation, info)`, `step(action) -> (observation, reward,
  terminated, truncated, info)`, rewards summed over the steps;
- TextArena's (single player): `reset(num_players=1, seed=)`, `get_observation() -> (player,
  observation)`, `step(action) -> (done, info)`, `close() -> (rewards, info)`, the player's reward.

Each observation is a user message and each answer the model's message content, verbatim: the
action. An observation that repeats the previous one and adds to it (TextArena's whole transcript)
is sent as what it adds, so the conversation holds each turn once. A task is a seed: train and eval
seeds never overlap. Each rollout makes its own environment, so rollouts run at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from openai.types.chat import ChatCompletionMessageParam

from journeyman.data.types import Trajectory
from journeyman.environments._protocol import Sampling, Split, Task, check_split, finite_reward
from journeyman.errors import InvalidFieldError

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel

EVAL_SEEDS_FROM = 1_000_000  # eval seeds start here; train seeds from 0


class GymEnvironment:
    """A gym-style text environment made by `make()` for each rollout."""

    def __init__(
        self,
        make: Callable[[], Any],
        *,
        name: str,
        train_size: int = 1000,
        eval_size: int = 100,
        max_turns: int = 32,
        system_prompt: str | None = None,
    ) -> None:
        for field, n in (("train_size", train_size), ("eval_size", eval_size), ("max_turns", max_turns)):
            if n < 1:
                raise InvalidFieldError(field, n, "use 1 or more")
        self.name = name
        self._make = make
        self._sizes = {"train": train_size, "eval": eval_size}
        self.max_turns = max_turns
        self.system_prompt = system_prompt

    def tasks(self, split: Split) -> Sequence[Task]:
        first = EVAL_SEEDS_FROM if check_split(split) == "eval" else 0
        return [Task(id=f"seed-{s}", input={"seed": s}) for s in range(first, first + self._sizes[split])]

    async def rollout(self, model: TrainableModel, task: Task, sampling: Sampling) -> Trajectory:
        seed = int(task.input["seed"]) if isinstance(task.input, dict) else None
        game = _Game(self._make())
        client = model.openai_client()
        messages: list[Any] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        seen = game.reset(seed)
        messages.append({"role": "user", "content": seen})
        trajectory = Trajectory(messages_and_choices=messages)
        turns = 0
        while not game.done and turns < self.max_turns:
            sent: list[ChatCompletionMessageParam] = trajectory.messages()  # pyright: ignore[reportAssignmentType]
            completion = await client.chat.completions.create(
                model=model.name,
                messages=sent,
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
            )
            choice = completion.choices[0]
            trajectory.messages_and_choices.append(choice)
            turns += 1
            observation = game.step(choice.message.content or "")
            if not game.done and turns < self.max_turns:
                new = observation[len(seen) :] if observation.startswith(seen) else observation
                trajectory.messages_and_choices.append(
                    {"role": "user", "content": new.strip() or observation}
                )
            seen = observation
        trajectory.reward = game.reward()
        trajectory.metrics.update({"turns": turns, "done": game.done})
        trajectory.metadata.update({"seed": seed, **game.info})
        return trajectory


class _Game:
    """One game of either shape, behind one small interface."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.arena = callable(getattr(env, "get_observation", None))
        self.done = False
        self.total = 0.0
        self.info: dict[str, Any] = {}

    def reset(self, seed: int | None) -> str:
        if self.arena:
            self.env.reset(num_players=1, seed=seed)
            return self._observe()
        out = self.env.reset(seed=seed)
        observation = out[0] if isinstance(out, tuple) else out
        return _text(observation)

    def step(self, action: str) -> str:
        if self.arena:
            done, _info = self.env.step(action)
            self.done = bool(done)
            return "" if self.done else self._observe()
        out = self.env.step(action)
        if not isinstance(out, tuple) or len(out) not in (4, 5):
            raise InvalidFieldError(
                "step", out, "a gym step returns (observation, reward, terminated, truncated, info)"
            )
        observation, reward = out[0], out[1]
        self.done = bool(out[2]) or (len(out) == 5 and bool(out[3]))
        self.total += finite_reward(reward, "step reward")
        return _text(observation)

    def reward(self) -> float:
        if not self.arena:
            return self.total
        closed = self.env.close()  # TextArena: (rewards by player, game info by player)
        rewards, info = closed if isinstance(closed, tuple) else (closed, {})
        if not self.done:
            return 0.0  # the turn limit of the bridge ended it: the game gave no reward
        if not isinstance(rewards, dict) or 0 not in rewards:
            raise InvalidFieldError("rewards", rewards, "the game gave no reward for player 0")
        player = info.get(0, {}) if isinstance(info, dict) else {}
        self.info = {k: v for k, v in player.items() if isinstance(v, str | int | float | bool)}
        return finite_reward(rewards[0], "reward")

    def _observe(self) -> str:
        got = self.env.get_observation()
        observation = got[1] if isinstance(got, tuple) else got
        return _text(observation)


def _text(observation: Any) -> str:
    if not isinstance(observation, str):
        raise InvalidFieldError(
            "observation",
            observation,
            f"a text environment's observation is a str, not {type(observation).__name__}",
        )
    return observation


def make_gym(module: str, env_id: str, kwargs: dict[str, Any]) -> GymEnvironment:
    """`module.make(env_id, **kwargs)` for each rollout (`textarena`, `gymnasium` and anything with a
    `make` of that shape); one is made now, so a bad id fails here, not in a rollout."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise InvalidFieldError("spec", f"gym:{module}:{env_id}", f"cannot import {module!r}: {e}") from e
    make = getattr(mod, "make", None)
    if not callable(make):
        raise InvalidFieldError(
            "spec", f"gym:{module}:{env_id}", f"module {module!r} has no make(id, **kwargs)"
        )
    try:
        first = make(env_id, **kwargs)
    except Exception as e:
        raise InvalidFieldError("spec", f"gym:{module}:{env_id}", f"{module}.make failed: {e}") from e
    made = [first]

    def fresh() -> Any:
        return made.pop() if made else make(env_id, **kwargs)

    return GymEnvironment(fresh, name=f"{module}:{env_id}")
