"""Several engine replicas behind one endpoint: group affinity, least-loaded otherwise, dead ones out.

The rollouts of one group share their conversation's start (system prompt, tools, the scenario's
user turn), so the endpoint gives each request an affinity key made of it; a key always maps to
the same live replica, whose prefix cache then serves the whole group. When that replica is busier
than the least-loaded one by more than `max_skew` requests, the request goes to the least loaded.
A replica whose request fails with `EngineDownError` is taken out of rotation: its in-flight
requests fail with that error (an agent's rollout raises, counted by `max_exceptions`), the others
continue; every new step's adapter is loaded on each live replica, and a replica that runs as a
worker process (`torch_process`) and went down is started afresh on that adapter and rejoins.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Sequence
from pathlib import Path

from journeyman.engine.base import Engine, OnToken, Sample, SamplingParams
from journeyman.errors import EngineDownError

log = logging.getLogger(__name__)


class ReplicatedEngine(Engine):
    def __init__(self, replicas: Sequence[Engine], max_skew: int = 8) -> None:
        if not replicas:
            raise ValueError("ReplicatedEngine needs at least one replica")
        self.replicas = list(replicas)
        self.max_skew = max_skew
        self.in_flight = [0] * len(self.replicas)
        self.down: set[int] = set()
        self.routed = [0] * len(self.replicas)
        self.step = self.replicas[0].step
        self.serves_other_steps = all(r.serves_other_steps for r in self.replicas)

    def live(self) -> list[int]:
        for i, r in enumerate(self.replicas):
            if i not in self.down and not r.alive:  # a worker that died between requests
                self.down.add(i)
                log.error(
                    "engine replica %d is down; %d replicas left", i, len(self.replicas) - len(self.down)
                )
        return [i for i in range(len(self.replicas)) if i not in self.down]

    def pick(self, affinity: str | None) -> int:
        live = self.live()
        if not live:
            raise EngineDownError(f"all {len(self.replicas)} engine replicas are down")
        least = min(live, key=lambda i: (self.in_flight[i], i))
        if affinity is None:
            return least
        home = live[zlib.crc32(affinity.encode()) % len(live)]
        return home if self.in_flight[home] <= self.in_flight[least] + self.max_skew else least

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None = None
    ) -> list[Sample]:
        i = self.pick(params.affinity)
        self.in_flight[i] += 1
        self.routed[i] += 1
        try:
            return await self.replicas[i].generate(prompt_ids, params, on_token)
        except EngineDownError:
            if i not in self.down:
                self.down.add(i)
                log.error("engine replica %d is down; %d replicas left", i, len(self.live()))
            raise
        finally:
            self.in_flight[i] -= 1

    async def load_adapter(self, path: Path, step: int) -> None:
        live, dead = self.live(), sorted(self.down)
        results = await asyncio.gather(
            *(self.replicas[i].load_adapter(path, step) for i in live),
            *(self._restart(i, path, step) for i in dead),
            return_exceptions=True,
        )
        for i, res in zip(live, results[: len(live)], strict=True):
            if isinstance(res, BaseException):
                self.down.add(i)
                log.error("engine replica %d could not load step %d (%s): out of rotation", i, step, res)
        for i, res in zip(dead, results[len(live) :], strict=True):
            if isinstance(res, BaseException):
                log.error("engine replica %d could not be restarted (%s): still out of rotation", i, res)
        if not self.live():
            raise EngineDownError(f"no engine replica could load the adapter of step {step}")
        self.step = step

    async def _restart(self, i: int, path: Path, step: int) -> None:
        """A down replica that can be started afresh (a worker process) is, serving `path`."""
        from journeyman.engine.torch_process import TorchProcessEngine

        old = self.replicas[i]
        if not isinstance(old, TorchProcessEngine):
            raise EngineDownError(f"engine replica {i} ({type(old).__name__}) cannot be restarted")
        fresh = await asyncio.to_thread(old.restarted, path, step)
        try:
            await asyncio.to_thread(fresh.wait_ready)
        except BaseException:
            fresh.close()
            raise
        self.replicas[i] = fresh
        self.down.discard(i)
        log.warning("engine replica %d restarted on step %d; back in rotation", i, step)

    async def sleep(self) -> None:
        await asyncio.gather(*(self.replicas[i].sleep() for i in self.live()))

    async def wake(self) -> None:
        await asyncio.gather(*(self.replicas[i].wake() for i in self.live()))

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    @property
    def requests_served(self) -> int:
        return sum(r.requests_served for r in self.replicas)

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for r in self.replicas:
            for k, v in r.counters().items():
                total[k] = total.get(k, 0) + v
        return total
