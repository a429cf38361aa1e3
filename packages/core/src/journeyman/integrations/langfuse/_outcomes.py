"""Langfuse scores as live outcomes: a person (or an evaluator) scores a trace in Langfuse, and the
live episode that trace records gets that score as its reward (`model.report_outcome`).

The link is the episode id: the agent puts the id it sends as `x-journeyman-capture` (`model.episode()`
yields it) on its Langfuse trace, as the session id (the default), as the trace id, or as a metadata
key of the trace's root observation. Reporting is idempotent, so this can run on a timer: a trace
already reported comes back as a duplicate; one whose score changed after it was reported is
counted, not reported (an outcome is final, as `report_outcome` says).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from journeyman.errors import InvalidFieldError
from journeyman.integrations.langfuse._import import _api, _decoded_meta, _query, scored_traces
from journeyman.integrations.langfuse._query import ReviewQuery

if TYPE_CHECKING:
    from langfuse import Langfuse
    from langfuse.api import LangfuseAPI

    from journeyman.data.live_types import OutcomeReceipt

ROOT_FIELDS = "core,basic,trace_context"


ReportOutcome = Callable[..., Awaitable["OutcomeReceipt"]]
"""`model.report_outcome` (episode id, reward, metrics=, group=), or a backend's bound to a model."""


class OutcomeSync(BaseModel):
    """What one `report_scored_outcomes` call did."""

    traces: int = Field(description="traces that matched the query")
    reported: int = Field(description="outcomes accepted now")
    duplicates: int = Field(description="outcomes reported before, the same again (nothing changed)")
    skipped: dict[str, int] = Field(
        default_factory=dict,
        description="traces not reported, by reason: no score, score not numeric, no episode id, not a "
        "live episode, expired, outcome already final",
    )


def _pick(root: Any, key: str) -> str | None:
    """The value `key` names on a trace's root observation: its session id, its trace id, its
    trace name, or a metadata key."""
    if key == "session_id":
        value = root.session_id
    elif key == "trace_id":
        value = root.trace_id
    elif key == "trace_name":
        value = root.trace_name or root.name
    else:
        value = _decoded_meta(root).get(key)
    return None if value is None or value == "" else str(value)


def _why(e: InvalidFieldError) -> str:
    if e.field == "reward":
        return "outcome already final"
    return "expired" if e.reason.startswith("expired") else "not a live episode"


async def report_scored_outcomes(
    report: ReportOutcome,
    query: ReviewQuery | None = None,
    *,
    episode_from: str = "session_id",
    group_from: str | None = None,
    client: Langfuse | LangfuseAPI | None = None,
    public_key: str | None = None,
    secret_key: str | None = None,
    host: str | None = None,
    **filters: Any,
) -> OutcomeSync:
    """Report the scored traces `query` matches as live outcomes, through `report` (a model's
    `report_outcome`: `await report_scored_outcomes(model.report_outcome, score="human")`).

    `query` (or its fields as keywords: `score="human", score_source="ANNOTATION"`) says which
    traces and which scores, as for `fetch_review_set`; the reward is the scores combined. The
    episode id is read from `episode_from` ("session_id", "trace_id", "trace_name" or a metadata key
    of the root observation); `group_from`, read the same way, is the outcome's group key (None: no
    group). Each numeric score also goes on the trajectory as a metric `langfuse/<name>`.
    """
    q = _query(query, filters)
    api = _api(client, public_key, secret_key, host)
    fields = (
        ROOT_FIELDS
        if {episode_from, group_from} <= {"session_id", "trace_id", "trace_name", None}
        else (ROOT_FIELDS + ",metadata")
    )
    roots, scores, rewards, skipped = await asyncio.to_thread(scored_traces, q, api, fields)
    counts: Counter[str] = Counter(skipped)
    reported = duplicates = 0
    for tid, reward in rewards.items():
        episode = _pick(roots[tid], episode_from)
        if episode is None:
            counts["no episode id"] += 1
            continue
        metrics = {f"langfuse/{s.name}": s.value for s in scores[tid] if s.value is not None}
        group = None if group_from is None else _pick(roots[tid], group_from)
        try:
            receipt = await report(episode, reward, metrics=metrics, group=group)
        except InvalidFieldError as e:
            counts[_why(e)] += 1
            continue
        if receipt.status == "duplicate":
            duplicates += 1
        else:
            reported += 1
    return OutcomeSync(traces=len(roots), reported=reported, duplicates=duplicates, skipped=dict(counts))
