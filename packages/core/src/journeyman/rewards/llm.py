"""One way to name an LLM that Journeyman asks for help (a RULER judge, a scenario generator) and one
way to ask it for JSON.

A spec is what a user writes on a command line or in code:

    "local"                        the model the backend registered last (offline; the embedded model)
    "local:<name>"                 the model registered under <name>, e.g. a frozen judge beside the policy
    a TrainableModel / ModelConfig  the same, by object
    "http(s)://host/v1" + model    any OpenAI-compatible server (vLLM, OpenAI); key: api_key or $OPENAI_API_KEY
    anything else                  a LiteLLM model string, e.g. "openai/gpt-4o" (pip install "journeyman[litellm]")

    llm = await resolve_llm("local")                          # backend: current_backend() unless given
    text, finish = await complete_json(llm, messages, schema, params={"max_tokens": 200})

`LLM.identity` names who answers, for caches: a local model's includes the step it serves
(`local:agent@3`), because a policy that judges itself is a new judge after every training step.
Every call has a timeout: a local CPU engine given a huge prompt was seen to answer nothing for
minutes rather than fail. `answer_cost` says what an answer cost (tokens; US dollars from LiteLLM's
price table for a LiteLLM model), for budgets (`data/budget.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import httpx
from pydantic import BaseModel, Field

from journeyman.client.model import TrainableModel
from journeyman.client.protocol import current_backend
from journeyman.data.config import ModelConfig
from journeyman.errors import InvalidFieldError, JourneymanError, UnknownModelError

if TYPE_CHECKING:
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletion

    from journeyman.client.protocol import Backend

log = logging.getLogger("journeyman.llm")

LLMSpec = str | ModelConfig
"""What names an LLM: "local", "local:<name>", a model object, an http(s) base URL, a LiteLLM id."""

DEFAULT_TIMEOUT_S = 600.0
"""Seconds one completion may take, retries included: generous for a CPU judge, never forever."""

_SPECS = 'use "local", "local:<model>", an http(s) base URL (with a model name), or a LiteLLM model string'


class LLM(BaseModel, frozen=True):
    """A resolved LLM: where to send requests, and an identity for caches."""

    kind: Literal["local", "openai", "litellm"] = Field(
        description="local: served by a journeyman backend; openai: an OpenAI-compatible base URL; "
        "litellm: a LiteLLM model string"
    )
    model: str = Field(description="the model name put in requests")
    base_url: str | None = Field(default=None, description="OpenAI base URL (None for LiteLLM)")
    api_key: str | None = Field(
        default=None, repr=False, description="bearer token; None lets LiteLLM read env vars"
    )
    identity: str = Field(
        description="who answers, for cache keys: local:<name>@<step>, <base_url>#<model>, litellm:<model>"
    )


class LLMTimeoutError(JourneymanError, TimeoutError):
    """An LLM gave no answer within the time allowed."""

    def __init__(self, identity: str, timeout: float) -> None:
        self.identity = identity
        self.timeout = timeout
        super().__init__(f"{identity} gave no answer within timeout={timeout:g}s")


def spec_label(spec: LLMSpec) -> str:
    """A spec as text, for logs and errors (a model object reads as "local:<name>")."""
    return f"local:{spec.name}" if isinstance(spec, ModelConfig) else str(spec)


async def resolve_llm(
    spec: LLMSpec,
    model: str | None = None,
    *,
    api_key: str | None = None,
    backend: Backend | None = None,
    field: str = "llm",
) -> LLM:
    """The LLM a spec names. `model` is the model to ask when `spec` is a base URL (only then).

    Local models are found through `backend`, else the backend of the latest `model.register` in this
    context (a registered TrainableModel brings its own). Errors name `field` and `<field>_model`,
    so a caller's users read their own argument names ("judge", "generator").
    """
    model_field = f"{field}_model"
    if isinstance(spec, ModelConfig):
        _no_model(model, model_field, "a model object names its model itself")
        if backend is None and isinstance(spec, TrainableModel):
            with contextlib.suppress(JourneymanError):  # not registered itself: try the current backend
                backend = spec.backend
        return await _local(spec.name, backend, field, spec)
    if not isinstance(spec, str) or not spec.strip() or any(c.isspace() for c in spec):
        raise InvalidFieldError(field, spec, _SPECS)
    if spec == "local" or spec.startswith("local:"):
        _no_model(model, model_field, f'name the local model as {field}="local:<model>"')
        name = spec.partition(":")[2] or None
        if spec.startswith("local:") and not name:
            raise InvalidFieldError(field, spec, 'name the model after "local:", or use "local"')
        return await _local(name, backend, field, spec)
    if spec.startswith(("http://", "https://")):
        base_url = spec.rstrip("/")
        if not httpx.URL(base_url).host:
            raise InvalidFieldError(field, spec, "a base URL needs a host, e.g. http://127.0.0.1:8000/v1")
        if not model:
            raise InvalidFieldError(
                model_field, model, f"{field}={spec!r} is a base URL: name the model to ask"
            )
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        return LLM(kind="openai", model=model, base_url=base_url, api_key=key, identity=f"{base_url}#{model}")
    _no_model(model, model_field, f"only a base-URL {field} takes {model_field}")
    _import_litellm(field, spec)  # fail now, not after the work that needed an answer
    return LLM(kind="litellm", model=spec, api_key=api_key, identity=f"litellm:{spec}")


def _no_model(model: str | None, model_field: str, reason: str) -> None:
    if model is not None:
        raise InvalidFieldError(model_field, model, reason)


async def _local(name: str | None, backend: Backend | None, field: str, spec: LLMSpec) -> LLM:
    if backend is None:
        try:
            backend = current_backend(field)
        except InvalidFieldError:
            raise InvalidFieldError(
                field,
                spec_label(spec),
                "no backend to serve it: register a model first (await model.register(backend)), pass "
                "backend=, or use an http(s) base URL or a LiteLLM model",
            ) from None
    try:
        where = backend.inference(name)
    except InvalidFieldError as e:
        raise InvalidFieldError(field, spec_label(spec), e.reason) from None
    except UnknownModelError as e:
        raise InvalidFieldError(field, spec_label(spec), f"not served here; served: {e.served}") from None
    # The served step is part of the identity: a trained policy judging itself is a new judge.
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.get(
            f"{where.base_url}/models", headers={"Authorization": f"Bearer {where.api_key}"}
        )
        resp.raise_for_status()
        served = resp.json()["data"]
    step = next((m["id"] for m in served if str(m["id"]).startswith(f"{where.model}@")), where.model)
    return LLM(
        kind="local",
        model=where.model,
        base_url=where.base_url,
        api_key=where.api_key,
        identity=f"local:{step}",
    )


def _import_litellm(field: str, model: str) -> Any:
    # LiteLLM fetches its price table from GitHub at import unless told to read the copy it ships:
    # a machine without that network would wait on it, and the prices would move under a run
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm  # pyright: ignore[reportMissingImports] - the optional journeyman[litellm] extra
    except ImportError as e:
        raise ImportError(
            f'{field}={model!r} is a LiteLLM model string: pip install "journeyman[litellm]" '
            '(or use "local" or an OpenAI-compatible base URL)'
        ) from e
    return litellm


async def complete_json(
    llm: LLM,
    messages: list[dict[str, Any]],
    schema: dict[str, Any],
    *,
    name: str = "answer",
    params: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    on_response: Callable[[ChatCompletion], None] | None = None,
) -> tuple[str, str | None]:
    """(answer text, finish reason) for `messages`, asked with `schema` as a JSON-schema response_format.

    `params` go to the completion call as they are (temperature, max_tokens, seed, reasoning_effort...);
    `on_response` sees the whole response (its `usage`: what the answer cost, `answer_cost`).
    Local and base-URL servers decode under the schema (`strict`); LiteLLM providers get it with
    `strict: false` (their strict modes accept different keywords), so check the answer yourself.
    """
    if not isinstance(timeout, int | float) or timeout <= 0:
        raise InvalidFieldError("timeout", timeout, "must be a number of seconds > 0")
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": schema, "strict": llm.kind != "litellm"},
    }
    try:
        return await asyncio.wait_for(
            _complete(llm, messages, response_format, params or {}, timeout, on_response), timeout
        )
    except TimeoutError as e:
        raise LLMTimeoutError(llm.identity, timeout) from e


class LiteLLMChat:
    """`chat.completions.create` over LiteLLM, answering OpenAI's own `ChatCompletion` type, so
    code written against an `AsyncOpenAI` client (a rollout, a judge) runs on any LiteLLM model."""

    def __init__(self, llm: LLM, timeout: float) -> None:
        self.llm, self.timeout = llm, timeout
        self.chat = self
        self.completions = self

    async def create(self, **kwargs: Any) -> ChatCompletion:
        from openai.types.chat import ChatCompletion

        litellm = _import_litellm("llm", self.llm.model)
        if self.llm.api_key:
            kwargs.setdefault("api_key", self.llm.api_key)
        resp = await litellm.acompletion(timeout=self.timeout, **kwargs)
        return ChatCompletion.model_validate(resp.model_dump())  # LiteLLM's ModelResponse is OpenAI-shaped

    async def close(self) -> None:
        """Nothing held: LiteLLM pools its own connections."""


def chat_client(llm: LLM, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """A client with OpenAI's `chat.completions.create` for `llm`, whichever kind it is."""
    if llm.kind == "litellm":
        return LiteLLMChat(llm, timeout)
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, timeout=timeout)


async def _complete(
    llm: LLM,
    messages: list[dict[str, Any]],
    response_format: dict[str, Any],
    params: dict[str, Any],
    timeout: float,
    on_response: Callable[[ChatCompletion], None] | None,
) -> tuple[str, str | None]:
    client = chat_client(llm, timeout)
    try:
        resp = await client.chat.completions.create(
            model=llm.model, messages=messages, response_format=response_format, **params
        )
    finally:
        await client.close()
    if on_response is not None:
        on_response(resp)
    choice = resp.choices[0]
    return choice.message.content or "", choice.finish_reason


_unpriced: set[str] = set()  # LiteLLM models warned about once: their price is not in the table


def answer_cost(llm: LLM, usage: CompletionUsage | None) -> tuple[int, float]:
    """(tokens, US dollars) one answer cost: the tokens it read and wrote (any LLM; none when the
    server reports no usage), and for a LiteLLM model their price in LiteLLM's own table
    (`litellm.cost_per_token`, shipped with the package; no request made). A model the table lacks,
    and a local or base-URL one, costs $0 (the first, with a warning once): cap those by tokens."""
    if usage is None:
        return 0, 0.0
    tokens = usage.prompt_tokens + usage.completion_tokens
    if llm.kind != "litellm":
        return tokens, 0.0
    litellm = _import_litellm("judge", llm.model)
    try:
        prompt_usd, completion_usd = litellm.cost_per_token(
            model=llm.model, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens
        )
    except Exception as e:  # LiteLLM raises its own errors for a model it cannot price
        if llm.model not in _unpriced:
            _unpriced.add(llm.model)
            log.warning(
                "%s has no price in LiteLLM's table (%s): its answers count $0, tokens only", llm.model, e
            )
        return tokens, 0.0
    return tokens, float(prompt_usd) + float(completion_usd)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LLM",
    "LLMSpec",
    "LLMTimeoutError",
    "LiteLLMChat",
    "answer_cost",
    "chat_client",
    "complete_json",
    "resolve_llm",
    "spec_label",
]
