"""Typed errors. Each names the field and the value that was wrong, so a user can fix it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


class JourneymanError(Exception):
    """Base class for every error Journeyman raises on purpose."""


class InvalidFieldError(JourneymanError, ValueError):
    """A value given by the user is not acceptable."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        shown = repr(value)
        if len(shown) > 200:
            shown = shown[:200] + "..."
        super().__init__(f"{field}={shown}: {reason}")


class UnknownModelError(JourneymanError, LookupError):
    """A request named a model the endpoint does not serve."""

    def __init__(self, name: str, served: list[str]) -> None:
        self.name = name
        self.served = served
        super().__init__(f"model={name!r} is not served here; served models: {', '.join(served) or '(none)'}")


class BaseModelNotFoundError(JourneymanError, FileNotFoundError):
    """`base_model` is neither the embedded model, a local directory, nor reachable on a hub."""


class ChatTemplateError(JourneymanError, ValueError):
    """A tokenizer has no chat template, or its template cannot render the conversation asked of it."""


class TrainerRankError(JourneymanError, RuntimeError):
    """A trainer rank died, did not start, or did not answer within `TrainerConfig.timeout_s`."""


class CheckpointError(JourneymanError, RuntimeError):
    """A checkpoint could not be written (disk full, I/O error), or one on disk is truncated or corrupt."""

    def __init__(self, step: int | None, file: str, reason: str) -> None:
        self.step = step
        self.file = file
        self.reason = reason
        where = f"step {step}: " if step is not None else ""
        super().__init__(f"{where}{file}: {reason}")


class EngineDownError(JourneymanError, RuntimeError):
    """An engine (or engine replica) stopped; the requests it held fail with this instead of waiting."""


class EngineTimeoutError(JourneymanError, TimeoutError):
    """An engine did not answer a request within the endpoint's `request_timeout_s` (a 504)."""


class WakeMemoryError(JourneymanError, MemoryError):
    """A stage of an engine's wake (or restart) would not fit the GPU's free memory: refused before
    the engine tries and runs out. Says what was needed, what is free, and what holds the rest."""

    def __init__(
        self, *, stage: str, needed: int, free: int, total: int, device: str, holders: str, what: str
    ) -> None:
        self.stage, self.needed, self.free, self.total, self.device = stage, needed, free, total, device
        gib = 1024**3
        super().__init__(
            f"{what}, stage {stage!r}, needs {needed / gib:.2f} GiB on {device} but {free / gib:.2f} GiB "
            f"of {total / gib:.2f} GiB is free; {holders}. Lower VLLMConfig.gpu_memory_utilization, "
            "or free what the trainer keeps between steps"
        )


class ImpossiblePlanError(JourneymanError, ValueError):
    """A configuration needs more memory than its GPUs have (`backends/memory_plan.py`), refused before any
    weights load. The message names what does not fit and the changes that would; `.changes` lists
    them, `.needed` and `.available` are bytes of the busiest GPU (`.where`)."""

    def __init__(self, message: str, *, needed: int, available: int, where: str, changes: list[str]) -> None:
        self.needed, self.available, self.where, self.changes = needed, available, where, changes
        super().__init__(message)


class EmptyGroupError(InvalidFieldError):
    """A TrajectoryGroup was built with no trajectories."""

    def __init__(self) -> None:
        super().__init__("trajectories", [], "a TrajectoryGroup needs at least one trajectory")


class TooManyExceptionsError(JourneymanError, RuntimeError):
    """More rollouts failed than `max_exceptions` allows. The groups gathered so far are kept on `.groups`."""

    def __init__(self, failed: int, total: int, limit: float, groups: list[Any]) -> None:
        self.failed = failed
        self.total = total
        self.groups = groups
        super().__init__(
            f"max_exceptions={limit!r}: {failed} of {total} rollouts raised; "
            f"the {len(groups)} groups finished so far are on this error's .groups"
        )


class RolloutDroppedError(JourneymanError):
    """A run raised and an integration's `on_error="drop"` discards it; `error` is what it raised.

    A TrajectoryGroup counts it under `dropped`, not `exceptions`: the user chose to ignore such
    runs, so they do not count against `max_exceptions`.
    """

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(f"on_error='drop': the run raised {type(error).__name__}: {error}")


class NoTrainableTokensError(InvalidFieldError):
    """A trajectory has no sampled assistant tokens to train on."""


class BackendUnavailableError(JourneymanError, ConnectionError):
    """A remote backend did not answer within the client's retries (down, restarting, or unreachable)."""


class AuthenticationError(JourneymanError, PermissionError):
    """A remote backend refused the token (401)."""


class ProtocolMismatchError(JourneymanError, RuntimeError):
    """Client and server speak different versions of the Backend protocol."""


class RemoteError(JourneymanError, RuntimeError):
    """A remote backend failed a request; `.type` names the server-side error."""

    def __init__(self, type_: str, message: str) -> None:
        self.type = type_
        super().__init__(f"{type_}: {message}")


class OwnErrorsModel(BaseModel):
    """A pydantic model whose validators' JourneymanErrors reach the caller as themselves.

    Pydantic wraps an exception raised in a validator into a ValidationError; users of ours catch
    InvalidFieldError and read `.field`, at construction and on assignment alike.
    """

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _own(e) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise _own(e) from None


def _own(e: ValidationError) -> Exception:
    for err in e.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, JourneymanError):
            return inner
    return e


__all__ = [
    "AuthenticationError",
    "BackendUnavailableError",
    "BaseModelNotFoundError",
    "ChatTemplateError",
    "EmptyGroupError",
    "EngineDownError",
    "EngineTimeoutError",
    "ImpossiblePlanError",
    "InvalidFieldError",
    "JourneymanError",
    "NoTrainableTokensError",
    "ProtocolMismatchError",
    "RemoteError",
    "RolloutDroppedError",
    "TooManyExceptionsError",
    "TrainerRankError",
    "UnknownModelError",
    "WakeMemoryError",
]
