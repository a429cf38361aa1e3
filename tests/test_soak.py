"""`bench/soak.py --minutes 0.1 --concurrency 32 --groups-per-step 2`, as CI runs it: 32 concurrent
multi-turn tool rollouts and, after the warm-up's, a training step on 2 groups 4 s in (or, on a slow machine, as soon as 2 groups finish), on the real model, with no failed request
and no memory blow-up (the bench's own runs use 64 rollouts for minutes to an hour: docs/soak.md). The bound here is 2 GiB over the warm-up's peak: the warm-up's step trains on the first
groups to finish, the shortest, and an engine batch's KV cache (up to ~2.6 GiB for 64 rows of ~900
tokens) depends on how the requests happened to batch, so a measured peak ran 0.8-1.6 GiB over it
in runs whose per-minute median RSS did not move at all. A leak shows in the longer runs'
per-minute slope (bench/soak.py; its own bound, for the 10-minute run, is 512 MiB)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quarter_minute_soak_has_no_errors_and_flat_memory() -> None:
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--minutes",
            "0.1",
            "--concurrency",
            "32",
            "--train-every-s",
            "4",
            "--warmup-s",
            "10",
            "--groups-per-step",
            "2",
            "--rss-bound-mib",
            "2048",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    print(r.stdout[-3000:], r.stderr[-3000:])
    report = re.search(r"soak .* (\d+) rollouts, (\d+) requests, (\d+) errors, (\d+) train steps", r.stdout)
    assert report, r.stdout + r.stderr
    rollouts, requests, errors, steps = map(int, report.groups())
    assert errors == 0 and r.returncode == 0, r.stdout
    assert rollouts >= 32 and requests >= rollouts and steps >= 1, report.group(0)
