"""Langfuse traces back into TrajectoryGroups ready for `model.train`, rewarded by their scores.

    roots (v2 observations: filter by tags, trace name, time)  ->  trace ids
    scores (v3 scores: by name, source, annotation queue)     ->  reward per trace (combined)
    observations of each scored trace (v2, full metadata)      ->  Trajectory
    group by a key (our group id, a metadata key, the session) ->  TrajectoryGroups

Traces exported by Journeyman carry their exact token records and rebuild identically. Any other
trace is rebuilt from its generations' messages and flagged `metadata["retokenized"] = True`: the
trainer tokenises those messages itself (old-policy logprobs unknown, so the ratio starts at 1).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, Field, ValidationError
from tqdm.auto import tqdm

from journeyman.chat.messages import ROLES, Message, text_of
from journeyman.data.types import History, Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError
from journeyman.integrations.langfuse import _wire
from journeyman.integrations.langfuse._client import credentials, read_api
from journeyman.integrations.langfuse._query import (
    Combine,
    GroupBy,
    LangfuseTrace,
    ReviewQuery,
    ReviewScore,
)
from journeyman.rollout.capture import CapturedCall
from journeyman.rollout.histories import join_calls, trajectory_of

try:
    from langfuse import Langfuse
    from langfuse.api import LangfuseAPI
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise ImportError('Langfuse support needs the extra: pip install "journeyman[langfuse]"') from e

log = logging.getLogger("journeyman.langfuse")

OBSERVATION_FIELDS = "core,basic,io,metadata,model,usage,trace_context"
SCORE_FIELDS = "details,subject,annotation"


class ReviewSet(BaseModel):
    """The groups to train on, and an account of every trace that did not make it."""

    groups: list[TrajectoryGroup]
    traces: int = Field(description="traces that matched the filter")
    trajectories: int = Field(description="trajectories in `groups`")
    retokenized: int = Field(description="trajectories rebuilt from messages (no exact token records)")
    skipped: dict[str, int] = Field(
        default_factory=dict,
        description="traces left out, by reason: no score, score not numeric, no policy generation, unreadable, no group key, group of one",
    )

    def summary(self) -> str:
        kept = f"{self.trajectories} trajectories in {len(self.groups)} groups from {self.traces} traces"
        extra = f", {self.retokenized} re-tokenised" if self.retokenized else ""
        skipped = (
            "; skipped: " + ", ".join(f"{n} {why}" for why, n in self.skipped.items()) if self.skipped else ""
        )
        return kept + extra + skipped


def _combine(scores: list[ReviewScore], how: Combine) -> float | None:
    usable = sorted((s for s in scores if s.value is not None), key=lambda s: s.timestamp)
    if callable(how):
        return how(usable) if usable else None
    if not usable:
        return None
    values = [s.value for s in usable if s.value is not None]
    if how == "mean":
        return statistics.fmean(values)
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    if how == "sum":
        return math.fsum(values)
    if how == "latest":
        return values[-1]
    if how == "first":
        return values[0]
    raise InvalidFieldError(
        "combine", how, "use mean, min, max, sum, latest, first or a function of the scores"
    )


def _score(raw: Any, categories: Mapping[str, float] | None) -> ReviewScore | None:
    subject = getattr(raw, "subject", None)
    if subject is None:
        return None
    kind = getattr(subject, "kind", None)
    if kind == "trace":
        trace_id, obs_id = subject.id, None
    elif kind == "observation" and getattr(subject, "trace_id", None):
        trace_id, obs_id = subject.trace_id, subject.id
    else:
        return None
    dtype = str(getattr(raw, "data_type", "NUMERIC")).upper()
    value: float | None = None
    if dtype == "BOOLEAN":
        value = 1.0 if raw.value else 0.0
    elif dtype == "NUMERIC":
        value = float(raw.value)
    elif dtype == "CATEGORICAL" and categories is not None:
        value = categories.get(str(raw.value))
    if value is not None and not math.isfinite(value):
        value = None
    return ReviewScore(
        name=raw.name,
        value=value,
        raw=raw.value,
        data_type=dtype,
        source=str(raw.source),
        trace_id=trace_id,
        observation_id=obs_id,
        timestamp=raw.timestamp,
        queue_id=getattr(raw, "queue_id", None),
        author_user_id=getattr(raw, "author_user_id", None),
        comment=getattr(raw, "comment", None),
    )


def _pages(call: Callable[..., Any], **kwargs: Any) -> Iterator[Any]:
    cursor = None
    while True:
        page = call(cursor=cursor, **kwargs)
        yield from page.data
        cursor = page.meta.cursor
        if not cursor or not page.data:
            return


def _root_filter(q: ReviewQuery) -> str:
    conditions: list[dict[str, Any]] = [
        {"type": "boolean", "column": "isRootObservation", "operator": "=", "value": True}
    ]
    if q.tags:
        conditions.append(
            {"type": "arrayOptions", "column": "traceTags", "operator": "all of", "value": q.tags}
        )
    if q.name:
        conditions.append({"type": "string", "column": "traceName", "operator": "=", "value": q.name})
    if q.since:
        conditions.append(
            {"type": "datetime", "column": "startTime", "operator": ">=", "value": q.since.isoformat()}
        )
    if q.until:
        conditions.append(
            {"type": "datetime", "column": "startTime", "operator": "<", "value": q.until.isoformat()}
        )
    if q.environment:
        conditions.append(
            {"type": "stringOptions", "column": "environment", "operator": "any of", "value": [q.environment]}
        )
    return json.dumps(conditions)


# -- rebuilding ------------------------------------------------------------------------------------


def _decoded_meta(obs: Any) -> dict[str, Any]:
    return {k: _wire.decode(v) for k, v in (getattr(obs, "metadata", None) or {}).items()}


def _ours(observations: list[Any], reward: float) -> Trajectory | None:
    """Exact rebuild from the payloads an export wrote; None when they are missing or unreadable."""
    payload: _wire.TracePayload | None = None
    gens: dict[int, _wire.GenerationPayload] = {}
    for obs in observations:
        meta = _decoded_meta(obs).get(_wire.META_KEY)
        if not isinstance(meta, dict):
            continue
        try:
            if "histories" in meta and payload is None:
                payload = _wire.TracePayload.model_validate(meta)
            elif "choice" in meta and str(obs.type).upper() == "GENERATION":
                g = _wire.GenerationPayload.model_validate(meta)
                gens[g.choice] = g
        except ValidationError as e:
            log.debug("unreadable journeyman payload on observation %s: %s", obs.id, e)
    if payload is None:
        return None
    exact = all(
        gens.get(k) is not None and gens[k].record is not None
        for k in range(sum(len(h.choice_positions) for h in payload.histories))
    )
    histories: list[History] = []
    k = 0
    for layout in payload.histories:
        items: list[Message | Choice] = list(layout.messages)
        for pos in layout.choice_positions:
            g = gens.get(k)
            if exact and g is not None and g.record is not None:
                items[pos] = Choice.model_validate(
                    {
                        "index": g.index,
                        "finish_reason": g.finish_reason,
                        "message": layout.messages[pos],
                        "logprobs": None,
                        "journeyman": g.record.model_dump(mode="json"),
                    }
                )
            k += 1
        histories.append(History(messages_and_choices=items, tools=layout.tools, trainable=layout.trainable))
    main = histories[0]
    trajectory = Trajectory(
        messages_and_choices=main.messages_and_choices,
        tools=main.tools,
        reward=reward,
        metrics=payload.metrics,
        metadata={**payload.metadata, "retokenized": not exact},
        logs=payload.logs,
        additional_histories=histories[1:],
    )
    if payload.start_time:
        trajectory.start_time = payload.start_time
    return trajectory


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    out = []
    for call in calls or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            continue
        args = fn.get("arguments", "{}")
        out.append(
            {
                "id": call.get("id") or f"call_{len(out)}",
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    return out


def _message(m: Any) -> Message | None:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        return None
    # text only (content parts joined): an image cannot be trained on by a text model (trace unreadable)
    out: Message = {"role": m["role"], "content": text_of(m.get("content"))}
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = _tool_calls(m["tool_calls"])
    if m["role"] == "tool" and m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _request(value: Any) -> tuple[list[Message], list[dict[str, Any]] | None] | None:
    value = _wire.decode(value)
    tools = None
    if isinstance(value, dict) and "messages" in value:
        tools = value.get("tools")
        value = value["messages"]
    if isinstance(value, str):
        return [{"role": "user", "content": value}], tools
    if isinstance(value, list):
        msgs = [_message(m) for m in value]
        if msgs and all(m is not None for m in msgs):
            return [m for m in msgs if m is not None], tools
    return None


def _reply(value: Any) -> Message | None:
    value = _wire.decode(value)
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, list) and value:
        value = value[-1]
    if isinstance(value, dict):
        if value.get("choices"):
            value = value["choices"][0]
        if isinstance(value.get("message"), dict):
            value = value["message"]
        if "content" in value or "tool_calls" in value:
            return _message({**value, "role": "assistant"})
    return None


def _foreign(observations: list[Any], reward: float, generation_name: str | None) -> Trajectory | None:
    """Rebuild from generation messages, joined into histories by their messages (no token records)."""
    gens = [
        o
        for o in observations
        if str(o.type).upper() == "GENERATION" and (generation_name is None or o.name == generation_name)
    ]
    calls: list[CapturedCall] = []
    for g in sorted(gens, key=lambda o: o.start_time):
        request, reply = _request(g.input), _reply(g.output)
        if request is None or reply is None:
            continue
        messages, tools = request
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        choice = {"index": 0, "finish_reason": finish, "message": reply, "logprobs": None}
        calls.append(
            CapturedCall(
                request_messages=messages, tools=tools, response={"choices": [choice]}, response_id=None
            )
        )
    if not calls:
        return None
    return trajectory_of(join_calls(calls, exact=False), reward=reward, metadata={"retokenized": True})


# -- the fetch -------------------------------------------------------------------------------------


def _api(
    client: Langfuse | LangfuseAPI | None, public_key: str | None, secret_key: str | None, host: str | None
) -> LangfuseAPI:
    if isinstance(client, LangfuseAPI):
        return client
    if client is not None:
        return client.api
    return read_api(credentials(public_key, secret_key, host))


def scored_traces(
    q: ReviewQuery, api: LangfuseAPI, fields: str = "core,basic,trace_context"
) -> tuple[dict[str, Any], dict[str, list[ReviewScore]], dict[str, float], Counter[str]]:
    """The traces `q` matches, one root observation each (with `fields`), their scores by name (and
    source / annotation queue), the reward each combines to, and the traces left out, by reason."""
    names = q.score
    sources = q.score_source or []
    skipped: Counter[str] = Counter()

    # 1. the traces: one root observation each (a trace may have several roots; keep the first)
    roots: dict[str, Any] = {}
    for obs in _pages(api.observations.get_many, fields=fields, filter=_root_filter(q), limit=1000):
        if obs.trace_id and obs.trace_id not in roots:
            roots[obs.trace_id] = obs
            if q.limit is not None and len(roots) >= q.limit:
                break
    trace_ids = list(roots)

    # 2. their scores
    scores: dict[str, list[ReviewScore]] = {}
    for i in range(0, len(trace_ids), 50):
        chunk = trace_ids[i : i + 50]
        for raw in _pages(
            api.scores.get_many,
            name=",".join(names),
            trace_id=",".join(chunk),
            source=",".join(sources) or None,
            queue_id=q.queue_id,
            fields=SCORE_FIELDS,
            limit=100,
        ):
            s = _score(raw, q.categories)
            if s is not None and s.trace_id in roots and s.name in names:
                scores.setdefault(s.trace_id, []).append(s)
    rewards: dict[str, float] = {}
    for tid in trace_ids:
        if tid not in scores:
            skipped["no score"] += 1
            continue
        value = _combine(scores[tid], q.combine)
        if value is None or not math.isfinite(value):
            skipped["score not numeric"] += 1
            continue
        rewards[tid] = float(value)
    return roots, scores, rewards, skipped


def _fetch(q: ReviewQuery, api: LangfuseAPI, progress: bool, concurrency: int) -> ReviewSet:
    roots, scores, rewards, skipped = scored_traces(q, api)

    # 3. every observation of each scored trace, with our payloads unabridged
    expand = ",".join(dict.fromkeys([_wire.META_KEY, *([q.group_by] if isinstance(q.group_by, str) else [])]))

    def load(tid: str) -> list[Any]:
        return list(
            _pages(
                api.observations.get_many,
                trace_id=tid,
                fields=OBSERVATION_FIELDS,
                expand_metadata=expand,
                limit=1000,
            )
        )

    built: list[tuple[LangfuseTrace, Trajectory]] = []
    with (
        ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool,
        tqdm(total=len(rewards), desc="langfuse", unit="trace", disable=not progress) as bar,
    ):
        for tid, observations in zip(rewards, pool.map(load, list(rewards)), strict=True):
            bar.update(1)
            root = roots[tid]
            root_obs = next((o for o in observations if o.id == root.id), root)
            trace = LangfuseTrace(
                id=tid,
                name=root.trace_name or root.name,
                tags=list(root.tags or []),
                session_id=root.session_id,
                timestamp=root.start_time,
                metadata=_decoded_meta(root_obs),
                scores=scores[tid],
            )
            try:
                traj = _ours(observations, rewards[tid]) or _foreign(
                    observations, rewards[tid], q.generation_name
                )
            except (ValidationError, InvalidFieldError, ValueError, TypeError) as e:
                log.debug("trace %s unreadable: %s", tid, e)
                skipped["unreadable"] += 1
                continue
            if traj is None:
                skipped["no policy generation"] += 1
                continue
            traj.metadata[_wire.TRACE_ID_KEY] = tid
            traj.metadata["langfuse_scores"] = [
                {"name": s.name, "value": s.value, "source": s.source} for s in trace.scores
            ]
            if traj.metadata.get("retokenized"):
                for k, v in trace.metadata.items():
                    if k != _wire.META_KEY and isinstance(v, str | int | float | bool):
                        traj.metadata.setdefault(k, v)
            built.append((trace, traj))

    # 4. groups, in the order their first trace started
    grouped: dict[str, list[tuple[LangfuseTrace, Trajectory]]] = {}
    for trace, traj in sorted(built, key=lambda b: b[0].timestamp):
        key = _group_key(q.group_by, trace, traj)
        if key is None:
            skipped["no group key"] += 1
            continue
        grouped.setdefault(key, []).append((trace, traj))
    groups: list[TrajectoryGroup] = []
    for key, members in grouped.items():
        if len(members) < q.min_group_size:
            skipped["group of one" if len(members) == 1 else f"group smaller than {q.min_group_size}"] += len(
                members
            )
            continue
        trajs = [t for _, t in sorted(members, key=lambda m: (_index(m[0]), m[0].timestamp))]
        groups.append(TrajectoryGroup(trajs, metadata={"group_key": key, "source": "langfuse"}))
    n = sum(len(g.trajectories) for g in groups)
    retok = sum(1 for g in groups for t in g.trajectories if t.metadata.get("retokenized"))
    if retok:
        log.warning(
            "%d of %d trajectories were rebuilt from messages (not exported by Journeyman, or their token "
            "records were lost): metadata['retokenized'] = True, the trainer tokenises them itself",
            retok,
            n,
        )
    return ReviewSet(
        groups=groups, traces=len(roots), trajectories=n, retokenized=retok, skipped=dict(skipped)
    )


def _index(trace: LangfuseTrace) -> int:
    payload = trace.metadata.get(_wire.META_KEY)
    return int(payload.get("index", 0)) if isinstance(payload, dict) else 0


def _group_key(group_by: GroupBy, trace: LangfuseTrace, traj: Trajectory) -> str | None:
    if callable(group_by):
        key = group_by(trace, traj)
        return None if key is None else str(key)
    if group_by is None:
        payload = trace.metadata.get(_wire.META_KEY)
        if isinstance(payload, dict) and payload.get("group_id"):
            return str(payload["group_id"])
        return trace.session_id
    if group_by == "session_id":
        return trace.session_id
    if group_by == "trace_name":
        return trace.name
    for source in (traj.metadata, trace.metadata):
        if source.get(group_by) is not None:
            return str(source[group_by])
    return None


async def fetch_review_set(
    query: ReviewQuery | None = None,
    *,
    client: Langfuse | LangfuseAPI | None = None,
    public_key: str | None = None,
    secret_key: str | None = None,
    host: str | None = None,
    progress: bool = True,
    concurrency: int = 8,
    **filters: Any,
) -> ReviewSet:
    """Fetch scored traces and rebuild them as TrajectoryGroups, with an account of what was skipped.

    `query` (a `ReviewQuery`), or its fields as keywords (`score="human", tags=["journeyman"]`; given
    with a query, they replace its fields), says which traces count: tags, trace name, start time,
    environment; the score(s) that become the reward and how several combine (categorical scores
    need `categories`, boolean scores are 1/0; `score_source="ANNOTATION"` keeps human review only,
    `queue_id` one annotation queue); and how trajectories group (by default the group an export
    recorded, else the Langfuse session; groups smaller than `min_group_size` are skipped, as GRPO
    compares rollouts within a group). Each field's description says the rest.

    Keys and host come from the arguments or LANGFUSE_* (or pass a `client`); `concurrency` traces
    are read at once.
    """
    q = _query(query, filters)
    api = _api(client, public_key, secret_key, host)
    return await asyncio.to_thread(_fetch, q, api, progress, concurrency)


def _query(query: ReviewQuery | None, filters: Mapping[str, Any]) -> ReviewQuery:
    if query is None:
        return ReviewQuery(**filters)
    if not filters:
        return query
    return ReviewQuery(**{**dict(query), **filters})  # fields as they are: a function stays a function


async def fetch_trajectory_groups(query: ReviewQuery | None = None, **kwargs: Any) -> list[TrajectoryGroup]:
    """`fetch_review_set(...)` returning just the groups (what was skipped is logged)."""
    review = await fetch_review_set(query, **kwargs)
    log.info("Langfuse review set: %s", review.summary())
    return review.groups
