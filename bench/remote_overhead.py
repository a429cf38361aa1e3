"""RemoteBackend vs LocalBackend: what going through `journeyman serve` over HTTP costs.

The same rollouts (concurrent chat completions of the built-in task, fixed seeds) and the same
training steps, first on a LocalBackend in this process, then through a RemoteBackend to
`journeyman serve` on 127.0.0.1 (a child process; both never run at once, they share the CPU).
Prints completion tokens/s of the rollouts and seconds per train step for each, as ratios
(goal: remote/local >= 0.95 for rollouts), and the compressed bytes sent per trajectory.

    uv run python bench/remote_overhead.py --rollouts 32 --max-tokens 32 --steps 3

Medians over the steps after the first (which warms caches and allocators up).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
import time

import journeyman as jm
from _task import rollout_step  # bench/ is on sys.path when a bench runs
from journeyman.app import tasks
from journeyman.backends.server import ServerProcess


async def measure(
    backend: jm.Backend, args: argparse.Namespace
) -> tuple[float, float, list[jm.TrajectoryGroup]]:
    """(rollout tokens/s, median train seconds per step, the last step's groups)."""
    model = jm.TrainableModel(name="bench", project="bench")
    await model.register(backend)
    client = model.openai_client()
    scenarios = tasks.scenarios("train", args.rollouts // args.group_size, seed=3)
    await client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "warm up"}], max_tokens=4
    )
    rates, train_s, groups = [], [], []
    for step in range(args.steps):
        groups, rate = await rollout_step(model, client, scenarios, args.group_size, args.max_tokens)
        rates.append(rate)
        t0 = time.perf_counter()
        await model.train(groups, config=jm.TrainConfig(learning_rate=1e-5), idempotency_key=f"bench-{step}")
        train_s.append(time.perf_counter() - t0)
        print(f"  step {step}: {rates[-1]:6.1f} rollout tokens/s, train {train_s[-1]:5.1f} s")
    timed = slice(1, None) if args.steps > 1 else slice(None)  # step 0 warms caches and allocators up
    return statistics.median(rates[timed]), statistics.median(train_s[timed]), groups


async def main(args: argparse.Namespace) -> None:
    print("local (LocalBackend in this process)")
    with tempfile.TemporaryDirectory(prefix="jm-bench-local-") as path:
        local = jm.LocalBackend(path=path)
        try:
            local_rate, local_train, _ = await measure(local, args)
        finally:
            local.close()
    print("remote (RemoteBackend -> journeyman serve on 127.0.0.1)")
    with tempfile.TemporaryDirectory(prefix="jm-bench-remote-") as path:
        token = secrets.token_urlsafe(24)
        server = ServerProcess(path, token).start()
        try:
            remote = jm.RemoteBackend(server.url, token=token, progress=False)
            remote_rate, remote_train, groups = await measure(remote, args)
        finally:
            server.kill()
    trajectories = sum(len(g.trajectories) for g in groups)
    print(f"{args.rollouts} concurrent rollouts x <= {args.max_tokens} tokens, {args.steps} steps")
    print(
        f"rollouts: local {local_rate:6.1f} tok/s, remote {remote_rate:6.1f} tok/s, remote/local {remote_rate / local_rate:.3f}"
    )
    print(
        f"train:    local {local_train:6.1f} s, remote {remote_train:6.1f} s, local/remote {local_train / remote_train:.3f}"
    )
    print(
        f"sent: {remote.sent_bytes / (trajectories * args.steps):.0f} gzip bytes per trajectory (train bodies)"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
