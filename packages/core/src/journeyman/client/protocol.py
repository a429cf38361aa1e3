"""The Backend contract: what a `TrainableModel` and every integration may ask of the thing that serves
and trains it. `LocalBackend` (this process), a remote client of `journeyman serve`, and a
distributed backend all implement it, so rollout code never changes when the backend does.

    class MyBackend:                       # structural: no base class needed
        async def register(self, model: ModelConfig) -> None: ...
        def inference(self, model_name: str | None = None) -> Inference: ...
        ...
    assert isinstance(MyBackend(), jm.Backend)

Threading: every method is called from the user's event loop; a backend that trains or samples on
other threads keeps its own state safe. Models are addressed by name (the `ModelConfig` given to
`register`), so the contract is data that can cross a process boundary.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from journeyman.data.config import ModelConfig, SFTConfig, TrainConfig, TrainResult
from journeyman.data.live_types import Decision, DecisionAction, LiveConfig, LiveStatus, OutcomeReceipt
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError
from journeyman.rollout.capture import CapturedCall

REQUEST_TIMEOUT_S = 900.0
"""How long an endpoint holds a request before it answers 504 (`EngineTimeoutError`). Clients wait a
little longer, so an overloaded engine ends a request with that named error, which also drops the
request from the engine's queue, rather than the client giving up on its own and retrying while
the abandoned request still takes batch time."""
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 60.0
"""What a client of an endpoint waits for an answer (see REQUEST_TIMEOUT_S)."""


Progress = Callable[[int, int], None]
"""`on_progress(done, total)`: how far a training step has come."""


class Inference(BaseModel):
    """Where a served model answers OpenAI-compatible requests."""

    base_url: str = Field(description="OpenAI base URL, e.g. http://127.0.0.1:7800/v1")
    api_key: str = Field(description="bearer token the endpoint accepts")
    model: str = Field(description="the model name to put in requests")


@runtime_checkable
class Backend(Protocol):
    """Serves and trains registered models; everything a model or an integration needs goes through here."""

    async def register(self, model: ModelConfig) -> None:
        """Load (or resume from its run directory) and serve `model`; registering again is a no-op."""
        ...

    def inference(self, model_name: str | None = None) -> Inference:
        """The endpoint serving `model_name` (the latest registered when None)."""
        ...

    async def get_step(self, model: ModelConfig) -> int:
        """The policy step the endpoint serves now."""
        ...

    async def train(
        self,
        model: ModelConfig,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        idempotency_key: str | None = None,
        on_progress: Progress | None = None,
        trained_by: str | None = None,
    ) -> TrainResult:
        """One training step on `groups`; the endpoint serves the new step when this returns.

        A call repeating the `idempotency_key` of a completed step returns that step's result.
        `on_progress(done, total)` follows the step (micro-batches); `trained_by`, who asked (an API
        token's name), goes into the step's history row: a server sets it to the caller's token."""
        ...

    async def train_sft(
        self,
        model: ModelConfig,
        trajectories: Iterable[Trajectory | TrajectoryGroup],
        config: SFTConfig | None = None,
        *,
        idempotency_key: str | None = None,
        on_progress: Progress | None = None,
        trained_by: str | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning on `trajectories`: one step of the same run, checkpoint and
        history as `train`, so RL continues from it. The keyword arguments work as for `train`
        (`on_progress` counts optimizer steps)."""
        ...

    async def log(
        self,
        model: ModelConfig,
        groups: Sequence[TrajectoryGroup] | None = None,
        split: str = "val",
        metrics: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Record groups (an evaluation) and/or metrics without training: one history row."""
        ...

    async def history(self, model: ModelConfig) -> list[dict[str, Any]]:
        """Every history row of the run, oldest first."""
        ...

    async def pop_captures(
        self, model: ModelConfig, capture_ids: Sequence[str]
    ) -> dict[str, list[CapturedCall]]:
        """Take the calls the endpoint filed under each capture id (each id once; unknown ids: [])."""
        ...

    async def serve_step(self, model: ModelConfig, step: int) -> None:
        """Serve checkpoint `step` (0 = the base model) until the next train step or `serve_step`."""
        ...

    async def delete_checkpoints(
        self, model: ModelConfig, best_checkpoint_metric: str = "val/reward"
    ) -> list[int]:
        """Keep the best checkpoint by `best_checkpoint_metric` and the latest; return the steps deleted."""
        ...

    def run_dir(self, model: ModelConfig) -> Path:
        """Where the run lives on the backend's machine (checkpoints, trajectories, history)."""
        ...

    def close(self) -> None:
        """Stop serving and release engines, threads and processes."""
        ...


@runtime_checkable
class LiveBackend(Protocol):
    """Live training (docs/live.md): episodes from live traffic, outcomes posted whenever they are
    known, candidates trained in the background and gated before they serve. `LocalBackend` and
    `RemoteBackend` implement it beside the `Backend`."""

    async def live(
        self, model: ModelConfig, config: LiveConfig | None = None, *, evaluate: Evaluate | None = None
    ) -> LiveStatus:
        """Start (or reconfigure) live training of `model`; it goes on until `config.enabled` is
        False. `evaluate(model_name)` scores the model served as `model_name` (`name@<step>`) for the
        gate; in this process only (a remote backend refuses it)."""
        ...

    async def report_outcome(
        self,
        model: ModelConfig,
        episode_id: str,
        reward: float,
        metrics: Mapping[str, float] | None = None,
        group: str | None = None,
    ) -> OutcomeReceipt:
        """The outcome of the episode whose requests carried `x-journeyman-capture: <episode_id>`:
        final, idempotent (the same outcome again is a `duplicate`), refused for an unknown or
        expired episode and for a second, different reward."""
        ...

    async def live_status(self, model: ModelConfig) -> LiveStatus:
        """Traffic, waiting episodes, the candidate, the promoted step and the last decisions."""
        ...

    async def decide(
        self,
        model: ModelConfig,
        action: DecisionAction,
        step: int | None = None,
        reason: str = "",
        *,
        trained_by: str | None = None,
    ) -> Decision:
        """A person's decision: promote a step (default: the candidate), reject the candidate, or
        roll the promoted step back to its parent; a history row (with `trained_by`, the token)."""
        ...


@runtime_checkable
class MeteredBackend(Protocol):
    """A backend that keeps each model's spend against its budget (`ModelConfig.budget`,
    `data/budget.py`) and takes the spend made outside it: RULER's judge calls, asked by the agent
    process. `LocalBackend` and `RemoteBackend` implement it beside the `Backend`."""

    async def charge(
        self, model: ModelConfig, judge_usd: float = 0.0, judge_tokens: int = 0, check: bool = True
    ) -> dict[str, float]:
        """Add what `model`'s judge cost to its run's spend; then, with `check`, refuse more judging
        past a limit (`BudgetExceededError`). Answers the spend so far (`Meter.spent`). RULER charges
        nothing and checks before it asks, then charges what the answer cost without a check."""
        ...


Evaluate = Callable[[str], Awaitable[float]]
"""`evaluate(model name)`: a score of the model served under that name (`name@<step>`), higher better."""


@runtime_checkable
class ServedBackend(Backend, Protocol):
    """A Backend that `journeyman serve` can put on the network: besides the Backend, its models by
    name and their OpenAI endpoint, which the server answers on its own origin. `LocalBackend` is one.

    The server calls the Backend's methods as the operations table says (`client/operations.py`),
    passing `trained_by` (the caller's token name) and `on_progress` to the training calls."""

    path: Path
    """Where the server keeps its own files (the models it serves, its tokens)."""

    def registered(self) -> list[str]:
        """Names of the models served, in order of registration."""
        ...

    def registered_model(self, name: str) -> ModelConfig:
        """The config the model `name` is served with (`UnknownModelError` when none is)."""
        ...

    async def chat_completion(
        self,
        body: dict[str, Any],
        capture_id: str | None = None,
        response_id: str | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> dict[str, Any]:
        """Answer an OpenAI chat completion request on the endpoint of the model it names, telling
        `on_text(choice, delta)` of its content as it is sampled."""
        ...

    def served_names(self) -> list[str]:
        """Every model name the OpenAI routes answer to (each model's, and `name@step`)."""
        ...


def named_or_latest(model_name: str | None, registered: Sequence[str]) -> str:
    """`model_name`, or when None the model registered last (what `inference()` serves by default)."""
    if model_name is not None:
        return model_name
    if not registered:
        raise InvalidFieldError("model", None, "no model is registered with this backend")
    return registered[-1]


# The backend the latest `register` in this context used: `judge="local"` and other "the model I am
# training" lookups find their endpoint through it. A ContextVar, so concurrent programs (tests, two
# trainers in one process) each see their own.
_current: ContextVar[Backend | None] = ContextVar("journeyman_backend", default=None)


# The model whose run pays for the help asked on its behalf (RULER's judge): `TrainLoop` sets it
# while it gathers, so `after_each=ruler_score_group` charges the loop's model with no argument.
_charged: ContextVar[ModelConfig | None] = ContextVar("journeyman_charged", default=None)


@contextmanager
def charging(model: ModelConfig) -> Iterator[None]:
    """Inside the block (and the tasks it starts), RULER charges its judge to `model`'s budget."""
    token = _charged.set(model)
    try:
        yield
    finally:
        _charged.reset(token)


def charged_model() -> ModelConfig | None:
    """The model `charging` names here, if any."""
    return _charged.get()


def set_current_backend(backend: Backend) -> None:
    _current.set(backend)


def current_backend(field: str = "backend") -> Backend:
    """The backend of the latest `model.register(backend)` in this context."""
    backend = _current.get()
    if backend is None:
        raise InvalidFieldError(field, None, "no model is registered in this context: register one first")
    return backend


__all__ = [
    "CLIENT_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "Backend",
    "Evaluate",
    "Inference",
    "LiveBackend",
    "MeteredBackend",
    "Progress",
    "ServedBackend",
    "charged_model",
    "charging",
    "current_backend",
    "named_or_latest",
]
