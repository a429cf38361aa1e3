"""`art.langgraph`: ART's `wrap_rollout` and `init_chat_model`, on `journeyman-langgraph`
(`pip install journeyman-langgraph`): every policy call of the graph is recorded token-exactly."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

import journeyman as jm
from journeyman.errors import InvalidFieldError

P = ParamSpec("P")


def _integration() -> Any:
    try:
        import journeyman_langgraph
    except ImportError as e:
        raise ImportError(
            "journeyman.art.langgraph needs LangGraph support: pip install journeyman-langgraph"
        ) from e
    return journeyman_langgraph


def wrap_rollout(
    model: jm.TrainableModel, fn: Callable[P, Awaitable[jm.Trajectory]]
) -> Callable[P, Awaitable[jm.Trajectory]]:
    """ART's `wrap_rollout(model, rollout)`: the rollout's Trajectory gets the messages and exact token
    records of every call the graph made through `init_chat_model()` (`@trajectory(model)`)."""
    if not isinstance(model, jm.TrainableModel):
        raise InvalidFieldError("model", model, "wrap_rollout records the calls of a TrainableModel")
    return _integration().trajectory(model)(fn)


def init_chat_model(model_name: str | None = None, **kwargs: Any) -> Any:
    """ART's `init_chat_model(model.name, temperature=...)` inside a `wrap_rollout` function: the
    episode's trained policy as a LangChain chat model. `model_name`, if given, must name it."""
    try:
        llm = _integration().init_chat_model(None, **kwargs)  # the episode's model
    except InvalidFieldError as e:
        if e.field != "model":
            raise
        raise InvalidFieldError(
            "model_name", model_name, "init_chat_model() is called inside a function given to wrap_rollout"
        ) from None
    served = getattr(llm, "model_name", None)
    if model_name is not None and model_name != served:
        raise InvalidFieldError("model_name", model_name, f"the rollout's model is {served!r}")
    return llm


__all__ = ["init_chat_model", "wrap_rollout"]
