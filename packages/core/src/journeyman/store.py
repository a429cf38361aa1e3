"""The run directory of one model: checkpoints, trajectories, metric history, resume state.

<path>/<project>/models/<name>/
    checkpoints/<step:04d>/   adapter (PEFT format) + optimizer.pt + manifest.json (sizes, sha256)
    trajectories/<split>/<step:04d>.jsonl   one TrajectoryGroup per line, written before training
    history.jsonl             one row of metrics per step (train) or per log call (val, ...)
    state.json                {"step": N, "base_model": ...}

Every write that a resume depends on is atomic (temp + fsync + rename): a checkpoint directory
appears whole or not at all, and `state.json` (the commit point) names only a checkpoint that is
already on disk. A resume verifies the committed checkpoint against its manifest and falls back to
the newest good one before it, so a truncated or corrupt file costs steps, never the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .config import check_name
from .errors import CheckpointError, InvalidFieldError
from .types import TrajectoryGroup

log = logging.getLogger("journeyman.store")

KEPT_REQUESTS = 64
MANIFEST = "manifest.json"
ADAPTER_FILE = "adapter_model.safetensors"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """`path` holds either its old text or `text`, never part of either, even across a power cut."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class RunStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        path = self.root / "state.json"
        if not path.exists():
            return {"step": 0}
        try:
            state = json.loads(path.read_text())
            int(state["step"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(None, str(path), f"is unreadable ({type(e).__name__}: {e})") from e
        return state

    def latest_step(self) -> int:
        return int(self.state()["step"])

    def check_step(self, step: int) -> None:
        """Refuse, naming it, a step this run does not have (0, the base model, it always has)."""
        latest = self.latest_step()
        if not 0 <= step <= latest:
            raise InvalidFieldError("step", step, f"the run at {self.root} has steps 0..{latest}")

    def write_state(self, step: int, request: tuple[str, dict[str, Any]] | None = None, **extra: Any) -> None:
        """The run's commit point, written atomically (a kill never leaves half a state).

        `request` = (idempotency key, result) of the train call this state completes: the last
        `KEPT_REQUESTS` are kept, so a retry of any of them returns its result instead of training again.
        """
        requests: dict[str, Any] = dict(self.state().get("requests", {}))
        if request is not None:
            requests[request[0]] = request[1]
            requests = dict(list(requests.items())[-KEPT_REQUESTS:])
        self._commit(step, requests, extra)

    def _commit(self, step: int, requests: dict[str, Any], extra: dict[str, Any]) -> None:
        write_atomic(self.root / "state.json", json.dumps({"step": step, **extra, "requests": requests}))

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
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / ADAPTER_FILE).exists())

    def write_checkpoint(self, step: int, save: Callable[[Path], None]) -> Path:
        """Checkpoint `step`, whole or not at all: `save(dir)` fills a temporary directory, each file
        is fsynced and listed in the manifest with its size and sha256, then the directory is renamed
        into place. A failure (disk full, I/O error) removes the partial directory and raises
        CheckpointError; earlier checkpoints and `state.json` are untouched."""
        final = self.checkpoint_dir(step)
        tmp = final.with_name(f".{final.name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            save(tmp)
            files: dict[str, dict[str, Any]] = {}
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                _fsync_file(f)
                files[f.relative_to(tmp).as_posix()] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            write_atomic(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
            if final.exists():  # left by a step killed before it committed: never served, replaced
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            file = getattr(e, "filename", None) or str(tmp)
            raise CheckpointError(step, str(file), f"could not be written ({type(e).__name__}: {e})") from e
        return final

    def verify_checkpoint(self, step: int) -> Path:
        """Checkpoint `step`'s directory if every file matches its manifest; else CheckpointError
        naming the step and the first bad file. Checkpoints from before manifests existed are
        checked for a readable adapter only."""
        d = self.checkpoint_dir(step)
        manifest = d / MANIFEST
        if not manifest.exists():
            adapter = d / ADAPTER_FILE
            if not adapter.exists():
                raise CheckpointError(step, str(adapter), "is missing")
            _check_safetensors(step, adapter)
            return d
        try:
            files: dict[str, dict[str, Any]] = json.loads(manifest.read_text())["files"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(step, str(manifest), f"is unreadable ({type(e).__name__}: {e})") from e
        for name, written in files.items():
            f = d / name
            if not f.is_file():
                raise CheckpointError(step, str(f), "is missing")
            size = f.stat().st_size
            if size != written["bytes"]:
                raise CheckpointError(
                    step, str(f), f"is truncated: {size} bytes of the {written['bytes']} written"
                )
            if _sha256(f) != written["sha256"]:
                raise CheckpointError(step, str(f), "does not match the sha256 written with it (corrupt)")
        return d

    def resume_step(self) -> int:
        """The step to resume from: the committed one if its checkpoint verifies, else the newest good
        checkpoint before it (0 = the base model), with a warning naming the bad step and file.

        A bad checkpoint is moved aside to `checkpoints/<step>.corrupt` and the trajectories trained
        after the good step to `trajectories/<split>/<step>.superseded.jsonl`: kept, not retrained
        over. Idempotency results of the lost steps are forgotten, so retrying them trains again.
        """
        try:
            state = self.state()
            committed = int(state["step"])
        except CheckpointError as e:
            log.warning("%s; resuming from the newest checkpoint that verifies", e)
            state, committed = {}, max(self.checkpoint_steps(), default=0)
        good = committed
        while good > 0:
            try:
                self.verify_checkpoint(good)
                break
            except CheckpointError as e:
                earlier = [s for s in self.checkpoint_steps() if s < good]
                log.warning(
                    "checkpoint %s; resuming from step %d instead",
                    e,
                    earlier[-1] if earlier else 0,
                )
                d = self.checkpoint_dir(good)
                if d.exists():
                    os.replace(d, d.with_name(f"{d.name}.corrupt"))
                good = earlier[-1] if earlier else 0
        if good != committed or not state:
            self._roll_back(good, state)
        return good

    def _roll_back(self, step: int, state: dict[str, Any]) -> None:
        for path in (self.root / "trajectories").glob("*/*.jsonl"):
            # train/<k> was trained into checkpoint k+1; any other split's <k> evaluated checkpoint k
            lost_from = step if path.parent.name == "train" else step + 1
            if path.stem.isdigit() and int(path.stem) >= lost_from:
                os.replace(path, path.with_name(f"{path.stem}.superseded.jsonl"))
        shutil.rmtree(self.root / "requests", ignore_errors=True)
        kept = {k: r for k, r in state.get("requests", {}).items() if int(r.get("step", 0)) <= step}
        self._commit(step, kept, {k: v for k, v in state.items() if k not in ("step", "requests")})

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


def _check_safetensors(step: int, path: Path) -> None:
    from safetensors import safe_open

    try:  # opening checks the header and that the file holds every byte it promises
        with safe_open(str(path), "pt") as f:
            f.keys()
    except Exception as e:
        raise CheckpointError(step, str(path), f"is not a readable safetensors file ({e})") from e
