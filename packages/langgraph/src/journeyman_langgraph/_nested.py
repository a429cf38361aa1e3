"""Chat models called inside a marked node are served by the trained model too.

A node marked `@trainable` (or a runnable passed through `trainable`) may run a graph or a chat model
of its own: a nested agent, a critic, a sub-team built with `init_chat_model("openai:gpt-4.1")` as
LangGraph's examples build them. While an episode runs, its calls inside the marked scope are the
policy's: they go to the trained model's endpoint, not to OpenAI (no credentials needed beyond the
placeholder the client wants at construction), and are captured like every trained call; the join
makes a nested graph's fresh conversation a history of its own (`additional_histories`).

LangChain has no seam to choose a chat model's provider per call (the Agents SDK has its default
runner), so `install` wraps the four sampling methods of `langchain_openai`'s `BaseChatOpenAI` (and
`ChatOpenAI`'s own routing overrides) once per process. The wrapper acts only inside an episode,
inside a marked scope, for a model not already pointed at the episode's endpoint: it samples
through a copy of the model (its settings, bound tools and callbacks kept) whose clients, base URL
and model name are the trained model's. Everything else passes through unchanged. Chat models of
other providers (Anthropic, Gemini) are not rerouted: give them `chat_model(model)`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from langchain_openai import ChatOpenAI
from langchain_openai.chat_models.base import BaseChatOpenAI

from . import _capture as cap
from ._chat import chat_model

_installed = False
_install_lock = threading.Lock()
_SERVED_FIELDS = (
    "client",
    "async_client",
    "root_client",
    "root_async_client",
    "model_name",
    "openai_api_key",
    "openai_api_base",
    "http_client",
    "http_async_client",
)


def _served_twin(llm: BaseChatOpenAI, run_manager: Any) -> BaseChatOpenAI | None:
    """The copy of `llm` that samples from the episode's trained model, when this call is the
    policy's (an episode runs, a marked scope) and `llm` is not already served by it; else None."""
    episode = cap.current_episode()
    if episode is None or str(llm.openai_api_base or "").startswith(episode.base_url):
        return None
    tags = getattr(run_manager, "tags", None) or []
    if not (cap._trainable_scope.get() or cap.TRAINABLE_TAG in tags):
        return None
    if episode.served_llm is None:  # once per episode (two threads racing build equal models)
        episode.served_llm = chat_model(episode.model)
    served = episode.served_llm
    update = {name: getattr(served, name) for name in _SERVED_FIELDS}
    return llm.model_copy(update={**update, "use_responses_api": False})


def _sync(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def served(
        self: BaseChatOpenAI, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        twin = _served_twin(self, run_manager)
        return method(self if twin is None else twin, messages, stop, run_manager, **kw)

    return served


def _async(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def served(
        self: BaseChatOpenAI, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Any:
        twin = _served_twin(self, run_manager)
        return await method(self if twin is None else twin, messages, stop, run_manager, **kw)

    return served


def _sync_stream(method: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    @functools.wraps(method)
    def served(
        self: BaseChatOpenAI, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Iterator[Any]:
        twin = _served_twin(self, run_manager)
        yield from method(self if twin is None else twin, messages, stop, run_manager, **kw)

    return served


def _async_stream(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    @functools.wraps(method)
    async def served(
        self: BaseChatOpenAI, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> AsyncIterator[Any]:
        twin = _served_twin(self, run_manager)
        async for chunk in method(self if twin is None else twin, messages, stop, run_manager, **kw):
            yield chunk

    return served


_WRAPPERS: dict[str, Callable[[Any], Any]] = {
    "_generate": _sync,
    "_agenerate": _async,
    "_stream": _sync_stream,
    "_astream": _async_stream,
}


def install() -> None:
    """Wrap the sampling methods once per process (see the module doc)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for cls in (BaseChatOpenAI, ChatOpenAI):
            for name, wrap in _WRAPPERS.items():
                method = cls.__dict__.get(name)  # only where the class defines it: no double wrap
                if method is not None:
                    setattr(cls, name, wrap(method))
        _installed = True
