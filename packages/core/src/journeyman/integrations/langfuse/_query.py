"""Which scored traces make a review set: `ReviewQuery`, the one statement of every filter.

`fetch_review_set` reads it, and `journeyman langfuse pull|train` derive their options from it (help
from each field's description), so a filter is described once. Pure pydantic, no Langfuse SDK: the
CLI builds its options from this module without the `langfuse` extra installed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from journeyman.data.types import Trajectory
from journeyman.errors import InvalidFieldError, OwnErrorsModel


class ReviewScore(BaseModel):
    """One Langfuse score on a trace (or on one of its observations)."""

    name: str
    value: float | None = Field(description="the number used as reward; None when the score has none")
    raw: float | bool | str | None = None
    data_type: str
    source: str = Field(description="API, ANNOTATION (human review), EVAL")
    trace_id: str
    observation_id: str | None = None
    timestamp: datetime
    queue_id: str | None = None
    author_user_id: str | None = None
    comment: str | None = None


class LangfuseTrace(BaseModel):
    """A fetched trace, as a `group_by` or `combine` callable sees it."""

    id: str
    name: str | None = None
    tags: list[str] = Field(default_factory=list)
    session_id: str | None = None
    timestamp: datetime
    metadata: dict[str, Any] = Field(default_factory=dict, description="the root observation's metadata")
    scores: list[ReviewScore] = Field(default_factory=list)


CombineName = Literal["mean", "min", "max", "sum", "latest", "first"]
Combine = CombineName | Callable[[list[ReviewScore]], float | None]
GroupBy = str | Callable[[LangfuseTrace, Trajectory], str | None] | None
_COMBINE_NAMES: tuple[str, ...] = CombineName.__args__  # pyright: ignore[reportAttributeAccessIssue]


def _listed(value: Any) -> Any:
    """One name or several: a lone string is a list of one (not a sequence of characters)."""
    return [value] if isinstance(value, str) else value


class ReviewQuery(OwnErrorsModel):
    """Which traces to fetch, what reward each gets, and how they group: every filter of a review set.

    `fetch_review_set(ReviewQuery(score="human", tags=["journeyman"]))`, or the same as keywords:
    `fetch_review_set(score="human", tags=["journeyman"])`."""

    model_config = ConfigDict(extra="forbid")  # a misspelt filter is an error, not a query for everything

    score: list[str] = Field(
        description="score name(s) that become the reward; several names (or several reviewers) on one "
        "trace are combined by `combine`"
    )
    combine: Combine = Field(
        default="mean",
        description="how several scores on one trace combine: mean, min, max, sum, latest, first (or, in "
        "Python, a function of the list of ReviewScore)",
    )
    tags: list[str] = Field(default_factory=list, description="only traces with every one of these tags")
    name: str | None = Field(default=None, description="only traces with this trace name")
    since: datetime | None = Field(
        default=None, description="only traces that started at or after this time (naive: UTC)"
    )
    until: datetime | None = Field(
        default=None, description="only traces that started before this time (naive: UTC)"
    )
    environment: str | None = Field(default=None, description="only traces of this Langfuse environment")
    score_source: list[str] | None = Field(
        default=None,
        description="only scores from this source (or these): ANNOTATION (human review), API, EVAL",
    )
    queue_id: str | None = Field(default=None, description="only scores from this annotation queue id")
    categories: dict[str, float] | None = Field(
        default=None,
        description='reward of each value of a categorical score, e.g. {"good": 1.0, "bad": 0.0} '
        "(boolean scores are 1/0; a categorical one without this is skipped as not numeric)",
    )
    group_by: GroupBy = Field(
        default=None,
        description="group by this metadata key (e.g. scenario_id), session_id or trace_name (or, in Python, "
        "a function (trace, trajectory) -> key); default: the group an export recorded, else the session",
    )
    min_group_size: int = Field(
        default=2, description="skip groups with fewer trajectories (GRPO compares within a group)"
    )
    generation_name: str | None = Field(
        default=None,
        description="in traces not exported by Journeyman: the name of the policy's generations",
    )
    limit: int | None = Field(default=None, description="look at most at this many traces")

    @field_validator("score", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        names = _listed(v)
        if (
            not isinstance(names, list | tuple)
            or not names
            or not all(isinstance(n, str) and n for n in names)
        ):
            raise InvalidFieldError(
                "score", v, "name the score(s) that become the reward, e.g. score='human'"
            )
        return list(names)

    @field_validator("tags", "score_source", mode="before")
    @classmethod
    def _several(cls, v: Any) -> Any:
        return _listed(v)

    @field_validator("combine", mode="before")
    @classmethod
    def _combine(cls, v: Any) -> Any:
        if not callable(v) and v not in _COMBINE_NAMES:
            raise InvalidFieldError(
                "combine", v, "use mean, min, max, sum, latest, first or a function of the scores"
            )
        return v

    @field_validator("since", "until")
    @classmethod
    def _utc(cls, v: datetime | None) -> datetime | None:
        return v if v is None or v.tzinfo is not None else v.replace(tzinfo=UTC)

    @field_validator("min_group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:
        if v < 1:
            raise InvalidFieldError("min_group_size", v, "must be >= 1")
        return v
