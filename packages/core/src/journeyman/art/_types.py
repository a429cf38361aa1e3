"""ART's training config and results, as ART code builds and reads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

import journeyman as jm
from journeyman.art._unsupported import refuse
from journeyman.art.dev import train_fields

ART_LEARNING_RATE = 5e-6
"""ART's default learning rate (`art.TrainConfig`, `backend.train`); Journeyman's own is 5e-5."""


class TrainConfig(BaseModel):
    """ART's `art.TrainConfig`: a learning rate and a KL coefficient, with ART's defaults."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(default=ART_LEARNING_RATE, gt=0)
    beta: float = Field(default=0.0, ge=0, description="KL coefficient (Journeyman's kl_coef)")


class TrainSFTConfig(BaseModel):
    """ART's `art.TrainSFTConfig` for `model.train_sft`: a learning rate, a batch size, which assistant
    turns train. A list of per-batch rates and `assistant_turns="last"` raise ArtFeatureNotSupported."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | list[float] = 5e-5
    batch_size: int | Literal["auto"] = "auto"
    assistant_turns: Literal["all", "last"] = "all"

    def journeyman(self) -> jm.SFTConfig:
        """The Journeyman SFTConfig this config asks for ("auto" batch size: Journeyman's default)."""
        if isinstance(self.learning_rate, list):
            refuse("art.TrainSFTConfig(learning_rate=)")
        if self.assistant_turns != "all":
            refuse("art.TrainSFTConfig(assistant_turns=)")
        fields: dict[str, Any] = {"learning_rate": self.learning_rate}
        if self.batch_size != "auto":
            fields["batch_size"] = self.batch_size
        return jm.SFTConfig(**fields)


@dataclass
class TrainResult:
    """What `backend.train` returns: the step trained to and its metrics (for `model.log`)."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LocalTrainResult(TrainResult):
    checkpoint_path: str | None = None


def journeyman_config(
    base: Mapping[str, Any],
    config: TrainConfig | jm.TrainConfig | None,
    art_settings: Mapping[str, Any],
    where: str,
) -> jm.TrainConfig:
    """One Journeyman TrainConfig from a model's `_internal_config` defaults (`base`), an ART or
    Journeyman config, and ART keyword settings (later wins). ART's learning rate is the default."""
    fields: dict[str, Any] = {"learning_rate": ART_LEARNING_RATE, **base}
    if isinstance(config, jm.TrainConfig):
        fields |= config.model_dump(exclude_unset=True)
    elif isinstance(config, TrainConfig):
        fields |= train_fields(config.model_dump(), where)
    elif config is not None:
        raise TypeError(
            f"{where}: config must be art.TrainConfig or journeyman.TrainConfig, not {type(config).__name__}"
        )
    fields |= train_fields(art_settings, where)
    return jm.TrainConfig(**fields)


__all__ = [
    "ART_LEARNING_RATE",
    "LocalTrainResult",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "journeyman_config",
]
