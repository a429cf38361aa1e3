"""Every trajectory that gather, train or log sees, as a Langfuse trace — off the training path.

`on_groups` (called by `journeyman.rollout.observe.emit` on the training path) only stamps ids and puts
references on a bounded queue: it never blocks and never raises. A daemon thread turns queued
trajectories into observations with the Langfuse SDK and flushes them; when Langfuse is slow or
down the queue overflows and trajectories are dropped with a counted warning instead.

One trajectory is one trace. Groups are announced by `gather` first (no run context) and again
by `train`/`log` (project, model, step, split): a gathered trajectory is held back for `hold_s`
seconds so the richer announcement can replace it, and a trajectory that already has a
`langfuse_trace_id` (exported before, or imported from Langfuse) is never exported twice.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, Field

from journeyman.data.types import History, Trajectory, TrajectoryGroup, record_of
from journeyman.errors import InvalidFieldError
from journeyman.integrations.langfuse import _wire
from journeyman.integrations.langfuse._client import ExportConnection, credentials, export_connection
from journeyman.rollout.observe import GroupContext, add_sink, remove_sink

try:
    from langfuse import Langfuse, propagate_attributes
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise ImportError('Langfuse support needs the extra: pip install "journeyman[langfuse]"') from e

log = logging.getLogger("journeyman.langfuse")


class ExportStats(BaseModel):
    """What the exporter did so far."""

    exported: int = Field(default=0, description="trajectories delivered as traces (with their reward score)")
    dropped: dict[str, int] = Field(default_factory=dict, description="trajectories dropped, by reason")
    skipped: int = Field(
        default=0, description="trajectories already in Langfuse (exported before or imported)"
    )
    queued: int = Field(default=0, description="waiting in the queue")
    held: int = Field(default=0, description="gathered, waiting briefly for train/log to add the run context")

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


@dataclass
class _Item:
    trajectory: Trajectory
    group_id: str
    group_size: int
    index: int
    context: GroupContext
    trace_id: str


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


_STOP = object()


class LangfuseExporter:
    """A trajectory sink (see `journeyman.rollout.observe`) that exports to Langfuse in a background thread.

    Create it with `export_to_langfuse(...)`. Thread-safe: `on_groups` may be called from any
    thread; everything that talks to Langfuse runs on the exporter's own daemon thread.
    """

    def __init__(
        self,
        connection: ExportConnection,
        *,
        trace_name: str | None = None,
        tags: Sequence[str] = (),
        reward_score: str = "reward",
        max_queue: int = 1000,
        hold_s: float = 30.0,
        batch_interval_s: float = 1.0,
        retry_after_s: float = 10.0,
        flush_timeout_s: float = 30.0,
    ) -> None:
        if max_queue < 1:
            raise InvalidFieldError("max_queue", max_queue, "must be >= 1")
        self._conn = connection
        self._trace_name = trace_name
        self._tags = [str(t) for t in tags]
        self._reward_score = reward_score
        self._max_queue = max_queue
        self._hold_s = hold_s
        self._interval = batch_interval_s
        self._retry_after = retry_after_s
        self._flush_timeout = flush_timeout_s
        self._q: queue.Queue[Any] = queue.Queue()  # bounded by _max_queue data items (markers always fit)
        self._lock = threading.Lock()
        self._queued = 0
        self._inflight: set[str] = set()  # trace ids queued or held, not yet exported
        self._held: dict[str, tuple[_Item, float]] = {}
        self._stats = ExportStats()
        self._last_warning = 0.0
        self._warned_total = 0
        self._retry_at = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="journeyman-langfuse-export", daemon=True)
        self._thread.start()

    @property
    def client(self) -> Langfuse:
        return self._conn.client

    # -- training path: never blocks, never raises ----------------------------------------------
    def on_groups(self, groups: Sequence[TrajectoryGroup], context: GroupContext) -> None:
        if self._closed:
            return
        items: list[_Item] = []
        new: list[bool] = []
        skipped = 0
        with self._lock:
            for group in groups:
                gid = group.metadata.setdefault(_wire.GROUP_ID_KEY, uuid.uuid4().hex)
                for i, t in enumerate(group.trajectories):
                    tid = t.metadata.get(_wire.TRACE_ID_KEY)
                    if tid is None:
                        tid = t.metadata[_wire.TRACE_ID_KEY] = uuid.uuid4().hex
                        new.append(True)
                    elif tid in self._inflight:
                        new.append(False)  # a richer announcement of a trajectory not yet exported
                    else:
                        skipped += 1  # already a Langfuse trace
                        continue
                    items.append(_Item(t, gid, len(group.trajectories), i, context, tid))
            room = max(0, self._max_queue - self._queued)
            accepted = items[:room]
            self._queued += len(accepted)
            for it, is_new in zip(accepted, new, strict=False):
                if is_new:
                    self._inflight.add(it.trace_id)
            self._stats.skipped += skipped
        for it in accepted:
            self._q.put(it)
        dropped_new = sum(new[room:])
        if dropped_new:
            self._drop(dropped_new, "queue full")

    # -- control --------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Export everything queued or held now; True when done within `timeout` seconds."""
        if self._closed or not self._thread.is_alive():
            return True
        marker = _Flush()
        self._q.put(marker)
        return marker.done.wait(self._flush_timeout if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush (bounded by `timeout`), stop the thread and unregister the sink."""
        if self._closed:
            return
        remove_sink(self)
        self.flush(timeout)
        self._closed = True
        self._q.put(_STOP)
        self._thread.join(timeout=5.0 if timeout is None else max(0.1, timeout))
        atexit.unregister(self.close)
        if self.stats.dropped_total > self._warned_total:
            self._warn(force=True)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> ExportStats:
        with self._lock:
            s = self._stats.model_copy(deep=True)
            s.queued = self._queued
            s.held = len(self._held)
        return s

    # -- worker ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._take()
            stop = any(x is _STOP for x in batch)
            flushes = [x for x in batch if isinstance(x, _Flush)]
            items = [x for x in batch if isinstance(x, _Item)]
            with self._lock:
                self._queued -= len(items)
            try:
                ready = self._route(items, force=stop or bool(flushes))
                if ready and time.monotonic() < self._retry_at:
                    # the last delivery failed: drop instead of waiting on a dead host (retry later)
                    self._forget(ready, f"not delivered to {self._host()}")
                elif ready:
                    self._export(ready)
            except Exception:  # the exporter must outlive any bad trajectory or SDK surprise
                log.exception("Langfuse export failed")
            for f in flushes:
                f.done.set()
            if stop:
                return

    def _take(self) -> list[Any]:
        """Block for the first entry (up to the batch interval), then drain what is already there."""
        out: list[Any] = []
        try:
            out.append(self._q.get(timeout=self._interval))
        except queue.Empty:
            return out
        while len(out) < 512:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                break
        return out

    def _route(self, items: list[_Item], force: bool) -> list[_Item]:
        """Merge announcements of the same trajectory; hold gathered ones; release those that are due."""
        now = time.monotonic()
        latest: dict[str, _Item] = {}
        for it in items:
            if it.trace_id not in self._inflight:
                continue  # exported already; a late announcement
            prev = latest.get(it.trace_id)
            if prev is None or it.context.source != "gather" or prev.context.source == "gather":
                latest[it.trace_id] = it
        ready: list[_Item] = []
        with self._lock:
            for tid, it in latest.items():
                if it.context.source == "gather" and not force:
                    deadline = self._held[tid][1] if tid in self._held else now + self._hold_s
                    self._held[tid] = (it, deadline)
                else:
                    self._held.pop(tid, None)
                    ready.append(it)
            for tid, (it, deadline) in list(self._held.items()):
                if force or deadline <= now:
                    del self._held[tid]
                    ready.append(it)
        return ready

    def _forget(self, items: list[_Item], reason: str) -> None:
        with self._lock:
            self._inflight.difference_update(it.trace_id for it in items)
        self._drop(len(items), reason)

    def _export(self, items: list[_Item]) -> None:
        client = self._conn.client
        sent: list[_Item] = []
        for it in items:
            try:
                self._send(client, it)
                sent.append(it)
            except Exception as e:
                log.warning("could not export trajectory %s to Langfuse: %s", it.trace_id, e)
                self._forget([it], "could not be converted")
        failed: set[str] = set()
        if self._conn.provider is not None and self._conn.exporter is not None:
            self._conn.provider.force_flush(int(self._flush_timeout * 1000))
            failed = self._conn.exporter.take_failed()
        ok = [it for it in sent if it.trace_id not in failed]
        for it in ok:
            client.create_score(
                name=self._reward_score, value=it.trajectory.reward, trace_id=it.trace_id, data_type="NUMERIC"
            )
        if ok:
            client.flush()  # the scores; bounded by the SDK's own retries
        with self._lock:
            self._inflight.difference_update(it.trace_id for it in sent)
            self._stats.exported += len(ok)
        if len(ok) < len(sent):
            self._retry_at = time.monotonic() + self._retry_after
            self._drop(len(sent) - len(ok), f"not delivered to {self._host()}")
        elif ok:
            self._retry_at = 0.0

    def _host(self) -> str:
        creds = self._conn.credentials
        return creds.host if creds is not None else "Langfuse"

    def _drop(self, n: int, reason: str) -> None:
        with self._lock:
            self._stats.dropped[reason] = self._stats.dropped.get(reason, 0) + n
        self._warn()

    def _warn(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_warning < 30.0:
            return
        stats = self.stats
        self._last_warning, self._warned_total = now, stats.dropped_total
        detail = ", ".join(f"{n} {reason}" for reason, n in stats.dropped.items())
        log.warning(
            "Langfuse export: %d trajectories dropped so far (%s); training is not affected",
            stats.dropped_total,
            detail,
        )

    # -- one trajectory -> one trace ------------------------------------------------------------
    def _send(self, client: Langfuse, it: _Item) -> None:
        t, ctx = it.trajectory, it.context
        records = t.records()
        model = ctx.model or (records[0].model.rsplit("@", 1)[0] if records else None)
        step = ctx.step if ctx.step is not None else (max(r.step for r in records) if records else None)
        payload = _wire.trace_payload(
            t,
            group_id=it.group_id,
            group_size=it.group_size,
            index=it.index,
            project=ctx.project,
            model=model,
            step=step,
            split=ctx.split,
            source=ctx.source,
        )
        name = self._trace_name or model or "journeyman"
        tags = [
            "journeyman",
            f"split:{ctx.split}",
            *([f"project:{ctx.project}"] if ctx.project else []),
            *self._tags,
        ]
        trace_meta = {
            k: v
            for k, v in {"project": ctx.project, "model": model, "step": step, "split": ctx.split}.items()
            if v is not None
        }
        main = payload.histories[0]
        first = main.choice_positions[0] if main.choice_positions else len(main.messages)
        user_meta = {
            k: v
            for k, v in payload.metadata.items()
            if isinstance(v, str | int | float | bool)
            and k != _wire.META_KEY
            and not k.startswith("langfuse_")
        }
        gens = _wire.generation_payloads(t)
        with (
            client.start_as_current_observation(
                trace_context={"trace_id": it.trace_id},
                name=name,
                as_type="agent",
                input=main.messages[:first],
                output=main.messages[-1] if main.messages else None,
                metadata={**user_meta, _wire.META_KEY: payload.model_dump(mode="json")},
            ),
            propagate_attributes(trace_name=name, tags=tags, session_id=it.group_id, metadata=trace_meta),
        ):
            self._history(client, t, gens[0], model, step)
            for h, extra in enumerate(t.additional_histories, start=1):
                with client.start_as_current_observation(
                    name=f"history {h}", as_type="chain", metadata={"trainable": extra.trainable}
                ):
                    self._history(client, extra, gens[h], model, step)

    def _history(
        self,
        client: Langfuse,
        history: History,
        gens: list[_wire.GenerationPayload],
        model: str | None,
        step: int | None,
    ) -> None:
        messages = history.messages()
        by_position = {g.position: g for g in gens}
        calls: dict[str, dict[str, Any]] = {}
        for pos, item in enumerate(history.messages_and_choices):
            if isinstance(item, Choice):
                g = by_position[pos]
                record = record_of(item)
                prefix = messages[:pos]
                request: Any = {"messages": prefix, "tools": history.tools} if history.tools else prefix
                usage = (
                    {"input": len(record.prompt_token_ids), "output": len(record.token_ids)}
                    if record
                    else None
                )
                for call in messages[pos].get("tool_calls") or []:
                    calls[call.get("id", "")] = call
                with client.start_as_current_observation(
                    name=_wire.GENERATION_NAME,
                    as_type="generation",
                    input=request,
                    output=messages[pos],
                    model=record.model if record else (f"{model}@{step}" if model else None),
                    usage_details=usage,
                    metadata={_wire.META_KEY: g.model_dump(mode="json")},
                    level="WARNING" if item.finish_reason == "length" else None,
                    status_message="stopped at max_tokens" if item.finish_reason == "length" else None,
                ):
                    pass
            elif item.get("role") == "assistant":
                for call in item.get("tool_calls") or []:
                    calls[call.get("id", "")] = call
            elif item.get("role") == "tool":
                call = calls.get(item.get("tool_call_id") or "", {})
                fn = call.get("function") or {}
                with client.start_as_current_observation(
                    name=str(fn.get("name") or "tool"),
                    as_type="tool",
                    input=_wire.decode(fn.get("arguments")) if fn else None,
                    output=item.get("content"),
                    metadata={"tool_call_id": item.get("tool_call_id")},
                ):
                    pass


_active: ContextVar[LangfuseExporter | None] = ContextVar("journeyman_langfuse_exporter", default=None)
"""The exporter `export_to_langfuse` started in this context: a program's own, not the process's.
Tasks and `asyncio.to_thread` inherit it (as they inherit the sink, `rollout.observe`), so one
program's rollouts, training and logging share it, while a second program in the same process
(another task tree) has its own, which turning export on again does not close."""


def export_to_langfuse(
    public_key: str | None = None,
    secret_key: str | None = None,
    host: str | None = None,
    *,
    trace_name: str | None = None,
    tags: Sequence[str] = (),
    reward_score: str = "reward",
    max_queue: int = 1000,
    hold_s: float = 30.0,
    timeout_s: float = 5.0,
    retry_after_s: float = 10.0,
) -> LangfuseExporter:
    """Turn on Langfuse export: from now on every trajectory gathered, trained on or logged is a trace.

    Keys and host come from the arguments or the SDK's environment variables (LANGFUSE_PUBLIC_KEY,
    LANGFUSE_SECRET_KEY, LANGFUSE_BASE_URL). The reward is sent as the score `reward_score`. At most
    `max_queue` trajectories wait for export; beyond that (Langfuse slow or unreachable) they are
    dropped with a warning that counts them. Calling this again replaces the previous exporter.
    Returns the exporter: `.flush()`, `.close()`, `.stats`.

    The exporter belongs to the context that turned it on (a `contextvars` scope: the calling task
    and the tasks and `to_thread` calls it starts): "again" means again in that context, and only
    trajectories announced there reach it, so two programs in one process (two task trees) each
    export their own trajectories to their own Langfuse.
    """
    creds = credentials(public_key, secret_key, host)
    conn = export_connection(creds, timeout_s)
    exporter = LangfuseExporter(
        conn,
        trace_name=trace_name,
        tags=tags,
        reward_score=reward_score,
        max_queue=max_queue,
        hold_s=hold_s,
        retry_after_s=retry_after_s,
        flush_timeout_s=max(timeout_s * 3, 10.0),
    )
    previous = _active.get()
    if previous is not None:
        previous.close()
    _active.set(exporter)
    add_sink(exporter)
    atexit.register(exporter.close)
    return exporter
