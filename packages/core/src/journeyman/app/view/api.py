"""The viewer's JSON API over run directories, and its static files: one `handle` function that the
stdlib server of `journeyman view` and the `/view/` routes of `journeyman serve` both call.

Routes (relative to where the viewer is mounted; every one is a GET and only reads):

    api/runs                                        the runs and their latest numbers
    api/runs/<run>/version                          a fingerprint of the run's files (pages poll it)
    api/runs/<run>/history                          history.jsonl's rows
    api/runs/<run>/steps?split=&offset=&limit=      trajectories files, newest first, a page at a time
    api/runs/<run>/step/<split>/<file>?offset=&limit=   the groups of one file, a page at a time
    api/runs/<run>/trajectory/<split>/<file>/<group>/<index>   one trajectory, messages and tokens
    <anything else>                                 static/<path> (index.html for the root)

A run's files are read as they are, whatever wrote them: every value is taken through the coercions
below (`_str`, `_dict`, `_items`, `_exact_int`, `_float`), so a field of an unexpected JSON type shows as
text or is left out, and never fails a page.
"""

from __future__ import annotations

import json
import math
import mimetypes
import re
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs

from pydantic import BaseModel, Field

from journeyman.app.view.runs import Run, RunFiles, StepFile
from journeyman.app.view.token_text import token_decoder
from journeyman.backends.store import finite  # NaN as null: answers are strict JSON
from journeyman.data.config import DEFAULT_BASE_MODEL
from journeyman.errors import InvalidFieldError
from journeyman.rollout.histories import extends

__all__ = ["Response", "handle"]

MAX_LIMIT = 200
PREVIEW_CHARS = 160
MAX_SAFE_INT = 2**53  # the largest integer a page's JavaScript holds exactly
MAX_TOKEN_ID = 2**32  # the tokenizer's ids are u32: a larger one is no token
# Every answer: scripts, styles and data from the viewer itself only, never framed by another page.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}


@dataclass
class Response:
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


# -- what the pages get -------------------------------------------------------------------------
class RunSummary(BaseModel):
    id: str
    project: str
    name: str
    path: str
    base_model: str | None
    step: int | None = Field(description="the run's committed step (state.json)")
    splits: list[str]
    history_rows: int
    latest: dict[str, float] = Field(description="the newest value of each reward-like metric")
    spend: str = Field(
        default="", description="what the run spent against its budget (spend.json), for people"
    )
    version: str


class StepRow(BaseModel):
    split: str
    name: str = Field(description="the file's name without .jsonl: the step, or step.attempt-<id> ...")
    step: int
    status: str
    size: int
    mtime: float
    metrics: dict[str, Any] = Field(description="the history row of this step and split, if any")


class StepPage(BaseModel):
    split: str
    total: int
    offset: int
    items: list[StepRow]


class TrajectorySummary(BaseModel):
    index: int
    reward: float
    advantage: float
    turns: int = Field(description="assistant turns")
    tool_calls: list[str] = Field(description="names of the tools it called, in order")
    tool_errors: int = Field(description="tool results that read as errors")
    error: str | None = Field(description="the exception type when the run raised")
    preview: str = Field(description="the start of its last assistant turn")
    metrics: dict[str, Any]


class GroupView(BaseModel):
    index: int
    prompt: str = Field(description="the start of the first user message")
    reward_mean: float
    reward_std: float
    trajectories: list[TrajectorySummary]
    exceptions: list[dict[str, str]]
    dropped: int
    metadata: dict[str, Any]


class StepView(BaseModel):
    split: str
    name: str
    step: int
    status: str
    total_groups: int
    offset: int
    groups: list[GroupView]
    metrics: dict[str, Any]


class ToolCallView(BaseModel):
    id: str | None
    name: str
    arguments: str


class MessageView(BaseModel):
    role: str
    content: str
    tool_calls: list[ToolCallView] = Field(default_factory=list)
    tool_call_id: str | None = None
    sampled: bool = Field(default=False, description="an assistant turn the policy sampled (token-recorded)")
    policy_step: int | None = None
    finish_reason: str | None = None
    tokens: int | None = None
    mean_logprob: float | None = None
    error: bool = Field(default=False, description="a tool result that reads as an error")


class TokenRow(BaseModel):
    """One training row as the trainer builds it: prompt ids masked, sampled ids trained."""

    ids: list[int]
    text: list[str] | None = Field(description="each token's text, when a tokenizer is at hand")
    trained: list[bool]
    logprobs: list[float | None]
    teacher_logprobs: list[float | None] | None = Field(
        default=None,
        description="a distillation teacher's logprob of each trained token, when it scored them",
    )


class ErrorView(BaseModel):
    """The exception a rollout raised, as the trajectory recorded it."""

    type: str
    message: str
    traceback: str


class TrajectoryView(BaseModel):
    run: str
    split: str
    file: str
    step: int
    group: int
    index: int
    group_size: int
    reward: float
    advantage: float
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    logs: list[str]
    error: ErrorView | None
    ruler_explanation: str | None
    tools: list[str]
    messages: list[MessageView]
    rows: list[TokenRow]
    trained_tokens: int
    masked_tokens: int


# -- reading: any JSON value to the type a page shows ---------------------------------------------
def _float(x: Any) -> float | None:
    """A finite number as a float (a bool, NaN, infinity or an integer past float's range: None)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        f = float(x)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _num(x: Any) -> float:
    f = _float(x)
    return 0.0 if f is None else f


def _exact_int(x: Any) -> int | None:
    """An integer a page holds exactly, else None."""
    return x if isinstance(x, int) and not isinstance(x, bool) and abs(x) < MAX_SAFE_INT else None


def _str(x: Any) -> str:
    """Text as is; any other JSON value as its JSON text (None: empty)."""
    return x if isinstance(x, str) else "" if x is None else _json(x)


def _opt_str(x: Any) -> str | None:
    return None if x is None else _str(x)


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _items(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _fields(x: Any) -> dict[str, Any]:
    """A free-form object the page lists (metrics, metadata): any other value kept under "value"."""
    return x if isinstance(x, dict) else {} if x is None else {"value": x}


def _mean_std(rewards: list[float]) -> tuple[float, float]:
    """Mean and population std. Rewards near float's limit give inf or NaN (null in the answer), not
    an error: `d * d` overflows to inf where `d ** 2` raises."""
    if not rewards:
        return 0.0, 0.0
    mean = sum(rewards) / len(rewards)
    return mean, math.sqrt(sum((r - mean) * (r - mean) for r in rewards) / len(rewards))


def advantages(rewards: list[float], scale_by_std: bool = True) -> list[float]:
    """GRPO's group advantages as the trainer computes them (`training.loss.group_advantages`,
    `TrainConfig.scale_rewards` on by default): (r - mean) / (std + 1e-6), population std."""
    mean, std = _mean_std(rewards)
    return [(r - mean) / (std + 1e-6) if scale_by_std else r - mean for r in rewards]


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI's content parts: their text
        return "".join(_str(p.get("text")) for p in content if isinstance(p, dict))
    return _str(content)


def _looks_like_error(text: str) -> bool:
    head = text.lstrip()[:200].lower()
    return head.startswith(("error", "traceback", '{"error"')) or "exception" in head[:60]


def _message(item: dict[str, Any]) -> MessageView:
    """A stored message or choice as one message: a choice is its assistant message plus its record."""
    if "message" in item and "finish_reason" in item:
        msg = _dict(item.get("message"))
        rec = _dict(item.get("journeyman"))
        logprobs = [f for f in map(_float, _items(rec.get("logprobs"))) if f is not None]
        return MessageView(
            role=_str(msg.get("role") or "assistant"),
            content=_text(msg.get("content")),
            tool_calls=_tool_calls(msg.get("tool_calls")),
            sampled=bool(rec),
            policy_step=_exact_int(rec.get("step")),
            finish_reason=_opt_str(item.get("finish_reason")),
            tokens=len(_items(rec.get("token_ids"))) if rec else None,
            mean_logprob=sum(logprobs) / len(logprobs) if logprobs else None,
        )
    content = _text(item.get("content"))
    role = _str(item.get("role", "?"))
    return MessageView(
        role=role,
        content=content,
        tool_calls=_tool_calls(item.get("tool_calls")),
        tool_call_id=_opt_str(item.get("tool_call_id")),
        error=role == "tool" and _looks_like_error(content),
    )


def _tool_calls(raw: Any) -> list[ToolCallView]:
    out = []
    for c in _items(raw):
        if not isinstance(c, dict):
            continue
        fn = _dict(c.get("function"))
        out.append(
            ToolCallView(
                id=_opt_str(c.get("id")), name=_str(fn.get("name", "?")), arguments=_str(fn.get("arguments"))
            )
        )
    return out


def _json(x: Any) -> str:
    try:
        return json.dumps(x, ensure_ascii=False)
    except RecursionError:  # parsed near the interpreter's depth limit, too deep to write from here
        return "[nested too deep to show]"


def _token_ids(x: Any) -> list[int]:
    return [i for i in _items(x) if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_TOKEN_ID]


def _records(traj: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        item["journeyman"]
        for item in _items(traj.get("messages_and_choices"))
        if isinstance(item, dict) and isinstance(item.get("journeyman"), dict)
    ]


Scores = list[float | None]


def _rows(records: list[dict[str, Any]]) -> list[tuple[list[int], list[bool], Scores, Scores]]:
    """Records joined into rows by the trainer's rule (`training.rows`): a call whose prompt extends
    the row so far continues it, its new prompt ids masked, its sampled ids trained; beside each
    sampled id its logprob, and its teacher's when a distillation teacher scored it."""
    rows: list[tuple[list[int], list[bool], Scores, Scores]] = []
    for rec in records:
        prompt = _token_ids(rec.get("prompt_token_ids"))
        sampled = _token_ids(rec.get("token_ids"))
        if rows and extends(rows[-1][0], prompt):
            ids, trained, logprobs, teacher = rows[-1]
            new = prompt[len(ids) :]
        else:
            ids, trained, logprobs, teacher = [], [], [], []
            rows.append((ids, trained, logprobs, teacher))
            new = prompt
        ids += new
        trained += [False] * len(new)
        ids += sampled
        trained += [True] * len(sampled)
        for scores, key in ((logprobs, "logprobs"), (teacher, "teacher_logprobs")):
            lps = _items(rec.get(key))
            scores += [None] * len(new)
            scores += [_float(x) for x in lps[: len(sampled)]]
            scores += [None] * (len(sampled) - len(lps))
    return rows


def _summary(i: int, traj: dict[str, Any], advantage: float) -> TrajectorySummary:
    messages = _messages(traj)
    assistant = [m for m in messages if m.role == "assistant"]
    last = next((m for m in reversed(assistant) if m.content), None)
    preview = (last.content if last else "")[:PREVIEW_CHARS]
    error = _error_view(traj.get("error"))
    return TrajectorySummary(
        index=i,
        reward=_num(traj.get("reward")),
        advantage=advantage,
        turns=len(assistant),
        tool_calls=[c.name for m in assistant for c in m.tool_calls],
        tool_errors=sum(m.error for m in messages),
        error=error.type if error else None,
        preview=preview,
        metrics=_fields(traj.get("metrics")),
    )


def _messages(traj: dict[str, Any]) -> list[MessageView]:
    return [_message(m) for m in _items(traj.get("messages_and_choices")) if isinstance(m, dict)]


def _error_view(raw: Any) -> ErrorView | None:
    """The recorded exception: a `{type, message, traceback}` object, or any other value as its text."""
    if raw is None:
        return None
    err = raw if isinstance(raw, dict) else {"message": raw}
    return ErrorView(
        type=_str(err.get("type") or "error"),
        message=_str(err.get("message")),
        traceback=_str(err.get("traceback")),
    )


def _trajectories(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """A line's trajectories: a group's, or the line itself in a file of loose trajectories."""
    if "trajectories" not in raw and "messages_and_choices" in raw:
        return [raw]
    return [t for t in _items(raw.get("trajectories")) if isinstance(t, dict)]


def _group(index: int, raw: dict[str, Any]) -> GroupView:
    trajs = _trajectories(raw)
    rewards = [_num(t.get("reward")) for t in trajs]
    advs = advantages(rewards)
    mean, std = _mean_std(rewards)
    first_user = ""
    if trajs:
        for m in _items(trajs[0].get("messages_and_choices")):
            if isinstance(m, dict) and m.get("role") == "user":
                first_user = _text(m.get("content"))[:PREVIEW_CHARS]
                break
    return GroupView(
        index=index,
        prompt=first_user,
        reward_mean=mean,
        reward_std=std,
        trajectories=[_summary(i, t, a) for i, (t, a) in enumerate(zip(trajs, advs, strict=True))],
        exceptions=[
            {"type": _str(e.get("type")), "message": _str(e.get("message"))[:500]}
            for e in _items(raw.get("exceptions"))
            if isinstance(e, dict)
        ],
        dropped=len(_items(raw.get("dropped"))),
        metadata=_fields(raw.get("metadata")),
    )


def _history_row(run: Run, split: str, step: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for r in run.history():
        if r.get("split") == split and r.get("step") == step:
            row = r  # the last one: an evaluation after training shares the step of the one before
    return row


def _latest(run: Run) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in run.history():
        for k, v in r.items():
            if k.endswith("/reward") and (f := _float(v)) is not None:
                out[k] = f
    return out


def run_summary(run: Run) -> RunSummary:
    state = run.state()
    return RunSummary(
        id=run.id,
        project=run.project,
        name=run.name,
        path=str(run.root),
        base_model=_opt_str(state.get("base_model")),
        step=_exact_int(state.get("step")),
        splits=run.splits(),
        history_rows=len(run.history()),
        latest=_latest(run),
        spend=run.spend(),
        version=run.version(),
    )


def steps_page(run: Run, split: str, offset: int, limit: int) -> StepPage:
    files_ = list(reversed(run.step_files(split)))  # newest first
    page = files_[offset : offset + limit]
    return StepPage(
        split=split,
        total=len(files_),
        offset=offset,
        items=[
            StepRow(
                split=f.split,
                name=f.name,
                step=f.step,
                status=f.status,
                size=f.size,
                mtime=f.mtime_ns / 1e9,
                metrics=_history_row(run, split, f.step) if f.status == "committed" else {},
            )
            for f in page
        ],
    )


def step_view(run: Run, f: StepFile, offset: int, limit: int) -> StepView:
    return StepView(
        split=f.split,
        name=f.name,
        step=f.step,
        status=f.status,
        total_groups=run.count_lines(f),
        offset=offset,
        groups=[_group(offset + i, g) for i, g in enumerate(run.read_lines(f, offset, offset + limit))],
        metrics=_history_row(run, f.split, f.step) if f.status == "committed" else {},
    )


def trajectory_view(run: Run, f: StepFile, group: int, index: int) -> TrajectoryView:
    if not 0 <= group < run.count_lines(f):
        raise InvalidFieldError("group", group, f"{f.name}.jsonl has {run.count_lines(f)} groups")
    raw = run.read_lines(f, group, group + 1)[0]
    trajs = _trajectories(raw) or [raw]
    if not 0 <= index < len(trajs):
        raise InvalidFieldError("index", index, f"group {group} has {len(trajs)} trajectories")
    traj = trajs[index]
    advs = advantages([_num(t.get("reward")) for t in trajs])
    decode = token_decoder(_str(run.state().get("base_model") or DEFAULT_BASE_MODEL))
    rows = []
    for ids, trained, logprobs, teacher in _rows(_records(traj)):
        scored = any(x is not None for x in teacher)
        rows.append(
            TokenRow(
                ids=ids,
                text=decode(ids) if decode else None,
                trained=trained,
                logprobs=logprobs,
                teacher_logprobs=teacher if scored else None,
            )
        )
    metadata = _fields(traj.get("metadata"))
    logs = traj.get("logs")
    return TrajectoryView(
        run=run.id,
        split=f.split,
        file=f.name,
        step=f.step,
        group=group,
        index=index,
        group_size=len(trajs),
        reward=_num(traj.get("reward")),
        advantage=advs[index],
        metrics=_fields(traj.get("metrics")),
        metadata=metadata,
        logs=[_str(x) for x in logs] if isinstance(logs, list) else [_str(logs)] if logs is not None else [],
        error=_error_view(traj.get("error")),
        ruler_explanation=_opt_str(metadata.get("ruler_explanation")),
        tools=[
            _str(_dict(t.get("function")).get("name", "?"))
            for t in _items(traj.get("tools"))
            if isinstance(t, dict)
        ],
        messages=_messages(traj),
        rows=rows,
        trained_tokens=sum(sum(r.trained) for r in rows),
        masked_tokens=sum(len(r.trained) - sum(r.trained) for r in rows),
    )


# -- routing ------------------------------------------------------------------------------------
_STATIC = files("journeyman.app.view") / "static"
_SAFE_STATIC = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9]+)+")


def _json_response(model: BaseModel | list[Any] | dict[str, Any], status: int = 200) -> Response:
    if isinstance(model, BaseModel):
        body = model.model_dump_json().encode()
    else:
        body = json.dumps(model, allow_nan=False, default=str).encode()
    return Response(status, "application/json", body, {"Cache-Control": "no-store"})


def _error(status: int, message: str, field: str | None = None) -> Response:
    return _json_response({"error": {"message": message, "param": field}}, status)


def _int(query: dict[str, list[str]], name: str, default: int, high: int | None = None) -> int:
    raw = query.get(name, [str(default)])[-1]
    try:
        value = int(raw)
    except ValueError:
        raise InvalidFieldError(name, raw, "must be an integer") from None
    if value < 0 or (high is not None and value > high):
        raise InvalidFieldError(name, value, f"must be between 0 and {high}" if high else "must be >= 0")
    return value


def _static(path: str) -> Response:
    name = path or "index.html"
    if not _SAFE_STATIC.fullmatch(name):
        return _error(404, f"no such page: {path}")
    res = _STATIC / name
    if not res.is_file():
        return _error(404, f"no such file: {name}")
    kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if kind.startswith("text/") or kind == "application/javascript":
        kind += "; charset=utf-8"
    return Response(200, kind, res.read_bytes(), {"Cache-Control": "no-cache"})


def _api(runs: RunFiles, parts: list[str], query: dict[str, list[str]]) -> Response:
    if parts == ["runs"]:
        return _json_response([run_summary(r).model_dump() for r in runs.runs()])
    if len(parts) < 3 or parts[0] != "runs":
        return _error(404, "no such route")
    run, what, rest = runs.get(parts[1]), parts[2], parts[3:]
    if what == "version" and not rest:
        return _json_response({"version": run.version()})
    if what == "history" and not rest:
        return _json_response(finite(run.history()))
    if what == "steps" and not rest:
        splits = run.splits()
        split = query.get("split", ["train" if "train" in splits else (splits or ["train"])[0]])[-1]
        if not splits:
            return _json_response(StepPage(split=split, total=0, offset=0, items=[]))
        page = steps_page(run, split, _int(query, "offset", 0), _int(query, "limit", 50, MAX_LIMIT))
        return _json_response(finite(page.model_dump()))
    if what == "step" and len(rest) == 2:
        f = run.step_file(rest[0], rest[1])
        view = step_view(run, f, _int(query, "offset", 0), _int(query, "limit", 50, MAX_LIMIT))
        return _json_response(finite(view.model_dump()))
    if what == "trajectory" and len(rest) == 4:
        f = run.step_file(rest[0], rest[1])
        group = _int({"group": [rest[2]]}, "group", 0)
        index = _int({"index": [rest[3]]}, "index", 0)
        return _json_response(finite(trajectory_view(run, f, group, index).model_dump()))
    return _error(404, "no such route")


def handle(runs: RunFiles, path: str, query_string: str = "") -> Response:
    """The answer to `GET <mount>/<path>?<query_string>` (path without its leading slash)."""
    res = _answer(runs, [p for p in path.split("/") if p], query_string)
    res.headers = {**SECURITY_HEADERS, **res.headers}
    return res


def _answer(runs: RunFiles, parts: list[str], query_string: str) -> Response:
    try:
        if parts[:1] == ["api"]:
            return _api(runs, parts[1:], parse_qs(query_string))
        return _static("/".join(parts))
    except InvalidFieldError as e:
        return _error(404 if e.field in ("run", "step", "split") else 400, str(e), e.field)
    except Exception as e:  # a case the coercions missed: the page says what, the connection stays up
        return _error(500, f"{type(e).__name__}: {e}")
