"""Many models on one base: N models registered on one backend against one backend per model.

Each arm runs in a fresh process (so RSS is its own): it registers N models on the embedded base,
either all on one `LocalBackend` ("one backend": they share one copy of the base's weights) or each
on a backend of its own ("a backend each": N copies, as every `register` built before), then sends
every model the same rollouts at once (`--requests` concurrent completions of `--max-tokens` tokens
a model) and measures resident memory and aggregate completion tokens a second.

Printed: per arm and N, RSS once every model has served (the weights are mmapped, so what was never
read does not count before), what each model added on average past the first, tokens/s and the
ratio one backend / a backend each at the same N; the memory that the N-th model adds, as a share
of what the first one cost.

    uv run python bench/many_models.py                       # N = 1, 2, 4, 8; ~10 min on 2 cores
    uv run python bench/many_models.py --models 1 2 --json many.json --plot many.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

Arm = Literal["one-backend", "backend-each"]
ARMS: tuple[Arm, ...] = ("one-backend", "backend-each")
PROMPTS = [
    "Name three rivers of Europe.",
    "What does a thermometer measure?",
    "Give one use of copper.",
    "Why do leaves change colour?",
]


class ArmResult(BaseModel):
    arm: Arm
    models: int
    rss_before_mib: float  # after importing and loading nothing: the process's own floor
    rss_registered_mib: float  # every model registered, nothing sampled yet (weights are mmapped:
    # pages not yet read do not count)
    rss_served_mib: float  # after the rollouts, every weight read: what the models hold
    rss_peak_mib: float  # the process's peak (VmHWM), the rollouts included
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


async def _run_arm(arm: Arm, n: int, requests: int, max_tokens: int, path: Path) -> ArmResult:
    import journeyman as jm

    rss0 = _status_mib("VmRSS")
    backends: list[jm.LocalBackend] = []
    models: list[jm.TrainableModel] = []
    for i in range(n):
        if arm == "backend-each" or not backends:
            backends.append(jm.LocalBackend(path=path / f"backend-{len(backends)}"))
        model = jm.TrainableModel(name=f"agent-{i}", project="many-models", max_tokens=max_tokens)
        await model.register(backends[-1])
        models.append(model)
    rss_registered = _status_mib("VmRSS")

    async def ask(model: jm.TrainableModel, k: int) -> int:
        done = await model.openai_client().chat.completions.create(
            model=model.name,
            messages=[{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
            max_tokens=max_tokens,
            temperature=1.0,
            seed=k,
        )
        return done.usage.completion_tokens if done.usage else 0

    # one warm-up request a model (first-call costs: the first batch's allocations, the grammar)
    await asyncio.gather(*(ask(m, 0) for m in models))
    t0 = time.monotonic()
    counts = await asyncio.gather(*(ask(m, k) for m in models for k in range(requests)))
    seconds = time.monotonic() - t0
    rss_served = _status_mib("VmRSS")
    for b in backends:
        b.close()
    return ArmResult(
        arm=arm,
        models=n,
        rss_before_mib=rss0,
        rss_registered_mib=rss_registered,
        rss_served_mib=rss_served,
        rss_peak_mib=_status_mib("VmHWM"),
        tokens=sum(counts),
        seconds=seconds,
    )


def _child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(_run_arm(args.arm, args.n, args.requests, args.max_tokens, Path(tmp)))
    print("RESULT " + result.model_dump_json(), flush=True)


def _spawn(arm: Arm, n: int, args: argparse.Namespace) -> ArmResult:
    cmd = [sys.executable, __file__, "--child", "--arm", arm, "--n", str(n)]
    cmd += ["--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{arm} with {n} models failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return ArmResult.model_validate_json(lines[-1].removeprefix("RESULT "))


def _table(results: list[ArmResult]) -> str:
    by = {(r.arm, r.models): r for r in results}
    rows = [
        "| models | arm | RSS serving (MiB) | added a model past the first (MiB) | peak (MiB) | tok/s | one/each |"
    ]
    rows.append("|---|---|---|---|---|---|---|")
    for r in results:
        first = by.get((r.arm, 1))
        added = (r.rss_served_mib - first.rss_served_mib) / (r.models - 1) if first and r.models > 1 else None
        other = by.get(("backend-each", r.models))
        ratio = f"{r.tokens_per_s / other.tokens_per_s:.2f}x" if r.arm == "one-backend" and other else ""
        rows.append(
            f"| {r.models} | {r.arm} | {r.rss_served_mib:.0f} | "
            f"{'' if added is None else f'{added:.0f}'} | {r.rss_peak_mib:.0f} | {r.tokens_per_s:.1f} | {ratio} |"
        )
    return "\n".join(rows)


def _nth_share(results: list[ArmResult], arm: Arm) -> str | None:
    """What the last model added (the step between the two largest N, per model) as a share of what
    the first cost (its RSS over the process's floor)."""
    mine = sorted((r for r in results if r.arm == arm), key=lambda r: r.models)
    if len(mine) < 2 or mine[0].models != 1:
        return None
    first = mine[0].rss_served_mib - mine[0].rss_before_mib
    a, b = mine[-2], mine[-1]
    each = (b.rss_served_mib - a.rss_served_mib) / (b.models - a.models)
    return f"{arm}: model {b.models} adds ~{each:.0f} MiB, {100 * each / first:.1f}% of the first's {first:.0f} MiB"


def _plot(results: list[ArmResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, tps) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in ARMS:
        mine = sorted((r for r in results if r.arm == arm), key=lambda r: r.models)
        xs = [r.models for r in mine]
        mem.plot(xs, [r.rss_served_mib for r in mine], marker="o", label=arm)
        tps.plot(xs, [r.tokens_per_s for r in mine], marker="o", label=arm)
    mem.set(xlabel="models", ylabel="RSS serving, weights read (MiB)", title="memory")
    tps.set(xlabel="models", ylabel="completion tokens / s (all models)", title="throughput")
    mem.legend()
    tps.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--models", type=int, nargs="+", default=[1, 2, 4, 8], help="N: models in each arm")
    p.add_argument("--requests", type=int, default=4, help="concurrent completions a model")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens a completion")
    p.add_argument("--timeout-s", type=float, default=1800, help="the most one arm may take")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write a PNG of memory and throughput here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    results: list[ArmResult] = []
    for n in args.models:
        for arm in ARMS:
            if n == 1 and arm == "backend-each":  # one model: the same thing as one backend
                continue
            print(f"{arm}, {n} model(s)...", file=sys.stderr, flush=True)
            results.append(_spawn(arm, n, args))
            print(f"  {results[-1].model_dump_json()}", file=sys.stderr, flush=True)
    ones = [r for r in results if r.models == 1]
    results += [r.model_copy(update={"arm": "backend-each"}) for r in ones]  # the same run
    results.sort(key=lambda r: (r.models, ARMS.index(r.arm)))
    print(_table(results))
    for arm in ARMS:
        if line := _nth_share(results, arm):
            print(line)
    if args.json:
        args.json.write_text(json.dumps([r.model_dump() for r in results], indent=1))
    if args.plot:
        _plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
