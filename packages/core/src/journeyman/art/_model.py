"""`art.Model` (a prompted model to compare against) and `art.TrainableModel`, as thin layers over
Journeyman's TrainableModel: ART's fields and call shapes, Journeyman's machinery underneath."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel, ConfigDict, PrivateAttr

import journeyman as jm
from journeyman.art._types import TrainConfig, TrainSFTConfig, journeyman_config
from journeyman.art._unsupported import refuse
from journeyman.art.dev import lora_config_fields, lora_fields, warn_unsupported
from journeyman.client.protocol import CLIENT_TIMEOUT_S
from journeyman.errors import InvalidFieldError, JourneymanError

if TYPE_CHECKING:
    from openai import AsyncOpenAI

_TRAINING_SPLITS = ("train", "sft")  # the groups of these splits were written by the train call


def as_groups(items: Iterable[Any] | None, where: str) -> list[jm.TrajectoryGroup] | None:
    """ART's accepted shapes: groups, one flat list of trajectories (one group), or lists of them."""
    if items is None:
        return None
    items = list(items)
    if all(isinstance(x, jm.TrajectoryGroup) for x in items):
        return items
    if all(isinstance(x, jm.Trajectory | BaseException) for x in items):
        return [jm.TrajectoryGroup(items)]
    if all(isinstance(x, list | tuple) for x in items):
        return [jm.TrajectoryGroup(x) for x in items]
    raise InvalidFieldError(where, items, "expected TrajectoryGroups, Trajectories, or lists of Trajectories")


def _named(name: str, step: int | None) -> str:
    return name if step is None else f"{name}@{step}"


class _ModelMeta(type(BaseModel)):
    """In ART a TrainableModel is a Model (rollouts annotated `art.Model` take either): `isinstance`
    and `issubclass` say so here too, though ours builds on Journeyman's TrainableModel instead."""

    def __instancecheck__(cls, instance: object) -> bool:
        return super().__instancecheck__(instance) or (cls is Model and isinstance(instance, TrainableModel))

    def __subclasscheck__(cls, subclass: type) -> bool:
        return super().__subclasscheck__(subclass) or (
            cls is Model and isinstance(subclass, type) and issubclass(subclass, TrainableModel)
        )


class Model(BaseModel, metaclass=_ModelMeta):
    """ART's prompted model: any OpenAI-compatible endpoint to roll out against (e.g. the base model
    a Journeyman endpoint serves under its own name, or a hosted model), compared with a trained one."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    name: str
    project: str
    config: Any = None
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None

    @property
    def trainable(self) -> bool:
        return False

    def get_inference_name(self, step: int | None = None) -> str:
        """The model name to send to the endpoint (`name@step` for one checkpoint, as ART writes it)."""
        return _named(self.inference_model_name or self.name, step)

    def openai_client(self) -> AsyncOpenAI:
        from openai import AsyncOpenAI

        if self.inference_base_url is None:
            raise InvalidFieldError(
                "inference_base_url", None, "a prompted art.Model needs the endpoint to call (and its key)"
            )
        return AsyncOpenAI(
            base_url=self.inference_base_url,
            api_key=self.inference_api_key or "none",
            http_client=httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_TIMEOUT_S)),
        )

    async def register(self, backend: Any) -> None:
        """Nothing to load for a prompted model: Journeyman records only trained models' runs."""

    async def get_step(self) -> int:
        return 0

    async def log(
        self,
        trajectories: Iterable[Any] | None = None,
        split: str = "val",
        *,
        metrics: Mapping[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        raise JourneymanError(
            f"model {self.name!r} is a prompted art.Model: Journeyman keeps runs of trained models only; "
            "compare its rewards in your own code (or log them on the TrainableModel with metrics={...})"
        )


class TrainableModel(jm.TrainableModel):
    """ART's `art.TrainableModel`: Journeyman's, plus ART's `config` (your own settings object),
    `run_name`, `inference_model_name`, `lora_config`, `_internal_config` (translated: LoRA
    rank/alpha/dropout/targets, learning rate, grad norm... ; warned about where Journeyman has no
    such knob), ART's `train`, `train_sft` and `log` call shapes.

    `run_name`: ART 0.5.23 keeps a run's checkpoints under `run_name` and serves it as `name`. A
    Journeyman run is kept and served under one name, so `run_name` is the model's `name` (the
    default); a different one raises ArtFeatureNotSupported rather than resuming the wrong run."""

    config: Any = None
    run_name: str | None = None
    inference_model_name: str | None = None
    _train_defaults: dict[str, Any] = PrivateAttr(default_factory=dict)
    _last_result: jm.TrainResult | None = PrivateAttr(None)

    def __init__(
        self,
        *,
        lora_config: Mapping[str, Any] | None = None,
        _internal_config: Mapping[str, Any] | None = None,
        **data: Any,
    ) -> None:
        run_name = data.get("run_name")
        if run_name is not None and run_name != data.get("name"):
            refuse("art.TrainableModel(run_name=)")
        lora, train = lora_fields(_internal_config or {})
        lora |= lora_config_fields(lora_config or {})
        if lora:
            given = data.get("lora")
            base = given.model_dump() if isinstance(given, jm.LoraConfig) else dict(given or {})
            data["lora"] = jm.LoraConfig(**{**base, **lora})
        super().__init__(**data)
        if self.run_name is None:
            self.run_name = self.name
        self._train_defaults = train

    @property
    def trainable(self) -> bool:
        return True

    def get_inference_name(self, step: int | None = None) -> str:
        """The name to send to this model's endpoint. Without `step`, the bare name, which the
        endpoint always serves with the latest step: ART's LocalBackend answers `name@<latest>`,
        a name that stops being served the moment the next step lands. With `step`, `name@step`,
        served while that step is (else a 404 that names the step served)."""
        return _named(self.inference_model_name or self.name, step)

    async def register(
        self, backend: jm.Backend, _openai_client_config: Mapping[str, Any] | None = None
    ) -> None:
        if _openai_client_config:
            warn_unsupported(
                "register(_openai_client_config=...)", "configures ART's vLLM server; not applied here"
            )
        await super().register(backend)

    def train_config(
        self, config: TrainConfig | jm.TrainConfig | None, settings: Mapping[str, Any]
    ) -> jm.TrainConfig:
        """The Journeyman config a train call with ART's `config` and keyword `settings` runs with."""
        return journeyman_config(self._train_defaults, config, settings, "train")

    async def train(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        trajectory_groups: Iterable[Any],
        config: TrainConfig | jm.TrainConfig | None = None,
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        *,
        idempotency_key: str | None = None,
    ) -> jm.TrainResult:
        """ART's (deprecated there) `model.train(groups, config=art.TrainConfig(...), _config=...)`: one
        step; ART's defaults (learning rate 5e-6). `backend.train(model, groups, ...)` is ART's current form."""
        groups = as_groups(trajectory_groups, "trajectory_groups") or []
        cfg = self.train_config(config, dict(_config or {}))
        result = await self.backend.train(self, groups, cfg, idempotency_key=idempotency_key)
        self._last_result = result
        return result

    async def train_sft(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        trajectories: Iterable[Any],
        config: TrainSFTConfig | jm.SFTConfig | None = None,
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        log_metrics: bool = True,
        *,
        idempotency_key: str | None = None,
    ) -> jm.TrainResult:
        """ART's `model.train_sft(trajectories, config=art.TrainSFTConfig(...))`: one SFT step of this
        run. `verbose` and `log_metrics` change nothing (progress is shown and the step's metrics
        recorded either way); ART's experimental `_config` raises ArtFeatureNotSupported."""
        del verbose, log_metrics
        if _config:
            refuse("art.dev.TrainSFTConfig")
        cfg = config.journeyman() if isinstance(config, TrainSFTConfig) else config
        return await super().train_sft(list(trajectories), cfg, idempotency_key=idempotency_key)

    async def log(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        trajectories: Iterable[Any] | None = None,
        split: str = "val",
        *,
        metrics: Mapping[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """ART's `model.log(groups, metrics=..., step=..., split=...)`: one history row at the served step.

        After `backend.train`, `log(groups, metrics=result.metrics, step=result.step, split="train")`
        is already recorded: the train call wrote those groups and metrics to the run; only metrics
        it did not record are added."""
        current = await self.get_step()
        if step is not None and step != current:
            raise InvalidFieldError("step", step, f"Journeyman records rows at the served step, {current}")
        groups = as_groups(trajectories, "trajectories")
        if split in _TRAINING_SPLITS:
            last = self._last_result
            recorded = last.metrics if last is not None and last.step == current else {}
            rest = {k: v for k, v in (metrics or {}).items() if recorded.get(k) != v}
            if groups is not None and last is None:
                warnings.warn(
                    f"journeyman.art: log(split={split!r}) of groups that did not train here: the groups of "
                    "a training split are the ones a train call wrote; not written again",
                    UserWarning,
                    stacklevel=2,
                )
            return await super().log(None, split, rest) if rest else {}
        return await super().log(groups, split, metrics)


__all__ = ["Model", "TrainableModel", "as_groups"]
