"""Soak: many concurrent multi-turn tool rollouts for minutes, with a training step every minute.

What it shows: nothing fails, nothing hangs and memory stays flat under sustained load. 64 rollouts
run at once (each: a forced tool call, the tool's result, a free answer, filed through a capture
scope as an agent integration does), groups of 4 finish into a queue, and every `--train-every-s` the
finished groups train one step while rollouts go on. Printed: rollouts, requests and errors; p50/p99
request latency; peak RSS of the warm-up (rollouts and one training step: a step's activations are
the peak) and of the measured part, where a leak shows as growth; what the endpoint holds. To tell a
leak from allocator drift, each minute also records what malloc has handed out and not taken back
(glibc `mallinfo2`: in use, not RSS) and how many Python objects are alive: a leak grows those; drift
grows RSS while they stay flat.

    uv run python bench/soak.py                 # 10 minutes
    uv run python bench/soak.py --minutes 0.5   # about what the test suite runs (tests/test_soak.py)
    uv run python bench/soak.py --minutes 30 --plot soak.png --json soak.json

Exit status 1 when a request failed or RSS grew by more than `--rss-bound-mib`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import journeyman as jm
from pydantic import BaseModel

# tests/_support.py: the tool the endpoint tests use too
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _support import weather_tools

CITIES = ["Oslo", "Lima", "Cairo", "Perth", "Quito", "Seoul", "Turin", "Dakar"]
TOOLS = weather_tools()


class SoakReport(BaseModel):
    seconds: float
    rollouts: int
    requests: int
    errors: dict[str, int]
    train_steps: int
    latency_p50_s: float
    latency_p99_s: float
    rss_warmup_peak_mib: float  # peak RSS of the warm-up, its training step included
    rss_peak_mib: float  # peak RSS of the measured part: a leak shows as growth over the warm-up's
    rss_by_minute_mib: list[float]  # median RSS of each measured minute: a leak shows as a slope
    heap_by_minute_mib: list[float] = []  # malloc's bytes in use at the end of each minute
    objects_by_minute: list[int] = []  # live Python objects (gc-tracked) at the end of each minute
    endpoint: dict[str, float]

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_peak_mib - self.rss_warmup_peak_mib

    @property
    def rss_slope_mib_per_hour(self) -> float:
        """Theil-Sen slope of the per-minute medians (`per_hour`)."""
        return per_hour(self.rss_by_minute_mib)

    @property
    def heap_slope_mib_per_hour(self) -> float:
        return per_hour(self.heap_by_minute_mib)

    @property
    def objects_slope_per_hour(self) -> float:
        return per_hour([float(n) for n in self.objects_by_minute])


def per_hour(ys: list[float]) -> float:
    """Theil-Sen slope (the median of every pairwise slope) of per-minute values, per hour; 0 with
    fewer than 3 minutes. A median of slopes, because a training step's activation peak comes and
    goes and one odd minute must not tilt the line; a leak stays."""
    if len(ys) < 3:
        return 0.0
    pairs = [(ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys))]
    return 60 * statistics.median(pairs)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use_mib() -> float:
    """Bytes malloc has handed out and not had back (small blocks + mmapped ones), MiB; NaN off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return float("nan")
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def rss_mib() -> float:
    """This process's resident memory (Linux /proc), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(
    model: jm.TrainableModel,
    *,
    seconds: float,
    concurrency: int = 64,
    group_size: int = 4,
    groups_per_step: int = 4,
    train_every_s: float = 60.0,
    warmup_s: float = 20.0,
    max_tokens: int = 24,
) -> SoakReport:
    """Run the load on a registered model for `seconds` after a warm-up (`warmup_s` of rollouts and
    `groups_per_step` finished groups, then one training step on them); rollouts never stop for a step."""
    client = model.openai_client().with_options(max_retries=0, timeout=300)
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    finished: list[jm.Trajectory] = []
    ready: list[jm.TrajectoryGroup] = []
    requests = rollouts = steps = 0
    endpoint: dict[str, float] = {}  # what the endpoint holds, as the last step's metrics report it
    measuring = False
    stop_at = math.inf  # set when the measured part starts

    async def ask(messages: list[dict], **kw: object) -> object:
        nonlocal requests
        t0 = time.perf_counter()
        out = await client.chat.completions.create(
            model=model.name, messages=messages, tools=TOOLS, max_tokens=max_tokens, **kw
        )
        if measuring:
            latencies.append(time.perf_counter() - t0)
            requests += 1
        return out

    async def worker(w: int) -> None:
        nonlocal rollouts
        rng = random.Random(w)
        while time.monotonic() < stop_at:
            city = rng.choice(CITIES)
            messages: list[dict] = [{"role": "user", "content": f"What's the weather in {city}?"}]
            try:
                async with model.capture() as cap:
                    first = await ask(messages, tool_choice="required", temperature=1.0)
                    call = first.choices[0]  # type: ignore[attr-defined]
                    calls = call.message.tool_calls or []
                    messages += [call.message.model_dump(exclude_none=True)]
                    for c in calls:
                        messages.append({"role": "tool", "tool_call_id": c.id, "content": f"{city}: 18C"})
                    second = await ask(messages, temperature=1.0)
                answer = second.choices[0]  # type: ignore[attr-defined]
                assert len(cap.calls) == 2, f"capture filed {len(cap.calls)} calls, not 2"
            except Exception as e:  # counted and shown; a soak run keeps going
                if measuring:
                    errors[f"{type(e).__name__}: {str(e)[:120]}"] += 1
                continue
            said = (answer.message.content or "").lower()
            reward = float("18" in said) + 0.5 * float(city.lower() in said) + rng.random() * 1e-3
            finished.append(
                jm.Trajectory(messages_and_choices=[messages[0], call, *messages[2:], answer], reward=reward)
            )
            if len(finished) >= group_size:
                ready.append(jm.TrajectoryGroup(finished[:group_size]))
                del finished[:group_size]
            if measuring:
                rollouts += 1

    async def train_once() -> None:
        nonlocal steps
        # the same number of groups every step, so each step's memory peak is the same
        groups, ready[:] = ready[-groups_per_step:], []
        if groups:
            try:
                result = await model.train(groups)
                endpoint.update({k: v for k, v in result.metrics.items() if k.startswith("endpoint_")})
                steps += 1
            except Exception as e:
                errors[f"train: {type(e).__name__}: {str(e)[:120]}"] += 1

    def may_stop() -> bool:
        # past the end, the measured part still owes one step: a slow machine (CI's 2 cores ran
        # p50 43 s a request) may not finish a step's groups before `stop_at`, but the workers'
        # last in-flight rollouts do, and the step then trains while the slowest still run
        past = time.monotonic() >= stop_at
        return past and (steps > 0 or all(w.done() for w in workers))

    async def trainer() -> None:
        next_step = time.monotonic() + train_every_s
        while True:
            await asyncio.sleep(max(0.0, next_step - time.monotonic()))
            while len(ready) < groups_per_step and not may_stop():
                await asyncio.sleep(0.5)
            if len(ready) < groups_per_step or (time.monotonic() >= stop_at and steps > 0):
                return
            await train_once()
            next_step += train_every_s

    # (seconds since start, measured part?, RSS MiB), once a second, from a thread of its own: a
    # sampler on the event loop was starved by the rollouts and sampled far less than once a second
    rss: list[tuple[float, bool, float]] = []
    heap: list[float] = []  # malloc in use at the end of each measured minute
    objects: list[int] = []
    done = threading.Event()

    def sample_rss() -> None:
        start = time.monotonic()
        measured_minutes = 0
        while not done.wait(1.0):
            now = time.monotonic() - start
            rss.append((now, measuring, rss_mib()))
            if measuring and (now - measure_start) >= 60 * (measured_minutes + 1):
                measured_minutes += 1
                heap.append(heap_in_use_mib())
                objects.append(len(gc.get_objects()))
            if len(rss) % 60 == 0:  # a line a minute: long runs show where they are
                print(
                    f"[soak {now / 60:.0f} min] {rollouts} rollouts, "
                    f"{sum(errors.values())} errors, {steps} train steps, RSS {rss[-1][2]:.0f} MiB, "
                    f"malloc in use {heap_in_use_mib():.0f} MiB" + ("" if measuring else " (warm-up)"),
                    file=sys.stderr,
                    flush=True,
                )

    workers = [asyncio.create_task(worker(w)) for w in range(concurrency)]
    measure_start = math.inf  # seconds after the sampler's start when the measured part began
    sampler = threading.Thread(target=sample_rss, name="soak-sampler", daemon=True)
    sampler_start = time.monotonic()
    sampler.start()
    warm_until = time.monotonic() + warmup_s
    while (
        time.monotonic() < warm_until or len(ready) < groups_per_step
    ) and time.monotonic() < warm_until + 600:
        await asyncio.sleep(0.5)
    await train_once()  # the first step allocates the optimizer state and training buffers: warm-up
    steps = 0
    measure_start = time.monotonic() - sampler_start
    measuring, t0 = True, time.perf_counter()
    stop_at = time.monotonic() + seconds
    await asyncio.gather(*workers, asyncio.create_task(trainer()))
    done.set()
    sampler.join()
    elapsed = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    measured = [m for _, was_measured, m in rss if was_measured]
    minutes: dict[int, list[float]] = {}
    for t, was_measured, m in rss:
        if was_measured:
            minutes.setdefault(int((t - measure_start) // 60), []).append(m)
    by_minute = [statistics.median(v) for _, v in sorted(minutes.items())]
    return SoakReport(
        seconds=elapsed,
        rollouts=rollouts,
        requests=requests,
        errors=dict(errors),
        train_steps=steps,
        latency_p50_s=q[49],
        latency_p99_s=q[98],
        rss_warmup_peak_mib=max(m for _, measured, m in rss if not measured),
        rss_peak_mib=max(measured),
        rss_by_minute_mib=by_minute,
        heap_by_minute_mib=heap,
        objects_by_minute=objects,
        endpoint=endpoint,
    )


def plot(report: SoakReport, path: Path) -> None:
    """Median RSS per measured minute, with the warm-up's peak as a reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    minutes = range(1, len(report.rss_by_minute_mib) + 1)
    ax.plot(minutes, report.rss_by_minute_mib, marker="o", label="median RSS of the minute")
    if report.heap_by_minute_mib:
        ax.plot(
            range(1, len(report.heap_by_minute_mib) + 1),
            report.heap_by_minute_mib,
            marker=".",
            label=f"malloc in use ({report.heap_slope_mib_per_hour:+.0f} MiB/h)",
        )
    ax.axhline(report.rss_warmup_peak_mib, color="grey", linestyle="--", label="warm-up peak")
    ax.set(
        xlabel="minute",
        ylabel="MiB",
        title=f"soak: {report.rollouts} rollouts, "
        f"{sum(report.errors.values())} errors, RSS {report.rss_slope_mib_per_hour:+.0f} MiB/h",
    )
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def show(report: SoakReport) -> str:
    return (
        f"soak {report.seconds / 60:.1f} min: {report.rollouts} rollouts, {report.requests} requests, "
        f"{sum(report.errors.values())} errors, {report.train_steps} train steps; latency p50 "
        f"{report.latency_p50_s:.2f} s p99 {report.latency_p99_s:.2f} s; peak RSS {report.rss_warmup_peak_mib:.0f} "
        f"MiB in warm-up -> {report.rss_peak_mib:.0f} MiB measured ({report.rss_growth_mib:+.0f}); "
        f"median RSS by minute {report.rss_by_minute_mib[0]:.0f} -> {report.rss_by_minute_mib[-1]:.0f} MiB, "
        f"slope {report.rss_slope_mib_per_hour:+.0f} MiB/h; malloc in use slope "
        f"{report.heap_slope_mib_per_hour:+.0f} MiB/h; live Python objects slope {report.objects_slope_per_hour:+.0f}/h; "
        f"endpoint {json.dumps(report.endpoint)}"
        + (f"\nerrors: {json.dumps(report.errors, indent=1)}" if report.errors else "")
    )


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--train-every-s", type=float, default=60.0)
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--groups-per-step", type=int, default=4, help="finished groups of 4 each step trains on")
    p.add_argument("--rss-bound-mib", type=float, default=512.0)
    p.add_argument("--plot", type=Path, help="write the RSS-by-minute plot (PNG) here")
    p.add_argument("--json", type=Path, help="write the report (JSON) here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as run:
        backend = jm.LocalBackend(path=Path(run))
        model = jm.TrainableModel(name="soak", project="bench")
        await model.register(backend)
        try:
            report = await soak(
                model,
                seconds=args.minutes * 60,
                concurrency=args.concurrency,
                train_every_s=args.train_every_s,
                warmup_s=args.warmup_s,
                groups_per_step=args.groups_per_step,
            )
        finally:
            backend.close()
    print(show(report))
    if args.plot:
        plot(report, args.plot)
    if args.json:
        args.json.write_text(report.model_dump_json(indent=1))
    bad = sum(report.errors.values()) > 0 or report.rss_growth_mib > args.rss_bound_mib
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
