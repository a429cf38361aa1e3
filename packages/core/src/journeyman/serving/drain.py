"""How `journeyman serve` stops: on SIGTERM it drains instead of dropping what it holds.

Kubernetes, systemd and docker stop a process with SIGTERM and kill it a grace period later (30 s
by default on Kubernetes). uvicorn alone stopped listening at once (new clients got a refused
connection, not an answer), waited without bound for open connections, then raised the signal
again, so the process died before the backend was closed. Draining instead:

1. every new request is answered 503 with `Retry-After: RETRY_AFTER_S` and `Connection: close`
   (the port still answers, so a client or a load balancer learns to come back or go elsewhere);
2. requests in flight finish, up to `DRAIN_TIMEOUT_S`; those still running then are cancelled
   (their connections closed) when uvicorn shuts down;
3. a training step under way commits, up to `STEP_DRAIN_TIMEOUT_S`: cut off, its weights would be
   changed and unsaved (a step cut off by a kill is redone on restart: README, run directory);
4. the backend is closed and the process exits 0.

A second SIGTERM (or SIGINT) stops at once, cancelling what runs.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Collection
from types import FrameType
from typing import Any

import uvicorn

from journeyman.serving.guard import ASGIApp, error_dialect

log = logging.getLogger("journeyman.serving.drain")

DRAIN_TIMEOUT_S = 30.0
"""How long requests in flight at SIGTERM may run on (Kubernetes' default grace period)."""
STEP_DRAIN_TIMEOUT_S = 300.0
"""How long a training step under way at SIGTERM may run on to commit (a CPU step takes minutes)."""
SHUTDOWN_GRACE_S = 2
"""After the drain: uvicorn's wait for connections before it cancels their tasks."""
RETRY_AFTER_S = 5
"""What a 503 during the drain tells the client to wait (`Retry-After`, seconds)."""


class Drain:
    """ASGI middleware outside everything else: it counts the requests in flight, and once `start()`
    is called answers every new one 503 with `Retry-After`, in the route's own error shape."""

    def __init__(self, app: ASGIApp, *, retry_after_s: int = RETRY_AFTER_S) -> None:
        self.app = app
        self.retry_after_s = retry_after_s
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self.draining = True

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining:
            refused = error_dialect(scope["path"])(
                503, "the server is shutting down; retry against a server that runs", kind="unavailable"
            )
            refused.headers["retry-after"] = str(self.retry_after_s)
            refused.headers["connection"] = "close"
            return await refused(scope, receive, send)
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether every request in flight finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


async def wait_done(tasks: Collection[asyncio.Task[Any]], timeout_s: float) -> bool:
    """Whether `tasks` (training steps under way) all finished within `timeout_s`; never cancels them."""
    if not tasks:
        return True
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    return not pending


class DrainingServer(uvicorn.Server):
    """uvicorn's server that drains on the first SIGTERM (`Drain`), waiting also for the tasks
    `steps()` returns (the training calls under way), then shuts down as uvicorn does."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        steps: Callable[[], Collection[asyncio.Task[Any]]],
        *,
        timeout_s: float = DRAIN_TIMEOUT_S,
        step_timeout_s: float = STEP_DRAIN_TIMEOUT_S,
    ) -> None:
        config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S
        super().__init__(config)
        self.drain, self.steps = drain, steps
        self.timeout_s, self.step_timeout_s = timeout_s, step_timeout_s
        self._drain_task: asyncio.Task[None] | None = None
        self.drained_in_s: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining and not self.should_exit:
            self.drain.start()  # on_tick (every 0.1 s, on the loop) starts the wait
            return
        # a second signal: stop now; not captured, so uvicorn does not raise it again on the way
        # out and the backend is still closed
        self.should_exit = True
        self.force_exit = self.drain.draining

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        started = time.monotonic()
        steps = list(self.steps())
        log.warning(
            "SIGTERM: draining %d request(s) (up to %g s) and %d training call(s) (up to %g s)",
            self.drain.in_flight,
            self.timeout_s,
            len(steps),
            self.step_timeout_s,
        )
        idle, committed = await asyncio.gather(
            self.drain.wait_idle(self.timeout_s), wait_done(steps, self.step_timeout_s)
        )
        self.drained_in_s = time.monotonic() - started
        log.warning(
            "drained in %.1f s%s%s",
            self.drained_in_s,
            "" if idle else f"; {self.drain.in_flight} request(s) still running are cancelled",
            "" if committed else "; a training step still running is abandoned (redone on restart)",
        )
        self.should_exit = True


__all__ = [
    "DRAIN_TIMEOUT_S",
    "RETRY_AFTER_S",
    "SHUTDOWN_GRACE_S",
    "STEP_DRAIN_TIMEOUT_S",
    "Drain",
    "DrainingServer",
    "wait_done",
]
