"""Per-request capture of what the endpoint served, addressable by a capture id.

Frameworks such as LangChain and the Agents SDK drop the extra fields a completion carries, so the
token records must also be reachable another way: a client marks its requests with the header
`x-journeyman-capture: <id>` (the `capture()` context does this through a ContextVar, so concurrent
episodes never mix), and the endpoint files every completion it serves under that id.

A capture belongs to the API token whose requests made it: `journeyman serve` answers each request
inside `owned_by(<token name>)`, and `capture_key` files and finds an id under that token, so one
token's `captures` pop and outcomes never see (or take) another token's calls, whatever ids they
send. In process (no token) an id is its own key. Captures live in one model's endpoint: a model's
captures are its own too.

Under live training the calls held are journaled (`Captures.keep_on_disk`): each call filed is
appended to a file as it is filed, each take and drop too, and a restarted server files again what
the file holds. An episode whose outcome has not come yet survives `kill -9` of the server; its
outcome, posted after the restart, finds its calls. Each line is flushed to the operating system
before the call's answer is sent (a process that dies loses nothing; a machine that loses power may
lose the last lines, which the outcomes journal, fsynced, does not).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, overload

from pydantic import BaseModel, Field

from journeyman.errors import InvalidFieldError

CAPTURE_HEADER = "x-journeyman-capture"

MAX_CAPTURE_IDS = 10_000  # capture ids an endpoint holds; past it the least recently filed is dropped
CAPTURE_MAX_AGE_S = 3600.0  # a capture id with no call filed for this long is dropped (live: episode_ttl_s)
MAX_CAPTURE_ID_CHARS = 256  # characters of an `x-journeyman-capture` id (400 past it, before sampling)
MAX_CALLS_PER_CAPTURE = 1024  # calls one capture id holds until popped (400 past it, before sampling)
COMPACT_LINES = 10_000  # journal lines (`keep_on_disk`) past which takes and drops are compacted away

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("journeyman_capture", default=None)
# the name of the API token whose request is being answered (`journeyman serve`); None in process
_owner: contextvars.ContextVar[str | None] = contextvars.ContextVar("journeyman_capture_owner", default=None)


@contextlib.contextmanager
def owned_by(token_name: str | None) -> Iterator[None]:
    """Answer what runs in this context (a request) for the API token `token_name`: its captures
    are filed and found under that token (`capture_key`)."""
    token = _owner.set(token_name)
    try:
        yield
    finally:
        _owner.reset(token)


@overload
def capture_key(capture_id: str) -> str: ...
@overload
def capture_key(capture_id: None) -> None: ...
def capture_key(capture_id: str | None) -> str | None:
    """The key `capture_id` is filed and found under for the caller: `<token name>/<id>` while an API
    token's request is answered (`owned_by`; a token name has no '/', so two tokens' ids never meet),
    the id itself in process. An id longer than MAX_CAPTURE_ID_CHARS is refused, naming the header."""
    if not capture_id:
        return capture_id
    if len(capture_id) > MAX_CAPTURE_ID_CHARS:
        raise InvalidFieldError(
            CAPTURE_HEADER,
            capture_id,
            f"is {len(capture_id)} characters: a capture id has at most {MAX_CAPTURE_ID_CHARS} "
            "(MAX_CAPTURE_ID_CHARS)",
        )
    owner = _owner.get()
    return capture_id if owner is None else f"{owner}/{capture_id}"


class CapturedCall(BaseModel):
    """One served chat completion: the request as received and the response as sent."""

    request_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    response: dict[str, Any] = Field(description="the chat.completion body, records included")
    response_id: str | None = Field(
        default=None, description="the Responses API id (`resp_...`) when the call came through /v1/responses"
    )


class Captures:
    """Server side: calls filed by capture id (the key `capture_key` makes of it), bounded so that
    ids nobody pops cannot grow memory.

    An id is dropped (counted in `dropped`) when `max_ids` newer ids are held, or when no call was
    filed under it for `max_age_s`: an episode still running keeps its id alive. The latest
    `max_ids` dropped ids are remembered (`was_dropped`), so a late outcome is told it expired. One
    id holds at most MAX_CALLS_PER_CAPTURE calls: a request past it is refused before it is sampled
    (`answering`), and the calls held stay.
    """

    def __init__(self, max_ids: int = MAX_CAPTURE_IDS, max_age_s: float = CAPTURE_MAX_AGE_S) -> None:
        self._calls: OrderedDict[str, tuple[float, list[CapturedCall]]] = OrderedDict()  # oldest first
        self._dropped_ids: OrderedDict[str, None] = OrderedDict()
        self._in_flight: dict[str, int] = {}  # requests being answered, by capture id
        self._cancelled_ids: OrderedDict[str, None] = OrderedDict()  # the latest `max_ids`, see `cancel`
        self._lock = threading.Lock()
        self._max = max_ids
        self.max_age_s = max_age_s
        self.dropped = 0
        self._journal: IO[str] | None = None  # `keep_on_disk`
        self.journal_path: Path | None = None
        self._lines = 0  # lines in the journal
        self._compact_at = COMPACT_LINES  # journal lines at which to count whether to compact

    def keep_on_disk(self, path: Path) -> int:
        """Journal the calls held to `path` from now on, after filing again what it holds from
        before (a restart). Returns the calls restored. Calling it again for the same path changes
        nothing; the file is rewritten with what is held now (older lines compacted away)."""
        path = Path(path)
        with self._lock:
            if self.journal_path == path:
                return 0
            restored = _replay(path) if path.exists() else {}
            now = time.monotonic()
            for key, calls in restored.items():
                _, held = self._calls.pop(key, (now, []))
                self._calls[key] = (now, calls + held)
            self.journal_path = path
            self._compact()
            self._expire(now)
            return sum(len(c) for c in restored.values())

    def _compact(self) -> None:
        """Rewrite the journal with the calls held now, alone (under the lock)."""
        assert self.journal_path is not None
        tmp = self.journal_path.with_suffix(".tmp")
        self.journal_path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("w") as f:
            for key, (_, calls) in self._calls.items():
                for call in calls:
                    f.write(_line({"add": key, "call": call.model_dump(mode="json")}))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.journal_path)
        if self._journal is not None:
            self._journal.close()
        self._journal = self.journal_path.open("a")
        self._lines = sum(len(calls) for _, calls in self._calls.values())

    def _log(self, record: dict[str, Any]) -> None:
        """One journal line (under the lock), flushed to the operating system at once; a journal
        grown to COMPACT_LINES lines, over twice what is held, is rewritten with what is held."""
        if self._journal is None:
            return
        self._journal.write(_line(record))
        self._journal.flush()
        self._lines += 1
        if self._lines >= self._compact_at:  # counted again only when the journal has doubled
            if self._lines > 2 * sum(len(c) for _, c in self._calls.values()):
                self._compact()
            self._compact_at = max(COMPACT_LINES, 2 * self._lines)

    def add(self, capture_id: str, call: CapturedCall) -> None:
        now = time.monotonic()
        with self._lock:
            _, calls = self._calls.pop(capture_id, (now, []))
            calls.append(call)
            self._calls[capture_id] = (now, calls)
            self._log({"add": capture_id, "call": call.model_dump(mode="json")})
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
            self._log({"drop": cid})
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
            held = len(self._calls.get(capture_id, (0.0, []))[1]) + self._in_flight.get(capture_id, 0)
            if held >= MAX_CALLS_PER_CAPTURE:
                raise InvalidFieldError(
                    CAPTURE_HEADER,
                    f"{held} calls",
                    f"holds {held} calls, the most one capture id holds (MAX_CALLS_PER_CAPTURE="
                    f"{MAX_CALLS_PER_CAPTURE}): pop them (or post the episode's outcome), or use a new id",
                )
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
            calls = self._calls.pop(capture_id, (0.0, []))[1]
            if calls:
                self._log({"drop": capture_id})
            return calls

    def peek(self, capture_id: str) -> list[CapturedCall]:
        """The calls held under `capture_id`, left in place (`take` them once they are safe elsewhere)."""
        with self._lock:
            return list(self._calls.get(capture_id, (0.0, []))[1])

    def take(self, capture_id: str, n: int) -> None:
        """Remove the first `n` calls under `capture_id` (those a `peek` returned); calls filed since stay."""
        with self._lock:
            held = self._calls.get(capture_id)
            if held is None:
                return
            del held[1][:n]
            self._log({"take": capture_id, "n": n})
            if not held[1]:
                del self._calls[capture_id]

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


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def _replay(path: Path) -> dict[str, list[CapturedCall]]:
    """The calls a journal (`Captures.keep_on_disk`) holds, by capture key. A last line cut off by
    the crash is skipped; so is a line that does not parse (logged nowhere: it held no whole call)."""
    held: dict[str, list[CapturedCall]] = {}
    with path.open() as f:
        for raw in f:
            try:
                record = json.loads(raw)
                if "add" in record:
                    held.setdefault(record["add"], []).append(CapturedCall.model_validate(record["call"]))
                elif "take" in record:
                    calls = held.get(record["take"], [])
                    del calls[: int(record["n"])]
                elif "drop" in record:
                    held.pop(record["drop"], None)
            except (ValueError, KeyError, TypeError):
                continue
    return {k: v for k, v in held.items() if v}


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


__all__ = [
    "CAPTURE_HEADER",
    "MAX_CALLS_PER_CAPTURE",
    "MAX_CAPTURE_ID_CHARS",
    "CapturedCall",
    "Captures",
    "add_capture_header",
    "capture_key",
    "capture_scope",
    "current_capture_id",
    "owned_by",
]
