"""`bench/gpu_check.py --dry-run`: every section of the one command for a GPU machine runs at toy
size here, on the CPU, and prints its table, so the command cannot rot between GPU machines."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = [
    "1 precision",
    "2 7B-width",
    "3 checkpointing",
    "4 packed attention",
    "5 memory handoff",
    "6 decode",
    "7 GRPO vs TRL",
    "8 vLLM wake",
]


def _strict(name: str) -> Any:
    raise ValueError(f"{name} in the JSON file: it must be strict JSON")


@pytest.mark.slow  # ~65 s of CPU time on the 2-core machine: imports, a dozen toy models, FlexAttention's compile
def test_dry_run_runs_every_section_and_writes_strict_json(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    if "PYTEST_XDIST_WORKER_COUNT" in env:  # the process computes on this worker's share of the cores
        share = max(1, (os.cpu_count() or 2) // int(env["PYTEST_XDIST_WORKER_COUNT"]))
        env["OMP_NUM_THREADS"] = str(share)
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    report = json.loads(out.read_text(), parse_constant=_strict)
    rows = report["rows"]
    assert report["dry_run"] is True and "random weights" in report["base_model"]
    assert not [row for row in rows if row["ok"] is False], rows
    by_section: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_section.setdefault(row["section"], {})[row["setting"]] = row
    for name in SECTIONS:  # a row of its own beside its elapsed time, and a line in the printed table
        assert set(by_section.get(name, {})) - {"elapsed"}, f"section {name!r} has no row: {rows}"
        assert f"\n{name}" in r.stdout

    precision = by_section["1 precision"]
    nll = {m: precision[f"base {m}: loss (NLL, 1st step)"]["figure"] for m in ("fp32", "TF32", "bf16")}
    # random weights over a 4096-token vocabulary: about ln 4096 = 8.3 nats, whatever the precision
    assert all(abs(v - math.log(4096)) < 0.5 for v in nll.values()), nll
    assert abs(nll["fp32"] - nll["TF32"]) < 1e-6  # TF32 is CUDA's: the same numbers on the CPU
    packed = by_section["4 packed attention"]
    gaps = [row["figure"] for setting, row in packed.items() if "vs rows" in setting]
    assert len(gaps) >= 5 and max(gaps) < 1e-4, packed
    assert by_section["5 memory handoff"]["wake-sized allocation, 2nd process"]["ok"] is True
    decode = [row for setting, row in by_section["6 decode"].items() if setting.endswith("tokens")]
    assert len(decode) == 6 and all(row["figure"] > 0 and row["ok"] for row in decode), decode  # eager, fixed
    assert by_section["6 decode"]["greedy logprob max|diff|, eager vs fixed"]["ok"] is True
    assert "CUDA" in by_section["8 vLLM wake"]["wake check"]["note"]
