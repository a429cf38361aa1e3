"""The in-process engine's rows in their KV slots (`batch`): row i lives in slot i of the `SlotPool`,
ready rows first, then the rows being prefilled. A row joins in the next free slot with what of its
prompt is already computed in place (`prompt_kv`); rows that leave are compacted away, the others
moving down with their filled slots only. Rows of one prompt (n > 1) wait, slotless, for the first
one's prefill and then copy its slot.
"""

from __future__ import annotations

from typing import Generic

import torch

from journeyman.engine.kv import SlotPool
from journeyman.engine.prompt_kv import PromptKV
from journeyman.engine.rows import RequestT, Row

__all__ = ["RowSlots"]


class RowSlots(Generic[RequestT]):
    """`rows[:ready]` sample, their next-token logits in `logits` (ready, V); `rows[ready:]` are
    being prefilled; `waiting` rows follow a row of the same prompt still prefilling."""

    def __init__(self, layout: tuple[int, int, int, torch.dtype, torch.device], prompt_kv: PromptKV) -> None:
        self._layout = layout
        self._prompt_kv = prompt_kv
        self.pool = SlotPool(*layout)
        self.rows: list[Row[RequestT]] = []
        self.ready = 0
        self.waiting: list[Row[RequestT]] = []
        self.logits: torch.Tensor | None = None

    @property
    def filling(self) -> bool:
        return len(self.rows) > self.ready

    @property
    def count(self) -> int:
        """Rows held: ready, prefilling, and waiting."""
        return len(self.rows) + len(self.waiting)

    def held(self) -> list[Row[RequestT]]:
        return [*self.rows, *self.waiting]

    def filling_jobs(self) -> list[RequestT]:
        """The requests whose rows are still prefilling."""
        return list(dict.fromkeys(r.answer.job for r in [*self.rows[self.ready :], *self.waiting]))

    def release(self) -> None:
        """Let the slots' memory go (no row is held)."""
        self.pool = SlotPool(*self._layout)

    def add(self, rows: list[Row[RequestT]]) -> None:
        """Give each of `rows` the next free slot, its prompt's computed part in place."""
        self.pool.reserve(len(self.rows) + len(rows), 0)
        for row in rows:
            self.rows.append(row)
            self._prompt_kv.place(row, len(self.rows) - 1, self.pool)

    def drop(self, jobs: list[RequestT]) -> None:
        """Take `jobs`' rows out; a row of another request that followed one of them is prefilled on
        its own now."""
        gone = {id(j) for j in jobs}
        self.waiting = [r for r in self.waiting if id(r.answer.job) not in gone]
        leaving = [i for i, r in enumerate(self.rows) if id(r.answer.job) in gone]
        orphans = [f for i in leaving for f in self.rows[i].followers if id(f.answer.job) not in gone]
        self._remove(leaving)
        for f in orphans:
            self.waiting.remove(f)
            self.add([f])

    def promote(self, slot: int, logits: torch.Tensor) -> None:
        """The prefilling row in `slot` is ready to sample (`logits`: its first token's); so are its
        followers, each with a copy of its slot."""
        first = self.ready
        self._swap(first, slot)
        leader = self.rows[first]
        self._ready_with(logits)
        for f in leader.followers:
            self.waiting.remove(f)
            if f.answer.failed:
                continue
            f.prefix, f.length = leader.prefix, leader.length
            self.rows.append(f)
            last = len(self.rows) - 1
            self.pool.reserve(len(self.rows), f.length)
            self.pool.copy(first, last, f.length)
            self._swap(self.ready, last)  # a prefilling row there moves to the end
            self._ready_with(logits)
        leader.followers = []

    def settle(self, keep: list[int]) -> None:
        """Take out the ready rows not in `keep` (a finished one's KV kept for a later turn) and the
        rows of failed requests; no row has logits until the next decode step."""
        kept = set(keep)
        for b, row in enumerate(self.rows[: self.ready]):
            if b not in kept and row.finish is not None and not row.answer.failed:
                self._prompt_kv.remember(row, b, self.pool)
        gone = [b for b in range(self.ready) if b not in kept]
        gone += [i for i in range(self.ready, len(self.rows)) if self.rows[i].answer.failed]
        self.waiting = [r for r in self.waiting if not r.answer.failed]
        self._remove(gone)
        self.logits = None

    def reset(self) -> list[RequestT]:
        """Drop every row; returns their requests."""
        jobs = list(dict.fromkeys(r.answer.job for r in self.held()))
        self.rows, self.waiting, self.ready, self.logits = [], [], 0, None
        return jobs

    def _swap(self, a: int, b: int) -> None:
        ra, rb = self.rows[a], self.rows[b]
        self.pool.swap(a, ra.length, b, rb.length)
        self.rows[a], self.rows[b] = rb, ra

    def _ready_with(self, logits: torch.Tensor) -> None:
        self.ready += 1
        self.logits = logits[None] if self.logits is None else torch.cat([self.logits, logits[None]])

    def _remove(self, gone: list[int]) -> None:
        """Take the rows in slots `gone` out; the others keep their slots but for moves that close
        the gaps (ready rows first, then the prefilling ones)."""
        if not gone:
            return
        dead = set(gone)
        ready = [i for i in range(self.ready) if i not in dead]
        filling = [i for i in range(self.ready, len(self.rows)) if i not in dead]
        rows: list[Row[RequestT]] = []
        for dst, src in enumerate(
            ready + filling
        ):  # ascending, each to a slot at or below its own: no clobbering
            self.pool.copy(src, dst, self.rows[src].length)
            rows.append(self.rows[src])
        self.rows, self.ready = rows, len(ready)
        if self.logits is not None and len(ready) < self.logits.shape[0]:  # a ready row dropped (`drop`)
            self.logits = self.logits[ready] if ready else None
