"""The trainer ranks' process group: all-reduce, broadcast, all-gather and a job mailbox.

A `ProcessGroupGloo` (CPU, bound to 127.0.0.1 when the ranks share a machine) or
`ProcessGroupNCCL` (CUDA) object built on a store, not torch's global default group, so a process
can hold several (one per served model) and tests can build and drop them.

The store carries control only: a job's kind and its size. A job's body (a step's groups and
config, an optimizer state) travels through the process group itself, a byte tensor broadcast from
rank 0 (NVLink or the network under NCCL), so a step of long agent rows or an AdamW state of
hundreds of MB never passes through the store's single TCP server (torchrun's, on node 0).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from journeyman.data.config import TrainerConfig
from journeyman.errors import InvalidFieldError, TrainerRankError

if TYPE_CHECKING:
    import torch

_POLL_S = 2.0


def bind_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (nothing to do elsewhere). Called before the
    model loads and before NCCL starts: without it a rank's CUDA context, NCCL's communicator and
    any `torch.device("cuda")` tensor land on GPU 0, where each rank's context costs ~0.5 GB and NCCL
    may pick the wrong GPU for the rank."""
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)


def _ranks_share_a_gpu(world: int) -> bool:
    """More ranks on this machine (torchrun's LOCAL_WORLD_SIZE; spawned ranks are all here) than GPUs."""
    import torch

    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) > torch.cuda.device_count()


class Collective:
    """The ranks' process group: all-reduce, broadcast and all-gather of tensors, and a job mailbox
    (control in the store, bodies broadcast through the group)."""

    def __init__(
        self, store: Any, rank: int, world: int, device: torch.device, config: TrainerConfig
    ) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world, self.store = rank, world, store
        # A sharded base gathers each layer in every forward and backward: every rank must run as
        # many passes as the busiest one (`share`).
        self.lockstep = config.shard_base and world > 1
        timeout = datetime.timedelta(seconds=config.timeout_s)
        backend = config.backend
        shared = device.type == "cuda" and _ranks_share_a_gpu(world)
        if backend == "auto":
            # gloo all-reduces CUDA tensors too (through host memory): the way left when ranks share a GPU
            backend = "nccl" if device.type == "cuda" and not shared else "gloo"
        elif backend == "nccl" and shared:
            raise InvalidFieldError(
                "trainer.backend",
                "nccl",
                "NCCL needs a GPU per rank, and this machine has more ranks than GPUs",
            )
        # where job bodies are broadcast: NCCL moves device tensors only
        self._bytes_device = device if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            bind_device(device)  # NCCL takes the current device for this rank's communicator
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue] (the stub lacks it)
            # bound to loopback when the ranks share this machine; torchrun's nodes use the host name
            host = "127.0.0.1" if config.master_addr is None else os.uname().nodename
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timeout
            self.pg = dist.ProcessGroupGloo(store, rank, world, opts)

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum `tensors` over the ranks, in place, as one flat buffer (one round trip)."""
        import torch

        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._wait(self.pg.allreduce([flat]), "all_reduce")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0's values of `tensors` on every rank, in place."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in tensors:
            self._wait(self.pg.broadcast([t], opts), "broadcast")

    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor) -> Callable[[], None]:
        """Start filling `full` (world × shard.numel() elements) with every rank's `shard`, in rank
        order; returns the wait for it (on CUDA, the current stream waits, not the host)."""
        work = self.pg._allgather_base(full, shard)
        return lambda: self._wait(work, "all_gather")

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise TrainerRankError(f"{what} across {self.world} trainer ranks failed: {e}") from e

    # -- jobs: rank 0 posts, the others take them in order ----------------------------------------

    def post(self, n: int, job: dict[str, Any], body: bytes = b"") -> None:
        """Job `n` for every other rank: `job` (small: its kind) in the store, `body` broadcast."""
        self.store.set(f"job/{n}", json.dumps({**job, "body_bytes": len(body)}).encode())
        if body:
            self._broadcast_bytes(body, len(body))

    def take(self, n: int, alive: Callable[[], bool]) -> tuple[dict[str, Any], bytes]:
        """Job `n` and its body, once rank 0 posts it (polling, so a rank 0 that died is noticed)."""
        while True:
            try:
                self.store.wait([f"job/{n}"], datetime.timedelta(seconds=_POLL_S))
                break
            except RuntimeError:  # the store's timeout: look again, unless rank 0 is gone
                if not alive():
                    raise TrainerRankError("rank 0 went away") from None
        job = json.loads(self.store.get(f"job/{n}"))
        size = int(job.pop("body_bytes", 0))
        return job, self._broadcast_bytes(None, size) if size else b""

    def _broadcast_bytes(self, body: bytes | None, size: int) -> bytes:
        import torch

        if body is not None:  # rank 0
            t = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(self._bytes_device)
        else:
            t = torch.empty(size, dtype=torch.uint8, device=self._bytes_device)
        self.broadcast([t])
        return body if body is not None else t.cpu().numpy().tobytes()

    def share(self, sizes: Sequence[int]) -> tuple[list[int], int]:
        """(indices of the micro-batches this rank runs, idle passes it adds): micro-batches balanced
        by tokens (`balanced_share`). In lockstep (a sharded base) every forward and backward
        all-gathers each layer with the other ranks, so each rank runs ceil(n / world) passes: at
        most that many micro-batches, and a pass at zero weight for each one it is short."""
        most = -(-len(sizes) // self.world) if self.lockstep else None
        shares = [balanced_share(sizes, r, self.world, most) for r in range(self.world)]
        mine = shares[self.rank]
        idle = max(len(s) for s in shares) - len(mine) if self.lockstep else 0
        return mine, idle


def balanced_share(sizes: Sequence[int], rank: int, world: int, most: int | None = None) -> list[int]:
    """Indices of the micro-batches (by token count) this rank runs: largest first to the least
    loaded rank, among those holding fewer than `most` (no limit by default)."""
    load = [0] * world
    count = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        open_ranks = [r for r in range(world) if most is None or count[r] < most]
        r = min(open_ranks, key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
        count[r] += 1
    return [i for i in range(len(sizes)) if owner[i] == rank]
