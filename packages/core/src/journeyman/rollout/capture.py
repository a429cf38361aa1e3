"""Per-request capture of what the endpoint served, addressable by a capture id.

Frameworks such as LangChain and the Agents SDK drop the extra fields a completion carries, so the
token records must also be reachable another way: a client marks its requests with the header
`x-journeyman-capture: <id>` (the `capture()` context does this through a ContextVar, so concurrent
episodes never mix), and the endpoint files every completion it serves under that id.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, Field

CAPTURE_HEADER = "x-journeyman-capture"

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("journeyman_capture", default=None)


class CapturedCall(BaseModel):
    """One served chat completion: the request as received and the response as sent."""

    request_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    response: dict[str, Any] = Field(description="the chat.completion body, records included")
    response_id: str | None = Field(
        default=None, description="the Responses API id (`resp_...`) when the call came through /v1/responses"
    )


class Captures:
    """Server side: calls filed by capture id, bounded so that ids nobody pops cannot grow memory.

    An id is dropped (counted in `dropped`) when `max_ids` newer ids are held, or when no call was
    filed under it for `max_age_s`: an episode still running keeps its id alive. The latest
    `max_ids` dropped ids are remembered (`was_dropped`), so a late outcome is told it expired.
    """

    def __init__(self, max_ids: int = 10_000, max_age_s: float = 3600.0) -> None:
        self._calls: OrderedDict[str, tuple[float, list[CapturedCall]]] = OrderedDict()  # oldest first
        self._dropped_ids: OrderedDict[str, None] = OrderedDict()
        self._in_flight: dict[str, int] = {}  # requests being answered, by capture id
        self._cancelled_ids: OrderedDict[str, None] = OrderedDict()  # the latest `max_ids`, see `cancel`
        self._lock = threading.Lock()
        self._max = max_ids
        self.max_age_s = max_age_s
        self.dropped = 0

    def add(self, capture_id: str, call: CapturedCall) -> None:
        now = time.monotonic()
        with self._lock:
            _, calls = self._calls.pop(capture_id, (now, []))
            calls.append(call)
            self._calls[capture_id] = (now, calls)
            self._expire(now)

    def expire(self) -> int:
        """Drop the ids past `max_age_s` now (`add` does it too); returns `dropped`."""
        with self._lock:
            self._expire(time.monotonic())
            return self.dropped

    def _expire(self, now: float) -> None:
        while self._calls and (
            len(self._calls) > self._max or next(iter(self._calls.values()))[0] < now - self.max_age_s
        ):
            cid, _ = self._calls.popitem(last=False)
            self.dropped += 1
            self._dropped_ids[cid] = None
            while len(self._dropped_ids) > self._max:
                self._dropped_ids.popitem(last=False)

    @contextlib.contextmanager
    def answering(self, capture_id: str | None) -> Iterator[None]:
        """Count a request under `capture_id` as in flight while it is answered (`in_flight`)."""
        if capture_id is None:
            yield
            return
        with self._lock:
            self._in_flight[capture_id] = self._in_flight.get(capture_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._in_flight.pop(capture_id) - 1
                if left:
                    self._in_flight[capture_id] = left

    def in_flight(self, capture_id: str) -> bool:
        """Whether a request under `capture_id` is being answered now (its call is filed when it ends)."""
        with self._lock:
            return capture_id in self._in_flight

    def cancel(self, capture_id: str) -> None:
        """A request under `capture_id` was cancelled (its client left): nothing of it is filed, and
        `was_cancelled` tells an outcome that came for it why it finds no call."""
        with self._lock:
            self._cancelled_ids[capture_id] = None
            while len(self._cancelled_ids) > self._max:
                self._cancelled_ids.popitem(last=False)

    def was_cancelled(self, capture_id: str) -> bool:
        with self._lock:
            return capture_id in self._cancelled_ids

    def pop(self, capture_id: str) -> list[CapturedCall]:
        with self._lock:
            return self._calls.pop(capture_id, (0.0, []))[1]

    def last_call(self, capture_id: str) -> float | None:
        """When (time.monotonic) the latest call under `capture_id` was filed; None: none is held."""
        with self._lock:
            held = self._calls.get(capture_id)
            return None if held is None else held[0]

    def was_dropped(self, capture_id: str) -> bool:
        with self._lock:
            return capture_id in self._dropped_ids

    def __len__(self) -> int:
        return len(self._calls)


def current_capture_id() -> str | None:
    return _current.get()


@contextlib.contextmanager
def capture_scope(capture_id: str | None = None) -> Iterator[str]:
    """Mark every request made in this context (task) with a fresh capture id."""
    cid = capture_id or uuid.uuid4().hex
    token = _current.set(cid)
    try:
        yield cid
    finally:
        _current.reset(token)


async def add_capture_header(request: Any) -> None:
    """httpx request hook: stamp the current capture id on outgoing requests."""
    cid = _current.get()
    if cid is not None:
        request.headers[CAPTURE_HEADER] = cid


__all__ = ["CAPTURE_HEADER", "CapturedCall", "add_capture_header", "capture_scope", "current_capture_id"]
