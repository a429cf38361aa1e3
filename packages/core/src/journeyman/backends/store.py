"""The run directory of one model: checkpoints, trajectories, metric history, resume state.

What each file holds and how it is written (where each lives: `journeyman.data.paths.RunLayout`):

<path>/<project>/models/<name>/
    checkpoints/<step:04d>/   adapter (PEFT format) + optimizer.pt + manifest.json (sizes, sha256)
    trajectories/<split>/<step:04d>.jsonl   one TrajectoryGroup per line: what trained into
                              checkpoint step+1 (train, sft; with the groups of skipped calls at that
                              step), or what was evaluated on checkpoint step (val, ...)
    trajectories/<split>/<step:04d>.<kind>-<id>.jsonl   groups that did not (or not yet) train:
                              attempt (in flight), failed (the call raised), abandoned (in flight when
                              the process died), superseded (lost to a resume's fallback; `<step>.superseded.jsonl`)
    history.jsonl             one row of metrics per step (train) or per log call (val, ...)
    history.superseded.jsonl  the rows of steps a resume's fallback lost
    requests/<key>.json       the result of each committed `train` call with an idempotency key, with
                              the digest of the call (`request_sha256`); `requests/<split>/<key>.json`
                              for another operation's (sft): a key is scoped to the model and operation
    state.json                {"step": N, "base_model": ..., "last": the last commit}

Every write that a resume depends on is atomic (temp + fsync + rename): a checkpoint directory
appears whole or not at all, and `state.json` (the commit point) names only a checkpoint that is
already on disk. A resume verifies the committed checkpoint against its manifest and falls back to
the newest good one before it, so a truncated or corrupt file costs steps, never the run.

A train call's groups go to an attempt file before the update (a crash loses nothing). The commit
writes `state.json` with the call's attempt and idempotency result in it (`last`); only then is the
attempt promoted to `<step>.jsonl` and the result copied to `requests/<key>.json`. Both follow-ups are
idempotent and redone by the next commit or resume, so a committed step always has its groups and
its key on record, and a recorded key or promoted group always belongs to a committed step.

Every JSON file written here is strict JSON: a non-finite float (a NaN loss) is written as null.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from journeyman.data.config import check_name
from journeyman.data.paths import HISTORY, SUPERSEDED_HISTORY, RunLayout
from journeyman.data.types import TrajectoryGroup
from journeyman.errors import CheckpointError, InvalidFieldError

log = logging.getLogger("journeyman.backends.store")

MANIFEST = "manifest.json"
ADAPTER_FILE = "adapter_model.safetensors"
TRAINING_SPLITS = ("train", "sft")
"""Splits whose `<k>` trained into checkpoint k+1; any other split's `<k>` evaluated checkpoint k."""

_ATTEMPT = re.compile(r"(?P<step>\d+)\.attempt-(?P<id>[A-Za-z0-9._-]+)\.jsonl")


def finite(value: Any) -> Any:
    """`value` with every non-finite float (NaN, ±inf) in it replaced by None: what strict JSON holds."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON (RFC 8259): non-finite floats become null instead of the non-standard `NaN`."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def groups_text(groups: Sequence[TrajectoryGroup]) -> str:
    """Groups as a trajectory file holds them: one JSON line each."""
    return "".join(g.model_dump_json() + "\n" for g in groups)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str | bytes) -> None:
    """`path` holds either its old text or `text`, never part of either, even across a power cut."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _append(path: Path, data: bytes) -> None:
    """One `os.write` on an O_APPEND descriptor, then fsync: concurrent appenders never interleave,
    and a kill leaves at most a torn last line (which the readers repair), never a torn middle one."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _free_name(directory: Path, base: str) -> Path:
    """`<base>.jsonl`, or `<base>.<n>.jsonl` if that is taken: a file set aside never overwrites another."""
    path, n = directory / f"{base}.jsonl", 2
    while path.exists():
        path, n = directory / f"{base}.{n}.jsonl", n + 1
    return path


def _row_lost(row: dict[str, Any], step: int) -> bool:
    """Whether a history row belongs to a step that a fallback to `step` loses (as its trajectories)."""
    s = row.get("step")
    if not isinstance(s, int) or isinstance(s, bool):
        return False
    return s >= step if row.get("split") in TRAINING_SPLITS else s > step


@dataclass(frozen=True)
class Attempt:
    """The groups of one train call at `step`, on disk before its update; `id` is the call's
    idempotency key (so a retry after a kill finds them) or a random one; `request_sha256` the digest
    of the call, kept with its result so the key cannot answer another call."""

    split: str
    step: int
    id: str
    request_sha256: str | None = None

    def file(self, kind: str) -> str:
        return f"{self.step:04d}.{kind}-{self.id}.jsonl"


class RunStore:
    """Reads and writes one run directory; where each file lives is `RunLayout`'s business."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layout = RunLayout(root)
        self.history_file = HistoryFile(self.layout.history, self.layout.superseded_history)
        self.root.mkdir(parents=True, exist_ok=True)

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        path = self.layout.state
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

    def write_state(
        self,
        step: int,
        request: tuple[str, dict[str, Any]] | None = None,
        attempt: Attempt | None = None,
        **extra: Any,
    ) -> None:
        """The run's commit point, written atomically (a kill never leaves half a state).

        `request` = (idempotency key, result) of the call this state completes: kept for good in
        `requests/<key>.json`, so a retry returns the result instead of training again, after any
        number of restarts. `attempt` = the call's groups, promoted to `<step>.jsonl`.
        """
        old = self.state()
        self._finish(old)  # a crash may have cut off the follow-ups of the previous commit
        self._keep_legacy_requests(old)
        last: dict[str, Any] = {}
        if request is not None:
            last.update(key=check_name("idempotency_key", request[0]), result=request[1])
        if attempt is not None:
            last.update(split=attempt.split, step=attempt.step, attempt=attempt.id)
        state = {"step": step, **extra, **({"last": last} if last else {})}
        write_atomic(self.layout.state, dumps(state))
        try:
            self._finish(state)
        except OSError as e:  # the step is committed: the next commit or resume finishes this
            log.warning("step %d committed, its follow-ups are left for later: %s", step, e)

    def _finish(self, state: dict[str, Any]) -> None:
        """The follow-ups of the commit `state` records, each a no-op once done."""
        last = state.get("last")
        if not isinstance(last, dict):
            return
        key, result = last.get("key"), last.get("result")
        if isinstance(key, str) and isinstance(result, dict):
            path = self._request_path(key, str(last.get("split", "train")))
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, dumps(result))
        if isinstance(last.get("attempt"), str):
            self._promote(Attempt(str(last["split"]), int(last["step"]), str(last["attempt"])))

    def _promote(self, attempt: Attempt) -> None:
        """The committed attempt's groups into `<step>.jsonl`; after groups of skipped calls at the
        same step, if any. Redone from where a crash cut it: `combined-` holds the merged file."""
        d = self._trajectory_dir(attempt.split)
        src, combined = d / attempt.file("attempt"), d / attempt.file("combined")
        final = self.layout.groups_file(attempt.split, attempt.step)
        if not combined.exists():
            if not src.exists():
                return  # promoted already
            if not final.exists():
                os.replace(src, final)
                _fsync_dir(d)
                return
            write_atomic(combined, final.read_text() + src.read_text())
        src.unlink(missing_ok=True)  # before the rename: a redo must not merge the groups twice
        os.replace(combined, final)
        _fsync_dir(d)

    def _request_path(self, key: str, split: str = "train") -> Path:
        """`requests/<key>.json` for `train` (where every key lived before keys were scoped to their
        operation), `requests/<split>/<key>.json` for another split's call."""
        path = self.layout.request(key)
        return path if split == "train" else path.parent / check_name("split", split) / path.name

    def _keep_legacy_requests(self, state: dict[str, Any]) -> None:
        """Runs from before `requests/` kept the last results in state.json: move them to files."""
        for key, result in (state.get("requests") or {}).items():
            path = self._request_path(key)
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, dumps(result))

    def request_result(self, key: str, split: str = "train") -> dict[str, Any] | None:
        """The record of the committed call of `split` (train, sft) with idempotency key `key`, if
        there is one: its result, and the call's `request_sha256` where it was kept."""
        path = self._request_path(key, split)
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except ValueError as e:  # written atomically, so only a damaged disk gets here
                log.warning("%s is unreadable (%s); the state's record is used if it has one", path, e)
        state = self.state()
        last = state.get("last")
        if (
            isinstance(last, dict)
            and (last.get("key"), last.get("split", "train")) == (key, split)
            and isinstance(last.get("result"), dict)
        ):
            return last["result"]  # committed; the copy to requests/ was cut off
        return (state.get("requests") or {}).get(key) if split == "train" else None

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.layout.checkpoint(step)

    def checkpoint_steps(self) -> list[int]:
        d = self.layout.checkpoints
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
            write_atomic(tmp / MANIFEST, dumps({"step": step, "files": files}, indent=1))
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

        The last commit's follow-ups are finished first; attempts still in flight (the process died
        during their step) become `<step>.abandoned-<id>.jsonl`. A bad checkpoint is moved aside to
        `checkpoints/<step>.corrupt`, the trajectories trained after the good step to
        `trajectories/<split>/<step>.superseded.jsonl` and their history rows to
        `history.superseded.jsonl`: kept, not retrained over. Idempotency results of the lost steps
        are forgotten, so retrying them trains again.
        """
        try:
            state = self.state()
            committed = int(state["step"])
        except CheckpointError as e:
            log.warning("%s; resuming from the newest checkpoint that verifies", e)
            state, committed = {}, max(self.checkpoint_steps(), default=0)
        self._finish(state)
        self._abandon_attempts()
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
            self._fall_back(good, state)
        return good

    def _abandon_attempts(self) -> None:
        for path in sorted(self.layout.trajectories.glob("*/*.attempt-*.jsonl")):
            if m := _ATTEMPT.fullmatch(path.name):
                to = _free_name(path.parent, f"{m['step']}.abandoned-{m['id']}")
                log.warning("%s was in flight when the run stopped; kept as %s", path, to.name)
                os.replace(path, to)
                _fsync_dir(path.parent)

    def _fall_back(self, step: int, state: dict[str, Any]) -> None:
        # Everything lost is set aside before the state commits: a crash in between redoes it all.
        for path in sorted(self.layout.trajectories.glob("*/*.jsonl")):
            lost_from = step if path.parent.name in TRAINING_SPLITS else step + 1
            if path.stem.isdigit() and int(path.stem) >= lost_from:
                os.replace(path, _free_name(path.parent, f"{path.stem}.superseded"))
        self.history_file.supersede(step)
        self._keep_legacy_requests(state)
        for path in self.layout.requests.rglob("*"):  # requests/<key>.json, requests/<split>/<key>.json
            if path.is_dir():
                continue
            try:
                lost = path.suffix != ".json" or int(json.loads(path.read_text()).get("step", 0)) > step
            except (ValueError, TypeError, AttributeError):
                lost = True
            if lost:
                path.unlink()
        kept = {k: v for k, v in state.items() if k not in ("step", "requests", "last")}
        write_atomic(self.layout.state, dumps({"step": step, **kept}))

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

    # -- trajectories ------------------------------------------------------------------------
    def _trajectory_dir(self, split: str) -> Path:
        return self.layout.split_dir(split)

    def begin_attempt(
        self,
        groups: Sequence[TrajectoryGroup],
        split: str,
        step: int,
        key: str | None = None,
        text: str | None = None,
        request_sha256: str | None = None,
    ) -> Attempt:
        """Write the groups of a train call at `step` to `<step>.attempt-<id>.jsonl`, before the
        update (`text`: the groups as `groups_text` renders them, if the caller has it). A retry of
        key `key` after a kill takes back its abandoned file if the groups are the same, so they are
        on disk once."""
        attempt = Attempt(
            split,
            step,
            uuid.uuid4().hex if key is None else check_name("idempotency_key", key),
            request_sha256,
        )
        d = self._trajectory_dir(split)
        d.mkdir(parents=True, exist_ok=True)
        text = groups_text(groups) if text is None else text
        path = d / attempt.file("attempt")
        left = d / attempt.file("abandoned")
        if key is not None and left.is_file() and left.read_text() == text:
            os.replace(left, path)
            _fsync_dir(d)
        else:
            write_atomic(path, text)
        return attempt

    def fail_attempt(self, attempt: Attempt) -> Path | None:
        """Set the groups of a call that raised aside as `<step>.failed-<id>.jsonl` (None if the
        attempt had committed: its groups are trained, whatever failed after the commit)."""
        try:
            last = self.state().get("last") or {}
        except CheckpointError:
            last = {}
        if (last.get("split"), last.get("step"), last.get("attempt")) == (
            attempt.split,
            attempt.step,
            attempt.id,
        ):
            return None
        d = self._trajectory_dir(attempt.split)
        path = d / attempt.file("attempt")
        if not path.exists():
            return None
        to = _free_name(d, f"{attempt.step:04d}.failed-{attempt.id}")
        try:
            os.replace(path, to)
            _fsync_dir(d)
        except OSError as e:  # the call's own error is what the caller needs to see
            log.warning("%s could not be renamed to %s (%s); a resume marks it abandoned", path, to.name, e)
            return None
        return to

    def write_groups(self, groups: Sequence[TrajectoryGroup], split: str, step: int) -> Path:
        """Append groups that are not trained (an evaluation: `log`) to `<split>/<step>.jsonl`."""
        path = self.layout.groups_file(split, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        _append(path, groups_text(groups).encode())
        return path

    def read_groups(self, split: str, step: int) -> list[TrajectoryGroup]:
        path = self.layout.groups_file(split, step)
        if not path.exists():
            raise InvalidFieldError("step", step, f"no {split} trajectories at {path}")
        return [
            TrajectoryGroup.model_validate_json(line)
            for line in path.read_text().splitlines()
            if line.strip()
        ]

    # -- history (`HistoryFile`) --------------------------------------------------------------
    def append_history(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append one row (strict JSON; a NaN metric becomes null) and return it as written."""
        return self.history_file.append(row)

    def history(self) -> list[dict[str, Any]]:
        return self.history_file.rows()


class HistoryFile:
    """history.jsonl: one strict-JSON row a step or a log call, appended whole under a lock; a torn
    last line (a kill mid-append) is repaired, and a resume's fallback to an older step moves the lost steps' rows aside."""

    def __init__(self, path: Path, superseded: Path) -> None:
        self.path = path
        self.superseded = superseded

    @contextmanager
    def _history_fd(self) -> Iterator[int]:
        """history.jsonl open for appending, locked against other appenders and repairers."""
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    def _repair_tail(self, fd: int) -> None:
        """A last line without its newline (a kill mid-append): a whole row gets its newline, a torn
        one is cut away, so the next append starts a line of its own."""
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return
        start = size
        while start > 0:  # back to the last newline
            lo = max(0, start - (1 << 16))
            i = os.pread(fd, start - lo, lo).rfind(b"\n")
            if i >= 0:
                start = lo + i + 1
                break
            start = lo
        tail = os.pread(fd, size - start, start)
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole:
            os.write(fd, b"\n")
            log.warning("%s: the last row had lost its newline; added", self.path)
        else:
            os.ftruncate(fd, start)
            log.warning(
                "%s: dropped a torn last line (%d bytes, cut off mid-write): %r",
                self.path,
                size - start,
                tail[:120],
            )
        os.fsync(fd)

    def append(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append one row (strict JSON; a NaN metric becomes null) and return it as written."""
        row = finite({"recorded_at": time.time(), **row})
        data = (json.dumps(row, allow_nan=False) + "\n").encode()
        with self._history_fd() as fd:
            self._repair_tail(fd)
            written = os.write(fd, data)  # one write: a kill leaves a torn last line, at worst
            if written != len(data):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes", HISTORY)
            os.fsync(fd)
        return row

    def rows(self) -> list[dict[str, Any]]:
        """Every row of history.jsonl. A torn last line is repaired away and a line that is not a
        JSON object is skipped, each with a warning: a damaged row costs that row, not the run."""
        path = self.path
        if not path.exists():
            return []
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            try:
                with self._history_fd() as fd:
                    self._repair_tail(fd)
                data = path.read_bytes()
            except OSError as e:  # a read-only run directory: read around the torn line
                log.warning("%s could not be repaired (%s)", path, e)
        rows: list[dict[str, Any]] = []
        for n, line in enumerate(data.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                log.warning("%s line %d is not a JSON object; skipped: %r", path, n, line[:120])
        return rows

    def supersede(self, step: int) -> None:
        """Move the rows of the steps lost by a fallback to `step` out of history.jsonl."""
        path = self.path
        if not path.exists():
            return
        self.rows()  # repairs a torn last line first
        kept: list[bytes] = []
        lost: list[bytes] = []
        for line in path.read_bytes().splitlines(keepends=True):
            try:
                row = json.loads(line)
            except ValueError:
                row = None  # kept byte for byte: the reader skips it with a warning
            (lost if isinstance(row, dict) and _row_lost(row, step) else kept).append(line)
        if not lost:
            return
        log.warning("%d history rows of the lost steps moved to %s", len(lost), SUPERSEDED_HISTORY)
        # added to the superseded file first: a crash in between duplicates rows there, never loses them
        _append(self.superseded, b"".join(lost))
        write_atomic(path, b"".join(kept))


def _check_safetensors(step: int, path: Path) -> None:
    from safetensors import safe_open

    try:  # opening checks the header and that the file holds every byte it promises
        with safe_open(str(path), "pt") as f:
            f.keys()
    except Exception as e:
        raise CheckpointError(step, str(path), f"is not a readable safetensors file ({e})") from e
