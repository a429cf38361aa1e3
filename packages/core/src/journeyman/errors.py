"""Typed errors. Each names the field and the value that was wrong, so a user can fix it."""

from __future__ import annotations

from collections.abc import Sequence
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
    """`base_model` is neither the embedded model, a local model directory, nor a hub id the hub
    provides. Like InvalidFieldError, it names the field (`.field`), the value and what would do."""

    def __init__(self, value: str, reason: str) -> None:
        self.field, self.value, self.reason = "base_model", value, reason
        super().__init__(f"base_model={value!r}: {reason}")


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
    """More rollouts failed than `max_exceptions` allows. The message names the first failure and where
    it was raised; every failure is on `.exceptions` (the first is also `__cause__`, so a traceback
    shows its own), the groups gathered so far on `.groups`."""

    def __init__(
        self,
        failed: int,
        total: int,
        limit: float,
        groups: list[Any],
        exceptions: Sequence[BaseException] = (),
    ) -> None:
        self.failed = failed
        self.total = total
        self.groups = groups
        self.exceptions = list(exceptions)
        first = ""
        if self.exceptions:
            e = self.exceptions[0]
            first = f"; the first: {type(e).__name__}: {e}{_raised_at(e)}"
            self.__cause__ = e
        super().__init__(
            f"max_exceptions={limit!r}: {failed} of {total} rollouts raised{first} "
            f"(all on this error's .exceptions; the {len(groups)} groups finished so far on .groups)"
        )


def _raised_at(e: BaseException) -> str:
    """` (at file:line in function)`: the innermost frame of `e`'s traceback, or "" without one."""
    tb = e.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f" (at {code.co_filename}:{tb.tb_lineno} in {code.co_name})"


class EnvironmentRolloutError(JourneymanError, RuntimeError):
    """An environment failed one task's rollout (it raised, or gave what is not a trajectory with a
    finite reward): `.environment` and `.task` name where, `__cause__` is what it raised. Training and
    evaluation count it against that task and go on (`journeyman.environments`)."""

    def __init__(self, environment: str, task: str, error: BaseException) -> None:
        self.environment = environment
        self.task = task
        self.error = error
        self.__cause__ = error
        super().__init__(f"environment {environment!r}, task {task!r}: {type(error).__name__}: {error}")


class EnvironmentWorkerError(JourneymanError, RuntimeError):
    """The process an environment runs in (a verifiers worker) did not load in time or died: `.spec`
    names the environment, the message ends with the process's last stderr lines. Every rollout
    waiting on it gets this error; what was collected before stays collected."""

    def __init__(self, spec: str, what: str, stderr_tail: str = "") -> None:
        self.spec = spec
        self.stderr_tail = stderr_tail
        tail = f"\n{stderr_tail}" if stderr_tail else ""
        super().__init__(f"the worker of environment {spec!r} {what}{tail}")


class RolloutDroppedError(JourneymanError):
    """A run raised and an integration's `on_error="drop"` discards it; `error` is what it raised.

    A TrajectoryGroup counts it under `dropped`, not `exceptions`: the user chose to ignore such
    runs, so they do not count against `max_exceptions`.
    """

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(f"on_error='drop': the run raised {type(error).__name__}: {error}")


class NoLearningSignalError(InvalidFieldError):
    """A training step had nothing to learn from and `TrainConfig.on_no_signal="error"` refused it
    (`.value`: each group's rewards; `.reason`: why, and what to change)."""


class IdempotencyKeyReusedError(InvalidFieldError):
    """A training call's idempotency key already names another call to the same model and operation
    (another body): refused before anything is written or trained. A key names one call; a new call
    needs a new key. `journeyman serve` answers it with 409 (or, found in the run directory after the
    call was forgotten, as the train stream's error event)."""


class NoTrainableTokensError(InvalidFieldError):
    """A trajectory has no sampled assistant tokens to train on."""


class TeacherError(JourneymanError):
    """A distillation teacher could not score a step's tokens; the step's groups are kept."""


class TeacherUnreachableError(TeacherError, ConnectionError):
    """The teacher's server did not answer (down, wrong URL, timed out) or answered with an error."""


class TeacherTokenizerError(TeacherError, ValueError):
    """The teacher's tokenizer is not the student's: its logprobs would score other tokens."""


class TeacherLogprobsError(TeacherError, InvalidFieldError):
    """A sampled token has no finite teacher logprob (missing from the answer, or NaN/inf)."""


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
    "IdempotencyKeyReusedError",
    "ImpossiblePlanError",
    "InvalidFieldError",
    "JourneymanError",
    "NoLearningSignalError",
    "NoTrainableTokensError",
    "ProtocolMismatchError",
    "RemoteError",
    "RolloutDroppedError",
    "TooManyExceptionsError",
    "TrainerRankError",
    "UnknownModelError",
    "WakeMemoryError",
]
