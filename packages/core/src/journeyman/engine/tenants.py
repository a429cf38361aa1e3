"""The models one in-process engine serves: one base, each model's LoRA adapter (`TorchEngine(...,
share_with=)`, which `backends/service.py` uses for every model registered on a base already served).

With one model the runner samples from that model's PEFT module with the adapter merged in
(`LoraPolicy.sampling`), as it always did. With two or more, rows of every model share the batch:
the runner runs a module of its own on the shared base weights, and `GroupedLora` adds each row's
own adapter. Each model's weights are guarded by its own lock (`LoraPolicy.lock`): the runner
holds a model's lock while rows of that model are in the batch, and lets it go as soon as its last
row leaves. A model whose training step waits for its lock (`editors_waiting`) gets no new rows, so
its rows drain while the other models' keep decoding: a step stalls its own traffic, not theirs.

Weight changes of the models (training steps, checkpoint loads) take turns in the order they
asked (`Turns`): one model's backlog of steps cannot starve another's, and one step at a time holds
gradients and activations, as the memory plan counts them.

A model joins or leaves between batches: the change is pending (`changing`) until the runner is
idle, and the runner admits no new rows meanwhile, so it gets there within one batch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from journeyman.policy.grouped_lora import GroupedLora
from journeyman.policy.lora import LoraPolicy

__all__ = ["Tenant", "Tenants", "Turns"]


class Turns:
    """A first-come, first-served lock (a ticket lock): threads get it in the order they asked,
    which `threading.Lock` does not promise."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket whose turn it is

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._cond.wait_for(lambda: self._serving == ticket)
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


@dataclass(eq=False)
class Tenant:
    """One model on the engine: its policy and the tokens that end its answers."""

    policy: LoraPolicy
    stop_ids: set[int]
    index: int = 0  # its place in the runner's lists (a row's `tenant`), fixed for its life
    closed: bool = False  # left the engine: its queued requests fail, new ones are refused


class Tenants:
    """The models of one runner. Its methods run on the runner's worker thread, but `join` and
    `leave`, which any thread may call (they only queue a change)."""

    def __init__(self, first: LoraPolicy, stop_ids: set[int]) -> None:
        self.all: list[Tenant] = [Tenant(first, stop_ids)]
        self.active: list[Tenant] = list(self.all)  # what the runner serves now (changed when idle)
        self._changes = threading.Lock()
        self._pending = False
        self.grouped: GroupedLora | None = None  # made when a second model joins
        self._held: set[int] = set()  # models whose lock the worker holds (their rows are in the batch)
        self.turns = Turns()  # the models' weight changes, one at a time, in the order asked

    @property
    def first(self) -> Tenant:
        return self.all[0]

    @property
    def mixed(self) -> bool:
        """Rows of several models share the batch (the grouped adapter product), now."""
        return len(self.active) > 1

    @property
    def changing(self) -> bool:
        """A model joins or leaves once the runner is idle: admit nothing new meanwhile."""
        return self._pending

    def join(self, policy: LoraPolicy, stop_ids: set[int]) -> Tenant:
        """Add a model on the same base weights; it is served from the runner's next idle moment.
        Blocking (the first time, loads the engine's own module around the shared weights)."""
        if policy.base is not self.first.policy.base:
            raise ValueError(f"{policy.base!r} is not the engine's base ({self.first.policy.base!r})")
        module = None if self.grouped is not None else policy.base.load_module()
        with self._changes:
            if self.grouped is None and module is not None:
                self.grouped = GroupedLora(module)
            tenant = Tenant(policy, stop_ids, index=len(self.all))
            self.all.append(tenant)
            self._pending = True
        return tenant

    def leave(self, tenant: Tenant) -> None:
        """Take `tenant` off the engine at its next idle moment; its queued requests fail."""
        with self._changes:
            tenant.closed = True
            self._pending = True

    def apply(self) -> bool:
        """Make pending joins and leaves current (the runner is idle); True when anything changed."""
        with self._changes:
            if not self._pending:
                return False
            self._pending = False
            # the last model to leave stays the runner's: its worker is stopping with it
            self.active = [t for t in self.all if not t.closed] or self.active
            if self.grouped is not None and len(self.active) > 1:
                self.grouped.set_models([t.policy for t in self.all])
            return True

    def policy(self, index: int) -> LoraPolicy:
        return self.all[index].policy

    def stop_ids(self, index: int) -> set[int]:
        return self.all[index].stop_ids

    def versions(self) -> list[int]:
        """Each model's weights' version, by index: what cached keys and values are checked against."""
        return [t.policy.version for t in self.all]

    # -- mixed batches: each model's lock, held while its rows run -----------------------------------

    def hold(self, index: int) -> bool:
        """Take model `index`'s lock for rows of it about to join, unless it is closed or a step
        waits for it (then its rows wait: False). Never blocks."""
        tenant = self.all[index]
        if index in self._held:
            return not tenant.closed and not tenant.policy.editors_waiting
        if tenant.closed or tenant.policy.editors_waiting or not tenant.policy.lock.acquire(blocking=False):
            return False
        self._held.add(index)
        return True

    def release_unused(self, in_batch: Iterable[int]) -> None:
        """Let the locks go of the models no row in the batch belongs to any more."""
        keep = set(in_batch)
        for index in [i for i in self._held if i not in keep]:
            self._held.discard(index)
            self.all[index].policy.lock.release()

    def release_all(self) -> None:
        self.release_unused(())

    @contextlib.contextmanager
    def forward(self, models: list[int], device: torch.device) -> Iterator[None]:
        """One forward pass's rows (mixed batches: each through its own model's adapter)."""
        if self.grouped is None or not self.mixed:
            yield
            return
        with self.grouped.rows(models, device):
            yield

    @property
    def module(self) -> Any:
        """The causal LM the runner samples with now: the one model's PEFT module, or the engine's
        own module with every model's adapter hooked in."""
        if self.mixed and self.grouped is not None:
            return self.grouped.module
        return self.active[0].policy.model.get_base_model()
