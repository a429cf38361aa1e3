"""Where finished trajectory groups are announced, for exporters such as Langfuse.

Off by default: nothing is registered, and `emit` is a loop over an empty tuple. An exporter
registers with `add_sink` and must not block (queue the work and return).

Sinks are scoped like `current_backend`: a ContextVar holds them, so a sink added in a task is seen
by that task and by the tasks and threads (`asyncio.to_thread`) it starts afterwards, never by a
sibling; two programs in one process (tests, two trainers) each export only their own groups. A
sink added before `asyncio.run(main())` is seen by all of `main`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Protocol

from pydantic import BaseModel

from journeyman.data.types import TrajectoryGroup

log = logging.getLogger(__name__)


class GroupContext(BaseModel):
    """Where the groups come from: which run, which policy step, which split."""

    project: str | None = None
    model: str | None = None
    step: int | None = None
    split: str = "train"  # "train" (gathered or trained on), "val", ...
    source: str = "gather"  # "gather" | "train" | "log"


class TrajectorySink(Protocol):
    def on_groups(self, groups: Sequence[TrajectoryGroup], context: GroupContext) -> None: ...


_sinks: ContextVar[tuple[TrajectorySink, ...]] = ContextVar("journeyman_sinks", default=())


def add_sink(sink: TrajectorySink) -> None:
    """Announce groups to `sink` from now on, in this context and the tasks it starts."""
    _sinks.set((*_sinks.get(), sink))


def remove_sink(sink: TrajectorySink) -> None:
    """Stop announcing to `sink` in this context (a no-op where it was not added)."""
    sinks = list(_sinks.get())
    if sink in sinks:
        sinks.remove(sink)
        _sinks.set(tuple(sinks))


def current_sinks() -> tuple[TrajectorySink, ...]:
    """The sinks `emit` reaches from this context."""
    return _sinks.get()


@contextlib.contextmanager
def sink_scope(sink: TrajectorySink) -> Iterator[TrajectorySink]:
    """`add_sink` for the duration of a block; the sinks before it are back afterwards."""
    token = _sinks.set((*_sinks.get(), sink))
    try:
        yield sink
    finally:
        _sinks.reset(token)


def emit(groups: Sequence[TrajectoryGroup], context: GroupContext) -> None:
    """Hand the groups to every sink; a failing sink is logged, never raised into training."""
    for sink in _sinks.get():
        try:
            sink.on_groups(groups, context)
        except Exception:
            log.exception("trajectory sink %r failed", sink)


__all__ = [
    "GroupContext",
    "TrajectorySink",
    "add_sink",
    "current_sinks",
    "emit",
    "remove_sink",
    "sink_scope",
]
