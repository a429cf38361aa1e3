"""Scale-out overhead: 1 vs 2 trainer ranks, 1 vs 2 engine replicas, in one run on this machine.

The same rollouts (the built-in task, fixed seeds) and the same training steps, on a LocalBackend
with `trainer=TrainerConfig(world_size=W)` and `engine_replicas=R`, for (W, R) in (1, 1), (2, 1),
(1, 2). Prints median seconds per train step and rollout tokens/s, and each as a ratio to (1, 1).
On a 2-core CPU expect little speed-up (both ranks share the cores; each engine replica is a worker
process with its own weights and half the cores): the point is the mechanism's overhead. On N GPUs
the same code gives each rank, and each replica, a GPU.

    uv run python bench/scale.py --rollouts 32 --max-tokens 24 --steps 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import journeyman as jm
from _task import rollout_step  # bench/ is on sys.path when a bench runs
from journeyman.app import tasks


async def measure(world_size: int, replicas: int, args: argparse.Namespace) -> tuple[float, float]:
    """(median train seconds per step after the first, rollout tokens/s)."""
    with tempfile.TemporaryDirectory() as tmp:
        backend = jm.LocalBackend(
            path=tmp, trainer=jm.TrainerConfig(world_size=world_size), engine_replicas=replicas
        )
        model = jm.TrainableModel(name="bench", project="bench")
        await model.register(backend)
        try:
            client = model.openai_client()
            scenarios = tasks.scenarios("train", args.rollouts // args.group_size, seed=3)
            rates, train_s = [], []
            for _ in range(args.steps):
                groups, rate = await rollout_step(model, client, scenarios, args.group_size, args.max_tokens)
                rates.append(rate)
                t0 = time.perf_counter()
                await model.train(groups, config=jm.TrainConfig(learning_rate=1e-5, micro_batch_tokens=256))
                train_s.append(time.perf_counter() - t0)
            return statistics.median(train_s[1:] or train_s), statistics.median(rates)
        finally:
            backend.close()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    rows = []
    for world_size, replicas in ((1, 1), (2, 1), (1, 2)):
        train_s, rate = await measure(world_size, replicas, args)
        rows.append((world_size, replicas, train_s, rate))
        print(
            f"ranks={world_size} replicas={replicas}: train {train_s:.2f} s/step, rollouts {rate:.1f} tok/s"
        )
    base_train, base_rate = rows[0][2], rows[0][3]
    print("\nratio to 1 rank, 1 replica (train: >1 is faster; rollouts: >1 is faster)")
    for world_size, replicas, train_s, rate in rows[1:]:
        print(
            f"ranks={world_size} replicas={replicas}: train speed x{base_train / train_s:.2f}, "
            f"rollout tokens/s x{rate / base_rate:.2f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
