"""A model's budget: hard caps on what its run spends, and what it has spent, kept across restarts.

`Budget` (`ModelConfig.budget`) caps tokens sampled by its endpoint, tokens trained, what RULER's
judge costs the run (currency from LiteLLM's price table for a paid judge, tokens for any judge) and
wall time since the budget began. `Meter` keeps the spend in the run directory (`spend.json`,
written atomically: at each training step, and after sampling at most every `SAVE_EVERY_S`), so a
restarted server goes on counting where it stopped. Past `warn_at` of a limit it logs a warning
once; at a limit the work that would spend more is refused before it starts with
`BudgetExceededError`, which names the budget, the limit and how far past it the run is: the
endpoint's 402, a training step's refusal, live training's stop (the step in progress commits), a
RULER call refused before it asks its judge (an answer, once paid for, is always counted).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from journeyman.errors import JourneymanError

__all__ = ["SAVE_EVERY_S", "Budget", "BudgetExceededError", "Meter", "Spend", "spend_text"]

log = logging.getLogger("journeyman.budget")

SAVE_EVERY_S = 5.0  # sampled tokens are written to spend.json at most this often (a step writes at once)
Work = Literal["sampling", "training", "judging"]
_SPENDS: dict[str, tuple[Work, ...]] = {
    "sampled_tokens": ("sampling",),
    "trained_tokens": ("training",),
    "judge_usd": ("judging",),
    "judge_tokens": ("judging",),
    "wall_s": ("sampling", "training", "judging"),
}


class Budget(BaseModel):
    """Hard limits on what a model's run may spend; None: no limit on that."""

    model_config = ConfigDict(extra="forbid")

    sampled_tokens: int | None = Field(
        default=None, ge=1, description="completion tokens its endpoint may sample, every request counted"
    )
    trained_tokens: int | None = Field(
        default=None, ge=1, description="tokens its training steps may train on (the loss's tokens)"
    )
    judge_usd: float | None = Field(
        default=None,
        gt=0,
        description="US dollars its RULER judge may cost, priced by LiteLLM's table (a LiteLLM judge)",
    )
    judge_tokens: int | None = Field(
        default=None, ge=1, description="tokens its RULER judge may read and write (any judge: local too)"
    )
    wall_s: float | None = Field(
        default=None, gt=0, description="seconds since the budget began (its first registration with one)"
    )
    warn_at: float = Field(
        default=0.8, gt=0, le=1, description="the share of a limit past which a warning is logged, once"
    )

    def limits(self) -> dict[str, float]:
        """{budget field: limit} for each limit set."""
        return {name: float(limit) for name in _SPENDS if (limit := getattr(self, name)) is not None}


class Spend(BaseModel):
    """What a run has spent (`spend.json`)."""

    sampled_tokens: int = 0
    trained_tokens: int = 0
    judge_usd: float = 0.0
    judge_tokens: int = 0
    started_at: float = Field(default_factory=time.time, description="when the budget began (epoch seconds)")
    saved_at: float | None = Field(default=None, description="when this was written (epoch seconds)")
    limits: dict[str, float] = Field(
        default_factory=dict,
        description="the budget's limits when this was written (for its readers: the viewer)",
    )

    def shown(self) -> str:
        """What the file says, for people (`spend_text`); wall time up to when it was written."""
        spent = {name: self.of(name, self.saved_at) for name in _SPENDS}
        return spend_text(spent, self.limits)

    def of(self, name: str, now: float | None = None) -> float:
        """The spend a budget field counts against."""
        if name == "wall_s":
            return (time.time() if now is None else now) - self.started_at
        return float(getattr(self, name))


def spend_text(spent: Mapping[str, float], limits: Mapping[str, float] | None = None) -> str:
    """Spend against each limit, for people (a progress bar, `journeyman live status`, the viewer):
    `sampled_tokens 1200/5000 (24%), judge_usd 0.031`. A spend is shown when it has a limit or is not
    zero; `spent` may be `Meter.spent()` or a history row's `train/spend_*` keys."""
    limits = limits or {}
    values = {k.removeprefix("train/").removeprefix("spend_"): v for k, v in spent.items()}
    parts = []
    for name in _SPENDS:
        value, limit = values.get(name), limits.get(name)
        if value is None or (not value and limit is None):
            continue
        shown = f"{value:.4g}" if name == "judge_usd" else f"{value:.0f}"
        if limit is not None:
            shown += f"/{limit:g} ({100 * value / limit:.0f}%)"
        parts.append(f"{name} {shown}")
    return ", ".join(parts) or "nothing yet"


class BudgetExceededError(JourneymanError):
    """A budget's limit is reached: the work that would spend more is refused (HTTP 402)."""

    def __init__(self, model: str, budget: str, limit: float, spent: float) -> None:
        self.model, self.budget, self.limit, self.spent = model, budget, limit, spent
        super().__init__(
            f"budget.{budget}: {model} spent {spent:g} of its limit {limit:g} (past it by {spent - limit:g}); "
            f"raise ModelConfig.budget.{budget} and register again to go on"
        )


class Meter:
    """One model's spend against its budget; thread-safe (the endpoint and the trainer add to it)."""

    def __init__(self, model: str, path: Path, budget: Budget | None = None) -> None:
        self.model, self.path = model, path
        self.budget = budget or Budget()
        self._lock = threading.Lock()
        self.spend = Spend.model_validate_json(path.read_text()) if path.exists() else Spend()
        self._warned: set[str] = set()
        self._saved_at = 0.0
        if budget is not None and not path.exists():
            self._save()  # the budget begins now (wall time counts from here)

    def configure(self, budget: Budget | None) -> None:
        """Another budget (registered again): what was spent stays counted."""
        with self._lock:
            self.budget = budget or Budget()
            self._warned.clear()

    def check(self, work: Work) -> None:
        """Refuse `work` when a limit that counts it is reached (`BudgetExceededError`)."""
        with self._lock:
            for name, limit, spent in self._levels():
                if work in _SPENDS[name] and spent >= limit:
                    raise BudgetExceededError(self.model, name, limit, spent)

    def add(
        self,
        *,
        sampled_tokens: int = 0,
        trained_tokens: int = 0,
        judge_usd: float = 0.0,
        judge_tokens: int = 0,
    ) -> None:
        with self._lock:
            self.spend.sampled_tokens += sampled_tokens
            self.spend.trained_tokens += trained_tokens
            self.spend.judge_usd += judge_usd
            self.spend.judge_tokens += judge_tokens
            now = time.monotonic()
            # a step's or a judge's spend is written at once (each is rare, and the judge's is money)
            if trained_tokens or judge_usd or judge_tokens or now - self._saved_at >= SAVE_EVERY_S:
                self._save()
            for name, limit, spent in self._levels():
                if spent >= self.budget.warn_at * limit and name not in self._warned:
                    self._warned.add(name)
                    log.warning(
                        "%s: budget.%s at %.0f%% (%g of %g)",
                        self.model,
                        name,
                        100 * spent / limit,
                        spent,
                        limit,
                    )

    def flush(self) -> None:
        with self._lock:
            self._save()

    def levels(self) -> dict[str, tuple[float, float]]:
        """{budget field: (spent, limit)} for each limit set."""
        with self._lock:
            return {name: (spent, limit) for name, limit, spent in self._levels()}

    def spent(self) -> dict[str, float]:
        """Every spend, limited or not (history rows, `/metrics`, `live status`)."""
        with self._lock:
            return {name: self.spend.of(name) for name in _SPENDS}

    def _levels(self) -> list[tuple[str, float, float]]:
        now = time.time()
        out = []
        for name in _SPENDS:
            limit = getattr(self.budget, name)
            if limit is not None:
                out.append((name, float(limit), self.spend.of(name, now)))
        return out

    def _save(self) -> None:
        self.spend.saved_at, self.spend.limits = time.time(), self.budget.limits()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.spend.model_dump()))
        os.replace(tmp, self.path)
        self._saved_at = time.monotonic()
