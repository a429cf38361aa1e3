"""The trainer ranks' process group: all-reduce, broadcast and a job mailbox over torch.distributed.

A `ProcessGroupGloo` (CPU, bound to 127.0.0.1 when the ranks share a machine) or
`ProcessGroupNCCL` (CUDA) object built on a store, not torch's global default group, so a process
can hold several (one per served model) and tests can build and drop them.
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


def _ranks_share_a_gpu(world: int) -> bool:
    """More ranks on this machine (torchrun's LOCAL_WORLD_SIZE; spawned ranks are all here) than GPUs."""
    import torch

    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) > torch.cuda.device_count()


class Collective:
    """The ranks' process group: all-reduce and broadcast of tensors, and a job mailbox (the store)."""

    def __init__(
        self, store: Any, rank: int, world: int, device: torch.device, config: TrainerConfig
    ) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.store = rank, world, store
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
        if backend == "nccl":
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

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise TrainerRankError(f"{what} across {self.world} trainer ranks failed: {e}") from e

    # -- jobs: rank 0 posts, the others take them in order ----------------------------------------

    def post(self, n: int, job: dict[str, Any], payload: bytes = b"") -> None:
        self.store.set(f"job/{n}", json.dumps(job).encode())
        self.store.set(f"payload/{n}", payload)

    def take(self, n: int, alive: Callable[[], bool]) -> tuple[dict[str, Any], bytes]:
        while True:
            try:
                self.store.wait([f"job/{n}"], datetime.timedelta(seconds=_POLL_S))
                break
            except RuntimeError:  # the store's timeout: look again, unless rank 0 is gone
                if not alive():
                    raise TrainerRankError("rank 0 went away") from None
        return json.loads(self.store.get(f"job/{n}")), self.store.get(f"payload/{n}")


def balanced_share(sizes: Sequence[int], rank: int, world: int) -> list[int]:
    """Indices of the micro-batches (by token count) this rank runs: largest first to the least loaded."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return [i for i in range(len(sizes)) if owner[i] == rank]
