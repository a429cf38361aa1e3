"""`journeyman serve`: the Backend protocol over HTTP, next to the GPU, for agents that run elsewhere.

One origin serves both halves: the OpenAI-compatible endpoint of every registered model
(`/v1/chat/completions`, `/v1/responses`, `/v1/models`; requests name the model) and the Backend
protocol under `/journeyman/v1/...` (see `remote_wire`). A `LocalBackend` does the work, so the
server's engines, trainer and run directory are exactly those of a local run; `RemoteBackend` is
its client.

Security: every route, the OpenAI ones included, needs `Authorization: Bearer <token>` (compared
in constant time; a 401 says nothing more). Request bodies are size-limited (413 names the limit).
The server binds 127.0.0.1 unless told otherwise; put TLS in front of it (a reverse proxy) before
exposing it beyond the machine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from .capture import CapturedCall
from .config import ModelConfig, TrainResult
from .errors import BackendUnavailableError, InvalidFieldError, JourneymanError, UnknownModelError
from .local_backend import LocalBackend
from .remote_wire import (
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
)

log = logging.getLogger("journeyman.server")

B = TypeVar("B", bound=BaseModel)
ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[..., Awaitable[None]]], Awaitable[None]
]

DEFAULT_MAX_BODY_BYTES = 64 * 2**20
HEARTBEAT_S = 15.0


def _error(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", **extra: Any
) -> JSONResponse:
    error = {"message": message, "type": kind, "param": param, **extra}
    return JSONResponse(status_code=status, content={"error": error})


class Guard:
    """ASGI middleware: the bearer token on every request, and a cap on the body's size."""

    def __init__(self, app: ASGIApp, token: str, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.max = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await _error(401, "unauthorized", kind="unauthorized")(scope, receive, send)
        too_large = _error(
            413, f"request body over the server's limit of {self.max} bytes (journeyman serve --max-body-mb)"
        )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max:
            return await too_large(scope, receive, send)
        if declared is not None:
            return await self.app(scope, receive, send)
        # No length declared (chunked): read the body here, up to the limit, then replay it.
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            seen += len(message.get("body", b""))
            if seen > self.max:
                return await too_large(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        replay = iter(messages)

        async def replayed() -> dict[str, Any]:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)


async def _body(request: Request, model: type[B], limit: int) -> B:
    """A JSON body (gzip-compressed or not) as `model`; errors name the bad field."""
    raw = await request.body()
    if request.headers.get("content-encoding") == "gzip":
        inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            raw = inflate.decompress(raw, limit + 1)
        except zlib.error as e:
            raise InvalidFieldError("body", "gzip", f"not valid gzip: {e}") from e
        if len(raw) > limit:
            raise InvalidFieldError("body", f"> {limit} bytes", "decompresses past the server's body limit")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        raise InvalidFieldError(where, err.get("input"), err["msg"]) from e


@dataclass
class TrainJob:
    """A train request in flight or done: its events, so a client can (re)attach at any time."""

    key: str
    events: list[TrainEvent] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def add(self, event: TrainEvent) -> None:
        self.events.append(event)
        self.changed.set()

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].kind != "progress"

    async def stream(self) -> AsyncIterator[str]:
        sent = 0
        while True:
            self.changed.clear()
            for event in self.events[sent:]:
                yield event.model_dump_json() + "\n"
            sent = len(self.events)
            if self.finished:
                return
            try:
                await asyncio.wait_for(self.changed.wait(), HEARTBEAT_S)
            except TimeoutError:  # a line every HEARTBEAT_S: the client tells a slow step from a dead link
                last = next((e for e in reversed(self.events) if e.kind == "progress"), None)
                yield (last or TrainEvent(kind="progress")).model_dump_json() + "\n"


class ModelRouter:
    """The OpenAI routes' view of the server: each request goes to the endpoint of the model it names."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend

    async def chat_completion(
        self, body: dict[str, Any], capture_id: str | None = None, response_id: str | None = None
    ) -> dict[str, Any]:
        name = body.get("model")
        if not isinstance(name, str) or name.split("@")[0] not in self.backend.registered():
            raise UnknownModelError(str(name), self.served_names())
        endpoint = self.backend.service(name.split("@")[0]).endpoint
        return await endpoint.chat_completion(body, capture_id, response_id)

    def served_names(self) -> list[str]:
        return [n for m in self.backend.registered() for n in self.backend.service(m).endpoint.served_names()]


def create_app(backend: LocalBackend, token: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server's ASGI app (wrap it in `Guard` to serve it; `serve` does)."""
    from .endpoint import build_app

    if len(token) < 16:
        raise InvalidFieldError(
            "token", "<hidden>", "use at least 16 characters (e.g. `openssl rand -hex 24`)"
        )
    app = build_app(ModelRouter(backend))
    jobs: dict[str, TrainJob] = {}

    @app.exception_handler(UnknownModelError)
    async def unknown(_: Request, e: UnknownModelError) -> JSONResponse:
        return _error(404, str(e), "model", "model_not_found", model=e.name, served=e.served)

    @app.exception_handler(InvalidFieldError)
    async def invalid(_: Request, e: InvalidFieldError) -> JSONResponse:
        return _error(400, str(e), e.field, value=repr(e.value)[:200], reason=e.reason)

    @app.exception_handler(JourneymanError)
    async def failed(_: Request, e: JourneymanError) -> JSONResponse:
        return _error(500, f"{type(e).__name__}: {e}", kind="server_error")

    def model_of(name: str) -> ModelConfig:
        if name not in backend.registered():
            raise UnknownModelError(name, backend.registered())
        return backend.service(name).model

    async def body(request: Request, model: type[B]) -> B:
        return await _body(request, model, max_body_bytes)

    @app.get(f"{PREFIX}/info")
    async def info() -> ServerInfo:
        return ServerInfo(
            journeyman=version("journeyman"), protocol=PROTOCOL_VERSION, models=backend.registered()
        )

    @app.post(f"{PREFIX}/register")
    async def register(request: Request) -> dict[str, Any]:
        model = (await body(request, RegisterBody)).model
        await backend.register(model)
        _remember(backend, model)
        return {"run_dir": str(backend.run_dir(model))}

    @app.get(f"{PREFIX}/models/{{name}}/step")
    async def step(name: str) -> dict[str, int]:
        return {"step": await backend.get_step(model_of(name))}

    def start(
        key: str, train: Callable[[Callable[[int, int], None]], Awaitable[TrainResult]]
    ) -> StreamingResponse:
        """The stream of the training call with idempotency key `key`: started by `train(progress)`
        unless it runs or ran already (a retry reattaches), or failed (a retry runs it again)."""
        job = jobs.get(key)
        if job is None or (job.finished and job.events[-1].kind == "error"):
            job = jobs[key] = TrainJob(key)
            loop = asyncio.get_running_loop()

            def progress(done: int, total: int) -> None:  # called on the trainer's thread
                loop.call_soon_threadsafe(job.add, TrainEvent(kind="progress", done=done, total=total))

            async def run() -> None:
                try:
                    job.add(TrainEvent(kind="result", result=await train(progress)))
                except Exception as e:  # the client gets the error as an event, by name
                    log.exception("train %s failed", key)
                    error: dict[str, Any] = {"type": type(e).__name__, "message": str(e), "param": None}
                    if isinstance(e, InvalidFieldError):
                        error.update(param=e.field, value=repr(e.value)[:200], reason=e.reason)
                    job.add(TrainEvent(kind="error", error=error))

            # Not tied to the request: a client that disconnects does not stop the step.
            job.task = asyncio.create_task(run())
        return StreamingResponse(job.stream(), media_type="application/x-ndjson")

    @app.post(f"{PREFIX}/models/{{name}}/train")
    async def train(name: str, request: Request) -> StreamingResponse:
        model = model_of(name)
        req = await body(request, TrainBody)
        return start(
            req.idempotency_key,
            lambda progress: backend.train(
                model, req.groups, req.config, idempotency_key=req.idempotency_key, on_progress=progress
            ),
        )

    @app.post(f"{PREFIX}/models/{{name}}/train_sft")
    async def train_sft(name: str, request: Request) -> StreamingResponse:
        model = model_of(name)
        req = await body(request, SFTBody)
        return start(
            req.idempotency_key,
            lambda progress: backend.train_sft(
                model,
                [*req.trajectories, *req.groups],
                req.config,
                idempotency_key=req.idempotency_key,
                on_progress=progress,
            ),
        )

    @app.post(f"{PREFIX}/models/{{name}}/log")
    async def log_(name: str, request: Request) -> dict[str, float]:
        req = await body(request, LogBody)
        return await backend.log(model_of(name), req.groups, req.split, req.metrics)

    @app.get(f"{PREFIX}/models/{{name}}/history")
    async def history(name: str) -> list[dict[str, Any]]:
        return await backend.history(model_of(name))

    @app.post(f"{PREFIX}/models/{{name}}/captures")
    async def captures(name: str, request: Request) -> dict[str, list[CapturedCall]]:
        req = await body(request, CapturesBody)
        return await backend.pop_captures(model_of(name), req.capture_ids)

    @app.post(f"{PREFIX}/models/{{name}}/serve_step")
    async def serve_step(name: str, request: Request) -> dict[str, bool]:
        await backend.serve_step(model_of(name), (await body(request, StepBody)).step)
        return {"ok": True}

    @app.post(f"{PREFIX}/models/{{name}}/delete_checkpoints")
    async def delete_checkpoints(name: str, request: Request) -> list[int]:
        req = await body(request, DeleteCheckpointsBody)
        return await backend.delete_checkpoints(model_of(name), req.best_checkpoint_metric)

    @app.get(f"{PREFIX}/models/{{name}}/run_dir")
    async def run_dir(name: str) -> dict[str, str]:
        return {"path": str(backend.run_dir(model_of(name)))}

    return app


def _registry(backend: LocalBackend) -> Path:
    return backend.path / "server-models.json"


def _remember(backend: LocalBackend, model: ModelConfig) -> None:
    """Models the server serves, kept on disk so a restarted server serves them again unasked."""
    path = _registry(backend)
    known = json.loads(path.read_text()) if path.exists() else {}
    known[model.name] = model.model_dump(mode="json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, path)


async def restore(backend: LocalBackend) -> list[str]:
    """Register every model the server served before it stopped (each resumes its run directory)."""
    path = _registry(backend)
    known = json.loads(path.read_text()) if path.exists() else {}
    for raw in known.values():
        await backend.register(ModelConfig.model_validate(raw))
    return list(known)


def serve(
    backend: LocalBackend,
    token: str,
    *,
    host: str = "127.0.0.1",
    port: int = 7800,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until interrupted (uvicorn, this thread); models registered before a restart are
    registered again by their clients and resume from the run directory."""
    import uvicorn

    app = Guard(create_app(backend, token, max_body_bytes=max_body_bytes), token, max_body_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=30)
    server = uvicorn.Server(config)

    async def main() -> None:
        restored = await restore(backend)
        if restored:
            log.warning("resumed %s from %s", ", ".join(restored), backend.path)
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started and on_ready is not None:
            on_ready(f"http://{host}:{port}")
        await task

    try:
        asyncio.run(main())
    finally:
        backend.close()


class ServerProcess:
    """`journeyman serve` as a child process on 127.0.0.1 (tests, benchmarks, a notebook's own GPU
    box): `start()` returns once it answers, `kill()` SIGKILLs its process group."""

    def __init__(
        self, path: str | Path, token: str, *, port: int | None = None, args: Sequence[str] = ()
    ) -> None:
        self.path, self.token = Path(path), token
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        env = {**os.environ, "JOURNEYMAN_TOKEN": self.token, "HF_HUB_OFFLINE": "1"}
        cmd = [
            sys.executable,
            "-m",
            "journeyman.cli",
            "serve",
            "--port",
            str(self.port),
            "--path",
            str(self.path),
        ]
        self.proc = subprocess.Popen(
            [*cmd, *self.args], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        assert self.proc.stderr is not None
        deadline, lines = time.monotonic() + timeout_s, []
        while time.monotonic() < deadline:  # readline blocks; the server prints as it starts
            line = self.proc.stderr.readline()
            lines.append(line)
            if line.strip() == "ready":
                return self
            if not line and self.proc.poll() is not None:
                break
        self.kill()
        raise BackendUnavailableError("journeyman serve did not start:\n" + "".join(lines[-30:]))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["DEFAULT_MAX_BODY_BYTES", "Guard", "ModelRouter", "ServerProcess", "create_app", "serve"]
