"""The door of every HTTP server Journeyman runs: tokens with scopes, bodies capped as read, deadlines
for a request's head and body. `journeyman serve` and each model's own endpoint (LocalBackend) both
stand behind it, so nothing that serves a model answers without a token.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode

import h11
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from journeyman.client.operations import OPERATIONS
from journeyman.client.wire import PREFIX
from journeyman.serving.api_tokens import ApiToken, Scope, TokenBook, allows

ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[..., Awaitable[None]]], Awaitable[None]
]

DEFAULT_MAX_BODY_BYTES = 64 * 2**20


def json_error(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", **extra: Any
) -> JSONResponse:
    error = {"message": message, "type": kind, "param": param, **extra}
    return JSONResponse(status_code=status, content={"error": error})


HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0

# What each route needs (scopes nest: sample < train < admin), by the last segment of its path: the
# Backend operations' as their table says; `info` needs `sample`, token admin `admin`, as do routes
# nobody listed. The OpenAI routes and the docs need `sample`.
ROUTE_SCOPES: dict[str, Scope] = {op.route: op.scope for op in OPERATIONS}
ROUTE_SCOPES.update(info="sample", tokens="admin")
_TOP_LEVEL = {"info", "tokens"} | {op.route for op in OPERATIONS if not op.per_model}  # not under models/
_PER_MODEL_ADMIN = {op.route for op in OPERATIONS if op.per_model and op.scope == "admin"}


VIEW_PREFIX = "/view"
VIEW_COOKIE = "journeyman_view"  # holds a viewer session's id, never an API token
_OLD_VIEW_COOKIE = "journeyman_token"  # held the API token itself until issue 53: cleared on sight
VIEW_SESSION_IDLE_S = 12 * 3600  # a viewer session ends 12 h after its last request (sliding) ...
VIEW_SESSION_MAX_S = 24 * 3600  # ... and 24 h after it opened, however busy (the cookie's Max-Age)
MAX_VIEW_SESSIONS = 1024  # in memory; past this the least recently used ends (each `?token=` opens one)


def needed_scope(path: str, token: ApiToken | None = None) -> Scope:
    """The scope a request to `path` needs (from `token`, when given).

    A token scoped to models (a tenant's) is their admin as far as their runs go: a model's route
    that needs `admin` (`delete_checkpoints`) needs `train` of it, and the app's tenant rule then
    refuses any model not in its list by name (a 403 naming the model, never the scope)."""
    if path == VIEW_PREFIX or path.startswith(VIEW_PREFIX + "/"):
        return "train"  # the viewer shows every model's trajectories: more than sampling needs
    if not path.startswith(PREFIX + "/"):
        return "sample"  # the OpenAI routes, /docs, /openapi.json
    parts = path[len(PREFIX) + 1 :].split("/")
    op = parts[0] if parts[0] in _TOP_LEVEL else parts[-1]
    needed = ROUTE_SCOPES.get(op, "admin")
    if needed == "admin" and token is not None and token.models is not None and op in _PER_MODEL_ADMIN:
        return "train"
    return needed


@dataclass
class _ViewSession:
    token_sha256: str  # the API token it stands for, by digest: a revoked token ends it
    opened: float  # time.monotonic()
    seen: float


class ViewSessions:
    """The viewer's browser sessions, in memory: they end with the process.

    A browser cannot send a bearer header when it follows a link, so the viewer's pages take the API
    token once as `?token=` and answer with a session id in a cookie. Cookies are not port-scoped: a
    page on any other port of the host receives it (`<img src="/view/x">`). So the id is random (256
    bits), never the token; it opens the viewer's read-only pages only, for `VIEW_SESSION_IDLE_S` after
    its last use and `VIEW_SESSION_MAX_S` at most, and ends when its token is revoked.
    """

    def __init__(
        self,
        idle_s: float = VIEW_SESSION_IDLE_S,
        max_s: float = VIEW_SESSION_MAX_S,
        max_sessions: int = MAX_VIEW_SESSIONS,
    ) -> None:
        self.idle_s, self.max_s, self.max_sessions = idle_s, max_s, max_sessions
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _ViewSession] = OrderedDict()  # by the id's sha256, oldest use first

    def open(self, token: ApiToken) -> str:
        """A new session for `token`; returns its id (for the cookie)."""
        session_id = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            self._sessions[_sha256(session_id)] = _ViewSession(token.sha256, now, now)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return session_id

    def token(self, session_id: str, tokens: TokenBook) -> ApiToken | None:
        """The token a live session stands for (its idle time restarts), or None."""
        key, now = _sha256(session_id), time.monotonic()
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            token = next((t for t in tokens.tokens() if t.sha256 == session.token_sha256), None)
            if token is None or now - session.seen > self.idle_s or now - session.opened > self.max_s:
                del self._sessions[key]
                return None
            session.seen = now
            self._sessions.move_to_end(key)
            return token

    def __len__(self) -> int:
        return len(self._sessions)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Guard:
    """ASGI middleware in front of everything the server answers.

    The bearer token (or, as Anthropic's SDKs send it, `x-api-key`) on every request (401), its scope against the route (403); a body read whole
    here, counted as it arrives whatever its framing (a declared Content-Length beside chunked
    transfer is refused outright: a request smuggling shape), capped (413) and with an idle timeout
    between its chunks (408). The app gets the token's name in `request.state.token`. The viewer's
    pages (`/view/`) also take a session of `view_sessions` from a same-origin request's cookie.
    """

    def __init__(
        self,
        app: ASGIApp,
        tokens: TokenBook | str,
        max_body_bytes: int,
        *,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.tokens = token_book(tokens)
        self.max = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.view_sessions = ViewSessions()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = error_dialect(scope["path"])
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers") or []:
            if k in headers and k in (
                b"authorization",
                b"x-api-key",
                b"content-length",
                b"transfer-encoding",
            ):
                return await error(400, f"duplicate {k.decode()} header", kind="bad_request")(
                    scope, receive, send
                )
            headers[k] = v
        auth = headers.get(b"authorization", b"")
        secret = auth[7:] if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key")  # Anthropic's SDKs
        token = self.tokens.lookup(secret.decode("latin-1")) if secret is not None else None
        if token is None and _is_view(scope["path"]):
            query_secret = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
            if query_secret:  # once: a session opens, the token leaves the address bar
                token = self.tokens.lookup(query_secret[-1])
                if token is not None and allows(token.scope, needed_scope(scope["path"])):
                    return await _open_view_session(scope, send, self.view_sessions.open(token))
            elif _same_origin(headers):
                session_id = _cookie(headers, VIEW_COOKIE)
                token = self.view_sessions.token(session_id, self.tokens) if session_id else None
            if token is None:
                return await error(
                    401,
                    f"open {VIEW_PREFIX}/?token=<an API token of scope train> to start a viewer session",
                    kind="unauthorized",
                )(scope, receive, send)
        if token is None:
            return await error(401, "unauthorized", kind="unauthorized")(scope, receive, send)
        needed = needed_scope(scope["path"], token)
        if not allows(token.scope, needed):
            return await error(
                403,
                f"this route needs a token of scope {needed!r}; this one is {token.scope!r}",
                kind="forbidden",
            )(scope, receive, send)
        scope.setdefault("state", {})["token"] = token.name
        if b"content-length" in headers and b"transfer-encoding" in headers:
            return await error(
                400, "Content-Length and Transfer-Encoding together are refused", kind="bad_request"
            )(scope, receive, send)
        too_large = error(
            413, f"request body over the server's limit of {self.max} bytes (journeyman serve --max-body-mb)"
        )
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max):
            return await too_large(scope, receive, send)
        messages: list[dict[str, Any]] = []
        seen = 0
        while True:  # the body, whole, before the app runs: counted as read, not as declared
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                return await error(
                    408, f"no body bytes for {self.body_timeout_s:g} s", kind="request_timeout"
                )(scope, receive, send)
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


def _is_view(path: str) -> bool:
    return path == VIEW_PREFIX or path.startswith(VIEW_PREFIX + "/")


def _same_origin(headers: dict[bytes, bytes]) -> bool:
    """Whether the browser says the request comes from the viewer's own pages or the address bar. A
    page on another port of the host is same-site, not same-origin: its frames and fetches of the
    viewer get no session (a client that sends no `Sec-Fetch-Site` is no browser page)."""
    return headers.get(b"sec-fetch-site", b"same-origin") in (b"same-origin", b"none")


def _cookie(headers: dict[bytes, bytes], name: str) -> str:
    cookies = SimpleCookie()
    try:
        cookies.load(headers.get(b"cookie", b"").decode("latin-1"))
    except CookieError:
        return ""
    morsel = cookies.get(name)
    return morsel.value if morsel is not None else ""


async def _open_view_session(scope: dict[str, Any], send: Any, session_id: str) -> None:
    """303 to the same page without `?token=`, the session's id in an HttpOnly, strictly same-site
    cookie for the viewer's paths (and the old cookie that held a token, cleared)."""
    query = [(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1")) if k != "token"]
    location = scope["path"] + ("?" + urlencode(query) if query else "")
    secure = "; Secure" if scope.get("scheme") == "https" else ""
    attrs = f"Path={VIEW_PREFIX}; HttpOnly; SameSite=Strict{secure}"
    cookies = [
        f"{VIEW_COOKIE}={session_id}; Max-Age={VIEW_SESSION_MAX_S}; {attrs}",
        f"{_OLD_VIEW_COOKIE}=; Max-Age=0; {attrs}",
    ]
    await send(
        {
            "type": "http.response.start",
            "status": 303,
            "headers": [
                (b"location", location.encode("latin-1")),
                *((b"set-cookie", c.encode("latin-1")) for c in cookies),
                (b"cache-control", b"no-store"),
                (b"referrer-policy", b"no-referrer"),
                (b"content-length", b"0"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b""})


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's head: a connection that has not sent
    complete headers `HEADER_TIMEOUT_S` after it opened (or after its last response, on top of the
    keep-alive wait) is closed, authenticated or not (uvicorn alone waits forever: slowloris)."""

    header_timeout_s = HEADER_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.timeout_keep_alive + self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, after_s: float) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(after_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def error_dialect(path: str) -> Callable[..., JSONResponse]:
    """How the route at `path` shapes an error: Anthropic's for `/v1/messages`, else OpenAI's."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        from journeyman.serving.messages_api import anthropic_error

        return lambda status, message, param=None, kind="", **_: anthropic_error(status, message, param, kind)
    return json_error


def token_book(tokens: TokenBook | str) -> TokenBook:
    return tokens if isinstance(tokens, TokenBook) else TokenBook(admin_secret=tokens)


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_VIEW_SESSIONS",
    "ROUTE_SCOPES",
    "VIEW_COOKIE",
    "VIEW_PREFIX",
    "VIEW_SESSION_IDLE_S",
    "VIEW_SESSION_MAX_S",
    "Guard",
    "HeaderTimeoutH11",
    "ViewSessions",
    "error_dialect",
    "json_error",
    "needed_scope",
    "token_book",
]
