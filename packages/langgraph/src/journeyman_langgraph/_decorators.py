"""The two decorators: `@trajectory(model)` marks an episode, `trainable` marks the trained policy."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar, overload

from journeyman import CapturedCall, InvalidFieldError, TrainableModel, Trajectory
from journeyman.integrations import Episode, ErrorReward, OnError, check_on_error
from langchain_core.language_models import BaseChatModel
from langchain_core.runnables import Runnable, RunnableBinding
from langchain_openai import ChatOpenAI

from . import _capture as cap
from . import _nested
from ._chat import chat_model

log = logging.getLogger("journeyman.langgraph")

P = ParamSpec("P")
T = TypeVar("T")

Reward = float | int | tuple[float | int, Mapping[str, float | int | bool]] | Trajectory


def _reward(value: Any, where: str) -> tuple[float, dict[str, float | int | bool]]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        reward, metrics = value
    else:
        reward, metrics = value, {}
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise InvalidFieldError(
            f"{where}() return value",
            value,
            "an episode returns its reward: a float, (float, {metric: value}), or a Trajectory",
        )
    return float(reward), dict(metrics)


class _EpisodeScope:
    """One call of a `@trajectory` function: its ContextVars while it runs, then its Trajectory."""

    def __init__(
        self, model: TrainableModel, name: str, on_error: OnError, error_reward: ErrorReward
    ) -> None:
        _nested.install()  # chat models called in a marked node are served by `model` (`_nested`)
        self.name = name
        episode = Episode(model, on_error=on_error, error_reward=error_reward)
        episode.trajectory.metadata["episode"] = name
        self.graph = cap.GraphEpisode(model=model, episode=episode, base_url=model.inference_base_url)
        self.episode = episode

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The function runs inside: an Exception it raises is kept for `finish` (core's `Episode`);
        the capture ids are stamped per request by the HTTP hook (`_capture.stamp`)."""
        tokens = (
            cap._episode.set(self.graph),
            cap._handler.set(cap.EpisodeHandler(self.graph)),
            cap._llm_run.set(None),
            cap._trainable_scope.set(False),
        )
        try:
            with self.episode.running(capture=False):
                yield
        finally:
            ep_t, h_t, run_t, scope_t = tokens
            cap._trainable_scope.reset(scope_t)
            cap._llm_run.reset(run_t)
            cap._handler.reset(h_t)
            cap._episode.reset(ep_t)

    async def finish(self, result: Any) -> Trajectory:
        """The function returned `result` (its reward, or ART style its Trajectory) or raised: its
        calls become the trajectory, settled by `on_error` when it raised (may raise)."""
        calls = _latest_per_run(await self.graph.pop_calls())  # first: nothing stays on the endpoint
        if self.episode.error is None:
            self._take_result(result)
        t = self.episode.trajectory  # keeps what the function put on current_trajectory()
        if not self.episode.join([c for _, c in calls]):  # one partition: calls join across nodes
            t.log(self._nothing_captured())
        graph = self.graph
        for run in graph.runs.values():
            if run.trainable and run.requests == 0 and run.model_name == graph.model.name:
                t.log(
                    f"a trainable call (node {run.node!r}) reached no Journeyman hook: build its chat model "
                    "with journeyman_langgraph.chat_model(model) or pass it through trainable()"
                )
        t.metadata["langgraph_nodes"] = [req.node for req, _ in calls]
        t.metadata["untrained_calls"] = graph.untrained_calls
        t = self.episode.settle()
        for line in t.logs:
            log.warning("%s: %s", self.name, line)
        return t

    def _nothing_captured(self) -> str:
        """Why the episode has no trained call: advice to mark the policy only if nothing was marked."""
        graph = self.graph
        if not graph.runs and not graph.untrained_calls:
            return "the episode made no LLM call: nothing to train"
        if any(run.trainable for run in graph.runs.values()):
            return "no trainable LLM call was captured"  # marked: the lines below say why, when known
        return "no trainable LLM call was captured: mark the policy with `trainable` (node or chat model)"

    def _take_result(self, result: Any) -> None:
        t = self.episode.trajectory
        if isinstance(result, Trajectory):  # ART style: the function built the Trajectory itself
            if result.messages_and_choices:
                raise InvalidFieldError(
                    f"{self.name}() return value",
                    f"Trajectory with {len(result.messages_and_choices)} messages",
                    "return a Trajectory without messages: the captured calls fill them",
                )
            result.metadata = {**t.metadata, **result.metadata}
            result.metrics = {**t.metrics, **result.metrics}
            result.logs = [*t.logs, *result.logs]
            result.additional_histories = [*t.additional_histories, *result.additional_histories]
            self.episode.trajectory = result
        else:
            t.reward, metrics = _reward(result, self.name)
            t.metrics = {**t.metrics, **metrics}

    async def discard(self) -> None:
        """The function was cancelled or interrupted: free what the endpoint filed for it."""
        await self.episode.discard()


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Finish an episode from a sync `@trajectory` function: on this thread when no event loop runs
    here, else on a worker thread (a sync graph called from async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _latest_per_run(
    calls: list[tuple[cap.Request, CapturedCall]],
) -> list[tuple[cap.Request, CapturedCall]]:
    """A client retry can file one LangChain call twice: keep the last filed request of each run."""
    last: dict[Any, int] = {}
    for i, (req, _) in enumerate(calls):
        if req.run is not None:
            last[req.run.run_id] = i
    return [(req, c) for i, (req, c) in enumerate(calls) if req.run is None or last[req.run.run_id] == i]


def trajectory(
    model: TrainableModel, *, on_error: OnError = "score", error_reward: ErrorReward = 0.0
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    """Mark the unit of an episode: a function that runs the graph for one scenario and returns its reward.

    Calling the decorated function returns a `journeyman.Trajectory` instead of the reward (awaitable
    if the function is async): every call the `trainable` policy made during it, in order, with the
    endpoint's exact token records, the tools offered, and the reward. Calls whose prompt does not
    extend the first conversation (a fresh prompt, a side task) become `additional_histories`.
    The function returns a float, `(float, {"metric": value})`, or (ART's style) a `Trajectory`
    without messages, which the captured calls then fill. Inside it, `current_trajectory()` gives
    the Trajectory being built (for `log`, `metadata`, `metrics`).

        @trajectory(model)
        async def rollout(scenario: Scenario) -> float:
            out = await graph.ainvoke({"messages": [("user", scenario.question)]})
            return score(out)

        traj = await rollout(scenario)

    An episode that raises (a node's exception, `GraphRecursionError`) follows `on_error`:
    `"score"` (default) returns the trajectory of the calls made before the error, `error` set (the
    exception object itself on `error.exception`, for `isinstance` checks and its attributes) and
    reward `error_reward` (a number, or a function of the trajectory); `"drop"` raises
    `RolloutDroppedError` (a group counts it as dropped); `"raise"` re-raises the exception. An
    episode that raised before any policy call left nothing to train and re-raises under "score"
    too. Service failures (endpoint unreachable, 5xx, timeouts) always re-raise
    (`journeyman.integrations.Episode`).

        t = await rollout(scenario)
        if t.error is not None and isinstance(t.error.exception, GraphRecursionError):
            ...  # the run hit its step limit: its calls are on `t`, scored `error_reward`
    """
    if not isinstance(model, TrainableModel):
        raise InvalidFieldError(
            "model", model, "trajectory() takes the journeyman.TrainableModel being trained"
        )
    policy = check_on_error(on_error, error_reward)

    def decorate(fn: Callable[P, Any]) -> Callable[P, Any]:
        name = getattr(fn, "__qualname__", repr(fn))
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def arun(*args: P.args, **kwargs: P.kwargs) -> Trajectory:
                scope = _EpisodeScope(model, name, policy, error_reward)
                result = None
                try:
                    with scope.running():
                        result = await fn(*args, **kwargs)
                except BaseException:
                    await scope.discard()
                    raise
                return await scope.finish(result)

            return arun

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> Trajectory:
            scope = _EpisodeScope(model, name, policy, error_reward)
            result = None
            try:
                with scope.running():
                    result = fn(*args, **kwargs)
            except BaseException:
                _run_sync(scope.discard())
                raise
            return _run_sync(scope.finish(result))

        return run

    return decorate


def current_trajectory() -> Trajectory:
    """The Trajectory the current `@trajectory` episode is building (to add logs, metadata, metrics)."""
    graph = cap._episode.get()
    if graph is None:
        raise InvalidFieldError("current_trajectory()", None, "called outside a @trajectory(model) function")
    return graph.episode.trajectory


M = TypeVar("M", bound=BaseChatModel)
R = TypeVar("R", bound=Runnable[Any, Any])


@overload
def trainable(target: M) -> M: ...
@overload
def trainable(target: R) -> R: ...
@overload
def trainable(target: Callable[P, T]) -> Callable[P, T]: ...
def trainable(target: Any) -> Any:
    """Mark the trained policy. Calls from anything unmarked (a judge, a summariser) are not trained.

    - a chat model (e.g. from `chat_model(model)`): every call it makes, in any node, is trained;
      it is tagged in place and returned (`create_agent(trainable(llm), tools)`).
    - a node function (sync or async), as a decorator: every call made while it runs is trained.
    - any other runnable (a `bind_tools` binding, a subgraph used as a node): calls inside it are
      trained (returns a tagged copy).
    """
    if isinstance(target, BaseChatModel):
        _hook_clients(target)
        if cap.TRAINABLE_TAG not in (target.tags or []):
            target.tags = [*(target.tags or []), cap.TRAINABLE_TAG]
        return target
    if isinstance(target, Runnable):
        bound = target
        while isinstance(bound, RunnableBinding):
            bound = bound.bound
        if isinstance(bound, BaseChatModel):
            _hook_clients(bound)
        return target.with_config(tags=[cap.TRAINABLE_TAG])
    if not callable(target):
        raise InvalidFieldError(
            "trainable(target)", target, "mark a chat model, a runnable, or a node function"
        )
    if inspect.iscoroutinefunction(target):

        @functools.wraps(target)
        async def anode(*args: Any, **kwargs: Any) -> Any:
            token = cap._trainable_scope.set(True)
            try:
                return await target(*args, **kwargs)
            finally:
                cap._trainable_scope.reset(token)

        return anode

    @functools.wraps(target)
    def node(*args: Any, **kwargs: Any) -> Any:
        token = cap._trainable_scope.set(True)
        try:
            return target(*args, **kwargs)
        finally:
            cap._trainable_scope.reset(token)

    return node


def _hook_clients(llm: BaseChatModel) -> None:
    """A ChatOpenAI built by the user (not by `chat_model`) gets the capture hook on its HTTP clients."""
    for attr in ("root_client", "root_async_client"):
        client = getattr(getattr(llm, attr, None), "_client", None)
        if client is not None:
            cap.install_hooks(client)


def init_chat_model(model: TrainableModel | None = None, **kwargs: Any) -> ChatOpenAI:
    """The trained policy as a chat model: `trainable(chat_model(model, **kwargs))` (ART's name).

    Inside a `@trajectory(model)` function `model` may be left out: the episode's model is used,
    as with ART's `init_chat_model()` inside `wrap_rollout`.
    """
    if model is None:
        episode = cap.current_episode()
        if episode is None:
            raise InvalidFieldError(
                "model",
                None,
                "pass the TrainableModel, or call init_chat_model() inside a @trajectory function",
            )
        model = episode.model
    return trainable(chat_model(model, **kwargs))
