"""What `/metrics` costs a request: the server's timing middleware (`backends/metrics.py`,
`TimedRequests`) against the same app without it, in one run.

Two FastAPI apps with one trivial route, one wrapped in `TimedRequests` over a real `ServerMetrics`
(latency histogram by route template and status, error counter), are asked `--requests` times each
through httpx's in-process ASGI transport, in alternating blocks so both see the same machine. A
trivial route leaves nothing but the middleware to measure: a chat completion's own time (tens of
milliseconds on a CPU) only adds to the denominator. Then one scrape (`ServerMetrics.render`) of
the histogram those requests filled.

    uv run python bench/metrics_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from fastapi import FastAPI
from journeyman.backends.metrics import ModelSource, ServerMetrics, TimedRequests


def app(timed: bool) -> tuple[FastAPI, ServerMetrics | None]:
    a = FastAPI()

    @a.get("/journeyman/v1/models/{name}/step")
    async def step(name: str) -> int:
        return len(name)

    if not timed:
        return a, None
    metrics = ServerMetrics(ModelSource(lambda: [], None))
    a.add_middleware(TimedRequests, metrics=metrics)
    return a, metrics


async def block(client: httpx.AsyncClient, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        r = await client.get(f"/journeyman/v1/models/m{i % 8}/step")
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200
    return out


async def main(args: argparse.Namespace) -> None:
    plain, _ = app(timed=False)
    timed, metrics = app(timed=True)
    assert metrics is not None
    clients = {
        name: httpx.AsyncClient(transport=httpx.ASGITransport(a), base_url="http://bench")
        for name, a in (("plain", plain), ("timed", timed))
    }
    seconds: dict[str, list[float]] = {"plain": [], "timed": []}
    for c in clients.values():  # warm-up
        await block(c, 200)
    for _ in range(args.blocks):
        for name, c in clients.items():
            seconds[name] += await block(c, args.requests // args.blocks)
    for c in clients.values():
        await c.aclose()
    med = {k: statistics.median(v) * 1e6 for k, v in seconds.items()}
    p99 = {k: statistics.quantiles(v, n=100)[98] * 1e6 for k, v in seconds.items()}
    t0 = time.perf_counter()
    text = metrics.render()
    scrape = (time.perf_counter() - t0) * 1e3
    print(f"{args.requests} requests each, in {args.blocks} alternating blocks")
    print(f"  without the middleware: median {med['plain']:.0f} us, p99 {p99['plain']:.0f} us")
    print(f"  with it:                median {med['timed']:.0f} us, p99 {p99['timed']:.0f} us")
    print(
        f"  cost a request: {med['timed'] - med['plain']:+.0f} us median ({med['timed'] / med['plain']:.2f}x)"
    )
    print(f"  one scrape of what they recorded: {scrape:.2f} ms, {len(text)} bytes")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--blocks", type=int, default=10)
    asyncio.run(main(p.parse_args()))
