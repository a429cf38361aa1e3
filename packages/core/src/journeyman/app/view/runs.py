"""The run directories a viewer shows, read lazily and read-only.

Nothing here loads a whole run: `history.jsonl` is small (one row a step) and is read whole when it
changed; a trajectories file is indexed by the byte offset of each line (one `bytes.find` pass, no
JSON parsing) the first time one of its groups is asked for, and only the lines a page shows are
parsed. Indexes are kept while the file's size and mtime stay the same, so a file a live run is
still writing is indexed again when it grows.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from journeyman.data.budget import Spend
from journeyman.data.paths import HISTORY, RunLayout
from journeyman.errors import InvalidFieldError

__all__ = ["Run", "RunFiles", "StepFile", "find_runs"]

# `<step>.jsonl` committed; `<step>.attempt-<id>.jsonl` being trained; `.failed-`/`.abandoned-` kept
_STEP_FILE = re.compile(
    r"(?P<step>\d+)(?:\.(?P<kind>attempt|failed|abandoned)-(?P<id>[A-Za-z0-9_-]+))?\.jsonl"
)
_SPLIT = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class StepFile:
    """One trajectories file: `trajectories/<split>/<name>`."""

    split: str
    name: str  # the file name without `.jsonl`: "0003", "0003.attempt-1a2b"
    step: int
    status: str  # committed | attempt | failed | abandoned
    path: Path
    size: int
    mtime_ns: int


@dataclass
class _Lines:
    size: int
    mtime_ns: int
    offsets: list[int]  # start of each non-empty line, and the file's length at the end


def _index_lines(path: Path) -> _Lines:
    """Byte offsets of a file's lines (a torn last line, without its newline, is left out)."""
    st = path.stat()
    data = path.read_bytes()
    offsets: list[int] = []
    start = 0
    while True:
        end = data.find(b"\n", start)
        if end < 0:
            break
        if end > start:
            offsets.append(start)
        start = end + 1
    offsets.append(start)
    return _Lines(len(data), st.st_mtime_ns, offsets)


class Run:
    """One model's run directory: its history, its state, and its trajectories files by split."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.layout = RunLayout(self.root)
        self.id = hashlib.sha256(str(self.root).encode()).hexdigest()[:12]
        self._lock = threading.Lock()
        self._history: tuple[tuple[int, int], list[dict[str, Any]]] | None = None
        self._lines: dict[Path, _Lines] = {}

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def project(self) -> str:
        # <root>/<project>/models/<name>: the project is two levels up when the run sits in that layout
        return self.root.parent.parent.name if self.root.parent.name == "models" else ""

    def state(self) -> dict[str, Any]:
        try:
            raw = json.loads(self.layout.state.read_text())
        except (OSError, ValueError, RecursionError):
            return {}
        return raw if isinstance(raw, dict) else {}

    def spend(self) -> str:
        """What the run spent against its budget (`spend.json`, `data/budget.py`), for people; "" when
        it has no such file (or a damaged one)."""
        try:
            return Spend.model_validate_json(self.layout.spend.read_bytes()).shown()
        except (OSError, ValueError):
            return ""

    def version(self) -> str:
        """Changes whenever the history, the state or a trajectories file changes: what a page polls."""
        parts: list[str] = []
        for p in (self.layout.history, self.layout.state):
            try:
                st = p.stat()
                parts.append(f"{st.st_size}:{st.st_mtime_ns}")
            except OSError:
                parts.append("-")
        for split in self.splits():
            with os.scandir(self.layout.trajectories / split) as it:
                for e in it:
                    if e.is_file():
                        st = e.stat()
                        parts.append(f"{e.name}:{st.st_size}:{st.st_mtime_ns}")
        return hashlib.sha256("|".join(sorted(parts)).encode()).hexdigest()[:16]

    def history(self) -> list[dict[str, Any]]:
        """Every row of history.jsonl (read again only when the file changed; bad lines skipped:
        a line being appended right now is not an error)."""
        try:
            st = self.layout.history.stat()
        except OSError:
            return []
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            if self._history is not None and self._history[0] == key:
                return self._history[1]
        rows: list[dict[str, Any]] = []
        with self.layout.history.open("rb") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(row, dict):
                    rows.append(row)
        with self._lock:
            self._history = (key, rows)
        return rows

    def splits(self) -> list[str]:
        try:
            with os.scandir(self.layout.trajectories) as it:
                return sorted(e.name for e in it if e.is_dir() and _SPLIT.fullmatch(e.name))
        except OSError:
            return []

    def step_files(self, split: str) -> list[StepFile]:
        """The split's trajectories files, by step then name (a directory listing: no file is read)."""
        if split not in self.splits():
            raise InvalidFieldError("split", split, f"not a split of this run ({', '.join(self.splits())})")
        out: list[StepFile] = []
        with os.scandir(self.layout.trajectories / split) as it:
            for e in it:
                m = _STEP_FILE.fullmatch(e.name)
                if m is None or not e.is_file():
                    continue
                st = e.stat()
                out.append(
                    StepFile(
                        split=split,
                        name=e.name.removesuffix(".jsonl"),
                        step=int(m["step"]),
                        status=m["kind"] or "committed",
                        path=Path(e.path),
                        size=st.st_size,
                        mtime_ns=st.st_mtime_ns,
                    )
                )
        return sorted(out, key=lambda f: (f.step, f.name))

    def step_file(self, split: str, name: str) -> StepFile:
        for f in self.step_files(split):
            if f.name == name:
                return f
        raise InvalidFieldError("step", name, f"no trajectories file {name}.jsonl in split {split!r}")

    def _lines_of(self, f: StepFile) -> _Lines:
        with self._lock:
            cached = self._lines.get(f.path)
        if cached is not None and (cached.size, cached.mtime_ns) == (f.size, f.mtime_ns):
            return cached
        lines = _index_lines(f.path)
        with self._lock:
            self._lines[f.path] = lines
        return lines

    def count_lines(self, f: StepFile) -> int:
        return len(self._lines_of(f).offsets) - 1

    def read_lines(self, f: StepFile, start: int, stop: int) -> list[dict[str, Any]]:
        """Lines `start` to `stop` (exclusive) of the file, parsed: only those bytes are read."""
        lines = self._lines_of(f)
        n = len(lines.offsets) - 1
        start, stop = max(0, start), min(n, stop)
        if start >= stop:
            return []
        with f.path.open("rb") as fh:
            fh.seek(lines.offsets[start])
            chunk = fh.read(lines.offsets[stop] - lines.offsets[start])
        out: list[dict[str, Any]] = []
        for i, raw in enumerate(chunk.splitlines()):
            try:
                item = json.loads(raw)
            except (ValueError, RecursionError) as e:  # nested past the parser's depth: not readable JSON
                raise InvalidFieldError(
                    f"{f.path.name}:{start + i + 1}", raw[:80], f"is not JSON: {e}"
                ) from None
            out.append(item if isinstance(item, dict) else {})
        return out


class RunFiles:
    """The runs under the paths `journeyman view` was given, found again on every listing (a run
    that starts while the viewer is open appears without a restart)."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = [p.expanduser() for p in paths]
        self._runs: dict[str, Run] = {}
        self._lock = threading.Lock()

    def runs(self) -> list[Run]:
        found = find_runs(self.paths)
        with self._lock:
            for root in found:
                run = Run(root)
                self._runs.setdefault(run.id, run)
            ids = {Run(root).id for root in found}
            return sorted((r for r in self._runs.values() if r.id in ids), key=lambda r: (r.project, r.name))

    def get(self, run_id: str) -> Run:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            run = next((r for r in self.runs() if r.id == run_id), None)
        if run is None:
            raise InvalidFieldError("run", run_id, "no such run under the viewer's paths")
        return run


def _is_run(path: Path) -> bool:
    return (path / HISTORY).is_file() or (path / "state.json").is_file()


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories: each path that is one, else those at `<path>/<project>/models/<name>` (a
    backend's root) or `<path>/models/<name>` (a project)."""
    out: list[Path] = []
    for p in paths:
        if _is_run(p):
            out.append(p)
            continue
        for pattern in ("*/models/*", "models/*"):
            out += sorted(q for q in p.glob(pattern) if q.is_dir() and _is_run(q))
    seen: set[Path] = set()
    unique = []
    for p in out:
        r = p.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(p)
    return unique
