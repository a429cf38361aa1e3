"""TrainableModel: the user's handle on a policy that a backend serves and trains."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import PrivateAttr

from journeyman.client.protocol import (
    CLIENT_TIMEOUT_S,
    Backend,
    Evaluate,
    Inference,
    LiveBackend,
    set_current_backend,
)
from journeyman.data.config import ModelConfig, SFTConfig, TrainConfig, TrainResult
from journeyman.data.live_types import Decision, DecisionAction, LiveConfig, LiveStatus, OutcomeReceipt
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError, JourneymanError
from journeyman.rollout.capture import CapturedCall, add_capture_header, capture_scope

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI


class Capture:
    """The calls made inside `model.capture()`, available after the block exits."""

    def __init__(self, capture_id: str) -> None:
        self.id = capture_id
        self.calls: list[CapturedCall] = []


class TrainableModel(ModelConfig):
    """A LoRA policy on `base_model`, served on an OpenAI-compatible endpoint once registered."""

    _backend: Backend | None = PrivateAttr(None)

    async def register(self, backend: Backend) -> None:
        """Load (or resume) this model on `backend` and start serving it."""
        if not isinstance(backend, Backend):
            raise InvalidFieldError(
                "backend", backend, "expected a journeyman Backend (e.g. jm.LocalBackend())"
            )
        await backend.register(self)
        self._backend = backend
        set_current_backend(backend)

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise JourneymanError(
                f"model {self.name!r} is not registered: call `await model.register(backend)` first"
            )
        return self._backend

    def inference(self) -> Inference:
        """Base URL, key and model name of this model's OpenAI-compatible endpoint."""
        return self.backend.inference(self.name)

    @property
    def inference_base_url(self) -> str:
        return self.inference().base_url

    @property
    def inference_api_key(self) -> str:
        return self.inference().api_key

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An AsyncOpenAI client for this model's endpoint; requests inside `capture()` are tagged."""
        from openai import AsyncOpenAI

        where = self.inference()
        timeout = httpx.Timeout(CLIENT_TIMEOUT_S)  # past the endpoint's own limit: its 504 names the cause
        http = httpx.AsyncClient(event_hooks={"request": [add_capture_header]}, timeout=timeout)
        return AsyncOpenAI(base_url=where.base_url, api_key=where.api_key, http_client=http, **kwargs)

    def anthropic_client(self, **kwargs: Any) -> AsyncAnthropic:
        """An AsyncAnthropic client for this model's `/v1/messages` (the Anthropic Messages API, served
        by the same endpoint); requests inside `capture()` are tagged. Needs `pip install anthropic`."""
        try:
            from anthropic import AsyncAnthropic, DefaultAsyncHttpxClient
        except ImportError as e:
            raise ImportError(
                "model.anthropic_client() needs the Anthropic SDK: pip install anthropic"
            ) from e

        where = self.inference()
        # the SDK's own HTTP client class (newer releases ship their own httpx), with the capture hook
        http = DefaultAsyncHttpxClient(
            event_hooks={"request": [add_capture_header]}, timeout=CLIENT_TIMEOUT_S
        )
        root = where.base_url.removesuffix("/").removesuffix("/v1")  # the SDK adds /v1/messages
        return AsyncAnthropic(**{"base_url": root, "api_key": where.api_key, "http_client": http, **kwargs})

    async def get_step(self) -> int:
        return await self.backend.get_step(self)

    async def train(
        self,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> TrainResult:
        """One GRPO-family step on `groups`; afterwards the endpoint serves the new step.

        Groups whose rewards are all equal teach nothing: with none that differs, the step is skipped
        (`result.skipped`, `result.skip_reason` says why, and the log), or with
        `TrainConfig(on_no_signal="error")` refused with `NoLearningSignalError`.

        `idempotency_key`: retrying a call with the same key never trains twice (a remote backend
        makes one up per call when none is given)."""
        return await self.backend.train(self, groups, config, idempotency_key=idempotency_key)

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory | TrajectoryGroup],
        config: SFTConfig | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning on good `trajectories` (a warm start before RL): one step of this
        run, on the same adapter, so `train` continues from it. Only assistant turns are trained,
        on their sampled ids where they were recorded, else as the chat template renders them."""
        return await self.backend.train_sft(self, trajectories, config, idempotency_key=idempotency_key)

    async def log(
        self,
        groups: Sequence[TrajectoryGroup] | None = None,
        split: str = "val",
        metrics: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Record groups (an evaluation) and/or extra `metrics` without training: one history row."""
        return await self.backend.log(self, groups, split, metrics)

    async def history(self) -> list[dict[str, Any]]:
        """The run's history rows (one per train step or log call), oldest first."""
        return await self.backend.history(self)

    async def serve_step(self, step: int) -> None:
        """Serve checkpoint `step` (0 = the base model); serve the latest again before training."""
        await self.backend.serve_step(self, step)

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Keep the best checkpoint by `best_checkpoint_metric` and the latest; return the steps deleted."""
        return await self.backend.delete_checkpoints(self, best_checkpoint_metric)

    @property
    def run_dir(self) -> Path:
        """Where the run lives on the backend's machine."""
        return self.backend.run_dir(self)

    async def pop_captures(self, capture_ids: Sequence[str]) -> dict[str, list[CapturedCall]]:
        """The calls the endpoint filed under each capture id (see `capture_scope`), taken off it."""
        return await self.backend.pop_captures(self, capture_ids)

    # -- live training (docs/live.md) ----------------------------------------------------------

    def _live(self) -> LiveBackend:
        backend = self.backend
        if not isinstance(backend, LiveBackend):
            raise InvalidFieldError(
                "backend", backend, "does not do live training (LocalBackend, RemoteBackend do)"
            )
        return backend

    def episode(self, episode_id: str | None = None) -> AbstractContextManager[str]:
        """Mark every request made in this context as one live episode (the clients of this model send
        `x-journeyman-capture: <id>`); yields the id, under which `report_outcome` posts its result."""
        return capture_scope(episode_id)

    async def live(self, config: LiveConfig | None = None, *, evaluate: Evaluate | None = None) -> LiveStatus:
        """Start (or reconfigure) live training: scored episodes train candidates in the background,
        and a gate decides which serve (`evaluate(model_name)` scores `name@<step>`, in-process only)."""
        return await self._live().live(self, config, evaluate=evaluate)

    async def report_outcome(
        self,
        episode_id: str,
        reward: float,
        *,
        metrics: Mapping[str, float] | None = None,
        group: str | None = None,
    ) -> OutcomeReceipt:
        """The outcome of a live episode, whenever it is known (idempotent)."""
        return await self._live().report_outcome(self, episode_id, reward, metrics, group)

    async def live_status(self) -> LiveStatus:
        return await self._live().live_status(self)

    async def decide(self, action: DecisionAction, step: int | None = None, reason: str = "") -> Decision:
        """Promote a step (default: the candidate), reject the candidate, or roll back the promoted step."""
        return await self._live().decide(self, action, step, reason)

    @asynccontextmanager
    async def capture(self) -> AsyncIterator[Capture]:
        """Collect every completion served to this context (this task and its children), in order."""
        with capture_scope() as cid:
            cap = Capture(cid)
            try:
                yield cap
            finally:
                cap.calls = (await self.pop_captures([cid]))[cid]
