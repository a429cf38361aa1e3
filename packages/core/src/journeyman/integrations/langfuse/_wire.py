"""How a Trajectory is laid out as a Langfuse trace. Export writes this layout; import reads it back.

    trace  id = trajectory.metadata["langfuse_trace_id"], session = the group, tags, name
    └─ agent "<trace name>"     input: messages before the first policy call; output: the last message
       │                        metadata.journeyman = TracePayload (every history's messages, reward, context)
       ├─ generation "policy"   input: the request messages; output: the sampled message (with tool calls)
       │                        model "name@step", usage input/output tokens,
       │                        metadata.journeyman = GenerationPayload (the exact TokenRecord)
       ├─ tool "<tool name>"    input: the call's arguments; output: the tool message's content
       └─ chain "history <h>"   an additional history, with its own generations and tools
    score "reward" on the trace

The payload keeps the conversation itself, so a trace whose generation observations were lost
still imports (re-tokenised, flagged). Values travel as JSON: floats round-trip exactly.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from journeyman.chat.messages import Message
from journeyman.data.types import History, TokenRecord, Tool, Trajectory, record_of

SCHEMA_VERSION = 1
META_KEY = "journeyman"  # the metadata key of both payloads (asked for unabridged on import)
TRACE_ID_KEY = "langfuse_trace_id"  # stamped on trajectory.metadata at export, set on import
GROUP_ID_KEY = "langfuse_group_id"  # stamped on group.metadata at export
GENERATION_NAME = "policy"


class HistoryLayout(BaseModel):
    """One history's messages (sampled choices as their assistant message) and where the choices are."""

    messages: list[Message]
    choice_positions: list[int] = Field(default_factory=list, description="indices into messages")
    tools: list[Tool] | None = None
    trainable: bool = True


class TracePayload(BaseModel):
    """Everything needed to rebuild the trajectory, minus the token records (on the generations)."""

    v: int = SCHEMA_VERSION
    project: str | None = None
    model: str | None = None
    step: int | None = None
    split: str = "train"
    source: str = "gather"
    group_id: str
    group_size: int
    index: int = Field(description="position of the trajectory in its group")
    reward: float
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    start_time: datetime | None = None
    histories: list[HistoryLayout] = Field(
        description="[0] is the main conversation, then additional histories"
    )


class GenerationPayload(BaseModel):
    """One policy call: which choice of which history, and its exact token record."""

    v: int = SCHEMA_VERSION
    choice: int = Field(description="running number of the choice over all histories, in layout order")
    history: int
    position: int
    index: int = 0
    finish_reason: str = "stop"
    record: TokenRecord | None = None


def layout(history: History) -> HistoryLayout:
    positions = [i for i, item in enumerate(history.messages_and_choices) if not isinstance(item, dict)]
    trainable = history.trainable if not isinstance(history, Trajectory) else True
    return HistoryLayout(
        messages=history.messages(), choice_positions=positions, tools=history.tools, trainable=trainable
    )


def trace_payload(
    trajectory: Trajectory,
    *,
    group_id: str,
    group_size: int,
    index: int,
    project: str | None,
    model: str | None,
    step: int | None,
    split: str,
    source: str,
) -> TracePayload:
    return TracePayload(
        project=project,
        model=model,
        step=step,
        split=split,
        source=source,
        group_id=group_id,
        group_size=group_size,
        index=index,
        reward=trajectory.reward,
        metrics=dict(trajectory.metrics),
        metadata=jsonable(trajectory.metadata),
        logs=list(trajectory.logs),
        start_time=trajectory.start_time,
        histories=[layout(trajectory), *(layout(h) for h in trajectory.additional_histories)],
    )


def generation_payloads(trajectory: Trajectory) -> list[list[GenerationPayload]]:
    """Per history, the payload of each choice, numbered in the same order as the layout."""
    out: list[list[GenerationPayload]] = []
    k = 0
    for h, history in enumerate([trajectory, *trajectory.additional_histories]):
        row = []
        for pos, item in enumerate(history.messages_and_choices):
            if isinstance(item, dict):
                continue
            row.append(
                GenerationPayload(
                    choice=k,
                    history=h,
                    position=pos,
                    index=item.index,
                    finish_reason=item.finish_reason,
                    record=record_of(item),
                )
            )
            k += 1
        out.append(row)
    return out


def jsonable(value: Any) -> Any:
    """A JSON-safe copy (non-JSON values become their string form), so a payload never fails to send."""
    return json.loads(json.dumps(value, default=str))


def decode(value: Any) -> Any:
    """Langfuse returns input, output and metadata values as raw JSON text or as parsed JSON: accept both."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
