"""Live training under random `kill -9`: every outcome posted is trained exactly once, or refused with a reason.

`journeyman serve` (embedded model) runs live training, `--episodes-per-step` episodes a step, the
gate off (every candidate promoted), while clients keep making episodes: `--calls` chat calls under
one `x-journeyman-capture` id, then the outcome. A killer sends SIGKILL at a random moment every
`--min-s`..`--max-s` seconds (mid-call, mid-outcome, mid-step: wherever it lands) and restarts the
server on the same port and run directory. A client whose request got no answer retries it after
the restart, as a client with at-least-once delivery does; an episode whose calls did not all get an
answer is given up and its outcome still posted (it must then be refused, or train what it has).

At the end, with the server up and the episodes trained, every episode id is looked up in the
run's trained trajectory files. Printed: kills, episodes, outcomes acknowledged, duplicates,
refusals (with their reasons), steps, and the check: an acknowledged outcome trained exactly once,
a refused one never, none twice. Exit code 1 if the check fails.

    uv run python bench/live_kill.py                  # 6 kills, ~10 min on 2 cores
    uv run python bench/live_kill.py --kills 2 --episodes 24

tests/test_live_kill.py runs it small, on a tiny random model that restarts in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import journeyman as jm
from journeyman.backends.server import ServerProcess

MODEL = "live-kill"


class Server:
    """The server process, restarted in place; `up` is set while it answers."""

    def __init__(self, root: Path, token: str) -> None:
        self.root, self.token = root, token
        self.process = ServerProcess(root, token).start()
        self.up = asyncio.Event()
        self.up.set()
        self.kills = 0

    async def kill_and_restart(self) -> None:
        self.up.clear()
        self.process.kill()
        self.kills += 1
        port = self.process.port
        self.process = await asyncio.to_thread(
            lambda: ServerProcess(self.root, self.token, port=port).start()
        )
        self.up.set()

    @property
    def url(self) -> str:
        return self.process.url


async def request(
    server: Server, http: httpx.AsyncClient, method: str, path: str, **kw: Any
) -> httpx.Response:
    """The request, retried across restarts until it gets an answer (at-least-once delivery)."""
    while True:
        await server.up.wait()
        try:
            return await http.request(method, server.url + path, timeout=120, **kw)
        except httpx.TransportError:
            await asyncio.sleep(0.5)


async def episode(server: Server, http: httpx.AsyncClient, i: int, calls: int, log: dict[str, Any]) -> None:
    eid = f"ep-{i}"
    for turn in range(calls):
        ask = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Task {i}, turn {turn}."}],
            "max_tokens": 4,
        }
        await server.up.wait()
        try:  # a call is not retried: an agent whose call failed goes on without it
            await http.post(
                server.url + "/v1/chat/completions",
                json=ask,
                headers={"x-journeyman-capture": eid},
                timeout=120,
            )
        except httpx.TransportError:
            log["calls_lost"] += 1
    outcome = {"episode_id": eid, "reward": random.random()}
    r = await request(server, http, "POST", f"/journeyman/v1/models/{MODEL}/outcome", json=outcome)
    body = r.json()
    if r.status_code == 200:
        log["status"][eid] = body["status"]
    else:
        log["status"][eid] = "refused"
        log["reasons"][body.get("error", {}).get("message", r.text)[:120]] += 1


def trained_ids(run_dir: Path) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    for f in sorted((run_dir / "trajectories" / "train").glob("[0-9][0-9][0-9][0-9].jsonl")):
        for line in f.read_text().splitlines():
            for t in json.loads(line)["trajectories"]:
                seen[t["metadata"]["episode_id"]] += 1
    return seen


async def main(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    root = Path(args.path or tempfile.mkdtemp(prefix="live-kill-"))
    token = secrets.token_urlsafe(24)
    server = Server(root, token)
    log: dict[str, Any] = {"status": {}, "reasons": collections.Counter(), "calls_lost": 0, "promoted": 0}
    auth = {"authorization": f"Bearer {token}"}
    model = jm.TrainableModel(
        name=MODEL,
        project="kill",
        max_tokens=4,
        **({"base_model": args.base_model} if args.base_model else {}),
    )
    t0 = time.monotonic()
    try:
        backend = jm.RemoteBackend(server.url, token=token, progress=False)
        await model.register(backend)
        # no canary: a watcher promotes each candidate (as an eval function or a person would), so
        # steps follow one another; the last episodes train once they have waited max_wait_s
        live = jm.LiveConfig(
            episodes_per_step=args.episodes_per_step,
            max_steps_off_policy=1_000_000,  # none dropped as stale: each outcome must train, not age out
            max_wait_s=3.0,
            min_episodes=1,
            settle_s=0.0,
            gate=jm.GateConfig(canary_share=0.0),
        )
        await model.live(live)

        async def promoter() -> None:
            while True:
                await asyncio.sleep(1.0)
                await server.up.wait()
                try:
                    status = await model.live_status()
                    if status.candidate is not None and not status.busy:
                        await model.decide("promote", reason="bench: every candidate")
                        log["promoted"] += 1
                except (jm.JourneymanError, httpx.HTTPError):
                    continue  # the server is down or restarting: ask again

        watcher = asyncio.create_task(promoter())
        async with httpx.AsyncClient(headers=auth) as http:
            sem = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                try:
                    await episode(server, http, i, args.calls, log)
                finally:
                    sem.release()

            async def clients() -> int:
                """Episodes, `--concurrency` at a time, until `--episodes` are made and every kill is done."""
                started: list[asyncio.Task[None]] = []
                while len(started) < args.episodes or server.kills < args.kills:
                    await sem.acquire()
                    started.append(asyncio.create_task(one(len(started))))
                await asyncio.gather(*started)
                return len(started)

            async def killer() -> None:
                while server.kills < args.kills:
                    await asyncio.sleep(random.uniform(args.min_s, args.max_s))
                    print(
                        f"kill {server.kills + 1} at {time.monotonic() - t0:.0f} s ({len(log['status'])} outcomes so far)",
                        flush=True,
                    )
                    await server.kill_and_restart()

            episodes, _ = await asyncio.gather(clients(), killer())
            deadline = time.monotonic() + args.final_wait_s  # the last episodes train (max_wait_s)
            while True:
                try:
                    status = await model.live_status()
                except (jm.JourneymanError, httpx.HTTPError):
                    await asyncio.sleep(1.0)
                    continue
                if not (status.episodes_waiting or status.busy or status.candidate is not None):
                    break
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
            watcher.cancel()
        run_dir = root / "kill" / "models" / MODEL
        seen = trained_ids(run_dir)
    finally:
        server.process.kill()
    statuses = collections.Counter(log["status"].values())
    acked = {e for e, s in log["status"].items() if s in ("accepted", "duplicate")}
    refused = {e for e, s in log["status"].items() if s == "refused"}
    twice = sorted(e for e, n in seen.items() if n > 1)
    missing = sorted(acked - set(seen))
    trained_refused = sorted(refused & set(seen))
    print(
        f"\n{server.kills} kills in {time.monotonic() - t0:.0f} s; {episodes} episodes, {args.calls} calls each "
        f"({log['calls_lost']} calls cut off by a kill); outcomes: {dict(statuses)}; "
        f"waiting at the end: {status.episodes_waiting}; trained: {sum(seen.values())} episodes in "
        f"{len(list((run_dir / 'trajectories' / 'train').glob('[0-9]*.jsonl')))} steps, {log['promoted']} promoted"
    )
    for reason, n in log["reasons"].items():
        print(f"  refused x{n}: {reason}")
    ok = not twice and not missing and not trained_refused
    print(
        f"check: acknowledged {len(acked)}, trained exactly once {len(acked & set(seen)) - len([e for e in twice if e in acked])}, "
        f"twice {len(twice)}, acknowledged but never trained {len(missing)}, refused yet trained {len(trained_refused)}: "
        + ("OK" if ok else "FAILED")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--episodes", type=int, default=48, help="at least; more while kills remain")
    p.add_argument("--calls", type=int, default=2, help="chat calls an episode")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--episodes-per-step", type=int, default=6)
    p.add_argument("--min-s", type=float, default=4.0)
    p.add_argument("--max-s", type=float, default=15.0)
    p.add_argument("--final-wait-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", default=None)
    p.add_argument("--base-model", default=None, help="default: the embedded model")
    raise SystemExit(asyncio.run(main(p.parse_args())))
