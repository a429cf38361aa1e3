"""Langfuse trace review: export every trajectory as a trace; train on traces people scored.

    from journeyman.integrations.langfuse import export_to_langfuse, fetch_review_set

    export_to_langfuse()                     # keys from LANGFUSE_PUBLIC_KEY / _SECRET_KEY / _BASE_URL
    ...                                      # gather, train, log: each trajectory becomes a trace
    review = await fetch_review_set(score="human", tags=["journeyman"], score_source="ANNOTATION")
    await model.train(review.groups)

Needs the extra: pip install "journeyman[langfuse]" (Langfuse Python SDK 5.x).
"""

from journeyman.integrations.langfuse._client import CountingSpanExporter, Credentials, credentials
from journeyman.integrations.langfuse._export import ExportStats, LangfuseExporter, export_to_langfuse
from journeyman.integrations.langfuse._import import (
    LangfuseTrace,
    ReviewScore,
    ReviewSet,
    fetch_review_set,
    fetch_trajectory_groups,
)
from journeyman.integrations.langfuse._wire import (
    GENERATION_NAME,
    GROUP_ID_KEY,
    META_KEY,
    TRACE_ID_KEY,
    GenerationPayload,
    TracePayload,
)

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
    "ReviewScore",
    "ReviewSet",
    "TracePayload",
    "credentials",
    "export_to_langfuse",
    "fetch_review_set",
    "fetch_trajectory_groups",
]
