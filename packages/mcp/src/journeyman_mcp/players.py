"""Who plays the held-out episodes: the trained policy, or a baseline to compare it with.

A baseline is named like any other LLM in Journeyman (`journeyman.llm`: "local:<name>", an
OpenAI-compatible base URL with a model name, a LiteLLM id), plus two words of our own: "base" (the
policy's own base model, i.e. step 0: the adapter off) and "none" (no comparison). Every player
runs the same `rollout`, so the two sides of a comparison differ only in who answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import journeyman as jm
from journeyman.llm import DEFAULT_TIMEOUT_S, resolve_llm
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

BASE = "base"
"""`--against base`: the policy's base model (step 0), served by the policy's own engine."""
NONE = "none"


@dataclass(frozen=True)
class Player:
    """A player: the model name put in requests, a client with `chat.completions.create`, and a
    label for reports."""

    model: str
    client: Any
    label: str


class LiteLLMChat:
    """`chat.completions.create` over LiteLLM, answering OpenAI's own `ChatCompletion` type, so a
    LiteLLM baseline goes through `rollout` unchanged."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.chat = self
        self.completions = self

    async def create(self, **kwargs: Any) -> ChatCompletion:
        import litellm  # pyright: ignore[reportMissingImports] - resolve_llm has checked it is installed

        resp = await litellm.acompletion(timeout=self.timeout, **kwargs)
        return ChatCompletion.model_validate(resp.model_dump())


def policy_player(model: jm.TrainableModel, label: str | None = None) -> Player:
    return Player(model=model.name, client=model.openai_client(), label=label or f"local:{model.name}")


async def resolve_against(
    spec: str,
    model: str | None = None,
    *,
    backend: jm.Backend | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Player:
    """The player `--against` names (not "base" or "none", which the caller handles: they need the
    policy). Errors name the field `against` / `against_model`."""
    llm = await resolve_llm(spec, model, backend=backend, field="against")
    if llm.kind == "litellm":
        return Player(model=llm.model, client=LiteLLMChat(timeout), label=llm.identity)
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, timeout=timeout)
    return Player(model=llm.model, client=client, label=llm.identity)
