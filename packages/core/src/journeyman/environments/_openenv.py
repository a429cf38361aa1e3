"""OpenEnv environment servers, driven over HTTP: `POST /reset`, then `POST /step` with the model's
answer until the server says `done`; the step rewards are summed.

Bodies are OpenEnv's: `/reset` takes `{"seed": n}`, `/step` takes `{"action": {<action_field>: text}}`
(`message` by default, as OpenEnv's text environments take it), and both answer `{"observation":
{...}, "reward": r, "done": bool}`. The observation's text is its first field of `TEXT_FIELDS`, or
the whole observation as JSON. An HTTP server holds one episode at a time, so this environment's
rollouts take turns.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from journeyman.data.types import Trajectory
from journeyman.environments._protocol import Sampling, Split, Task, check_split, finite_reward
from journeyman.errors import InvalidFieldError

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel

TEXT_FIELDS = ("prompt", "text", "message", "observation", "echoed_message", "content")


class OpenEnvEnvironment:
    """An OpenEnv server at `url`: its episodes, seeded by task, driven by the model."""

    def __init__(
        self,
        url: str,
        *,
        action_field: str = "message",
        train_size: int = 1000,
        eval_size: int = 100,
        max_turns: int = 32,
        timeout_s: float = 60.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidFieldError("spec", f"openenv:{url}", "write openenv:http://host:port")
        self.name = f"openenv:{url}"
        self.url = url.rstrip("/")
        self.action_field = action_field
        self._sizes = {"train": train_size, "eval": eval_size}
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self._turn = asyncio.Lock()

    def tasks(self, split: Split) -> Sequence[Task]:
        first = 1_000_000 if check_split(split) == "eval" else 0
        return [Task(id=f"seed-{s}", input={"seed": s}) for s in range(first, first + self._sizes[split])]

    async def rollout(self, model: TrainableModel, task: Task, sampling: Sampling) -> Trajectory:
        seed = task.input.get("seed") if isinstance(task.input, dict) else None
        client = model.openai_client()
        async with self._turn, httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s) as http:
            state = await self._post(http, "/reset", {"seed": seed} if seed is not None else {})
            trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": _text(state)}])
            total, turns = 0.0, 0
            while not state.get("done") and turns < self.max_turns:
                completion = await client.chat.completions.create(
                    model=model.name,
                    messages=trajectory.messages(),  # pyright: ignore[reportArgumentType]
                    max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature,
                )
                choice = completion.choices[0]
                trajectory.messages_and_choices.append(choice)
                turns += 1
                action = {self.action_field: choice.message.content or ""}
                state = await self._post(http, "/step", {"action": action})
                if state.get("reward") is not None:
                    total += finite_reward(state["reward"], "reward")
                if not state.get("done") and turns < self.max_turns:
                    trajectory.messages_and_choices.append({"role": "user", "content": _text(state)})
        trajectory.reward = total
        trajectory.metrics.update({"turns": turns, "done": bool(state.get("done"))})
        return trajectory

    async def _post(self, http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await http.post(path, json=body)
        if response.status_code >= 400:
            raise InvalidFieldError(
                path, body, f"{self.url}{path} answered {response.status_code}: {response.text[:200]}"
            )
        data = response.json()
        if not isinstance(data, dict) or "observation" not in data:
            raise InvalidFieldError(path, data, "an OpenEnv answer is {observation, reward, done}")
        return data  # pyright: ignore[reportUnknownVariableType]


def _text(state: dict[str, Any]) -> str:
    observation = state.get("observation")
    if isinstance(observation, str):
        return observation
    if isinstance(observation, dict):
        for field in TEXT_FIELDS:
            value = observation.get(field)  # pyright: ignore[reportUnknownMemberType]
            if isinstance(value, str) and value:
                return value
    return json.dumps(observation)
