"""Langfuse trace review: export every trajectory as a trace; train on traces people scored.

    from journeyman.integrations.langfuse import export_to_langfuse, fetch_review_set

    export_to_langfuse()                     # keys from LANGFUSE_PUBLIC_KEY / _SECRET_KEY / _BASE_URL
    ...                                      # gather, train, log: each trajectory becomes a trace
    review = await fetch_review_set(score="human", tags=["journeyman"], score_source="ANNOTATION")
    await model.train(review.groups)

Needs the extra: pip install "journeyman[langfuse]" (Langfuse Python SDK 5.x). The names load on
first use, so the query model and the payload types (no SDK in them) import without the extra, and
a name that needs the SDK says what to install when it is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from journeyman.integrations.langfuse._client import CountingSpanExporter, Credentials, credentials
    from journeyman.integrations.langfuse._export import ExportStats, LangfuseExporter, export_to_langfuse
    from journeyman.integrations.langfuse._import import ReviewSet, fetch_review_set, fetch_trajectory_groups
    from journeyman.integrations.langfuse._outcomes import OutcomeSync, report_scored_outcomes
    from journeyman.integrations.langfuse._query import LangfuseTrace, ReviewQuery, ReviewScore
    from journeyman.integrations.langfuse._wire import (
        GENERATION_NAME,
        GROUP_ID_KEY,
        META_KEY,
        TRACE_ID_KEY,
        GenerationPayload,
        TracePayload,
    )

_WHERE = {
    "_client": ("CountingSpanExporter", "Credentials", "credentials"),
    "_export": ("ExportStats", "LangfuseExporter", "export_to_langfuse"),
    "_import": ("ReviewSet", "fetch_review_set", "fetch_trajectory_groups"),
    "_outcomes": ("OutcomeSync", "report_scored_outcomes"),
    "_query": ("LangfuseTrace", "ReviewQuery", "ReviewScore"),
    "_wire": (
        "GENERATION_NAME",
        "GROUP_ID_KEY",
        "META_KEY",
        "TRACE_ID_KEY",
        "GenerationPayload",
        "TracePayload",
    ),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


__all__ = [
    "GENERATION_NAME",
    "GROUP_ID_KEY",
    "META_KEY",
    "TRACE_ID_KEY",
    "CountingSpanExporter",
    "Credentials",
    "ExportStats",
    "GenerationPayload",
    "LangfuseExporter",
    "LangfuseTrace",
    "OutcomeSync",
    "ReviewQuery",
    "ReviewScore",
    "ReviewSet",
    "TracePayload",
    "credentials",
    "export_to_langfuse",
    "fetch_review_set",
    "fetch_trajectory_groups",
    "report_scored_outcomes",
]
