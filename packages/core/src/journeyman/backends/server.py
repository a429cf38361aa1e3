"""`journeyman serve`: the Backend protocol over HTTP, next to the GPU, for agents that run elsewhere.

One origin serves both halves: the OpenAI-compatible endpoint of every registered model
(`/v1/chat/completions`, `/v1/responses`, `/v1/models`; requests name the model) and the Backend
protocol under `/journeyman/v1/...`, one route per row of the operations table
(`client/operations.py`, bodies in `client/wire.py`). Any `ServedBackend` does the work; with a
`LocalBackend` the server's engines, trainer and run directory are exactly those of a local run.
`RemoteBackend` is its client.

Security (README's threat model): every route, the OpenAI ones included, needs
`Authorization: Bearer <token>` of a scope that allows it (`serving/api_tokens.py`: sample < train < admin; a
401 says nothing more, a 403 names the scope needed). Bodies are read whole before any route runs,
capped as read (413), with an idle timeout (408); a connection must send its request head within
`HEADER_TIMEOUT_S`. A token scoped to models (`ApiToken.models`) touches those alone: `_check_tenant`
is the one rule, applied where every request names its model (`answer` for the Backend routes, the
path or the registered config; `_TenantServed` for the OpenAI routes, the body's `model` as the
backend reads it; `_PerToken` for the viewer's runs), a 403 naming the model and the token. The server binds 127.0.0.1 unless told otherwise and speaks TLS when given a
certificate and key.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import IO, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from journeyman.backends.metrics import CONTENT_TYPE, ModelSource, ServerMetrics, TimedRequests
from journeyman.backends.otel import OtelExport, OtelSettings
from journeyman.client.operations import OPERATIONS, REGISTER, Operation
from journeyman.client.protocol import Progress, ServedBackend
from journeyman.client.wire import PREFIX, PROTOCOL_VERSION, Registered, ServerInfo, TrainEvent, body_error
from journeyman.data.budget import BudgetExceededError
from journeyman.data.config import ModelConfig, TrainConfig, TrainResult
from journeyman.data.live_types import LiveConfig
from journeyman.data.paths import RunRoot
from journeyman.errors import (
    BackendUnavailableError,
    BaseModelNotFoundError,
    InvalidFieldError,
    JourneymanError,
    UnknownModelError,
)
from journeyman.rollout.capture import owned_by
from journeyman.serving.api_tokens import ApiToken, Scope, TokenBook, may_touch
from journeyman.serving.drain import Drain, DrainingServer
from journeyman.serving.guard import (
    DEFAULT_MAX_BODY_BYTES,
    VIEW_PREFIX,
    Guard,
    HeaderTimeoutH11,
    error_dialect,
    json_error,
    needed_scope,
    token_book,
)

log = logging.getLogger("journeyman.backends.server")

B = TypeVar("B", bound=BaseModel)
HEARTBEAT_S = 15.0
MAX_FINISHED_JOBS = 256


OFF_LOOP_BYTES = 256 * 2**10


async def _body(request: Request, model: type[B], limit: int) -> B:
    """A JSON body (gzip-compressed or not) as `model`; errors name the bad field. A large body is
    inflated and parsed on a worker thread: tens of MB of trajectories would hold the event loop,
    and with it every other route, for seconds."""
    raw = await request.body()
    gzipped = request.headers.get("content-encoding") == "gzip"
    if gzipped or len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(_parse, raw, model, limit, gzipped)
    return _parse(raw, model, limit, gzipped)


def _parse(raw: bytes, model: type[B], limit: int, gzipped: bool) -> B:
    if gzipped:
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
        raise body_error(e) from e


JobName = tuple[str, str, str]
"""(model, operation, idempotency key): a key names one training call of one model and operation."""


@dataclass
class TrainJob:
    """A train request in flight or done: its events, so a client can (re)attach at any time, and
    the digest of its body (`_body_sha256`), so that its key cannot attach another call to it."""

    key: str
    body_sha256: str
    events: list[TrainEvent] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def add(self, event: TrainEvent) -> None:
        self.events.append(event)
        self.changed.set()

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].kind != "progress"

    @property
    def failed(self) -> bool:
        return self.finished and self.events[-1].kind == "error"

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


class NewTokenBody(BaseModel):
    name: str = Field(description="who will hold it (letters, digits, '.', '_', '-')")
    scope: Scope = Field(description="sample < train < admin")
    models: list[str] | None = Field(
        default=None, description="the models it may touch (left out: every model); never with scope admin"
    )


class NewToken(BaseModel):
    name: str
    scope: Scope
    models: list[str] | None
    token: str = Field(description="the secret, shown this once")


_CALLER: ContextVar[ApiToken | None] = ContextVar("journeyman_caller", default=None)
"""The API token of the request being answered (`_PerToken`); None: no Guard in front (tests)."""


class ModelForbiddenError(JourneymanError, PermissionError):
    """A token scoped to models named another one."""

    def __init__(self, model: str, token: ApiToken, what: str | None = None) -> None:
        self.model, self.token = model, token.name
        what = what or f"model={model!r}"
        super().__init__(f"{what}: the token {token.name!r} may touch only the models {token.models}")


def _check_tenant(model: object) -> None:
    """The one rule of tenants: the caller's token, if scoped to models, names `model` (a name or
    `name@step`; anything else, a base model's own name included, is another tenant's)."""
    token = _CALLER.get()
    if (
        token is not None
        and token.models is not None
        and not (isinstance(model, str) and may_touch(token, model))
    ):
        raise ModelForbiddenError(str(model), token)


def _check_teacher(arguments: dict[str, Any]) -> None:
    """A distillation teacher is read by the server for the caller: a token scoped to models may
    name as teacher only a model it may touch, never a path or URL the server would open for it
    (another tenant's checkpoint, a service on the server's network)."""
    token = _CALLER.get()
    for value in arguments.values():
        config = value.train if isinstance(value, LiveConfig) else value
        if not isinstance(config, TrainConfig) or config.distill is None:
            continue
        teacher = config.distill.teacher
        if teacher.base_url is None and teacher.base_model is None:
            _check_tenant(teacher.model)
        elif token is not None and token.models is not None:
            raise ModelForbiddenError(
                "teacher",
                token,
                "config.distill.teacher: a token scoped to models distills only from a model registered here "
                "that it may touch, not a base_model or base_url the server would open",
            )


def _visible(names: list[str]) -> list[str]:
    """Of `names`, those the caller may touch (all, for a token without a model list)."""
    token = _CALLER.get()
    return names if token is None else [n for n in names if may_touch(token, n)]


def _check_unscoped(what: str) -> None:
    """Token management is every tenant's business: a token scoped to models (only a hand-edited
    tokens.json gives an admin one) may not do it."""
    token = _CALLER.get()
    if token is not None and token.models is not None:
        raise ModelForbiddenError(
            "", token, f"{what} are every model's: managing them needs an unscoped token"
        )


class _TenantServed:
    """The backend as the OpenAI routes see it: a chat completion checks the model its body names,
    as the backend will read it, and `/v1/models` lists the caller's models alone. Every OpenAI
    route (chat, Responses, Messages, streamed or not) samples through `chat_completion`."""

    def __init__(self, backend: ServedBackend) -> None:
        self.backend = backend

    def admit(self, model: object) -> None:
        """Before a route reads the rest of the body (a Responses `previous_response_id`, a
        malformed field): another tenant's model is refused by name, not by what else was sent."""
        _check_tenant(model)

    async def chat_completion(
        self,
        body: dict[str, Any],
        capture_id: str | None = None,
        response_id: str | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> dict[str, Any]:
        _check_tenant(body.get("model"))
        try:
            return await self.backend.chat_completion(body, capture_id, response_id, on_text)
        except UnknownModelError as e:  # its list of served models: the caller's alone
            raise UnknownModelError(e.name, _visible(e.served)) from None

    def served_names(self) -> list[str]:
        return _visible(self.backend.served_names())


def create_app(
    backend: ServedBackend,
    tokens: TokenBook | str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    routes: Callable[[FastAPI], None] | None = None,
) -> FastAPI:
    """The server's ASGI app (wrap it in `Guard` with the same tokens to serve it; `serve` does).

    `routes` adds more of them, behind the same tokens (the CLI adds the run viewer's `/view/`)."""
    from journeyman.serving.endpoint import build_app

    book = token_book(tokens)
    app = build_app(_TenantServed(backend))  # the OpenAI routes: each request goes to the model it names
    app.add_middleware(_PerToken, book=book)
    # a tenant's token sees its models' series alone (`_visible` reads the caller's token)
    metrics = ServerMetrics(
        ModelSource(lambda: _visible(backend.registered()), getattr(backend, "service", None))
    )
    app.add_middleware(TimedRequests, metrics=metrics)
    app.state.metrics = metrics  # what an OpenTelemetry export reads (`serve(otel=...)`)
    jobs: dict[JobName, TrainJob] = {}
    app.state.train_jobs = jobs  # what a drain waits for (`serve`)

    @app.exception_handler(BaseModelNotFoundError)
    async def no_base(_: Request, e: BaseModelNotFoundError) -> JSONResponse:
        # One answer for every miss: which of the server's paths exist is not the caller's business.
        reason = (
            "not a model this server can load (the embedded model, or a model directory or hub id it holds)"
        )
        log.info("refused: %s", e)
        return json_error(400, f"model.base_model: {reason}", "model.base_model", reason=reason)

    @app.exception_handler(UnknownModelError)
    async def unknown(_: Request, e: UnknownModelError) -> JSONResponse:
        log.info("refused: %s", e)
        e = UnknownModelError(e.name, _visible(e.served))  # other tenants' models go unnamed
        return json_error(404, str(e), "model", "model_not_found", model=e.name, served=e.served)

    @app.exception_handler(ModelForbiddenError)
    async def forbidden(request: Request, e: ModelForbiddenError) -> JSONResponse:
        log.info("refused: %s", e)  # shaped as the Guard's scope 403, in the route's dialect
        return error_dialect(request.url.path)(
            403, str(e), "model", kind="forbidden", model=e.model, token=e.token
        )

    @app.exception_handler(InvalidFieldError)
    async def invalid(_: Request, e: InvalidFieldError) -> JSONResponse:
        log.info("refused: %s", e)
        return json_error(400, str(e), e.field, value=repr(e.value)[:200], reason=e.reason)

    @app.exception_handler(BudgetExceededError)
    async def over_budget(_: Request, e: BudgetExceededError) -> JSONResponse:
        log.info("refused: %s", e)  # no retry helps: a person raises the budget
        return json_error(
            402, str(e), f"budget.{e.budget}", "budget_exceeded", model=e.model, limit=e.limit, spent=e.spent
        )

    @app.exception_handler(JourneymanError)
    async def failed(_: Request, e: JourneymanError) -> JSONResponse:
        return json_error(500, f"{type(e).__name__}: {e}", kind="server_error")

    @app.get(f"{PREFIX}/info")
    async def info() -> ServerInfo:
        return ServerInfo(
            journeyman=version("journeyman"), protocol=PROTOCOL_VERSION, models=_visible(backend.registered())
        )

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"content": {CONTENT_TYPE.split(";")[0]: {}}, "description": "Prometheus' text format"}
        },
    )
    async def prometheus() -> Response:
        """Prometheus' text format (`backends/metrics.py`, docs/metrics.md)."""
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.get(f"{PREFIX}/tokens")
    async def list_tokens() -> list[dict[str, Any]]:
        _check_unscoped("tokens")
        return [t.model_dump(exclude={"sha256"}) for t in book.tokens()]

    @app.post(f"{PREFIX}/tokens")
    async def add_token(request: Request) -> NewToken:
        _check_unscoped("tokens")
        req = await _body(request, NewTokenBody, max_body_bytes)
        secret = await asyncio.to_thread(book.add, req.name, req.scope, req.models)
        added = next(t for t in book.tokens() if t.name == req.name)
        return NewToken(name=added.name, scope=added.scope, models=added.models, token=secret)

    @app.delete(f"{PREFIX}/tokens/{{name}}")
    async def revoke_token(name: str) -> dict[str, bool]:
        _check_unscoped("tokens")
        if not await asyncio.to_thread(book.revoke, name):
            raise InvalidFieldError("name", name, "no token of that name")
        return {"revoked": True}

    def start(
        name: JobName, body_sha256: str, train: Callable[[Progress], Awaitable[TrainResult]]
    ) -> Response:
        """The stream of the training call `name` (model, operation, idempotency key): started by
        `train(progress)` unless it runs or ran already (a retry, the same body: it reattaches), or
        failed (a retry runs it again). Another body under a key that runs or ran is a 409."""
        model, operation, key = name
        job = jobs.get(name)
        if job is not None and not job.failed and job.body_sha256 != body_sha256:
            reason = (
                f"names another {operation} call to {model} (another body), which "
                f"{'ran' if job.finished else 'runs'} under it: a key names one call; send a new key with a new call"
            )
            return json_error(
                409,
                f"idempotency_key={key!r}: {reason}",
                "idempotency_key",
                "idempotency_key_reused",
                value=repr(key),
                reason=reason,
            )
        if job is None or job.failed:
            _forget_finished(jobs)
            job = jobs[name] = TrainJob(key, body_sha256)
            loop = asyncio.get_running_loop()

            def progress(done: int, total: int) -> None:  # called on the trainer's thread
                loop.call_soon_threadsafe(job.add, TrainEvent(kind="progress", done=done, total=total))

            async def run() -> None:
                try:
                    result = await train(progress)
                    log.info("%s: %s", key, result.skip_reason or f"trained, now at step {result.step}")
                    job.add(TrainEvent(kind="result", result=result))
                except Exception as e:  # the client gets the error as an event, by name
                    log.exception("train %s failed", key)
                    error: dict[str, Any] = {"type": type(e).__name__, "message": str(e), "param": None}
                    if isinstance(e, InvalidFieldError):
                        error.update(param=e.field, value=repr(e.value)[:200], reason=e.reason)
                    if isinstance(e, BudgetExceededError):
                        error.update(budget=e.budget, model=e.model, limit=e.limit, spent=e.spent)
                    job.add(TrainEvent(kind="error", error=error))

            # Not tied to the request: a client that disconnects does not stop the step.
            job.task = asyncio.create_task(run())
        return StreamingResponse(job.stream(), media_type="application/x-ndjson")

    async def answer(op: Operation[Any], request: Request, name: str | None) -> Any:
        """A Backend operation's route: the model its path names (unknown: 404, before the body is
        read), the arguments its body holds, the method called. A training call runs as a job named
        by its idempotency key, recording the caller's token as `trained_by`, and answers its stream."""
        if name is not None:
            _check_tenant(name)  # before the model is looked up: another tenant's gets no 404
        arguments: dict[str, Any] = {} if name is None else {"model": backend.registered_model(name)}
        body = None if op.body is None else await _body(request, op.body, max_body_bytes)
        if body is not None:
            arguments.update(body.arguments())
        if op is REGISTER:
            _check_tenant(arguments["model"].name)
            return await _register(backend, arguments["model"])
        _check_teacher(arguments)
        if "trained_by" in inspect.signature(op.declared).parameters:  # who asked: the caller's token
            arguments["trained_by"] = _token_name(request)
        if op.progress_unit is not None:
            assert name is not None and body is not None  # the training calls are a model's, with a body
            return start(
                (name, op.name, arguments["idempotency_key"]),
                await asyncio.to_thread(_body_sha256, body),
                lambda progress: op.call(backend, {**arguments, "on_progress": progress}),
            )
        return await op.call(backend, arguments)

    if routes is not None:
        routes(app)
    for op in OPERATIONS:
        _add_route(app, op, answer)
    _document_bodies(app)
    return app


def _add_route(
    app: FastAPI, op: Operation[Any], answer: Callable[[Operation[Any], Request, str | None], Awaitable[Any]]
) -> None:
    """`op`'s route (FastAPI finds the path's `{name}` in the handler's parameters); its answer is
    documented as the operation's response, except a training call's event stream."""

    async def about_a_model(name: str, request: Request) -> Any:
        return await answer(op, request, name)

    async def top_level(request: Request) -> Any:
        return await answer(op, request, None)

    app.add_api_route(
        PREFIX + op.path,
        about_a_model if op.per_model else top_level,
        methods=[op.http],
        name=op.name,
        response_model=None if op.progress_unit is not None else op.response,
    )


async def _register(backend: ServedBackend, model: ModelConfig) -> Registered:
    _check_registry(backend, model)  # before loading anything: a name lives in one project
    await backend.register(model)
    log.info("registered %s/%s (base %s)", model.project, model.name, model.base_model)
    _remember(backend, model)
    return Registered(run_dir=str(backend.run_dir(model)))


def _document_bodies(app: FastAPI) -> None:
    """Publish each route's request body in /openapi.json: the routes read raw bodies (gzip, the
    OpenAI routes' lenient parsing), so FastAPI cannot see them; clients and schema fuzzers can."""
    from pydantic.json_schema import models_json_schema

    from journeyman.serving.endpoint import ChatCompletionRequest
    from journeyman.serving.messages_api import MessagesRequest

    bodies: dict[str, type[BaseModel]] = {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/messages": MessagesRequest,
        f"{PREFIX}/tokens": NewTokenBody,
        **{PREFIX + op.path: op.body for op in OPERATIONS if op.body is not None},
    }
    responses = {
        "type": "object",
        "required": ["model", "input"],
        "properties": {"model": {"type": "string"}},
    }
    made = FastAPI.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = made(app)
        refs, defs = models_json_schema(
            [*((m, "validation") for m in bodies.values()), (TrainEvent, "serialization")],
            ref_template="#/components/schemas/{model}",
        )
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        # every route stands behind the Guard: a bearer token, or Anthropic's header on any route
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        doc["security"] = [{"bearer": []}, {"x-api-key": []}]
        doc["info"]["description"] = PROTOCOL_DOC
        for path, m in [*bodies.items(), ("/v1/responses", None)]:
            schema = responses if m is None else refs[(m, "validation")]
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema}},
            }
        doc["components"]["schemas"]["Error"] = _ERROR_SCHEMA
        for path, methods in doc["paths"].items():
            for method, op in methods.items():
                _document_answers(path, method, op, refs[(TrainEvent, "serialization")])
        return doc

    app.openapi = openapi  # pyright: ignore[reportAttributeAccessIssue]


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An error: OpenAI's shape ({error: {message, type, param}}) on every route but "
    "/v1/messages, whose errors are Anthropic's ({type: 'error', error: {type, message}})",
    "properties": {
        "type": {"type": "string"},
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"], "description": "the field that was wrong"},
            },
            "required": ["message", "type"],
        },
    },
    "required": ["error"],
}
_ERRORS = {
    "400": "a field is wrong: `param` (and the message) names it",
    "401": "no token, or not one this server knows",
    "403": "the token's scope does not allow this route, or the token is scoped to other models "
    "(the message names the model and the token)",
    "404": "the model the path or body names is not registered",
    "413": "the body is over the server's limit",
    "503": "the server is draining after SIGTERM (`Retry-After`: when to call again), or an engine is down",
}


def _document_answers(path: str, method: str, op: dict[str, Any], event: dict[str, Any]) -> None:
    """The errors a route answers (the Guard's and the routes' own, never FastAPI's 422: every
    body is read raw), its scope (`x-journeyman-scope`), and a training call's event stream."""
    answers = op.setdefault("responses", {})
    answers.pop("422", None)
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for status, why in _ERRORS.items():
        if status != "404" or "{name}" in path or path.startswith("/v1/"):
            answers[status] = {"description": why, **error}
    op["x-journeyman-scope"] = needed_scope(path)
    if path.endswith(("/train", "/train_sft")):
        answers["200"] = {
            "description": "newline-delimited TrainEvent JSON: progress lines (one at least every 15 s), "
            "then one `result` or `error` line. Retried with the same idempotency_key and body, it "
            "reattaches (a key is scoped to the model and the operation).",
            "content": {"application/x-ndjson": {"schema": event}},
        }
        answers["409"] = {
            "description": "the idempotency_key names another call (another body) that runs or ran under it; "
            "one found only in the run directory is the stream's error event IdempotencyKeyReusedError",
            **error,
        }


PROTOCOL_DOC = (
    f"`journeyman serve`: the Backend protocol (version {PROTOCOL_VERSION}) under `{PREFIX}/`, and each "
    "registered model's OpenAI-compatible (`/v1/chat/completions`, `/v1/responses`, `/v1/models`) and "
    "Anthropic (`/v1/messages`) routes. Every route needs a token (`Authorization: Bearer <token>` or "
    "`x-api-key: <token>`) of a scope that allows it: sample < train < admin. A request carrying "
    "`x-journeyman-capture: <id>` is filed under that id for `POST .../captures`. Training routes answer "
    "newline-delimited TrainEvent JSON. See docs/protocol.md."
)


def _token_name(request: Request) -> str | None:
    return request.scope.get("state", {}).get("token")


def _body_sha256(body: BaseModel) -> str:
    """A body's digest as parsed (its JSON's spacing and compression do not count)."""
    return hashlib.sha256(body.model_dump_json().encode()).hexdigest()


class _PerToken:
    """ASGI: each request is answered for its API token (the Guard's `state.token`): the captures it
    files, pops and reports outcomes for are that token's own (`rollout/capture.py`), and a token
    scoped to models sees theirs alone (`_CALLER`, `_check_tenant`), in the viewer too: a run's pages
    and data are its model's, and the list of runs is cut to the caller's."""

    def __init__(self, app: Any, book: TokenBook) -> None:
        self.app, self.book = app, book

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        name = scope.get("state", {}).get("token")
        caller = None if name is None else next((t for t in self.book.tokens() if t.name == name), None)
        reset = _CALLER.set(caller)
        try:
            with owned_by(name):
                if caller is not None and caller.models is not None and scope["type"] == "http":
                    return await self._viewer(scope, receive, send)
                await self.app(scope, receive, send)
        finally:
            _CALLER.reset(reset)

    async def _viewer(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A scoped caller's request, the viewer's API checked (its runs are named by id, not model)."""
        parts = [p for p in scope["path"].split("/") if p]
        if parts[:3] != [VIEW_PREFIX.strip("/"), "api", "runs"]:
            return await self.app(scope, receive, send)
        if len(parts) > 3:
            # the viewer's own ids, resolved by the viewer (`app/view/mount.py`, which set it)
            run_model = getattr(scope["app"].state, "view_run_model", None)
            if run_model is None:  # no viewer on this server: its 404
                return await self.app(scope, receive, send)
            try:
                model = await asyncio.to_thread(run_model, parts[3])
            except InvalidFieldError:  # no such run: the viewer's own 404
                return await self.app(scope, receive, send)
            try:
                _check_tenant(model)  # a run directory is named after its model
            except ModelForbiddenError as e:
                response = error_dialect(scope["path"])(
                    403, str(e), "model", kind="forbidden", model=e.model, token=e.token
                )
                return await response(scope, receive, send)
            return await self.app(scope, receive, send)
        await _filtered_runs(self.app, scope, receive, send)


async def _filtered_runs(app: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The viewer's list of runs, cut to those of the caller's models (the answer is buffered: a
    list of summaries)."""
    start: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def keep(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, keep)
    body = b"".join(chunks)
    if start.get("status") == 200:
        runs = json.loads(body)
        body = json.dumps([r for r in runs if _visible([r["name"]])]).encode()
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _forget_finished(jobs: dict[JobName, TrainJob]) -> None:
    """Keep at most MAX_FINISHED_JOBS finished jobs in memory (oldest go first): an older key's retry
    is answered from the run directory, where every committed key's result is kept."""
    finished = [k for k, j in jobs.items() if j.finished]
    for k in finished[: max(0, len(finished) - MAX_FINISHED_JOBS + 1)]:
        del jobs[k]


def _registry(backend: ServedBackend) -> Path:
    return RunRoot(backend.path).server_models


def _check_registry(backend: ServedBackend, model: ModelConfig) -> None:
    """Refuse a name the server already serves under another project (it would re-point the
    registry, orphaning the first run after a restart)."""
    path = _registry(backend)
    known = json.loads(path.read_text()) if path.exists() else {}
    project = (known.get(model.name) or {}).get("project")
    if project is not None and project != model.project:
        raise InvalidFieldError(
            "model.project",
            model.project,
            f"the model {model.name!r} is registered on this server under project {project!r}; "
            "a name lives in one project: pick another name",
        )


def _remember(backend: ServedBackend, model: ModelConfig) -> None:
    """Models the server serves, kept on disk so a restarted server serves them again unasked."""
    path = _registry(backend)
    known = json.loads(path.read_text()) if path.exists() else {}
    known[model.name] = model.model_dump(mode="json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, path)


async def restore(backend: ServedBackend) -> list[str]:
    """Register every model the server served before it stopped (each resumes its run directory)."""
    path = _registry(backend)
    known = json.loads(path.read_text()) if path.exists() else {}
    for raw in known.values():
        model = ModelConfig.model_validate(raw)
        await backend.register(model)
    return list(known)


def serve(
    backend: ServedBackend,
    token: str,
    *,
    host: str = "127.0.0.1",
    port: int = 7800,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_ready: Callable[[str], None] | None = None,
    ssl_certfile: str | Path | None = None,
    ssl_keyfile: str | Path | None = None,
    routes: Callable[[FastAPI], None] | None = None,
    otel: OtelSettings | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT (uvicorn, this thread); models registered before a restart are
    registered again by their clients and resume from the run directory. SIGTERM drains first
    (`serving/drain.py`): new requests get 503, those in flight and a training step under way finish.

    `token` is the admin token; more, with scopes, live in `<backend.path>/tokens.json`
    (`journeyman token add`). With `ssl_certfile` and `ssl_keyfile` the server speaks HTTPS itself.
    With `otel` the `/metrics` series are also pushed to an OpenTelemetry collector (`backends/otel.py`)."""
    import uvicorn

    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise InvalidFieldError("ssl_keyfile", ssl_keyfile, "TLS needs both a certificate and its key")
    book = TokenBook(RunRoot(backend.path).tokens, admin_secret=token)
    routed = create_app(backend, book, max_body_bytes=max_body_bytes, routes=routes)
    app = Drain(Guard(routed, book, max_body_bytes))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_keep_alive=30,
        http=HeaderTimeoutH11,
        ssl_certfile=None if ssl_certfile is None else str(ssl_certfile),
        ssl_keyfile=None if ssl_keyfile is None else str(ssl_keyfile),
    )
    jobs: dict[JobName, TrainJob] = routed.state.train_jobs
    server = DrainingServer(
        config, app, lambda: [j.task for j in jobs.values() if j.task and not j.task.done()]
    )
    scheme = "https" if ssl_certfile is not None else "http"

    async def main() -> None:
        restored = await restore(backend)
        if restored:
            log.warning("resumed %s from %s", ", ".join(restored), backend.path)
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started and on_ready is not None:
            on_ready(f"{scheme}://{host}:{port}")
        await task

    export = None
    if otel is not None:
        export = OtelExport(routed.state.metrics.registry, otel.endpoint, interval_s=otel.interval_s).start()
        log.info(
            "exporting metrics to %s every %g s (OpenTelemetry, from %s)",
            otel.endpoint,
            otel.interval_s,
            otel.source,
        )
    try:
        asyncio.run(main())
    finally:
        if export is not None:
            export.close()  # one last export, bounded by its timeout
        backend.close()


class ServerProcess:
    """`journeyman serve` as a child process on 127.0.0.1 (tests, benchmarks, a notebook's own GPU
    box): `start()` returns once it answers, `terminate()` stops it as a process manager does (SIGTERM:
    it drains), `kill()` SIGKILLs its process group."""

    def __init__(
        self, path: str | Path, token: str, *, port: int | None = None, args: Sequence[str] = ()
    ) -> None:
        self.path, self.token = Path(path), token
        self.port = port or _free_port()
        scheme = "https" if "--ssl-certfile" in args else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.args = list(args)
        self.proc: subprocess.Popen[str] | None = None
        self.log: deque[str] = deque(maxlen=200)  # the server's latest stderr lines

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        env = {**os.environ, "JOURNEYMAN_TOKEN": self.token, "HF_HUB_OFFLINE": "1"}
        cmd = [
            sys.executable,
            "-m",
            "journeyman.app.cli",
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
                # read on: a full pipe would block the server at its next log line
                threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()
                return self
            if not line and self.proc.poll() is not None:
                break
        self.kill()
        raise BackendUnavailableError("journeyman serve did not start:\n" + "".join(lines[-30:]))

    def _drain(self, stderr: IO[str]) -> None:
        for line in stderr:
            self.log.append(line)

    def terminate(self, timeout_s: float = 600.0) -> int:
        """SIGTERM, as a process manager stops it (the server drains first); its exit status."""
        assert self.proc is not None, "start() it first"
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "Guard",
    "HeaderTimeoutH11",
    "ServerProcess",
    "create_app",
    "needed_scope",
    "serve",
]
