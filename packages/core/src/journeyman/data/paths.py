"""Where Journeyman keeps files on this machine: the cache, and the layout of a run directory.

The layout is written here once; the store, the backends, the server and every CLI ask it for a
path instead of joining `"models"` or `"history.jsonl"` themselves:

    <path>/                        a backend's root (`LocalBackend(path=...)`, `journeyman serve --path`)
        tokens.json                the server's named API tokens (sha256 digests)
        server-models.json         the models the server registered, for a restart
        <project>/models/<name>/   one model's run directory (RunLayout)
            checkpoints/<step:04d>/        adapter + optimizer + manifest
            trajectories/<split>/<step:04d>.jsonl
            history.jsonl                  one row of metrics per step or log call
            history.superseded.jsonl       rows of steps lost when a resume fell back past a bad checkpoint
            requests/<key>.json            results of committed train calls, by idempotency key
            state.json                     the commit point: {"step": N, ...}
            wandb/                         the Weights & Biases run, with report_to=["wandb"]
            reward.png                     the reward curve the CLIs draw
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir

from journeyman.data.config import check_name

__all__ = ["HISTORY", "SUPERSEDED_HISTORY", "TOKENS_FILE", "RunLayout", "RunRoot", "cache_dir"]

TOKENS_FILE = "tokens.json"
HISTORY = "history.jsonl"
SUPERSEDED_HISTORY = "history.superseded.jsonl"


def cache_dir() -> Path:
    """Where converted weights and judge answers live: `$JOURNEYMAN_CACHE`, else the user's cache dir."""
    return Path(os.environ.get("JOURNEYMAN_CACHE") or user_cache_dir("journeyman"))


@dataclass(frozen=True)
class RunRoot:
    """A backend's root directory: every model's run under it, and the server's own files beside them."""

    path: Path

    def run(self, project: str, name: str) -> RunLayout:
        """The run directory of model `name` in `project` (both checked: they become directories)."""
        return RunLayout(self.path / check_name("project", project) / "models" / check_name("name", name))

    @property
    def tokens(self) -> Path:
        return self.path / TOKENS_FILE

    @property
    def server_models(self) -> Path:
        return self.path / "server-models.json"


@dataclass(frozen=True)
class RunLayout:
    """The run directory of one model and the name of every file in it (nothing is created here)."""

    root: Path

    @classmethod
    def of(cls, path: Path | str, project: str, name: str) -> RunLayout:
        """`<path>/<project>/models/<name>`: the run of model `name` under the backend root `path`."""
        return RunRoot(Path(path)).run(project, name)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{step:04d}"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    def split_dir(self, split: str) -> Path:
        """`trajectories/<split>/` (the split is checked: it becomes a directory)."""
        return self.trajectories / check_name("split", split)

    def groups_file(self, split: str, step: int) -> Path:
        """`trajectories/<split>/<step:04d>.jsonl`: the groups trained (or evaluated) at `step`."""
        return self.split_dir(split) / f"{step:04d}.jsonl"

    @property
    def history(self) -> Path:
        return self.root / HISTORY

    @property
    def superseded_history(self) -> Path:
        return self.root / SUPERSEDED_HISTORY

    @property
    def requests(self) -> Path:
        return self.root / "requests"

    def request(self, key: str) -> Path:
        """`requests/<key>.json`: the result of the committed train call with idempotency key `key`."""
        return self.requests / f"{check_name('idempotency_key', key)}.json"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def spend(self) -> Path:
        """What the run spent against its budget (`data/budget.py`'s Meter writes it)."""
        return self.root / "spend.json"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def reward_plot(self) -> Path:
        return self.root / "reward.png"
