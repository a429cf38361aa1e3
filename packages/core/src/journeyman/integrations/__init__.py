"""What an integration package may use from core, besides `journeyman` itself; and, below it, the
integrations core ships (`journeyman.integrations.langfuse`).

The rule: an integration (journeyman_langgraph, journeyman_agents, journeyman_mcp, or yours) imports
only `journeyman` and `journeyman.integrations`, and only the names in their `__all__`; examples
follow it too. Core's layer modules may move or change between releases; these names change on
purpose (`tests/test_boundaries.py` holds the integrations to it). `journeyman.adapters` is the old
name of this module and still works.

What is here:
- the episode seam (`Episode`): capture a run's calls, join them into histories, settle a run that
  raised by `on_error` (`OnError`, `ErrorReward`, `check_on_error`), and a history's pieces;
- the HTTP timeout a client of the endpoint should use (`CLIENT_TIMEOUT_S`);
- the chat-message helpers (`message_of_choice`, `assistant_key`, ...);
- the "local | URL | LiteLLM id" model spec and its clients, for judges, generators and baselines
  (`resolve_llm`, `complete_json`, `chat_client`, ...);
- where a run's files live (`RunLayout`), and the command lines' parts: options derived from a
  pydantic model's fields (`Fields`, `with_fields`, `ADVANCED`; `BUDGET` and `budget_of`, the
  budget's `--budget-*` options) and the app (`App`: one-line
  errors, `--debug`, whole option names in help); loaded on first use;
- loaded on first use, so that `import journeyman.integrations` stays light (no torch, fastapi or
  matplotlib): `plot_history` (matplotlib), the Langfuse export (`journeyman[langfuse]`) and the
  built-in demo task (`tasks`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from journeyman.chat.messages import Message, assistant_key, message_key, message_of_choice, openai_message
from journeyman.client.protocol import CLIENT_TIMEOUT_S
from journeyman.data.failures import ErrorReward, OnError, check_on_error, is_service_error
from journeyman.data.paths import RunLayout
from journeyman.rewards.llm import (
    DEFAULT_TIMEOUT_S,
    LLM,
    LLMSpec,
    chat_client,
    complete_json,
    resolve_llm,
    spec_label,
)
from journeyman.rollout.episode import CaptureSource, Episode, EpisodeCall
from journeyman.rollout.histories import CallHistory

if TYPE_CHECKING:
    from journeyman.app import tasks
    from journeyman.app.options import ADVANCED, BUDGET, App, Fields, budget_of, with_fields
    from journeyman.app.plot import plot_history
    from journeyman.integrations.langfuse import TRACE_ID_KEY, export_to_langfuse, fetch_review_set

# name -> (module, attribute; None: the module itself), imported when first asked for
_LAZY: dict[str, tuple[str, str | None]] = {
    "plot_history": ("journeyman.app.plot", "plot_history"),
    "tasks": ("journeyman.app.tasks", None),
    "ADVANCED": ("journeyman.app.options", "ADVANCED"),
    "BUDGET": ("journeyman.app.options", "BUDGET"),
    "budget_of": ("journeyman.app.options", "budget_of"),
    "App": ("journeyman.app.options", "App"),
    "Fields": ("journeyman.app.options", "Fields"),
    "with_fields": ("journeyman.app.options", "with_fields"),
    "TRACE_ID_KEY": ("journeyman.integrations.langfuse", "TRACE_ID_KEY"),
    "export_to_langfuse": ("journeyman.integrations.langfuse", "export_to_langfuse"),
    "fetch_review_set": ("journeyman.integrations.langfuse", "fetch_review_set"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


__all__ = [
    "ADVANCED",
    "BUDGET",
    "CLIENT_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "LLM",
    "TRACE_ID_KEY",
    "App",
    "CallHistory",
    "CaptureSource",
    "Episode",
    "EpisodeCall",
    "ErrorReward",
    "Fields",
    "LLMSpec",
    "Message",
    "OnError",
    "RunLayout",
    "assistant_key",
    "budget_of",
    "chat_client",
    "check_on_error",
    "complete_json",
    "export_to_langfuse",
    "fetch_review_set",
    "is_service_error",
    "message_key",
    "message_of_choice",
    "openai_message",
    "plot_history",
    "resolve_llm",
    "spec_label",
    "tasks",
    "with_fields",
]
