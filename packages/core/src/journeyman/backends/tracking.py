"""Experiment trackers: every history row of a run, its settings and sample trajectories, sent to
the tools people already watch runs in. Off by default; `LocalBackend(report_to=["wandb"])` turns
one on.

The run directory stays the record (`history.jsonl` is written first); a tracker mirrors it. A row
goes to a tracker exactly as it is written to `history.jsonl`, so what the tracker shows and what
`journeyman report` plots are the same numbers. A tracker that fails is logged, never raised into
training, as with `observe.emit`.

    class PrintTracker:                      # structural: no base class needed
        def log(self, row, groups=()): print(row)
        def config(self, values): print(values)
        def close(self): pass

Weights & Biases (`wandb`) is the one built in: it is what ART reports to, so an ART user's
dashboards and habits carry over; `WANDB_MODE=offline` writes the same run to disk with no
network (CI runs the real library that way) for `wandb sync` later. Threading: a backend calls its
trackers from the event loop that trains, one call at a time.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from journeyman.chat.messages import text_of
from journeyman.data.config import ModelConfig
from journeyman.data.paths import RunLayout
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError

log = logging.getLogger(__name__)

SAMPLES_PER_ROW = 4
"""Trajectories per history row shown in a tracker's sample table (the first of each group first)."""


@runtime_checkable
class Tracker(Protocol):
    """Where a run's history rows, settings and sample trajectories are mirrored."""

    def log(self, row: Mapping[str, Any], groups: Sequence[TrajectoryGroup] = ()) -> None:
        """One history row (as written to history.jsonl), with the groups it was computed from."""
        ...

    def config(self, values: Mapping[str, Any]) -> None:
        """Settings of the run: the model at the start, each kind of step's config as it is used."""
        ...

    def close(self) -> None:
        """Flush and finish the run."""
        ...


class Trackers:
    """The trackers of one run, called together; with none it does nothing."""

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self.trackers = list(trackers)

    def _each(self, what: str, *args: Any) -> None:
        for t in self.trackers:
            try:
                getattr(t, what)(*args)
            except Exception:
                log.exception("tracker %r failed in %s; the run directory still has everything", t, what)

    def log(self, row: Mapping[str, Any], groups: Sequence[TrajectoryGroup] = ()) -> None:
        self._each("log", row, groups)

    def config(self, values: Mapping[str, Any]) -> None:
        self._each("config", values)

    def close(self) -> None:
        self._each("close")


KNOWN = ("wandb",)


def check_report_to(report_to: Sequence[str] | str | None) -> list[str]:
    """The tracker names, checked (a typo fails at construction, not at the first step)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for i, name in enumerate(names):
        if name not in KNOWN:
            raise InvalidFieldError(f"report_to[{i}]", name, f"known trackers: {', '.join(KNOWN)}")
    return names


def open_trackers(report_to: Sequence[str], model: ModelConfig, run_dir: Path) -> Trackers:
    """The trackers named by `report_to` for one model's run (resuming the tracker's run, if any)."""
    trackers: list[Tracker] = []
    for name in check_report_to(report_to):
        if name == "wandb":
            trackers.append(WandbTracker(model, run_dir))
    return Trackers(trackers)


def sample_rows(groups: Sequence[TrajectoryGroup], limit: int = SAMPLES_PER_ROW) -> list[list[Any]]:
    """[group, reward, conversation, metrics] of up to `limit` trajectories, one per group first."""
    order: list[tuple[int, Trajectory]] = []
    for ti in range(max((len(g.trajectories) for g in groups), default=0)):
        order += [(gi, g.trajectories[ti]) for gi, g in enumerate(groups) if ti < len(g.trajectories)]
    rows = []
    for gi, t in order[:limit]:
        lines = []
        for m in t.messages():
            text = text_of(m.get("content"), strict=False)
            calls = m.get("tool_calls")
            lines.append(f"{m['role']}: {text}" + (f" {json.dumps(calls)}" if calls else ""))
        rows.append([gi, t.reward, "\n".join(lines), json.dumps(t.metrics)])
    return rows


class WandbTracker:
    """A Weights & Biases run per model, in `<run_dir>/wandb`; project and name are the model's.

    The W&B run id is kept in `<run_dir>/wandb/journeyman-run-id`, so registering the model again
    (a resume) continues the same W&B run. Each history row is one W&B row; its Journeyman `step`
    is the x-axis of every chart (several rows can share a step: a val row and the next train row).
    W&B reads WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE and the rest of its environment as usual.
    """

    def __init__(self, model: ModelConfig, run_dir: Path) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                'report_to=["wandb"] needs the wandb package: pip install "journeyman[wandb]"'
            ) from e
        self._wandb = wandb
        folder = RunLayout(run_dir).wandb
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "journeyman-run-id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12])
        self.run = wandb.init(
            project=model.project,
            name=model.name,
            id=id_file.read_text().strip(),
            resume="allow",
            dir=str(run_dir),
            config={"model": model.model_dump(mode="json")},
            reinit="create_new",  # one run per model: a backend may serve several
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: Mapping[str, Any], groups: Sequence[TrajectoryGroup] = ()) -> None:
        data = dict(row)
        if groups:
            table = self._wandb.Table(columns=["step", "group", "reward", "conversation", "metrics"])
            for sample in sample_rows(groups):
                table.add_data(row.get("step"), *sample)
            data[f"{row.get('split', 'train')}/samples"] = table
        self.run.log(data)

    def config(self, values: Mapping[str, Any]) -> None:
        self.run.config.update(dict(values), allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


__all__ = ["KNOWN", "Tracker", "Trackers", "WandbTracker", "check_report_to", "open_trackers"]
