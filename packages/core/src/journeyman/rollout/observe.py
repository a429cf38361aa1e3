"""Where finished trajectory groups are announced, for exporters such as Langfuse.

Off by default: nothing is registered, and `emit` is a loop over an empty list. An exporter
registers with `add_sink` and must not block (queue the work and return).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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


_sinks: list[TrajectorySink] = []


def add_sink(sink: TrajectorySink) -> None:
    _sinks.append(sink)


def remove_sink(sink: TrajectorySink) -> None:
    if sink in _sinks:
        _sinks.remove(sink)


def emit(groups: Sequence[TrajectoryGroup], context: GroupContext) -> None:
    """Hand the groups to every sink; a failing sink is logged, never raised into training."""
    for sink in list(_sinks):
        try:
            sink.on_groups(groups, context)
        except Exception:
            log.exception("trajectory sink %r failed", sink)
