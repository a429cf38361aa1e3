"""One episode, one Trajectory: the seam every integration runs an agent through.

An integration (LangGraph's `@trajectory`, the Agents SDK's `TrainableRunner`, MCP's `rollout`) does the
same five things around a framework's run, and does them here:
1. capture: the run's requests carry capture ids of this episode (`running()` / `capture()` set one
   for the context, `new_capture_id()` hands one out per request), and the endpoint files each
   call it serves under its id; a loop that sees its completions itself `record`s them instead;
2. pop: `calls()` takes the episode's calls off the endpoint in one round trip, once;
3. join: `join(calls, partition)` makes histories of them by core's one rule
   (`journeyman.rollout.histories`) and puts them on the trajectory, the main one first;
4. fail: an Exception the run raises inside `running()` is kept, not raised;
5. settle: `settle()` returns the trajectory (`metrics["errored"]` False), or for a run that
   raised applies `on_error` (`journeyman.data.failures`: keep it scored, drop it, or re-raise).

`finish()` is 2, 3 and 5 with one partition. A new integration is then a page:

    episode = Episode(model, on_error="score")
    with episode.running():                      # requests of model.openai_client() are captured
        answer = await my_framework.run(task, client=model.openai_client())
    trajectory = await episode.finish()          # or raises, per on_error
    trajectory.reward = score(answer)

A run that is cancelled (a BaseException) passes through `running()`; the integration then calls
`discard()` so that nothing it filed stays on the endpoint.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from journeyman.data.failures import ErrorReward, OnError, check_on_error, settle_failed_run
from journeyman.data.types import Trajectory
from journeyman.rollout.capture import CapturedCall, capture_scope
from journeyman.rollout.histories import CallHistory, fill_histories, join_calls, main_first


class CaptureSource(Protocol):
    """Where the endpoint filed an episode's calls: a `TrainableModel` is one."""

    async def pop_captures(self, capture_ids: Sequence[str]) -> dict[str, list[CapturedCall]]: ...


@dataclass(frozen=True)
class EpisodeCall:
    """One call of the episode, with the capture id it was filed under (None: `record`ed)."""

    capture_id: str | None
    call: CapturedCall


class Episode:
    """The calls of one run of an agent, and the Trajectory they become.

    `source` is where the endpoint files captured calls (the `TrainableModel`; None when every call
    is `record`ed). `trajectory` is the one being built (default: a fresh one): the run may log to
    it, add metadata or set its reward before it ends. Thread-safe where the run may be: capture
    ids and recorded calls may come from several threads.
    """

    def __init__(
        self,
        source: CaptureSource | None = None,
        *,
        on_error: OnError = "score",
        error_reward: ErrorReward = 0.0,
        trajectory: Trajectory | None = None,
    ) -> None:
        self.on_error: OnError = check_on_error(on_error, error_reward)
        self.error_reward = error_reward
        self.id = uuid.uuid4().hex
        self.trajectory = trajectory if trajectory is not None else Trajectory()
        self.error: Exception | None = None
        """What the run raised (kept by `running()` or `fail`), settled by `settle`."""
        self.histories: list[CallHistory] = []
        """The histories of the last `join`, the main one first."""
        self._source = source
        self._ids: list[str] = []
        self._recorded: list[CapturedCall] = []
        self._popped: list[EpisodeCall] | None = None
        self._lock = threading.Lock()

    # -- capture ---------------------------------------------------------------------------------
    def new_capture_id(self) -> str:
        """A fresh capture id of this episode (`<episode id>.<n>`), popped with the others."""
        with self._lock:
            cid = f"{self.id}.{len(self._ids)}"
            self._ids.append(cid)
            return cid

    @contextlib.contextmanager
    def capture(self) -> Iterator[str]:
        """Mark every request made in this context (this task and those it starts) with a capture id
        of this episode (`journeyman.capture_scope`)."""
        with capture_scope(self.new_capture_id()) as cid:
            yield cid

    def record(self, call: CapturedCall) -> None:
        """Add a call the caller saw itself (a loop that holds its completions, records included)."""
        with self._lock:
            self._recorded.append(call)

    # -- the run ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, *, capture: bool = True) -> Iterator[Episode]:
        """Run the agent inside: its requests are captured (unless `capture=False`: the integration
        stamps them itself) and an Exception it raises is kept for `settle`, not raised.
        BaseExceptions (cancellation, Ctrl-C) pass through."""
        with self.capture() if capture else contextlib.nullcontext():
            try:
                yield self
            except Exception as e:
                self.fail(e)

    def fail(self, error: Exception) -> None:
        """The run raised `error` (outside `running()`, e.g. while a stream was consumed)."""
        self.error = error

    # -- pop, join, settle -----------------------------------------------------------------------
    async def calls(self) -> list[EpisodeCall]:
        """The episode's calls, taken off the endpoint on the first call (one round trip): per capture
        id in the order the ids were handed out, each id's calls in the order served; then the
        recorded ones. Calls filed after the first `calls()` are not the episode's."""
        if self._popped is None:
            with self._lock:
                ids = list(self._ids)
            filed = await self._source.pop_captures(ids) if ids and self._source is not None else {}
            if self._popped is None:  # a concurrent `calls()` may have popped first
                popped = [EpisodeCall(cid, c) for cid in ids for c in filed.get(cid, [])]
                with self._lock:
                    popped += [EpisodeCall(None, c) for c in self._recorded]
                self._popped = popped
        return list(self._popped)

    async def discard(self) -> None:
        """Free what the endpoint filed for the episode (a cancelled or interrupted run)."""
        await self.calls()

    def join(
        self,
        calls: Sequence[CapturedCall],
        partition: Sequence[Hashable] | None = None,
        *,
        trained: Collection[Hashable] | None = None,
        exact: bool = True,
    ) -> list[CallHistory]:
        """Join `calls` into histories (`journeyman.rollout.histories.join_calls`: `partition` gives
        one key per call, `trained` the trained keys, `exact=False` admits calls without token
        records) and put them on the trajectory: the main history (the first trainable one) as its
        conversation, the others after its `additional_histories`. Returns them, the main one first."""
        self.histories = main_first(join_calls(calls, partition, trained=trained, exact=exact))
        fill_histories(self.trajectory, self.histories)
        return self.histories

    def settle(self) -> Trajectory:
        """The episode's trajectory: `metrics["errored"]` False when the run returned; for a run that
        raised, settled by `on_error` (kept with `error` set and reward `error_reward`, or raises;
        see `journeyman.data.failures.settle_failed_run`)."""
        if self.error is None:
            self.trajectory.metrics["errored"] = False
            return self.trajectory
        self.trajectory = settle_failed_run(self.trajectory, self.error, self.on_error, self.error_reward)
        return self.trajectory

    async def finish(self, *, exact: bool = True) -> Trajectory:
        """`calls()`, `join` in one partition, `settle`: the trajectory of a one-agent episode."""
        self.join([c.call for c in await self.calls()], exact=exact)
        return self.settle()


__all__ = ["CaptureSource", "Episode", "EpisodeCall"]
