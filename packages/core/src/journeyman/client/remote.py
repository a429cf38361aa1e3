"""RemoteBackend: the Backend protocol as a client of `journeyman serve` on another machine.

    backend = jm.RemoteBackend("http://gpu-box:7800", token=os.environ["JOURNEYMAN_TOKEN"])
    await model.register(backend)      # the same TrainableModel, rollouts and adapters as locally
    client = model.openai_client()     # inference goes to the server; token records come back

Every call has a timeout. A connection the server refuses or drops is retried with backoff for up
to `reconnect_s` (a server being restarted), then `BackendUnavailableError`. Training is safe to
retry: each call carries an idempotency key, the server keeps running a step whose client went
away, and the client reattaches to it (or, after a server restart, gets the completed step's
result or trains it exactly once). Calls that are not idempotent (popping captures, logging) are
retried only when the request never reached the server.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, TypeAdapter

from journeyman.client.protocol import Inference
from journeyman.client.wire import (
    PREFIX,
    PROTOCOL_VERSION,
    CapturesBody,
    DeleteCheckpointsBody,
    LogBody,
    RegisterBody,
    ServerInfo,
    SFTBody,
    StepBody,
    TrainBody,
    TrainEvent,
    gzip_json,
)
from journeyman.data.config import ModelConfig, SFTConfig, TrainConfig, TrainResult, check_name
from journeyman.data.trajectory_file import check_trajectories
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import (
    AuthenticationError,
    BackendUnavailableError,
    InvalidFieldError,
    ProtocolMismatchError,
    RemoteError,
    UnknownModelError,
)
from journeyman.rollout.capture import CapturedCall

_CAPTURES = TypeAdapter(dict[str, list[CapturedCall]])


class _Shown:
    """A value as the server printed it (its repr), carried into a client-side error."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class RemoteBackend:
    """A `Backend` whose engine, trainer and run directory live behind `journeyman serve` at `url`."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 120.0,
        reconnect_s: float = 120.0,
        progress: bool = True,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidFieldError("url", url, "use the http(s) URL `journeyman serve` printed")
        token = token or os.environ.get("JOURNEYMAN_TOKEN")
        if not token:
            raise InvalidFieldError(
                "token", None, "pass token= or set $JOURNEYMAN_TOKEN (journeyman serve prints it)"
            )
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.progress = progress
        self._run_dirs: dict[str, Path] = {}
        self._checked = False
        self.sent_bytes = 0  # compressed trajectory bytes sent by train/log, for measuring

    # -- transport -----------------------------------------------------------------------------

    def _client(self, read_timeout: float | None = None) -> httpx.AsyncClient:
        timeout = httpx.Timeout(self.timeout_s, connect=10.0, read=read_timeout or self.timeout_s)
        return httpx.AsyncClient(
            base_url=self.url, headers={"authorization": f"Bearer {self._token}"}, timeout=timeout
        )

    async def _retrying(self, attempt: Any, *, any_failure: bool) -> Any:
        """Run `attempt()` until it gets an answer; connection failures are retried with backoff
        (any transport failure when `any_failure`, i.e. the call is idempotent)."""
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.2
        retried = (httpx.TransportError,) if any_failure else (httpx.ConnectError, httpx.ConnectTimeout)
        while True:
            try:
                return await attempt()
            except retried as e:
                if time.monotonic() + delay > deadline:
                    raise BackendUnavailableError(
                        f"{self.url} did not answer for {self.reconnect_s:.0f} s ({type(e).__name__}: {e}); "
                        "is `journeyman serve` running there?"
                    ) from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        *,
        compress: bool = False,
        idempotent: bool = True,
    ) -> Any:
        if not self._checked:
            await self._check_server()
        headers = {"content-type": "application/json"}
        content: bytes | None = None
        if body is not None:
            if compress:
                content = gzip_json(body)
                headers["content-encoding"] = "gzip"
                self.sent_bytes += len(content)
            else:
                content = body.model_dump_json().encode()

        async def attempt() -> httpx.Response:
            async with self._client() as c:
                return await c.request(method, path, content=content, headers=headers)

        response = await self._retrying(attempt, any_failure=idempotent)
        self._raise_for(response)
        return response.json()

    def _raise_for(self, r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        try:
            err = r.json().get("error") or {}
        except ValueError:
            err = {"message": r.text[:500]}
        message = str(err.get("message", ""))
        if r.status_code == 401:
            raise AuthenticationError(
                f"{self.url} refused the token (401): use the token `journeyman serve` printed"
            )
        if r.status_code == 404 and err.get("type") == "model_not_found":
            raise UnknownModelError(str(err.get("model", "?")), list(err.get("served") or []))
        if r.status_code in (400, 413):
            raise InvalidFieldError(
                str(err.get("param") or "body"),
                _Shown(str(err.get("value", "..."))),
                str(err.get("reason", message)),
            )
        raise RemoteError(str(err.get("type", f"HTTP {r.status_code}")), message)

    async def _check_server(self) -> ServerInfo:
        async def attempt() -> httpx.Response:
            async with self._client() as c:
                return await c.get(f"{PREFIX}/info")

        r = await self._retrying(attempt, any_failure=True)
        self._raise_for(r)
        info = ServerInfo.model_validate(r.json())
        if info.protocol != PROTOCOL_VERSION:
            raise ProtocolMismatchError(
                f"{self.url} speaks Backend protocol {info.protocol} (journeyman {info.journeyman}); this "
                f"client speaks {PROTOCOL_VERSION} (journeyman {version('journeyman')}): install the same "
                "journeyman version on both sides"
            )
        self._checked = True
        return info

    # -- the Backend protocol ------------------------------------------------------------------

    async def register(self, model: ModelConfig) -> None:
        config = ModelConfig.model_validate(model.model_dump())
        out = await self._call("POST", f"{PREFIX}/register", RegisterBody(model=config))
        self._run_dirs[model.name] = Path(out["run_dir"])

    def inference(self, model_name: str | None = None) -> Inference:
        if model_name is None:
            if not self._run_dirs:
                raise InvalidFieldError("model", None, "no model is registered with this backend")
            model_name = next(reversed(self._run_dirs))
        return Inference(base_url=f"{self.url}/v1", api_key=self._token, model=model_name)

    async def get_step(self, model: ModelConfig) -> int:
        return int((await self._call("GET", f"{PREFIX}/models/{model.name}/step"))["step"])

    async def train(
        self,
        model: ModelConfig,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> TrainResult:
        """One step on the server; progress streams into a bar here. Reattaches after a dropped
        connection or a server restart with the same idempotency key, so the step happens once."""
        key = check_name("idempotency_key", idempotency_key or uuid.uuid4().hex)
        body = TrainBody(groups=list(groups), config=config, idempotency_key=key)
        return await self._step(
            f"{PREFIX}/models/{model.name}/train", body, f"train {model.name}", "micro-batch"
        )

    async def train_sft(
        self,
        model: ModelConfig,
        trajectories: Iterable[Trajectory | TrajectoryGroup],
        config: SFTConfig | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning on the server, streamed and retried like `train`."""
        items, _ = check_trajectories(trajectories)
        key = check_name("idempotency_key", idempotency_key or uuid.uuid4().hex)
        body = SFTBody(
            trajectories=[t for t in items if isinstance(t, Trajectory)],
            groups=[g for g in items if isinstance(g, TrajectoryGroup)],
            config=config,
            idempotency_key=key,
        )
        return await self._step(f"{PREFIX}/models/{model.name}/train_sft", body, f"sft {model.name}", "step")

    async def _step(self, path: str, body: BaseModel, desc: str, unit: str) -> TrainResult:
        """POST a training call and follow its event stream to the result (see `remote_wire`)."""
        from tqdm.auto import tqdm

        if not self._checked:
            await self._check_server()
        content = gzip_json(body)
        self.sent_bytes += len(content)
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        bar = tqdm(desc=desc, unit=unit, disable=not self.progress, leave=False)

        async def attempt() -> TrainResult:
            # The server sends an event at least every 15 s while a step runs: a silent minute is a dead link.
            async with (
                self._client(read_timeout=60.0) as c,
                c.stream("POST", path, content=content, headers=headers) as r,
            ):
                if r.status_code >= 400:
                    await r.aread()
                    self._raise_for(r)
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    event = TrainEvent.model_validate_json(line)
                    if event.kind == "progress":
                        bar.total = event.total or None
                        bar.n = event.done
                        bar.refresh()
                    elif event.kind == "result" and event.result is not None:
                        return event.result
                    else:
                        err = event.error or {}
                        if err.get("param") is not None:  # an InvalidFieldError (or a subclass) by name
                            raise InvalidFieldError(
                                str(err["param"]),
                                _Shown(str(err.get("value", "..."))),
                                str(err.get("reason") or err.get("message")),
                            )
                        raise RemoteError(str(err.get("type", "error")), str(err.get("message", "")))
            raise httpx.RemoteProtocolError("the train stream ended before its result")

        try:
            return await self._retrying(attempt, any_failure=True)
        finally:
            bar.close()

    async def log(
        self,
        model: ModelConfig,
        groups: Sequence[TrajectoryGroup] | None = None,
        split: str = "val",
        metrics: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        body = LogBody(
            groups=list(groups) if groups is not None else None, split=split, metrics=dict(metrics or {})
        )
        return await self._call(
            "POST", f"{PREFIX}/models/{model.name}/log", body, compress=True, idempotent=False
        )

    async def history(self, model: ModelConfig) -> list[dict[str, Any]]:
        return await self._call("GET", f"{PREFIX}/models/{model.name}/history")

    async def pop_captures(
        self, model: ModelConfig, capture_ids: Sequence[str]
    ) -> dict[str, list[CapturedCall]]:
        out = await self._call(
            "POST",
            f"{PREFIX}/models/{model.name}/captures",
            CapturesBody(capture_ids=list(capture_ids)),
            idempotent=False,
        )
        return _CAPTURES.validate_python(out)

    async def serve_step(self, model: ModelConfig, step: int) -> None:
        await self._call("POST", f"{PREFIX}/models/{model.name}/serve_step", StepBody(step=step))

    async def delete_checkpoints(
        self, model: ModelConfig, best_checkpoint_metric: str = "val/reward"
    ) -> list[int]:
        body = DeleteCheckpointsBody(best_checkpoint_metric=best_checkpoint_metric)
        return await self._call(
            "POST", f"{PREFIX}/models/{model.name}/delete_checkpoints", body, idempotent=False
        )

    def run_dir(self, model: ModelConfig) -> Path:
        """The run directory on the server's machine (as the server reported it at registration)."""
        try:
            return self._run_dirs[model.name]
        except KeyError:
            raise InvalidFieldError("model", model.name, "is not registered with this backend") from None

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own connection."""


__all__ = ["RemoteBackend"]
