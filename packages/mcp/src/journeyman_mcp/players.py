"""Who plays the held-out episodes: the trained policy, or a baseline to compare it with.

A baseline is named like any other LLM in Journeyman (`journeyman.integrations.resolve_llm`: "local:<name>", an
OpenAI-compatible base URL with a model name, a LiteLLM id), plus two words of our own: "base" (the
policy's own base model, i.e. step 0: the adapter off) and "none" (no comparison). Every player
runs the same `rollout`, so the two sides of a comparison differ only in who answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import journeyman as jm
from journeyman.integrations import DEFAULT_TIMEOUT_S, chat_client, resolve_llm

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
    return Player(model=llm.model, client=chat_client(llm, timeout), label=llm.identity)
