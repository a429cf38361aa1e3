"""What `journeyman serve` and `RemoteBackend` say to each other: the Backend protocol as JSON.

One pydantic model per request body, shared by both sides, so the two cannot drift apart. Groups
travel gzip-compressed (`Content-Encoding: gzip`): trajectories are token-id lists that compress
about 4x. Training answers with newline-delimited JSON events (progress, then the result), so a
client shows progress as it happens and a dropped connection loses nothing: the step goes on, and
the client reattaches with the same idempotency key.
"""

from __future__ import annotations

import gzip
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from journeyman.data.config import ModelConfig, SFTConfig, TrainConfig, TrainResult, check_name
from journeyman.data.types import Trajectory, TrajectoryGroup

PROTOCOL_VERSION = 2
"""Bumped on any change to these bodies or routes; client and server refuse a mismatch by name."""

PREFIX = "/journeyman/v1"


class ServerInfo(BaseModel):
    journeyman: str = Field(description="the server's package version")
    protocol: int = Field(description="PROTOCOL_VERSION of the server")
    models: list[str] = Field(default_factory=list, description="models registered on the server")


class RegisterBody(BaseModel):
    model: ModelConfig


class TrainBody(BaseModel):
    groups: list[TrajectoryGroup]
    config: TrainConfig | None = None
    idempotency_key: str = Field(
        description="the same key for every retry of one step (see config.check_name)"
    )

    @field_validator("idempotency_key")
    @classmethod
    def _key(cls, v: str) -> str:
        return check_name("idempotency_key", v)


class SFTBody(BaseModel):
    trajectories: list[Trajectory] = Field(default_factory=list, description="loose trajectories")
    groups: list[TrajectoryGroup] = Field(default_factory=list, description="trajectories in groups")
    config: SFTConfig | None = None
    idempotency_key: str = Field(description="the same key for every retry of one step")

    @field_validator("idempotency_key")
    @classmethod
    def _key(cls, v: str) -> str:
        return check_name("idempotency_key", v)


class LogBody(BaseModel):
    groups: list[TrajectoryGroup] | None = None
    split: str = "val"
    metrics: dict[str, float] | None = None


class CapturesBody(BaseModel):
    capture_ids: list[str]


class StepBody(BaseModel):
    step: int


class DeleteCheckpointsBody(BaseModel):
    best_checkpoint_metric: str = "val/reward"


class TrainEvent(BaseModel):
    """One line of a train stream."""

    kind: Literal["progress", "result", "error"]
    done: int = 0
    total: int = 0
    result: TrainResult | None = None
    error: dict[str, Any] | None = None


def gzip_json(body: BaseModel) -> bytes:
    return gzip.compress(body.model_dump_json().encode(), compresslevel=5)
