"""A LangChain chat model bound to a Journeyman model's endpoint, with the capture hooks installed."""

from __future__ import annotations

import threading
from typing import Any

import httpx
from journeyman import InvalidFieldError, TrainableModel
from journeyman.integrations import CLIENT_TIMEOUT_S
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from ._capture import async_hook, sync_hook

_TIMEOUT = httpx.Timeout(CLIENT_TIMEOUT_S)
_clients: dict[str, tuple[httpx.Client, httpx.AsyncClient]] = {}
_clients_lock = threading.Lock()


def _http_clients(base_url: str) -> tuple[httpx.Client, httpx.AsyncClient]:
    """One hooked client pair per endpoint, shared by every chat model built for it.

    The hooks act only inside an episode (ContextVars), so sharing is safe; building a new pair per
    `chat_model()` call would leak a connection pool per rollout in ART-style code that builds the
    model inside the rollout. LangChain shares its default clients per base URL the same way.
    """
    with _clients_lock:
        pair = _clients.get(base_url)
        if pair is None:
            pair = (
                httpx.Client(event_hooks={"request": [sync_hook]}, timeout=_TIMEOUT),
                httpx.AsyncClient(event_hooks={"request": [async_hook]}, timeout=_TIMEOUT),
            )
            _clients[base_url] = pair
        return pair


def chat_model(model: TrainableModel, **kwargs: Any) -> ChatOpenAI:
    """`ChatOpenAI` pointed at `model`'s endpoint (Chat Completions), ready for capture.

    What `init_chat_model("openai:...")` would build, with base URL, key and HTTP clients wired:
    `bind_tools` (with `tool_choice="required"` or a tool name: grammar-constrained by the
    endpoint), `with_structured_output` (JSON schema, constrained too) and streaming work as usual.
    Other keyword arguments go to `ChatOpenAI` (`temperature`, `max_tokens`, ...).
    The model is not marked trainable: wrap it in `trainable(...)`, or mark the node using it.
    """
    if not isinstance(model, TrainableModel):
        raise InvalidFieldError("model", model, "chat_model() takes a registered journeyman.TrainableModel")
    for key in ("base_url", "openai_api_base", "api_key", "http_client", "http_async_client"):
        if key in kwargs:
            raise InvalidFieldError(key, kwargs[key], "chat_model() sets this from the model; leave it out")
    sync_client, async_client = _http_clients(model.inference_base_url)
    return ChatOpenAI(
        model=model.name,
        base_url=model.inference_base_url,
        api_key=SecretStr(model.inference_api_key),
        http_client=sync_client,
        http_async_client=async_client,
        use_responses_api=False,
        **kwargs,
    )
