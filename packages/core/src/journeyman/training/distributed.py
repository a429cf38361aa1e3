"""Data-parallel training over torch.distributed: rank 0 is the backend, ranks 1..N-1 are workers.

Every rank holds the base model (whole, or 1/N of its decoder layers with
`TrainerConfig(shard_base=True)`: `sharding.py`), the same LoRA adapter and the same AdamW state.
For a step, rank 0 posts the job's kind in the group's store and broadcasts its body (the groups
and the config, as JSON) through the process group; every rank builds the same rows, takes its
share of the micro-batches (balanced by tokens), and runs forward and backward;
gradients and metric sums are all-reduced (summed: the loss is normalised by the step's global
token count, so the sum is the gradient one process would get), and every rank applies the same
clipped AdamW step. Rank 0 writes the checkpoint and the history, as with one process.

Two ways to start the ranks, one code path:
- `jm.LocalBackend(trainer=TrainerConfig(world_size=N))` spawns N-1 worker processes on this
  machine (a FileStore in a private directory; gloo bound to 127.0.0.1, NCCL on CUDA).
- Under `torchrun` (several nodes): rank 0 runs the user's script with
  `trainer=TrainerConfig.from_env()`, every other rank runs `python -m journeyman.training.distributed
  --base-model ...` (torchrun's MASTER_ADDR:MASTER_PORT hosts the store).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from journeyman.data.config import LoraConfig, TrainConfig, TrainerConfig
from journeyman.data.types import TrajectoryGroup
from journeyman.errors import TrainerRankError
from journeyman.policy.base_weights import pick_device
from journeyman.training.collective import Collective, bind_device
from journeyman.training.sharding import ShardedBase

if TYPE_CHECKING:
    from journeyman.policy.lora import LoraPolicy
    from journeyman.training.trainer import GRPOTrainer


def _state_bytes(trainer: GRPOTrainer) -> bytes:
    import torch

    buf = io.BytesIO()
    opt = trainer.optimizer.state_dict() if trainer.optimizer is not None else None
    torch.save({"optimizer": opt}, buf)
    return buf.getvalue()


def _load_state(policy: LoraPolicy, trainer: GRPOTrainer, payload: bytes) -> None:
    import torch

    state = torch.load(io.BytesIO(payload), map_location=policy.device, weights_only=True)
    if state["optimizer"] is None:
        trainer.optimizer = None
    else:
        trainer.optimizer = torch.optim.AdamW(policy.trainable_parameters())
        trainer.optimizer.load_state_dict(state["optimizer"])
    policy.version += 1


class RankGroup:
    """Rank 0's handle on the trainer ranks: starts them, hands them each step, stops them.

    Start-up order where the ranks share their GPUs with vLLM: the trainer side first. Each rank
    loads the base whole and, with `shard_base`, keeps its slice of it (`ShardedBase`), so a
    rank's peak is at load time (the whole base) and its resident size after that is the shard.
    vLLM starts after, and takes `gpu_memory_utilization` of each GPU from what is then free. The
    other way round starves one side: vLLM started first takes its share, weights and KV cache,
    and the next whole-base load runs out of memory (32B: 65.5 GB on an 80 GB GPU); and vLLM
    refuses to start when less than its share is free, which a rank still loading makes likely.
    So a GPU holds the rank's shard, LoRA and AdamW state, plus vLLM's share, which must leave the
    step's activations room while vLLM sleeps (docs/scale.md, "Sharded base").
    """

    def __init__(
        self,
        config: TrainerConfig,
        base_model: Path,
        lora: LoraConfig,
        policy: LoraPolicy,
        trainer: GRPOTrainer,
        dtype: str,
    ) -> None:
        import torch.distributed as dist

        self.config, self.policy, self.trainer = config, policy, trainer
        self.world = config.world_size
        self._n = 0
        self._procs: list[subprocess.Popen[bytes]] = []
        self._dir: str | None = None
        timeout = datetime.timedelta(seconds=config.timeout_s)
        if config.master_addr is None:  # spawn the ranks here; the store is a private file
            self._dir = tempfile.mkdtemp(prefix="journeyman-ranks-")
            store_file = os.path.join(self._dir, "store")
            store = dist.FileStore(store_file, self.world)  # pyright: ignore[reportPrivateImportUsage]
            _announce(store, config)
            # `python -m`, not multiprocessing: its spawn re-runs the user's script in each child
            # (training scripts rarely guard `asyncio.run(main())`), which then fails or recurses.
            for rank in range(1, self.world):
                spec = _WorkerSpec(
                    rank=rank,
                    world=self.world,
                    store_file=store_file,
                    base_model=str(base_model),
                    lora=lora.model_dump(),
                    dtype=dtype,
                    device=str(pick_device(policy.device.type, rank)),
                    trainer=config.model_dump(),
                    parent=os.getpid(),
                )
                cmd = [sys.executable, "-m", __name__, "--spawned", spec.model_dump_json()]
                self._procs.append(subprocess.Popen(cmd))
        else:  # torchrun's agent on node 0 already hosts a store on MASTER_PORT: join it, as torch does
            store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                config.master_addr,
                config.master_port or 29500,
                self.world,
                is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                timeout=timeout,
            )
            _announce(store, config)
        self.collective = Collective(store, 0, self.world, policy.device, config)
        self.sharded = ShardedBase(policy.model, self.collective) if config.shard_base else None
        self.sync()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)

    def _post(self, job: dict[str, Any], body: bytes = b"") -> None:
        dead = [code for p in self._procs if (code := p.poll()) is not None]
        if dead:
            raise TrainerRankError(f"{len(dead)} trainer rank(s) exited (codes {dead})")
        self._n += 1
        self.collective.post(self._n, job, body)

    def sync(self) -> None:
        """Every rank takes rank 0's adapter weights and optimizer state (at start, after a resume)."""
        self._post({"kind": "state"}, _state_bytes(self.trainer))
        self.collective.broadcast([p.data for p in self.policy.trainable_parameters()])

    def step(
        self,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> tuple[bool, dict[str, float]]:
        body = {
            "config": config.model_dump(mode="json"),
            "groups": [g.model_dump(mode="json") for g in groups],
        }
        self._post({"kind": "step"}, json.dumps(body).encode())
        return self.trainer.step(groups, config, on_progress, collective=self.collective)

    def close(self) -> None:
        # every rank stops, spawned here or started by torchrun (whose agents wait for all to exit)
        with contextlib.suppress(TrainerRankError):  # a dead rank needs no stop
            self._post({"kind": "stop"})
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class _WorkerSpec(BaseModel):
    rank: int
    world: int
    store_file: str | None = None
    base_model: str
    lora: dict[str, Any]
    dtype: str
    device: str | None
    trainer: dict[str, Any]
    parent: int | None = None


def _spawned_worker(spec: str) -> None:
    import torch.distributed as dist

    s = _WorkerSpec.model_validate_json(spec)
    store = dist.FileStore(s.store_file or "", s.world)  # pyright: ignore[reportPrivateImportUsage]
    parent = s.parent
    run_worker(s, store, alive=lambda: os.getppid() == parent and _reachable(store))


def run_worker(s: _WorkerSpec, store: Any, alive: Callable[[], bool]) -> None:
    """A trainer rank > 0: the same model and trainer as rank 0, stepping when rank 0 posts a job."""
    from journeyman.chat.formats import ChatFormat
    from journeyman.policy.lora import LoraPolicy
    from journeyman.training.trainer import GRPOTrainer

    device = pick_device(s.device)
    bind_device(device)  # before the first CUDA tensor: this rank's context and NCCL on its own GPU
    policy = LoraPolicy(
        Path(s.base_model), LoraConfig.model_validate(s.lora), device=str(device), dtype=s.dtype
    )
    trainer = GRPOTrainer(policy, ChatFormat(policy.tokenizer))
    # rank 0's choice (a torchrun rank's own config comes from its environment, which lacks it)
    shard_base = TrainerConfig.model_validate_json(store.get(_ANNOUNCE_KEY)).shard_base
    config = TrainerConfig.model_validate(s.trainer).model_copy(update={"shard_base": shard_base})
    collective = Collective(store, s.rank, s.world, policy.device, config)
    if shard_base:
        ShardedBase(policy.model, collective)
    n = 0
    while True:
        n += 1
        job, body = collective.take(n, alive)
        if job["kind"] == "stop":
            return
        if job["kind"] == "state":
            _load_state(policy, trainer, body)
            collective.broadcast([p.data for p in policy.trainable_parameters()])
        elif job["kind"] == "step":
            step = json.loads(body)
            groups = [TrajectoryGroup.model_validate(g) for g in step["groups"]]
            trainer.step(groups, TrainConfig.model_validate(step["config"]), collective=collective)


def main(argv: Sequence[str] | None = None) -> None:
    """A rank > 0 under torchrun: `torchrun ... -m journeyman.training.distributed --base-model DIR`."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m journeyman.training.distributed", description=main.__doc__)
    p.add_argument("--spawned", help=argparse.SUPPRESS)  # a rank the backend started on this machine
    p.add_argument("--base-model", help="the same base model directory as rank 0's")
    p.add_argument("--lora-r", type=int, default=LoraConfig().r)
    p.add_argument("--lora-alpha", type=int, default=LoraConfig().alpha)
    p.add_argument(
        "--dtype", default=None, help="default: by device, as rank 0 chooses (policy/precision.py)"
    )
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    if args.spawned is not None:
        _spawned_worker(args.spawned)
        return
    if args.base_model is None:
        p.error("--base-model is required")
    config = TrainerConfig.from_env()
    if config.rank == 0 or config.master_addr is None:
        raise SystemExit("run rank 0 as your training script with trainer=TrainerConfig.from_env()")
    from journeyman.policy.base_weights import pick_device
    from journeyman.policy.precision import resolve_precision
    from journeyman.policy.weights import resolve_base_model

    store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        config.master_addr,
        config.master_port or 29500,
        config.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=config.timeout_s),
    )
    spec = _WorkerSpec(
        rank=config.rank,
        world=config.world_size,
        base_model=str(resolve_base_model(args.base_model)),
        lora=LoraConfig(r=args.lora_r, alpha=args.lora_alpha).model_dump(),
        dtype=resolve_precision(args.dtype, pick_device(args.device)).dtype,
        device=args.device,
        trainer=config.model_dump(),
    )
    run_worker(spec, store, alive=lambda: _reachable(store))


_ANNOUNCE_KEY = "trainer"


def _announce(store: Any, config: TrainerConfig) -> None:
    """Rank 0's trainer settings in the store, for the ranks to read at start (control, a few bytes)."""
    store.set(_ANNOUNCE_KEY, config.model_dump_json().encode())


def _reachable(store: Any) -> bool:
    try:
        store.num_keys()  # torchrun's store lives in rank 0: gone with it
        return True
    except RuntimeError:
        return False


if __name__ == "__main__":
    main()
