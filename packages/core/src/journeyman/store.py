"""The run directory of one model: checkpoints, trajectories, metric history, resume state.

<path>/<project>/models/<name>/
    checkpoints/<step:04d>/   adapter (PEFT format) + optimizer.pt
    trajectories/<split>/<step:04d>.jsonl   one TrajectoryGroup per line, written before training
    history.jsonl             one row of metrics per step (train) or per log call (val, ...)
    state.json                {"step": N, "base_model": ...}
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import check_name
from .errors import InvalidFieldError
from .types import TrajectoryGroup

KEPT_REQUESTS = 64


class RunStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        path = self.root / "state.json"
        return json.loads(path.read_text()) if path.exists() else {"step": 0}

    def latest_step(self) -> int:
        return int(self.state()["step"])

    def write_state(self, step: int, request: tuple[str, dict[str, Any]] | None = None, **extra: Any) -> None:
        """The run's commit point, written atomically (a kill never leaves half a state).

        `request` = (idempotency key, result) of the train call this state completes: the last
        `KEPT_REQUESTS` are kept, so a retry of any of them returns its result instead of training again.
        """
        requests: dict[str, Any] = dict(self.state().get("requests", {}))
        if request is not None:
            requests[request[0]] = request[1]
            requests = dict(list(requests.items())[-KEPT_REQUESTS:])
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps({"step": step, **extra, "requests": requests}))
        os.replace(tmp, self.root / "state.json")

    def request_result(self, key: str) -> dict[str, Any] | None:
        """The result of the train call with idempotency key `key`, if it completed."""
        return self.state().get("requests", {}).get(key)

    def mark_written(self, key: str) -> bool:
        """Record that the groups of request `key` are on disk; False if they already were."""
        marker = self.root / "requests" / f"{check_name('idempotency_key', key)}.written"
        if marker.exists():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return True

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.root / "checkpoints" / f"{step:04d}"

    def checkpoint_steps(self) -> list[int]:
        d = self.root / "checkpoints"
        if not d.exists():
            return []
        return sorted(
            int(p.name)
            for p in d.iterdir()
            if p.name.isdigit() and (p / "adapter_model.safetensors").exists()
        )

    def delete_checkpoints(
        self, best_checkpoint_metric: str = "val/reward", keep_latest: bool = True
    ) -> list[int]:
        """Delete every checkpoint but the best by `best_checkpoint_metric` (higher is better) and the latest."""
        steps = self.checkpoint_steps()
        best: tuple[float, int] | None = None
        for row in self.history():
            value = row.get(best_checkpoint_metric)
            if (
                isinstance(value, int | float)
                and math.isfinite(value)
                and row.get("step") in steps
                and (best is None or value > best[0])
            ):
                best = (float(value), int(row["step"]))
        keep = {steps[-1]} if steps and keep_latest else set()
        if best is not None:
            keep.add(best[1])
        deleted = [s for s in steps if s not in keep]
        for s in deleted:
            shutil.rmtree(self.checkpoint_dir(s))
        return deleted

    # -- trajectories and history ------------------------------------------------------------
    def write_groups(self, groups: Sequence[TrajectoryGroup], split: str, step: int) -> Path:
        check_name("split", split)
        path = self.root / "trajectories" / split / f"{step:04d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for g in groups:
                f.write(g.model_dump_json() + "\n")
            f.flush()
            os.fsync(f.fileno())
        return path

    def read_groups(self, split: str, step: int) -> list[TrajectoryGroup]:
        path = self.root / "trajectories" / check_name("split", split) / f"{step:04d}.jsonl"
        if not path.exists():
            raise InvalidFieldError("step", step, f"no {split} trajectories at {path}")
        return [
            TrajectoryGroup.model_validate_json(line)
            for line in path.read_text().splitlines()
            if line.strip()
        ]

    def append_history(self, row: dict[str, Any]) -> None:
        with (self.root / "history.jsonl").open("a") as f:
            f.write(json.dumps({"recorded_at": time.time(), **row}) + "\n")

    def history(self) -> list[dict[str, Any]]:
        path = self.root / "history.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
