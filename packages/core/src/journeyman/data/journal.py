"""A write-ahead journal of groups waiting to train, shared by the pipeline and live training.

Groups are appended before they train; what became of each id (a train call sent with its
idempotency key, trained, dropped) is appended beside them. A line is written whole with one
`write` and flushed, so a `kill -9` keeps every line written, and a line it cut short is skipped on
reading. A group added again under the same id replaces the earlier line (an episode whose later
calls arrived after it was first written).

    journal = GroupJournal(run_dir / "pipeline")
    journal.add("g1", group)                      # before it can train
    journal.settle(["g1"], "training", step, key)  # a restart retries this very call (same key)
    journal.settle(["g1"], "trained", step + 1)
    sent, waiting = journal.pending()             # after a restart: the call in flight, the rest
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from journeyman.data.types import TrajectoryGroup


@dataclass
class JournalBatch:
    """A step's groups and the idempotency key its train call is sent with."""

    key: str
    groups: list[tuple[str, TrajectoryGroup]]


class GroupJournal:
    """`groups.jsonl` (id, group) and `settled.jsonl` (ids, how, step, key) in `folder`. With
    `fsync=True` every line is on disk before `add`/`settle` return (a power cut keeps it too)."""

    def __init__(self, folder: Path, *, fsync: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.groups, self.settled = folder / "groups.jsonl", folder / "settled.jsonl"
        self.fsync = fsync

    @staticmethod
    def lines(path: Path) -> list[dict[str, Any]]:
        """The whole JSON lines of `path` (a torn last line is skipped)."""
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def pending(self) -> tuple[JournalBatch | None, list[tuple[str, TrajectoryGroup]]]:
        """(the batch whose train call was sent and never answered, with its idempotency key; the
        other groups not yet trained or dropped, in the order they were first added)."""
        done: set[str] = set()
        sent: dict[str, Any] | None = None
        for row in self.lines(self.settled):
            if row["how"] == "training":
                sent = row
            else:
                done.update(row["ids"])
                if sent is not None and set(sent["ids"]) <= done:
                    sent = None
        groups = {
            row["id"]: TrajectoryGroup.model_validate(row["group"])
            for row in self.lines(self.groups)
            if row["id"] not in done
        }
        batch = None
        if sent is not None:
            batch = JournalBatch(sent["key"], [(i, groups.pop(i)) for i in sent["ids"] if i in groups])
        return batch, list(groups.items())

    def add(self, gid: str, group: TrajectoryGroup) -> None:
        line = json.dumps({"id": gid, "group": group.model_dump(mode="json")}, allow_nan=False)
        self._append(self.groups, line)

    def settle(self, ids: Sequence[str], how: str, step: int, key: str | None = None) -> None:
        if ids:
            row: dict[str, Any] = {"ids": list(ids), "how": how, "step": step}
            if key is not None:
                row["key"] = key
            self._append(self.settled, json.dumps(row))

    def _append(self, path: Path, line: str) -> None:
        with path.open("a") as f:
            f.write(line + "\n")
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())


__all__ = ["GroupJournal", "JournalBatch"]
