"""The data that crosses boundaries: token records, trajectories, groups. All JSON round-trippable."""

from __future__ import annotations

import asyncio
import inspect
import math
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from openai.types.chat.chat_completion import Choice
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from journeyman.chat.messages import Message, message_of_choice
from journeyman.errors import EmptyGroupError, InvalidFieldError, OwnErrorsModel, RolloutDroppedError

MessageOrChoice = Message | Choice
Tool = dict[str, Any]


TokenId = Annotated[int, Field(ge=0)]
Logprob = Annotated[float, Field(allow_inf_nan=False)]


class TokenRecord(BaseModel):
    """What the engine saw and sampled for one choice: the ground truth the trainer uses.

    Checked when parsed, since a record can arrive from outside (a remote client, a file): ids are
    non-negative, logprobs finite, one logprob per sampled id. That the ids are in the vocabulary
    only the model knows: `LocalBackend` checks it before it writes or trains anything.
    """

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[TokenId]
    token_ids: list[TokenId] = Field(description="sampled completion ids, in order")
    logprobs: list[Logprob] = Field(
        description="log π(token) under the sampling policy, temperature 1; one per `token_ids` entry"
    )
    model: str
    step: int = Field(ge=0, description="training step of the policy that sampled these tokens")
    finish_reason: Literal["stop", "length", "tool_calls"]
    spliced_turns: int = Field(
        default=0, ge=0, description="earlier assistant turns given to the engine as their sampled ids"
    )
    teacher_logprobs: list[Logprob] | None = Field(
        default=None,
        description="log π_teacher(token) of each sampled id after the same prompt, for on-policy "
        "distillation (`TrainConfig.distill`): filled once by the backend before the step, kept with "
        "the trajectory so a retried step asks the teacher nothing again",
    )

    @field_validator("logprobs", "teacher_logprobs")
    @classmethod
    def _one_per_token(cls, v: list[float] | None, info: ValidationInfo) -> list[float] | None:
        ids = info.data.get("token_ids")  # absent when the ids themselves were refused
        if v is not None and ids is not None and len(v) != len(ids):
            raise ValueError(f"has {len(v)} entries for {len(ids)} token_ids: one logprob per sampled id")
        return v


def record_of(choice: Choice) -> TokenRecord | None:
    """The token record the endpoint attached to a choice, if any (extra field `journeyman`)."""
    extra = choice.model_extra or {}
    raw = extra.get("journeyman")
    if raw is None:
        return None
    return raw if isinstance(raw, TokenRecord) else TokenRecord.model_validate(raw)


def set_teacher_logprobs(choice: Choice, values: list[float]) -> None:
    """Keep a teacher's logprobs on the choice's token record, whichever form the record is in (a
    parsed `TokenRecord` or the raw dict a wire body or a run file gave)."""
    raw = (choice.model_extra or {}).get("journeyman")
    if isinstance(raw, TokenRecord):
        raw.teacher_logprobs = list(values)
    elif isinstance(raw, dict):
        raw["teacher_logprobs"] = list(values)


def _checked_record(choice: Choice, where: str) -> Choice:
    """`choice`, once its token record (if any) validates; else InvalidFieldError naming the field
    inside the record, e.g. `messages_and_choices[3].journeyman.token_ids[5]`."""
    raw = (choice.model_extra or {}).get("journeyman")
    if raw is None or isinstance(raw, TokenRecord):
        return choice
    try:
        TokenRecord.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
        why = (err.get("ctx") or {}).get("error") if err["type"] == "value_error" else None
        raise InvalidFieldError(
            f"{where}.journeyman{loc}", err.get("input"), str(why or err["msg"])
        ) from None
    return choice


def _as_choice_or_message(item: Any, where: str = "messages_and_choices[]") -> MessageOrChoice:
    if isinstance(item, Choice):
        return _checked_record(item, where)
    if isinstance(item, BaseModel):  # e.g. a ChatCompletionMessage: store as a plain message
        item = item.model_dump(exclude_none=True)
    if isinstance(item, dict) and "finish_reason" in item and "message" in item:
        return _checked_record(Choice.model_validate(item), where)
    if isinstance(item, dict) and "role" in item:
        return item
    raise InvalidFieldError(where, item, "expected a chat message dict or a completion Choice")


class RolloutException(BaseModel):
    """What a rollout raised: on a group's `exceptions` (it produced nothing), or on a Trajectory's
    `error` (a run that raised, kept with the calls it made before)."""

    type: str
    message: str
    traceback: str
    _exception: BaseException | None = PrivateAttr(default=None)

    @property
    def exception(self) -> BaseException | None:
        """The exception object itself, for the process that caught it (`except`-style handling on a
        kept run, e.g. a guardrail tripwire's `guardrail_result`); not serialized, so None once the
        record has been through JSON (a run file, the wire)."""
        return self._exception

    def __eq__(self, other: object) -> bool:
        # the record, not the live object: a copy read back from JSON equals the original
        if not isinstance(other, RolloutException):
            return NotImplemented
        return (self.type, self.message, self.traceback) == (other.type, other.message, other.traceback)

    @classmethod
    def from_exception(cls, e: BaseException) -> RolloutException:
        out = cls(type=type(e).__name__, message=str(e), traceback="".join(traceback.format_exception(e)))
        out._exception = e
        return out


class History(OwnErrorsModel):
    """A side conversation inside a rollout (its own prompt prefix): trained or not, never merged."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[Tool] | None = None
    trainable: bool = True

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _coerce(cls, v: Any) -> list[MessageOrChoice]:
        if not isinstance(v, list | tuple):
            raise InvalidFieldError("messages_and_choices", v, "must be a list of messages and choices")
        return [_as_choice_or_message(x, f"messages_and_choices[{i}]") for i, x in enumerate(v)]

    def messages(self) -> list[Message]:
        """Plain OpenAI messages (choices turned into their assistant message)."""
        out = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                out.append(message_of_choice(item))
            else:
                out.append(item)
        return out

    def records(self) -> list[TokenRecord]:
        return [
            r for item in self.messages_and_choices if isinstance(item, Choice) and (r := record_of(item))
        ]


class Trajectory(History):
    """One rollout: the conversation with the exact token records of each sampled choice, and a reward."""

    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    additional_histories: list[History] = Field(default_factory=list)
    start_time: datetime = Field(default_factory=lambda: datetime.now(UTC))
    error: RolloutException | None = Field(
        default=None,
        description="set when the run raised (turn limit, guardrail, ...): the trajectory holds the "
        "calls made before it and trains like any other; see `journeyman.data.failures`",
    )

    @field_validator("metrics", mode="before")
    @classmethod
    def _null_is_nan(cls, v: Any) -> Any:
        # run files and wire bodies are strict JSON, where a NaN metric is written as null
        if isinstance(v, dict):
            return {k: math.nan if x is None else x for k, x in v.items()}
        return v

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise InvalidFieldError("reward", v, "must be a finite number")
        return float(v)

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True, extra="forbid")

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> Trajectory:
        """Record the seconds since `start_time` as `metrics["duration"]` (ART's `finish`); returns self."""
        self.metrics["duration"] = (datetime.now(UTC) - self.start_time).total_seconds()
        return self

    @asynccontextmanager
    async def track_duration(self, name: str) -> AsyncIterator[None]:
        """Add the block's seconds to `metrics[f"{name}_duration"]` (ART's `track_duration`)."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{name}_duration"
            self.metrics[key] = float(self.metrics.get(key, 0.0)) + time.monotonic() - start

    def for_logging(self) -> dict[str, Any]:
        """A JSON-ready dict for a log or a tracker: reward, metrics, metadata, logs, tools, and the
        messages as plain dicts, each marked `trainable` (sampled by the policy) or not (ART's shape)."""
        messages = [
            {**message_of_choice(x), "trainable": True}
            if isinstance(x, Choice)
            else {**x, "trainable": False}
            for x in self.messages_and_choices
        ]
        return {
            "reward": self.reward,
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
            "messages": messages,
            "tools": self.tools,
            "logs": list(self.logs),
        }


RolloutEnd = Literal["trajectory", "errored", "dropped", "exception"]
"""How one rollout ended: a trajectory; a trajectory of a run that raised (its `error` set); a run
discarded by its `on_error="drop"` policy; an exception that left nothing. ("Outcome" is live
training's word for an episode's reported result: `journeyman.data.live_types.EpisodeOutcome`.)"""
Outcome = RolloutEnd  # the old name, kept for code that imports it


class TrajectoryGroup(BaseModel):
    """The rollouts of one scenario. GRPO compares rewards within a group.

    Accepts finished trajectories, or awaitables of them (gathered by `gather_trajectory_groups`
    or by awaiting the group). Exceptions raised by rollouts are kept, not lost: on `exceptions`
    when the rollout left nothing (an exception given in the list lands there too, as ART's groups
    take them), on `dropped` when an integration's `on_error="drop"` discarded the run. A run an
    integration kept despite its error is a trajectory (`error` set) and trains.

    A group is a sequence of its trajectories: `for t in group`, `len(group)`, `group[0]`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[RolloutException] = Field(default_factory=list)
    dropped: list[RolloutException] = Field(
        default_factory=list, description='runs that raised and were discarded by on_error="drop"'
    )
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(
        default_factory=dict,
        description="numbers about the group as a whole; a history row averages each over the groups logged",
    )
    logs: list[str] = Field(default_factory=list)

    def __init__(
        self,
        trajectories: Iterable[Trajectory | Awaitable[Trajectory] | BaseException] | None = None,
        /,
        **data: Any,
    ) -> None:
        items = trajectories if trajectories is not None else data.pop("trajectories", [])
        if isinstance(items, str | bytes | dict) or not isinstance(items, Iterable):
            raise InvalidFieldError("trajectories", items, "must be a list of trajectories")
        items = list(items)
        raised: list[RolloutException] = []
        for i, t in enumerate(items):
            if isinstance(t, BaseException):
                raised.append(RolloutException.from_exception(t))
            elif not isinstance(t, Trajectory | dict) and not inspect.isawaitable(t):
                raise InvalidFieldError(
                    f"trajectories[{i}]", t, "expected a Trajectory, its dict, or a rollout"
                )
        items = [t for t in items if not isinstance(t, BaseException)]
        pending = [t for t in items if not isinstance(t, Trajectory | dict)]
        done = [t for t in items if isinstance(t, Trajectory | dict)]
        if raised:
            data["exceptions"] = [*data.get("exceptions", []), *raised]
        if not items and not data.get("exceptions") and not data.get("dropped"):
            raise EmptyGroupError()
        super().__init__(trajectories=done, **data)
        self._pending = pending

    # A group reads as the list of its trajectories (ART's groups do too): pydantic's own iteration
    # yields (field, value) pairs, so `[t for t in group]` would silently be the wrong thing.
    def __iter__(self) -> Iterator[Trajectory]:  # pyright: ignore[reportIncompatibleMethodOverride]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __getitem__(self, i: int) -> Trajectory:
        return self.trajectories[i]

    @property
    def pending(self) -> list[Awaitable[Trajectory]]:
        return self._pending

    async def resolve(
        self, on_result: Callable[[TrajectoryGroup, RolloutEnd], None] | None = None
    ) -> TrajectoryGroup:
        """Await pending rollouts; each exception is recorded on the group instead of raised."""

        async def one(aw: Awaitable[Trajectory]) -> None:
            end: RolloutEnd
            try:
                t = await aw
                if not isinstance(t, Trajectory):
                    raise InvalidFieldError("rollout result", t, "a rollout must return a Trajectory")
                self.trajectories.append(t)
                end = "errored" if t.error is not None else "trajectory"
            except RolloutDroppedError as e:
                self.dropped.append(RolloutException.from_exception(e.error))
                end = "dropped"
            except Exception as e:
                self.exceptions.append(RolloutException.from_exception(e))
                end = "exception"
            if on_result is not None:
                on_result(self, end)

        pending, self._pending = self._pending, []
        await asyncio.gather(*(one(aw) for aw in pending))
        return self

    def __await__(self):
        return self.resolve().__await__()

    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def has_signal(self, min_spread: float = 0.0) -> bool:
        """Whether the rewards differ (by at least `min_spread`): a group whose rollouts all scored
        alike has no group-relative advantage to learn from (DAPO's dynamic sampling drops it)."""
        rewards = self.rewards()
        spread = max(rewards) - min(rewards) if rewards else 0.0
        return spread > 0 and spread >= min_spread

    def errored(self) -> list[Trajectory]:
        """The trajectories of runs that raised and were kept (`error` set); they train as the others."""
        return [t for t in self.trajectories if t.error is not None]


TrajectoryGroup.model_rebuild()

__all__ = [
    "History",
    "MessageOrChoice",
    "Outcome",
    "RolloutEnd",
    "RolloutException",
    "TokenRecord",
    "Tool",
    "Trajectory",
    "TrajectoryGroup",
    "record_of",
    "set_teacher_logprobs",
]
