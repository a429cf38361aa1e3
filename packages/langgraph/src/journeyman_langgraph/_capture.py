"""Per-request capture inside one episode: which LangChain run sent which request to the endpoint.

The join, per request:
- LangChain's callback view (`on_chat_model_start`: run id, node, tags, messages) is recorded by
  `EpisodeHandler`, which LangChain adds to every run started inside an episode (a configure hook).
  It runs inline, in the caller's context, so the run it starts is visible to the HTTP hook below.
- The httpx request hook of the chat model's client gives each trainable request its own capture id
  (`<episode id>.<n>`) in the `x-journeyman-capture` header; the endpoint files the exact
  completion (token records included) under that id.
At the end of the episode each request id is popped from the endpoint and joined to its run.

Everything lives in ContextVars holding per-episode objects: LangGraph copies the context into the
threads and tasks that run nodes, so concurrent episodes never see each other's calls.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import UUID

import httpx
from journeyman import CAPTURE_HEADER, CapturedCall
from journeyman.integrations import Episode
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables.config import var_child_runnable_config
from langchain_core.tracers.context import register_configure_hook

if TYPE_CHECKING:
    from journeyman import TrainableModel

TRAINABLE_TAG = "journeyman:trainable"
"""LangChain tag that marks a chat model or runnable as the trained policy (set by `trainable`)."""

_episode: ContextVar[GraphEpisode | None] = ContextVar("journeyman_langgraph_episode", default=None)
_trainable_scope: ContextVar[bool] = ContextVar("journeyman_langgraph_trainable", default=False)
_llm_run: ContextVar[LLMRun | None] = ContextVar("journeyman_langgraph_llm_run", default=None)
_handler: ContextVar[EpisodeHandler | None] = ContextVar("journeyman_langgraph_handler", default=None)
register_configure_hook(_handler, inheritable=True)


@dataclass
class LLMRun:
    """LangChain's view of one chat-model call."""

    run_id: UUID
    episode: GraphEpisode
    node: str | None
    trainable: bool
    model_name: str | None
    ended: bool = False
    requests: int = 0


@dataclass
class Request:
    """One HTTP request that the endpoint will file under `capture_id`."""

    capture_id: str
    run: LLMRun | None
    node: str | None


@dataclass
class GraphEpisode:
    """One run of a `@trajectory` function: core's `Episode` (capture ids, calls, the Trajectory)
    plus LangChain's view of its requests."""

    model: TrainableModel
    episode: Episode
    base_url: str
    requests: dict[str, Request] = field(default_factory=dict)
    runs: dict[UUID, LLMRun] = field(default_factory=dict)
    untrained_calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    served_llm: Any = None
    """The chat model of the trained model's endpoint whose clients serve the calls rerouted from
    other chat models inside a marked scope: built by `_nested` on first use (it sits above `_chat`,
    this module below it)."""

    def new_request(self, run: LLMRun | None, node: str | None) -> str:
        cid = self.episode.new_capture_id()
        with self.lock:
            self.requests[cid] = Request(cid, run, node)
            if run is not None:
                run.requests += 1
        return cid

    async def pop_calls(self) -> list[tuple[Request, CapturedCall]]:
        """Take this episode's calls off the endpoint (one round trip), in request order."""
        return [(self.requests[c.capture_id], c.call) for c in await self.episode.calls() if c.capture_id]


def current_episode() -> GraphEpisode | None:
    """The episode of the `@trajectory` function running in this context, if any."""
    return _episode.get()


def node_path(metadata: Mapping[str, Any]) -> str | None:
    """The LangGraph node of a run's metadata, under the subgraph nodes it runs in ("team/agent"):
    two subgraphs' "agent" nodes are told apart. LangGraph's checkpoint namespace names each level
    as "<node>:<task id>", joined by "|" (`langgraph_checkpoint_ns`, beside `langgraph_node`)."""
    node = metadata.get("langgraph_node")
    if not isinstance(node, str):
        return None
    ns = metadata.get("langgraph_checkpoint_ns")
    if not isinstance(ns, str) or not ns:
        return node
    return "/".join(part.split(":", 1)[0] for part in ns.split("|"))


def current_node() -> str | None:
    """The LangGraph node running in this context (`node_path`), from LangChain's runnable config."""
    config = var_child_runnable_config.get() or {}
    return node_path(config.get("metadata") or {})


class EpisodeHandler(BaseCallbackHandler):
    """Records LangChain's view of each chat-model call of one episode (added to every run in it)."""

    run_inline = True  # same context as the call: the HTTP hook then sees `_llm_run`
    raise_error = True

    # Only chat-model events matter; BaseCallbackHandler declares these switches as properties.
    @property
    def ignore_chain(self) -> bool:
        return True

    @property
    def ignore_agent(self) -> bool:
        return True

    @property
    def ignore_retriever(self) -> bool:
        return True

    @property
    def ignore_retry(self) -> bool:
        return True

    @property
    def ignore_custom_event(self) -> bool:
        return True

    def __init__(self, episode: GraphEpisode) -> None:
        self.episode = episode

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[Any]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        params = kwargs.get("invocation_params") or {}
        run = LLMRun(
            run_id=run_id,
            episode=self.episode,
            node=node_path(metadata or {}),
            trainable=TRAINABLE_TAG in (tags or []) or _trainable_scope.get(),
            model_name=params.get("model") or params.get("model_name"),
        )
        with self.episode.lock:
            self.episode.runs[run_id] = run
        _llm_run.set(run)

    def _end(self, run_id: UUID) -> None:
        run = self.episode.runs.get(run_id)
        if run is not None:
            run.ended = True  # a later plain request in this context must not inherit this run

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id)


def stamp(request: httpx.Request) -> None:
    """Give a trainable request of the current episode its own capture id."""
    run = _llm_run.get()
    if run is not None and run.ended:
        run = None
    episode = run.episode if run is not None else _episode.get()
    if episode is None or not str(request.url).startswith(episode.base_url):
        return
    trainable = run.trainable if run is not None else _trainable_scope.get()
    if not trainable:
        with episode.lock:
            episode.untrained_calls += 1
        return
    node = run.node if run is not None else current_node()
    request.headers[CAPTURE_HEADER] = episode.new_request(run, node)


def sync_hook(request: httpx.Request) -> None:
    stamp(request)


async def async_hook(request: httpx.Request) -> None:
    stamp(request)


def install_hooks(client: Any) -> None:
    """Add the capture hook to an httpx client (sync or async) once."""
    hook = async_hook if isinstance(client, httpx.AsyncClient) else sync_hook
    hooks = client.event_hooks
    if hook not in hooks["request"]:
        hooks["request"] = [*hooks["request"], hook]
        client.event_hooks = hooks
