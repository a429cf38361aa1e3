"""TrainableModel: the user's handle on a policy that a backend serves and trains."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from openai import AsyncOpenAI
from pydantic import Field, PrivateAttr, field_validator

from .adapter import LoraConfig
from .capture import CapturedCall, add_capture_header, capture_scope
from .errors import InvalidFieldError, JourneymanError, OwnErrorsModel
from .weights import DEFAULT_BASE_MODEL

if TYPE_CHECKING:
    from .backend import LocalBackend
    from .train import TrainConfig, TrainResult
    from .types import TrajectoryGroup

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(field: str, value: str) -> str:
    """Names become directories: refuse anything that could escape the run directory."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise InvalidFieldError(field, value, "use letters, digits, '.', '_' and '-' (no '/', no '..')")
    return value


class Capture:
    """The calls made inside `model.capture()`, available after the block exits."""

    def __init__(self, capture_id: str) -> None:
        self.id = capture_id
        self.calls: list[CapturedCall] = []


class TrainableModel(OwnErrorsModel):
    """A LoRA policy on `base_model`, served on an OpenAI-compatible endpoint once registered."""

    name: str
    project: str
    base_model: str = Field(
        DEFAULT_BASE_MODEL, description="embedded model name, local HF directory, or hub id"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    max_tokens: int = Field(1024, ge=1, description="default max_tokens for requests that set none")

    _backend: LocalBackend | None = PrivateAttr(None)

    @field_validator("name", "project")
    @classmethod
    def _safe(cls, v: str, info: Any) -> str:
        return check_name(info.field_name, v)

    async def register(self, backend: LocalBackend) -> None:
        """Load (or resume) this model on `backend` and start serving it."""
        await backend.register(self)
        self._backend = backend

    @property
    def backend(self) -> LocalBackend:
        if self._backend is None:
            raise JourneymanError(
                f"model {self.name!r} is not registered: call `await model.register(backend)` first"
            )
        return self._backend

    @property
    def inference_base_url(self) -> str:
        return self.backend.base_url(self)

    @property
    def inference_api_key(self) -> str:
        return "journeyman"

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An AsyncOpenAI client for this model's endpoint; requests inside `capture()` are tagged."""
        http = httpx.AsyncClient(event_hooks={"request": [add_capture_header]}, timeout=httpx.Timeout(600.0))
        return AsyncOpenAI(
            base_url=self.inference_base_url, api_key=self.inference_api_key, http_client=http, **kwargs
        )

    async def get_step(self) -> int:
        return self.backend.step(self)

    async def train(
        self, groups: Sequence[TrajectoryGroup], config: TrainConfig | None = None
    ) -> TrainResult:
        """One GRPO-family step on `groups`; afterwards the endpoint serves the new step."""
        return await self.backend.train(self, groups, config)

    async def log(self, groups: Sequence[TrajectoryGroup], split: str = "val") -> dict[str, float]:
        """Record groups without training (evaluation): trajectories on disk, a history row."""
        return await self.backend.log(self, groups, split)

    def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Keep the best checkpoint by `best_checkpoint_metric` and the latest; return the steps deleted."""
        return self.backend.store(self).delete_checkpoints(best_checkpoint_metric)

    @property
    def run_dir(self) -> Path:
        return self.backend.model_dir(self)

    @asynccontextmanager
    async def capture(self) -> AsyncIterator[Capture]:
        """Collect every completion served to this context (this task and its children), in order."""
        with capture_scope() as cid:
            cap = Capture(cid)
            try:
                yield cap
            finally:
                cap.calls = self.backend.pop_captures(self, cid)
