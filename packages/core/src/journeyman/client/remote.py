"""RemoteBackend: the Backend protocol as a client of `journeyman serve` on another machine.

    backend = jm.RemoteBackend("http://gpu-box:7800", token=os.environ["JOURNEYMAN_TOKEN"])
    await model.register(backend)      # the same TrainableModel, rollouts and integrations as locally
    client = model.openai_client()     # inference goes to the server; token records come back

Every call has a timeout. Only what can recover is retried, for up to `reconnect_s`: a connection
refused or dropped after the server has answered once (a server being restarted), with backoff, and
a 503 with `Retry-After` (a server draining before a restart), after the time it asks; then
`BackendUnavailableError`. A first contact that nothing answers fails at once, naming the URL: a
wrong port or a server never started does not come back by waiting. Training is safe to
retry: each call carries an idempotency key, the server keeps running a step whose client went
away, and the client reattaches to it (or, after a server restart, gets the completed step's
result or trains it exactly once). Calls that are not idempotent (popping captures, logging) are
retried only when the request never reached the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

import journeyman.errors as errors
from journeyman.client.operations import (
    CHARGE,
    DECIDE,
    DELETE_CHECKPOINTS,
    GET_STEP,
    HISTORY,
    LIVE,
    LIVE_STATUS,
    LOG,
    POP_CAPTURES,
    REGISTER,
    REPORT_OUTCOME,
    SERVE_STEP,
    TRAIN,
    TRAIN_SFT,
    Operation,
)
from journeyman.client.protocol import Inference, Progress, named_or_latest
from journeyman.client.wire import PREFIX, PROTOCOL_VERSION, Registered, ServerInfo, TrainEvent, gzip_json
from journeyman.data.budget import BudgetExceededError
from journeyman.data.config import ModelConfig, TrainResult
from journeyman.errors import (
    AuthenticationError,
    BackendUnavailableError,
    IdempotencyKeyReusedError,
    InvalidFieldError,
    ProtocolMismatchError,
    RemoteError,
    UnknownModelError,
)

log = logging.getLogger("journeyman")


class _RetryAfter(Exception):
    """A 503 with `Retry-After`: the server asks to be called again in `delay` seconds."""

    def __init__(self, delay: float, response: httpx.Response) -> None:
        self.delay, self.response = delay, response
        super().__init__(f"503, Retry-After: {delay:g} s")


def _retry_after(r: httpx.Response) -> None:
    """Raise `_RetryAfter` for a 503 that says when to come back; any other answer is the caller's."""
    if r.status_code == 503 and (after := r.headers.get("retry-after", "")).strip().isdigit():
        raise _RetryAfter(float(after), r)


class _Shown:
    """A value as the server printed it (its repr), carried into a client-side error."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _field_error(err: dict[str, Any]) -> InvalidFieldError:
    """The server's InvalidFieldError again, as the subclass it raised where that one keeps the
    base's (field, value, reason) (NoLearningSignalError, NoTrainableTokensError), by its name."""
    found = getattr(errors, str(err.get("type")), None)
    cls = InvalidFieldError
    if isinstance(found, type) and issubclass(found, InvalidFieldError):
        cls = found if found.__init__ is InvalidFieldError.__init__ else InvalidFieldError
    return cls(
        str(err["param"]), _Shown(str(err.get("value", "..."))), str(err.get("reason") or err.get("message"))
    )


def _raise_budget(err: dict[str, Any]) -> None:
    """A server's refusal over a budget (a 402, or a train stream's error) as `BudgetExceededError`."""
    if "budget" in err and "limit" in err and "spent" in err:
        raise BudgetExceededError(
            str(err.get("model", "?")), str(err["budget"]), float(err["limit"]), float(err["spent"])
        )


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
        """Run `attempt()` until it gets an answer. A 503 with Retry-After is asked again after that
        wait; a connection failure, with backoff (any transport failure when `any_failure`, i.e. the
        call is idempotent), once the server has answered before: on the first contact, a failed
        connection is final (nothing listens there, or the host is unknown or unreachable)."""
        deadline = time.monotonic() + self.reconnect_s
        backoff = 0.2
        retried = (httpx.TransportError,) if any_failure else (httpx.ConnectError, httpx.ConnectTimeout)
        while True:
            try:
                return await attempt()
            except _RetryAfter as e:
                if time.monotonic() + e.delay > deadline:
                    self._raise_for(e.response)
                log.info("%s is draining (503): asking again in %g s", self.url, e.delay)
                await asyncio.sleep(e.delay)
            except retried as e:
                if not self._checked and isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                    raise BackendUnavailableError(
                        f"nothing answers at {self.url} ({type(e).__name__}: {e or 'refused'}): is "
                        "`journeyman serve` running there, on that port? (start it, or fix url=)"
                    ) from e
                if time.monotonic() + backoff > deadline:
                    raise BackendUnavailableError(
                        f"{self.url} did not answer for {self.reconnect_s:.0f} s ({type(e).__name__}: {e}); "
                        "is `journeyman serve` running there?"
                    ) from e
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

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
        if r.status_code == 402:
            _raise_budget({**err, "budget": str(err.get("param", "budget.?")).removeprefix("budget.")})
        if r.status_code == 409 and err.get("type") == "idempotency_key_reused":
            raise IdempotencyKeyReusedError(
                "idempotency_key", _Shown(str(err.get("value", "..."))), str(err.get("reason", message))
            )
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
                r = await c.get(f"{PREFIX}/info")
            _retry_after(r)
            return r

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

    async def _send(self, op: Operation[Any], arguments: dict[str, Any]) -> Any:
        """One Backend call on the server (`arguments` as the protocol names them): its body sent,
        retried as the operation allows, its answer read as the method returns it."""
        if arguments.get("trained_by") is not None:
            raise InvalidFieldError(
                "trained_by",
                arguments["trained_by"],
                "the server records the name of the token that calls it",
            )
        if arguments.get("evaluate") is not None:
            raise InvalidFieldError(
                "evaluate",
                arguments["evaluate"],
                "an eval function runs in the server's process: give it to LocalBackend.live there, or "
                "evaluate name@<step> from here and `decide`",
            )
        body = op.body.of(arguments) if op.body is not None else None  # a bad argument fails here, named
        if not self._checked:
            await self._check_server()
        headers = {"content-type": "application/json"}
        content: bytes | None = None
        if body is not None and op.gzip:
            content = gzip_json(body)
            headers["content-encoding"] = "gzip"
            self.sent_bytes += len(content)
        elif body is not None:
            content = body.model_dump_json().encode()
        url = op.url(arguments["model"].name)
        if op.progress_unit is not None:
            desc = f"{op.name} {arguments['model'].name}"
            return await self._follow(
                url, content, headers, desc, op.progress_unit, arguments.get("on_progress")
            )

        async def attempt() -> httpx.Response:
            async with self._client() as c:
                r = await c.request(op.http, url, content=content, headers=headers)
            _retry_after(r)
            return r

        response = await self._retrying(attempt, any_failure=op.idempotent)
        self._raise_for(response)
        return op.answer(response.json())

    async def _follow(
        self,
        url: str,
        content: bytes | None,
        headers: dict[str, str],
        desc: str,
        unit: str,
        on_progress: Progress | None,
    ) -> TrainResult:
        """POST a training call and follow its event stream to the result, into a progress bar and
        `on_progress`. A dropped connection or a server restart is retried with the same body, and so
        the same idempotency key: the client reattaches to the step, which happens once."""
        from tqdm.auto import tqdm

        bar = tqdm(desc=desc, unit=unit, disable=not self.progress, leave=False)

        async def attempt() -> TrainResult:
            # The server sends an event at least every 15 s while a step runs: a silent minute is a dead link.
            async with (
                self._client(read_timeout=60.0) as c,
                c.stream("POST", url, content=content, headers=headers) as r,
            ):
                if r.status_code >= 400:
                    await r.aread()
                    _retry_after(r)
                    self._raise_for(r)
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    event = TrainEvent.model_validate_json(line)
                    if event.kind == "progress":
                        bar.total = event.total or None
                        bar.n = event.done
                        bar.refresh()
                        if on_progress is not None:
                            on_progress(event.done, event.total)
                    elif event.kind == "result" and event.result is not None:
                        return event.result
                    else:
                        err = event.error or {}
                        _raise_budget(err)
                        if err.get("param") is not None:
                            raise _field_error(err)
                        raise RemoteError(str(err.get("type", "error")), str(err.get("message", "")))
            raise httpx.RemoteProtocolError("the train stream ended before its result")

        try:
            result: TrainResult = await self._retrying(attempt, any_failure=True)
        finally:
            bar.close()
        if result.skipped:  # the server logged it there; the user is here
            log.warning("%s: step %d skipped: %s", desc, result.step, result.skip_reason)
        return result

    async def register(self, model: ModelConfig) -> None:
        registered: Registered = await self._send(REGISTER, {"model": model})
        self._run_dirs[model.name] = Path(registered.run_dir)

    def inference(self, model_name: str | None = None) -> Inference:
        model_name = named_or_latest(model_name, list(self._run_dirs))
        return Inference(base_url=f"{self.url}/v1", api_key=self._token, model=model_name)

    # The rest of the protocol, made from the operations table: each sends its arguments to the server.
    get_step = GET_STEP.forwarded_to(_send)
    train = TRAIN.forwarded_to(_send)
    train_sft = TRAIN_SFT.forwarded_to(_send)
    log = LOG.forwarded_to(_send)
    history = HISTORY.forwarded_to(_send)
    pop_captures = POP_CAPTURES.forwarded_to(_send)
    serve_step = SERVE_STEP.forwarded_to(_send)
    delete_checkpoints = DELETE_CHECKPOINTS.forwarded_to(_send)
    # live training (`LiveBackend`, docs/live.md)
    live = LIVE.forwarded_to(_send)
    report_outcome = REPORT_OUTCOME.forwarded_to(_send)
    live_status = LIVE_STATUS.forwarded_to(_send)
    decide = DECIDE.forwarded_to(_send)
    # what a judge cost (`MeteredBackend`)
    charge = CHARGE.forwarded_to(_send)

    def run_dir(self, model: ModelConfig) -> Path:
        """The run directory on the server's machine (as the server reported it at registration)."""
        try:
            return self._run_dirs[model.name]
        except KeyError:
            raise UnknownModelError(model.name, sorted(self._run_dirs)) from None

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own connection."""


__all__ = ["RemoteBackend"]
