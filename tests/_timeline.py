"""Where the suite's time goes: per test, wall seconds and CPU seconds (the worker's own, and its
reaped child processes'), one JSON line per test per xdist worker. The numbers behind FILE_SECONDS
in the root conftest.py.

    JOURNEYMAN_TIMELINE=.pytest-timeline ./dev test   # <worker>.jsonl there (the root conftest registers this)
    uv run python tests/_timeline.py .pytest-timeline  # per-file wall and CPU, longest first

A child's CPU counts when it is reaped, so a module-scoped server's shows up on the test whose
teardown stopped it; servers that outlive every test are not counted at all.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

OUT = Path(os.environ.get("JOURNEYMAN_TIMELINE") or ".pytest-timeline")
_file: IO[str] | None = None


def _cpu() -> tuple[float, float]:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _file
    if _file is None:
        OUT.mkdir(parents=True, exist_ok=True)
        _file = (OUT / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl").open("a")
    t0, (me0, ch0) = time.time(), _cpu()
    yield
    me1, ch1 = _cpu()
    line = {"id": item.nodeid, "t0": t0, "t1": time.time(), "cpu": me1 - me0, "children_cpu": ch1 - ch0}
    _file.write(json.dumps(line) + "\n")
    _file.flush()


def summary(out: Path = OUT) -> str:
    """Per file: wall seconds, the worker's CPU seconds, its children's; then each worker's span."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    spans: dict[str, tuple[float, float]] = {}
    for path in sorted(out.glob("*.jsonl")):
        tests = [json.loads(line) for line in path.read_text().splitlines()]
        if tests:
            spans[path.stem] = (min(t["t0"] for t in tests), max(t["t1"] for t in tests))
        for t in tests:
            row = files[t["id"].split("::")[0]]
            row[0] += t["t1"] - t["t0"]
            row[1] += t["cpu"]
            row[2] += t["children_cpu"]
    lines = [f"{'file':64s} {'wall':>6s} {'cpu':>6s} {'child':>6s}"]
    for name, (wall, cpu, child) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{name[-64:]:64s} {wall:6.0f} {cpu:6.0f} {child:6.0f}")
    start = min((s for s, _ in spans.values()), default=0.0)
    lines += [f"{w}: busy until {end - start:.0f} s" for w, (_, end) in sorted(spans.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
