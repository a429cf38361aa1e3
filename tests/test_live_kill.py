"""`bench/live_kill.py` small, as CI runs it: `kill -9` of `journeyman serve` at random moments of a
live run, restarted in place, clients retrying the outcomes that got no answer; every outcome posted
is trained exactly once or refused with a reason (the bench's own exit code says so). On a tiny
random model (tests/_support.py `tiny_model_dir`), which restarts in seconds: what is under test is
the journal, not the model (the bench's default, the embedded model: docs/live.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _support import tiny_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]


def test_random_kills_of_a_live_server_lose_and_repeat_no_outcome(tmp_path: Path) -> None:
    args = ["--kills", "3", "--episodes", "18", "--min-s", "2", "--max-s", "5", "--episodes-per-step", "8"]
    args += ["--concurrency", "2"]
    args += ["--base-model", str(tiny_model_dir()), "--path", str(tmp_path), "--seed", "1"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "live_kill.py"), *args],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    print(r.stdout[-3000:], r.stderr[-3000:])
    check = re.search(r"check: acknowledged (\d+), trained exactly once (\d+), twice (\d+)", r.stdout)
    kills = re.search(r"(\d+) kills in", r.stdout)
    assert check and kills, r.stdout + r.stderr[-3000:]
    acknowledged, once, twice = map(int, check.groups())
    assert r.returncode == 0 and int(kills.group(1)) >= 1, r.stdout
    assert acknowledged >= 1 and once == acknowledged and twice == 0, check.group(0)
