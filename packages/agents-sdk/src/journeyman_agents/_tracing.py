"""The SDK's view of each model call, from its own tracing interface.

`SpanCollector` is a `TracingProcessor` added once with `add_trace_processor` (beside the user's
processors and the SDK's default exporter, which it never replaces). It keeps spans only for the
traces a wrapped run is watching, and for each model-call span records which agent made it and a
key that identifies the call on the endpoint side:
- Responses API: the response id (`resp_<hex>`; the endpoint filed the call as `chatcmpl-<hex>`);
- Chat Completions: the assistant turn (text + tool calls) the span's output holds, as
  `assistant_key`. Streaming spans hold a Responses-shaped dump, read the same way.
Spans without data (`trace_include_sensitive_data=False`) still give the agent; the join then
falls back to call order.

Tracing stays on for the runs we serve (the join needs it), so without an OpenAI key the SDK's
default exporter logs "OPENAI_API_KEY is not set, skipping trace export" for them, a notice about
a service those runs never used. `_ExportNotice` drops it unless a trace of the user's own (not a
wrapped run's, with no key of its own) started since the last one: their notice still shows, and
nothing of the user's tracing setup (processors, exporter, keys) is changed.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

from agents.tracing import (
    AgentSpanData,
    GenerationSpanData,
    ResponseSpanData,
    Span,
    Trace,
    TracingProcessor,
    TurnSpanData,
    add_trace_processor,
)
from journeyman.integrations import assistant_key


@dataclass
class SpanInfo:
    """What one span tells us; model-call spans get `key` when they end."""

    span_id: str
    parent_id: str | None
    order: int
    agent: str | None  # set on agent and turn spans
    model_call: bool
    key: str | None = None


def _key_from_output(output: Any) -> str | None:
    """`assistant_key` of a generation span's output (a chat message, or a Responses dump)."""
    if not isinstance(output, list) or not output or not isinstance(output[0], dict):
        return None
    out = output[0]
    if "output" in out:  # streamed: the SDK stores the final Responses object
        text, calls = [], []
        for item in out.get("output") or []:
            if item.get("type") == "message":
                text += [
                    p.get("text", "") for p in item.get("content") or [] if p.get("type") == "output_text"
                ]
            elif item.get("type") == "function_call":
                calls.append({"function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}})
        return assistant_key("".join(text), calls)
    return assistant_key(out.get("content"), out.get("tool_calls"))


class SpanCollector(TracingProcessor):
    """Keeps the spans of watched traces (thread-safe: the SDK may end spans from worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[str, int] = {}
        self._spans: dict[str, list[SpanInfo]] = {}
        self._order = itertools.count()
        self._user_trace_unkeyed = False  # a key-less trace of the user's own since the last notice

    def watch(self, trace_id: str) -> None:
        with self._lock:
            self._watched[trace_id] = self._watched.get(trace_id, 0) + 1
            self._spans.setdefault(trace_id, [])

    def release(self, trace_id: str) -> list[SpanInfo]:
        """Stop watching (for one watcher) and return the trace's spans so far, in start order."""
        with self._lock:
            spans = list(self._spans.get(trace_id, []))
            left = self._watched.get(trace_id, 0) - 1
            if left <= 0:
                self._watched.pop(trace_id, None)
                self._spans.pop(trace_id, None)
            else:
                self._watched[trace_id] = left
            return spans

    def on_trace_start(self, trace: Trace) -> None:
        if trace.tracing_api_key is None:
            with self._lock:
                if trace.trace_id not in self._watched:
                    self._user_trace_unkeyed = True

    def take_user_trace_unkeyed(self) -> bool:
        """Whether a key-less trace of the user's own started since the last call."""
        with self._lock:
            seen, self._user_trace_unkeyed = self._user_trace_unkeyed, False
            return seen

    def on_trace_end(self, trace: Trace) -> None:
        pass

    def on_span_start(self, span: Span[Any]) -> None:
        data = span.span_data
        agent = (
            data.name
            if isinstance(data, AgentSpanData)
            else data.agent_name
            if isinstance(data, TurnSpanData)
            else None
        )
        info = SpanInfo(
            span_id=span.span_id,
            parent_id=span.parent_id,
            order=next(self._order),
            agent=agent,
            model_call=isinstance(data, GenerationSpanData | ResponseSpanData),
        )
        with self._lock:
            if span.trace_id in self._watched:
                self._spans[span.trace_id].append(info)

    def on_span_end(self, span: Span[Any]) -> None:
        data = span.span_data
        if isinstance(data, ResponseSpanData):
            key = data.response.id if data.response is not None else None
        elif isinstance(data, GenerationSpanData):
            key = _key_from_output(data.output)
        else:
            return
        with self._lock:
            for info in self._spans.get(span.trace_id, []):
                if info.span_id == span.span_id:
                    info.key = key

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


def agent_of(span: SpanInfo, spans: list[SpanInfo]) -> str | None:
    """The agent a model-call span belongs to: its nearest agent (or turn) ancestor."""
    by_id = {s.span_id: s for s in spans}
    parent = by_id.get(span.parent_id) if span.parent_id else None
    while parent is not None:
        if parent.agent is not None:
            return parent.agent
        parent = by_id.get(parent.parent_id) if parent.parent_id else None
    return None


EXPORT_NOTICE = "OPENAI_API_KEY is not set, skipping trace export"
"""What the SDK's default exporter logs (`openai.agents`) for a batch it cannot send."""


class _ExportNotice(logging.Filter):
    """Keeps `EXPORT_NOTICE` only when it may concern a trace of the user's own (see module doc)."""

    def __init__(self, spans: SpanCollector) -> None:
        super().__init__()
        self.spans = spans

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != EXPORT_NOTICE or self.spans.take_user_trace_unkeyed()


_collector: SpanCollector | None = None
_collector_lock = threading.Lock()


def collector() -> SpanCollector:
    """The process-wide collector, added to the SDK's processors (and its notice filter to the SDK's
    logger) on first use."""
    global _collector
    with _collector_lock:
        if _collector is None:
            _collector = SpanCollector()
            add_trace_processor(_collector)
            logging.getLogger("openai.agents").addFilter(_ExportNotice(_collector))
        return _collector
