"""What `journeyman serve` and `RemoteBackend` say to each other: the Backend protocol as JSON.

One pydantic model per request body, shared by both sides, so the two cannot drift apart. A body is
the arguments of one Backend call less the model its path names: `Body.of(arguments)` on the client,
`body.arguments()` back on the server. Groups travel gzip-compressed (`Content-Encoding: gzip`):
trajectories are token-id lists that compress about 4x. Training answers with newline-delimited
JSON events (progress, then the result), so a client shows progress as it happens and a dropped
connection loses nothing: the step goes on, and the client reattaches with the same idempotency key.
"""

from __future__ import annotations

import gzip
import uuid
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, Field, ValidationError, field_validator

from journeyman.data.config import ModelConfig, SFTConfig, TrainConfig, TrainResult, check_name
from journeyman.data.live_types import DecisionAction, LiveConfig
from journeyman.data.trajectory_file import check_trajectories
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError

PROTOCOL_VERSION = 5
"""Bumped on any change to these bodies or routes; client and server refuse a mismatch by name."""

PREFIX = "/journeyman/v1"


class ServerInfo(BaseModel):
    journeyman: str = Field(description="the server's package version")
    protocol: int = Field(description="PROTOCOL_VERSION of the server")
    models: list[str] = Field(default_factory=list, description="models registered on the server")


class Body(BaseModel):
    """A request body: the arguments of one Backend call, named as the protocol names them."""

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        """The body of a call with `arguments` (those it has no field for stay on the client)."""
        try:
            return cls.model_validate({k: v for k, v in arguments.items() if k in cls.model_fields})
        except ValidationError as e:
            raise body_error(e) from e

    def arguments(self) -> dict[str, Any]:
        """The call's arguments again, on the server."""
        return {name: getattr(self, name) for name in type(self).model_fields}


class RegisterBody(Body):
    model: ModelConfig

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        # a TrainableModel is sent as the plain config it is; fields of subclasses (journeyman.art's
        # run_name, config) stay on the client, as LocalBackend ignores them too
        config = arguments["model"].model_dump(include=set(ModelConfig.model_fields))
        return super().of({"model": ModelConfig.model_validate(config)})


class Registered(BaseModel):
    run_dir: str = Field(description="the run directory on the server's machine")


class _KeyedBody(Body):
    """A training call: retried with the same key, it trains once."""

    idempotency_key: str = Field(
        description="the same key for every retry of one step (see config.check_name)"
    )

    @field_validator("idempotency_key")
    @classmethod
    def _key(cls, v: str) -> str:
        return check_name("idempotency_key", v)

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        # made once per call, before any retry: every retry carries it
        return super().of(
            {**arguments, "idempotency_key": arguments.get("idempotency_key") or uuid.uuid4().hex}
        )


class TrainBody(_KeyedBody):
    groups: list[TrajectoryGroup]
    config: TrainConfig | None = None


class SFTBody(_KeyedBody):
    trajectories: list[Trajectory] = Field(default_factory=list, description="loose trajectories")
    groups: list[TrajectoryGroup] = Field(default_factory=list, description="trajectories in groups")
    config: SFTConfig | None = None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        items, _ = check_trajectories(arguments["trajectories"])
        loose = [t for t in items if isinstance(t, Trajectory)]
        grouped = [g for g in items if isinstance(g, TrajectoryGroup)]
        return super().of({**arguments, "trajectories": loose, "groups": grouped})

    def arguments(self) -> dict[str, Any]:
        arguments = super().arguments()
        arguments["trajectories"] = [*self.trajectories, *arguments.pop("groups")]
        return arguments


class LogBody(Body):
    groups: list[TrajectoryGroup] | None = None
    split: str = "val"
    metrics: dict[str, float] | None = None


class CapturesBody(Body):
    capture_ids: list[str]


class StepBody(Body):
    step: int


class DeleteCheckpointsBody(Body):
    best_checkpoint_metric: str = "val/reward"


class LiveBody(Body):
    config: LiveConfig | None = None


class OutcomeBody(Body):
    """An episode's outcome, as `curl` posts it: `{"episode_id": "...", "reward": 1.0}`."""

    episode_id: str = Field(description="the x-journeyman-capture header value of the episode's requests")
    reward: float
    metrics: dict[str, float] | None = None
    group: str | None = Field(default=None, description="episodes of one task share a key")


class DecideBody(Body):
    action: DecisionAction
    step: int | None = Field(
        default=None, description="default: the candidate (promote, reject), the promoted step (rollback)"
    )
    reason: str = ""


class ChargeBody(Body):
    judge_usd: float = Field(default=0.0, ge=0, description="what the judge's answers cost, in US dollars")
    judge_tokens: int = Field(default=0, ge=0, description="the tokens the judge read and wrote")
    check: bool = Field(default=True, description="then refuse (402) when a judging limit is reached")


class TrainEvent(BaseModel):
    """One line of a train stream."""

    kind: Literal["progress", "result", "error"]
    done: int = 0
    total: int = 0
    result: TrainResult | None = None
    error: dict[str, Any] | None = None


def body_error(e: ValidationError) -> InvalidFieldError:
    """A body's first validation error, naming its field (a nested validator's own field under it)."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "body"
    inner = (err.get("ctx") or {}).get("error")
    if isinstance(inner, InvalidFieldError):
        named = where == inner.field or where.endswith("." + inner.field)
        return InvalidFieldError(where if named else f"{where}.{inner.field}", inner.value, inner.reason)
    return InvalidFieldError(where, err.get("input"), err["msg"])


def gzip_json(body: BaseModel) -> bytes:
    return gzip.compress(body.model_dump_json().encode(), compresslevel=5)
