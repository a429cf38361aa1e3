"""OpenEnv environment servers (`openenv` on PyPI, `openenv.core.env_server.create_app`), driven over
their session WebSocket: one connection to `/ws` per episode, `reset` with the task's seed, then a
`step` with the model's answer until the server says `done`; the step rewards are summed.

Why the WebSocket and not `POST /reset` + `POST /step`: an OpenEnv server's HTTP `/reset` and
`/step` each build a fresh environment and close it after answering (openenv 0.10,
`http_server.py`), so a `/step` never sees the episode `/reset` began; the server's own client
(`EnvClient`) talks over `/ws`, where a connection holds one environment for its lifetime.

Messages (JSON text frames): `{"type": "reset", "data": {"seed": n}}`, `{"type": "step", "data":
{<action_field>: text}}`, `{"type": "close"}`; the server answers `{"type": "observation", "data":
{"observation": {...}, "reward": r, "done": bool}}` or `{"type": "error", "data": {"message",
"code"}}`. `GET /schema` (plain HTTP) gives the action's JSON schema: the action field is the one
named, else `message` where the schema has it, else the schema's only required field. The
observation's text is its first field of `TEXT_FIELDS`, or the whole observation as JSON.

A server holds `max_concurrent_envs` sessions (1 in `openenv init`'s template); this environment
opens at most `sessions` at once, so by default its rollouts take turns.
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
        action_field: str | None = None,
        train_size: int = 1000,
        eval_size: int = 100,
        max_turns: int = 32,
        sessions: int = 1,
        timeout_s: float = 60.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidFieldError("spec", f"openenv:{url}", "write openenv:http://host:port")
        if sessions < 1:
            raise InvalidFieldError("sessions", sessions, "at least 1 (the server's max_concurrent_envs)")
        self.name = f"openenv:{url}"
        self.url = url.rstrip("/")
        self.ws_url = "ws" + self.url.removeprefix("http") + "/ws"
        self.action_field = action_field
        self._sizes = {"train": train_size, "eval": eval_size}
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self._sessions = asyncio.Semaphore(sessions)
        self._schema_lock = asyncio.Lock()
        self._field: str | None = None

    def tasks(self, split: Split) -> Sequence[Task]:
        first = 1_000_000 if check_split(split) == "eval" else 0
        return [Task(id=f"seed-{s}", input={"seed": s}) for s in range(first, first + self._sizes[split])]

    async def rollout(self, model: TrainableModel, task: Task, sampling: Sampling) -> Trajectory:
        try:
            from websockets.asyncio.client import connect
            from websockets.exceptions import WebSocketException
        except ImportError as e:  # pragma: no cover - textarena (journeyman[envs]) brings it
            raise ImportError('pip install "journeyman[envs]" (or websockets) for OpenEnv servers') from e
        field = await self._action_field()
        seed = task.input.get("seed") if isinstance(task.input, dict) else None
        client = model.openai_client()
        async with self._sessions:
            try:
                ws = await connect(self.ws_url, open_timeout=self.timeout_s, max_size=None)
            except (OSError, WebSocketException) as e:
                raise ConnectionError(f"no OpenEnv server answers at {self.ws_url}: {e}") from e
            async with ws:
                state = await self._send(ws, "reset", {"seed": seed} if seed is not None else {})
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
                    state = await self._send(ws, "step", {field: choice.message.content or ""})
                    if state.get("reward") is not None:
                        total += finite_reward(state["reward"], "step reward")
                    if not state.get("done") and turns < self.max_turns:
                        trajectory.messages_and_choices.append({"role": "user", "content": _text(state)})
                await ws.send(json.dumps({"type": "close"}))
        trajectory.reward = total
        trajectory.metrics.update({"turns": turns, "done": bool(state.get("done"))})
        return trajectory

    async def _action_field(self) -> str:
        """The action's text field: the one named, checked against the server's `/schema`."""
        async with self._schema_lock:
            if self._field is not None:
                return self._field
            try:
                async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                    response = await http.get(f"{self.url}/schema")
            except httpx.TransportError as e:
                raise ConnectionError(f"no OpenEnv server answers at {self.url}/schema: {e!r}") from e
            try:
                schema = response.json().get("action") if response.status_code == 200 else None
            except (ValueError, AttributeError):  # not JSON, or not an object
                schema = None
            if not isinstance(schema, dict):
                raise InvalidFieldError(
                    "spec",
                    self.name,
                    f"{self.url}/schema answered {response.status_code}, not OpenEnv's schemas",
                )
            properties: dict[str, Any] = schema.get("properties") or {}  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
            required: list[str] = schema.get("required") or []  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
            field = self.action_field
            if field is None:
                field = (
                    "message" if "message" in properties else (required[0] if len(required) == 1 else None)
                )
            if field is None or field not in properties:
                raise InvalidFieldError(
                    "action_field",
                    field,
                    f"the actions of {self.url} have the fields {sorted(properties)}: name the text one",
                )
            self._field = field
            return field

    async def _send(self, ws: Any, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        try:
            await ws.send(json.dumps({"type": kind, "data": data}))
            raw = await asyncio.wait_for(ws.recv(), self.timeout_s)
        except TimeoutError as e:
            raise TimeoutError(
                f"the OpenEnv server at {self.ws_url} did not answer {kind} in {self.timeout_s:g} s"
            ) from e
        except Exception as e:  # the connection closed: the server stopped or dropped the session
            raise ConnectionError(
                f"the OpenEnv server at {self.ws_url} dropped the session at {kind}: {e!r}"
            ) from e
        answer = json.loads(raw)
        body = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(body, dict):
            raise InvalidFieldError(kind, answer, "an OpenEnv answer is {type, data}")
        if answer.get("type") == "error":
            raise InvalidFieldError(
                kind, data, f"{self.ws_url} refused it: {body.get('code')}: {body.get('message')}"
            )  # pyright: ignore[reportUnknownMemberType]
        if "observation" not in body:
            raise InvalidFieldError(kind, answer, "an OpenEnv observation is {observation, reward, done}")
        return body  # pyright: ignore[reportUnknownVariableType]


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
