"""Live training's data: its settings, an episode's outcome, a gate decision, the status.

Shared by the server (`backends/live_training.py`), the HTTP bodies (`client/wire.py`) and the light client,
so every side reads the same fields. The protocol is in docs/live.md.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from journeyman.data.budget import Budget
from journeyman.data.config import TrainConfig, check_name
from journeyman.errors import InvalidFieldError

# What an episode's outcome may hold (`EpisodeOutcome`; its episode_id is a name: `check_name`'s 128
# characters). Each is named in the 400 that refuses a value past it, before anything is taken.
MAX_OUTCOME_REWARD = 1e6  # |reward| of an outcome: the baseline, advantages and canary statistics stay finite
MAX_OUTCOME_METRICS = 64  # metrics one outcome carries
MAX_METRIC_NAME_CHARS = 128  # characters of the name of an outcome's metric
MAX_OUTCOME_METRIC = 1e15  # |value| of an outcome's metric: finite, and so are its means in history
MAX_OUTCOME_GROUP_CHARS = 256  # characters of an outcome's group key


def _live_train_config() -> TrainConfig:
    # Live episodes carry their advantage as their reward (reward minus the stated baseline), and
    # every token its sampling step: off-policy turns are weighted by π_θ/π_behaviour, truncated at 2.
    return TrainConfig(advantages="given", tis_cap=2.0, learning_rate=1e-4)


class GateConfig(BaseModel):
    """How a candidate adapter is judged before it serves the production traffic, and when a
    promoted one is rolled back. The test is stated in docs/live.md ("The gate")."""

    model_config = ConfigDict(extra="forbid")

    canary_share: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description="share of new episodes (by episode id) sampled by the candidate while it is judged; "
        "0 leaves the decision to an eval function or a person",
    )
    canary_episodes: int = Field(
        default=8,
        ge=1,
        description="scored episodes the candidate and the promoted step each need before a decision",
    )
    margin: float = Field(
        default=0.0,
        ge=0.0,
        description="how much worse than the promoted step a candidate may look and still pass "
        "(reward units)",
    )
    against: Literal["promoted", "best"] = Field(
        default="promoted",
        description="what an evaluated candidate is compared with: the promoted step, or the best eval "
        'of any step promoted so far (a ratchet: "not worse within the margin" cannot drift down one '
        "margin per step)",
    )
    z: float = Field(
        default=1.645,
        ge=0.0,
        description="a candidate is rejected when its mean reward is below the promoted step's by more "
        "than margin + z standard errors (one-sided, 95% by default)",
    )
    rollback_episodes: int = Field(
        default=16,
        ge=1,
        description="scored production episodes of a promoted step before the rollback check runs",
    )
    rollback_drop: float = Field(
        default=0.2,
        ge=0.0,
        description="roll a promoted step back to its parent when its mean live reward falls this far "
        "below the parent's",
    )


class LiveConfig(BaseModel):
    """Live training of one served model: when a step trains, on what, and the gate."""

    model_config = ConfigDict(extra="forbid")

    episodes_per_step: int = Field(
        default=16, ge=1, description="train a candidate when this many scored episodes wait"
    )
    max_wait_s: float | None = Field(
        default=None,
        gt=0,
        description="or when the oldest scored episode has waited this long (with min_episodes at least)",
    )
    min_episodes: int = Field(default=2, ge=1, description="fewest episodes a step trains on")
    settle_s: float = Field(
        default=1.0,
        ge=0.0,
        description="an episode joins a step once no call of it was served for this long after its "
        "outcome arrived (an outcome may come before the episode's last call)",
    )
    episode_ttl_s: float = Field(
        default=3600.0,
        gt=0,
        description="an episode without an outcome expires after this long with no call (counted as "
        "expired; its outcome, if it comes later, is refused)",
    )
    max_steps_off_policy: int = Field(
        default=8,
        ge=0,
        description="drop a waiting episode sampled more than this many steps before the parent it "
        "would train (counted as stale)",
    )
    train: TrainConfig = Field(
        default_factory=_live_train_config, description="each step's training settings"
    )
    gate: GateConfig = Field(default_factory=GateConfig)
    enabled: bool = Field(
        default=True, description="False stops training and the gate (outcomes are still taken)"
    )
    budget: Budget | None = Field(
        default=None,
        description="the model's budget from now on (as if registered again with it; spend stays counted): "
        "`journeyman live start --budget-*`; None leaves the registered one",
    )

    @model_validator(mode="after")
    def _check(self) -> LiveConfig:
        if self.train.advantages != "given":
            raise InvalidFieldError(
                "train.advantages",
                self.train.advantages,
                "live episodes carry their advantage as their reward: use 'given'",
            )
        if self.min_episodes > self.episodes_per_step:
            raise InvalidFieldError(
                "min_episodes",
                self.min_episodes,
                f"is more than episodes_per_step ({self.episodes_per_step})",
            )
        return self


class EpisodeOutcome(BaseModel):
    """What a client posts when an episode's result is known (minutes or days later)."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str = Field(
        description="the `x-journeyman-capture` header value the episode's requests carried"
    )
    reward: float = Field(
        description=f"the episode's reward (higher is better), finite, within ±{MAX_OUTCOME_REWARD:g}"
    )
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description=f"more numbers, kept on the trajectory: at most {MAX_OUTCOME_METRICS}, names of at most "
        f"{MAX_METRIC_NAME_CHARS} characters, finite values within ±{MAX_OUTCOME_METRIC:g}",
    )
    group: str | None = Field(
        default=None,
        description="episodes of the same task share a key: they are compared with each other, and the "
        f"baseline of a lone one is its key's running mean (at most {MAX_OUTCOME_GROUP_CHARS} characters)",
    )

    @field_validator("episode_id")
    @classmethod
    def _id(cls, v: str) -> str:
        return check_name("episode_id", v)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not (math.isfinite(v) and abs(v) <= MAX_OUTCOME_REWARD):
            raise InvalidFieldError(
                "reward",
                v,
                f"must be a finite number within ±{MAX_OUTCOME_REWARD:g} (MAX_OUTCOME_REWARD): scale it",
            )
        return v

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: dict[str, float]) -> dict[str, float]:
        if len(v) > MAX_OUTCOME_METRICS:
            raise InvalidFieldError(
                "metrics", f"{len(v)} metrics", f"at most {MAX_OUTCOME_METRICS} (MAX_OUTCOME_METRICS)"
            )
        for name, x in v.items():
            if len(name) > MAX_METRIC_NAME_CHARS:
                raise InvalidFieldError(
                    "metrics",
                    name,
                    f"a metric's name has at most {MAX_METRIC_NAME_CHARS} characters (MAX_METRIC_NAME_CHARS)",
                )
            if not (math.isfinite(x) and abs(x) <= MAX_OUTCOME_METRIC):
                raise InvalidFieldError(
                    name, x, f"must be a finite number within ±{MAX_OUTCOME_METRIC:g} (MAX_OUTCOME_METRIC)"
                )
        return v

    @field_validator("group")
    @classmethod
    def _group(cls, v: str | None) -> str | None:
        if v is not None and len(v) > MAX_OUTCOME_GROUP_CHARS:
            raise InvalidFieldError(
                "group",
                f"{len(v)} characters",
                f"a group key has at most {MAX_OUTCOME_GROUP_CHARS} characters (MAX_OUTCOME_GROUP_CHARS)",
            )
        return v


class OutcomeReceipt(BaseModel):
    episode_id: str
    status: Literal["accepted", "duplicate"] = Field(
        description="accepted: recorded now; duplicate: this very outcome was recorded before (nothing changed)"
    )
    calls: int = Field(description="calls of the episode joined so far")
    step: int | None = Field(description="the policy step that served the episode")


DecisionAction = Literal["promote", "reject", "rollback"]


class Decision(BaseModel):
    """One gate decision: also a history row (`split: "live"`, `decision: ...`)."""

    action: DecisionAction
    step: int = Field(description="the candidate promoted or rejected; the step rolled back")
    served: int = Field(description="the step the production traffic is served by after it")
    reason: str
    by: str = Field(description="'gate', 'rollback', or the name of the person's API token")
    at: float = Field(description="unix time")


class LiveStatus(BaseModel):
    """`journeyman live status`: traffic, waiting episodes, candidates, the promoted step."""

    enabled: bool
    promoted: int = Field(description="the step the bare model name serves")
    candidate: int | None = Field(
        description="the step being judged, served to the canary share and as name@step"
    )
    latest: int = Field(description="the newest checkpoint")
    episodes_open: int = Field(description="episodes with calls and no outcome yet")
    episodes_waiting: int = Field(description="scored episodes waiting to train")
    counts: dict[str, int] = Field(
        description="outcomes, duplicates, expired, refused_expired, unknown, stale, trained, steps, "
        "set_aside (episodes that could not train; each batch a history row with the reason)"
    )
    canary: dict[str, float] = Field(
        description="the judged candidate's and the promoted step's live numbers"
    )
    decisions: list[Decision] = Field(description="the latest decisions, newest last")
    busy: bool = Field(default=False, description="a step trains, or a candidate is being judged, now")
    error: str | None = Field(default=None, description="the live loop's last error, if any")
    spent: dict[str, float] = Field(
        default_factory=dict, description="what the run has spent (`Meter.spent`: tokens, judge, wall time)"
    )
    limits: dict[str, float] = Field(
        default_factory=dict, description="the model's budget limits that are set"
    )


__all__ = [
    "MAX_METRIC_NAME_CHARS",
    "MAX_OUTCOME_GROUP_CHARS",
    "MAX_OUTCOME_METRIC",
    "MAX_OUTCOME_METRICS",
    "MAX_OUTCOME_REWARD",
    "Decision",
    "DecisionAction",
    "EpisodeOutcome",
    "GateConfig",
    "LiveConfig",
    "LiveStatus",
    "OutcomeReceipt",
]
