"""A decode step of fixed shape, so that on CUDA it is captured once and replayed (a CUDA graph).

An eager decode step of a small model is launch-bound on a GPU: every layer is a few dozen kernel
launches and the step's shapes change with every token, so nothing can be replayed. Here the step's
shapes come from buckets instead: the rows are padded to a bucket of row counts, the attended slots
to a power of two, the shared prefix to its buffer's capacity. What changes from step to step (each
row's latest token, the slot it writes, how much of the shared prefix it reads) is three integers a
row, copied into a static buffer in one transfer; the masks and positions are computed from them on
the device, inside the captured step. On CUDA each shape is captured the first time it is met and
replayed afterwards; elsewhere the same step runs eagerly (the CPU tests run it to check the
padding against the eager path).

Padding rows write their keys into the slots after the ready rows, at the last attended slot: those
slots belong to rows still being prefilled, whose filled part ends before it (the caller sizes the
attended length past every such row), or to nobody.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from journeyman.engine.kv import KVPlan, SharedPrefix, SlotPool

__all__ = ["ROW_BUCKETS", "DecodeGraphs", "kv_bucket", "row_bucket"]

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def row_bucket(n: int) -> int:
    """The padded row count of a step of `n` rows: the next of `ROW_BUCKETS`, past them a multiple of 64."""
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    return -(-n // 64) * 64


def kv_bucket(n: int) -> int:
    """The attended slots of a step whose longest row needs `n`: the next power of two, at least 64."""
    return max(64, 1 << (n - 1).bit_length())


# Runs the decoder on (ids, positions) under a plan and returns its last hidden states.
RunFn = Callable[[torch.Tensor, torch.Tensor, KVPlan], torch.Tensor]


@dataclass(eq=False)
class _Step:
    """One shape's static buffers and, on CUDA, its captured graph."""

    inputs: torch.Tensor  # (3, rows): latest token, slot written, shared-prefix tokens read
    logits: torch.Tensor | None = None  # (rows, V), written by each run or replay
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Decode steps of bucketed shape over a `SlotPool` (and a `SharedPrefix`), replayed on CUDA
    when `replay`. Graphs hold the addresses of the pool's and prefix's buffers: when either is
    reallocated, every graph is dropped and shapes are captured again as they come."""

    def __init__(self, run: RunFn, head: torch.nn.Module, device: torch.device, replay: bool) -> None:
        self._run, self._head, self.device = run, head, device
        self.replay = replay and device.type == "cuda"
        self._steps: dict[tuple[int, int, int], _Step] = {}
        self._owner: tuple[int, ...] = ()
        self._mempool = torch.cuda.graph_pool_handle() if self.replay else None
        self.captures = 0  # shapes captured (CUDA)
        self.replays = 0  # steps replayed from a captured graph
        self.failure: str | None = None  # why capturing was given up (then steps run eagerly)

    def clear(self) -> None:
        self._steps.clear()
        self._owner = ()
        if self.replay:  # a pool whose graphs are all gone is released: the next captures need a new one
            self._mempool = torch.cuda.graph_pool_handle()

    def attended(self, lengths: list[int], held: list[int]) -> int:
        """The attended slots of a step whose ready rows are filled to `lengths`, with the rows still
        prefilling in the padding rows' slots filled to `held` (a padding row writes past them)."""
        return kv_bucket(max(*lengths, *held, 0) + 1)

    def logits(
        self,
        pool: SlotPool,
        shared: SharedPrefix | None,
        latest: list[int],
        lengths: list[int],
        prefixes: list[int],
        kv_len: int,
    ) -> torch.Tensor:
        """(n, V) the next-token logits of the n ready rows: each writes its `latest` token's keys at
        slot `lengths[i]` and reads the first `prefixes[i]` tokens of `shared`. The pool holds at
        least `row_bucket(n)` rows and `kv_len` slots a row (`attended`)."""
        n = len(latest)
        rows = row_bucket(n)
        prefix = shared.capacity if shared is not None and any(prefixes) else 0
        owner = (
            pool.k[0].data_ptr(),
            pool.rows,
            pool.capacity,
            shared.k[0].data_ptr() if shared is not None and prefix else 0,
            prefix,
        )
        if owner != self._owner:
            self.clear()
            self._owner = owner
        key = (rows, kv_len, prefix)
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = _Step(torch.zeros((3, rows), dtype=torch.long, device=self.device))
        host = torch.zeros((3, rows), dtype=torch.long)
        host[0, :n] = torch.tensor(latest)
        host[1, :n] = torch.tensor(lengths)
        host[1, n:] = kv_len - 1
        host[2, :n] = torch.tensor(prefixes)
        step.inputs.copy_(host, non_blocking=False)
        if not self.replay:
            step.logits = self._body(step, pool, shared if prefix else None, kv_len)
        elif step.graph is None:
            step.logits = self._capture(step, pool, shared if prefix else None, kv_len)
        else:
            step.graph.replay()
            self.replays += 1
        assert step.logits is not None
        return step.logits[:n].clone()

    def _body(self, step: _Step, pool: SlotPool, shared: SharedPrefix | None, kv_len: int) -> torch.Tensor:
        """The step itself: everything from the static inputs to the logits, on the device."""
        rows = step.inputs.shape[1]
        ids, write, read = step.inputs[0][:, None], step.inputs[1][:, None], step.inputs[2]
        own_k, own_v = pool.rows_view(0, rows)
        slots = torch.arange(kv_len, device=self.device)
        plan = KVPlan(own_k, own_v, write, kv_len, slots <= write[:, :, None])
        if shared is not None:
            plan.prefix_k = [k[0] for k in shared.k]
            plan.prefix_v = [v[0] for v in shared.v]
            plan.prefix_mask = torch.arange(shared.capacity, device=self.device) < read[:, None]
        hidden = self._run(ids, write + read[:, None], plan)
        return self._head(hidden[:, -1]).float()

    def _capture(self, step: _Step, pool: SlotPool, shared: SharedPrefix | None, kv_len: int) -> torch.Tensor:
        """Run the step on a side stream (libraries initialise lazily), then capture it; a capture
        that fails turns replay off for good (the step runs eagerly, and `failure` says why)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._body(step, pool, shared, kv_len)  # writes the same keys the replay writes
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                logits = self._body(step, pool, shared, kv_len)
        except Exception as e:  # an op that cannot be captured: eager from now on
            torch.cuda.synchronize(self.device)
            self.replay, self.failure = False, f"{type(e).__name__}: {e}"
            logger.warning("decode steps run eagerly: capturing one failed (%s)", self.failure)
            self.clear()
            return self._body(step, pool, shared, kv_len)
        step.graph = graph
        self.captures += 1
        graph.replay()
        self.replays += 1
        return logits
