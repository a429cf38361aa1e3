"""Trajectories to training rows: exact sampled ids trained, everything else masked.

A row is one token sequence. Consecutive calls of a history join one row when the later call's
prompt starts with the row so far (`histories.extends`, the rule that also joins captured calls
into histories: the endpoint splices sampled turns, so a multi-turn tool run is one row); a call
that does not extend it starts a new row: with a template that rewrites history (Qwen3 drops earlier
reasoning, Mistral moves the tool list) that is every call whose prompt the rewrite changed, each
trained on exactly the ids it was sampled from. Such rows share their prompt's start (system, tools,
first turns), which the trainer runs once per micro-batch (`packing.pack_rows`); what they cost is
the rest of each prompt run again. Additional histories are rows of their own. Histories
with no token records (e.g. imported traces) are rendered with the chat template, their assistant
turns trained as re-tokenised text (flagged, old logprobs unknown).

A row longer than the trainer's limit is fitted between sampled turns (`fit_rows`): by default
split into rows that each end on a sampled turn, so the last turns of a long agent run, where it
reaches its outcome, are trained rather than cut off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from journeyman.chat.formats import ChatFormat
from journeyman.chat.messages import normalize_messages
from journeyman.data.config import LongRows
from journeyman.data.types import History, TokenRecord, Trajectory
from journeyman.errors import NoTrainableTokensError, TeacherLogprobsError
from journeyman.rollout.histories import extends

__all__ = [
    "LONG_ROW_METRICS",
    "Row",
    "check_teacher_logprobs",
    "fit_rows",
    "history_rows",
    "trajectory_rows",
    "truncate_rows",
]

NAN = math.nan


@dataclass
class Row:
    input_ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    # log π_rollout of each trained token (NaN where unknown: re-tokenised turns, prompt tokens)
    rollout_logprobs: list[float] = field(default_factory=list)
    advantage: float = 0.0
    retokenized: bool = False
    # log π_teacher of each trained token (on-policy distillation; NaN where none was scored)
    teacher_logprobs: list[float] = field(default_factory=list)

    def extend(
        self,
        ids: list[int],
        trained: bool,
        logprobs: list[float] | None = None,
        teacher: list[float] | None = None,
    ) -> None:
        self.input_ids += ids
        self.trained += [trained] * len(ids)
        self.rollout_logprobs += logprobs if logprobs is not None else [NAN] * len(ids)
        self.teacher_logprobs += teacher if teacher is not None else [NAN] * len(ids)

    @property
    def num_trained(self) -> int:
        return sum(self.trained)


def _rows_from_records(records: list[TokenRecord]) -> list[Row]:
    rows: list[Row] = []
    row: Row | None = None
    for rec in records:
        prompt = rec.prompt_token_ids
        if row is not None and extends(row.input_ids, prompt):
            row.extend(prompt[len(row.input_ids) :], trained=False)
        else:
            row = Row()
            rows.append(row)
            row.extend(prompt, trained=False)
        row.extend(rec.token_ids, trained=True, logprobs=rec.logprobs, teacher=rec.teacher_logprobs)
    return rows


def _rows_from_messages(history: History, chat_format: ChatFormat) -> list[Row]:
    """Render a conversation without token records; assistant turns are trained as re-tokenised text.

    Each assistant turn is what the template writes after its generation prompt, up to its stop
    token; turns join one row while the template keeps earlier turns as they were (the same rule as
    for records), else a new row starts.
    """
    messages = normalize_messages(history.messages())
    tools = history.tools
    stops = [chat_format.decode([i]) for i in chat_format.stop_ids]
    rows: list[Row] = []
    so_far: str | None = None
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = chat_format.render(messages[:k], tools, True)
        full = chat_format.render(messages[: k + 1], tools, False)
        if not full.startswith(prompt):
            continue  # the template writes this turn unlike a sample (nothing honest to train)
        turn = full[len(prompt) :]
        end = max((turn.rfind(t) + len(t) for t in stops if t and t in turn), default=len(turn))
        if so_far is not None and prompt.startswith(so_far):
            rows[-1].extend(chat_format.encode(prompt[len(so_far) :]), trained=False)
        else:
            rows.append(Row(retokenized=True))
            rows[-1].extend(chat_format.encode(prompt), trained=False)
        rows[-1].extend(chat_format.encode(turn[:end]), trained=True)
        so_far = prompt + turn[:end]
    return rows


def history_rows(history: History, chat_format: ChatFormat) -> list[Row]:
    records = history.records()
    if records:
        return _rows_from_records(records)
    return _rows_from_messages(history, chat_format)


def trajectory_rows(
    trajectory: Trajectory, chat_format: ChatFormat, advantage: float, where: str = "trajectory"
) -> list[Row]:
    """All rows of one trajectory (its main history, then trainable additional histories)."""
    histories: list[History] = [trajectory, *[h for h in trajectory.additional_histories if h.trainable]]
    rows = [row for h in histories for row in history_rows(h, chat_format)]
    if not any(r.num_trained for r in rows):
        raise NoTrainableTokensError(
            where,
            f"{len(trajectory.messages_and_choices)} messages",
            "has no sampled assistant tokens to train on",
        )
    for r in rows:
        r.advantage = advantage
    return rows


def check_teacher_logprobs(rows: Sequence[Row], where: str) -> None:
    """Every trained token of `rows` has a finite teacher logprob, else `TeacherLogprobsError`
    naming the trajectory and the token (distillation trains on nothing else)."""
    for r in rows:
        for k, (trained, lp) in enumerate(zip(r.trained, r.teacher_logprobs, strict=True)):
            if trained and not math.isfinite(lp):
                why = (
                    "was re-tokenised from text (no token records): distillation needs the sampled ids"
                    if r.retokenized
                    else "has no teacher logprob: score the groups with the teacher first "
                    "(TrainConfig.distill does so on the backend)"
                )
                raise TeacherLogprobsError(f"{where}.token[{k}]", lp, why)


def truncate_rows(rows: Sequence[Row], max_seq_len: int) -> int:
    """Cut rows longer than `max_seq_len` tokens in place; returns how many were cut."""
    truncated = 0
    for r in rows:
        if len(r.input_ids) > max_seq_len:
            truncated += 1
            del r.input_ids[max_seq_len:], r.trained[max_seq_len:], r.rollout_logprobs[max_seq_len:]
            del r.teacher_logprobs[max_seq_len:]
    return truncated


LONG_ROW_METRICS = (
    "rows_over_limit",  # rows longer than max_seq_len
    "rows_from_long",  # the rows they became
    "rows_truncated",  # rows cut at max_seq_len (cut_end, or a turn too long to fit after the prefix)
    "trained_tokens_dropped",  # sampled tokens trained in no row
    "context_tokens_dropped",  # earlier turns a fitted row does not hold, summed over rows
)


def fit_rows(rows: Sequence[Row], max_seq_len: int, policy: LongRows) -> tuple[list[Row], dict[str, float]]:
    """Rows no longer than `max_seq_len`: those that fit as they are, a longer one fitted by `policy`
    (`TrainConfig.long_rows` states the policies), cut only between sampled turns. Returns the rows,
    in order, and the counts of `LONG_ROW_METRICS`.

    A row is its prompt prefix (every token before the first trained one: system, tools, first user
    message), then turns: the untrained tokens since the previous sampled run (a tool result, the
    template's scaffolding) and one sampled run of trained tokens. A fitted row is the prefix, then
    consecutive whole turns, the earliest of them untrained context, ending on a sampled token."""
    out: list[Row] = []
    counts: dict[str, float] = dict.fromkeys(LONG_ROW_METRICS, 0.0)
    for row in rows:
        if len(row.input_ids) <= max_seq_len:
            out.append(row)
            continue
        counts["rows_over_limit"] += 1
        prefix, turns = _turns(row)
        room = max_seq_len - prefix
        if policy == "cut_end" or not turns or room < max(end - start for start, end in turns):
            fitted = [
                Row(
                    row.input_ids[:max_seq_len],
                    row.trained[:max_seq_len],
                    row.rollout_logprobs[:max_seq_len],
                    row.advantage,
                    row.retokenized,
                    row.teacher_logprobs[:max_seq_len],
                )
            ]
            counts["rows_truncated"] += 1
        else:
            plans = _split(turns, room) if policy == "split" else _keep_end(turns, room)
            fitted = [_slice(row, prefix, turns, *plan) for plan in plans]
            counts["context_tokens_dropped"] += sum(turns[context][0] - prefix for context, _, _ in plans)
        counts["trained_tokens_dropped"] += row.num_trained - sum(r.num_trained for r in fitted)
        counts["rows_from_long"] += len(fitted)
        out += fitted
    return out, counts


def _turns(row: Row) -> tuple[int, list[tuple[int, int]]]:
    """(prefix length, turns): each turn (start, end) runs from the end of the sampled run before it
    (the prefix's end for the first) to the end of its own sampled run."""
    t = row.trained
    ends = [i + 1 for i in range(len(t)) if t[i] and (i + 1 == len(t) or not t[i + 1])]
    if not ends:
        return len(t), []
    prefix = t.index(True)
    return prefix, list(zip([prefix, *ends[:-1]], ends, strict=True))


def _slice(row: Row, prefix: int, turns: list[tuple[int, int]], context: int, first: int, stop: int) -> Row:
    """The prefix, turns [context, first) as untrained context, then turns [first, stop) as in
    `row`; their rollout logprobs kept only when no turn between the prefix and them is left out."""
    out = Row(advantage=row.advantage, retokenized=row.retokenized)
    out.extend(row.input_ids[:prefix], trained=False)
    if context < first:
        out.extend(row.input_ids[turns[context][0] : turns[first - 1][1]], trained=False)
    start, end = turns[first][0], turns[stop - 1][1]
    out.input_ids += row.input_ids[start:end]
    out.trained += row.trained[start:end]
    out.rollout_logprobs += row.rollout_logprobs[start:end] if context == 0 else [NAN] * (end - start)
    # kept whatever was dropped: with the student's rollout logprob, the teacher's is what the sampled
    # token was worth after its whole context, the advantage this token earned
    out.teacher_logprobs += row.teacher_logprobs[start:end]
    return out


def _split(turns: list[tuple[int, int]], room: int) -> list[tuple[int, int, int]]:
    """(context, first, stop) per row: the first row the row's exact start (the whole turns that
    fit); each later one the next turns (at least one) within half the room, after as many of the
    latest earlier turns as fit in the rest."""
    plans: list[tuple[int, int, int]] = []
    first = 0
    while first < len(turns):
        budget = room if first == 0 else room - room // 2
        stop, size = first + 1, _len(turns[first])
        while stop < len(turns) and size + _len(turns[stop]) <= budget:
            size += _len(turns[stop])
            stop += 1
        context = first
        while context > 0 and size + _len(turns[context - 1]) <= room:
            context -= 1
            size += _len(turns[context])
        plans.append((context, first, stop))
        first = stop
    return plans


def _keep_end(turns: list[tuple[int, int]], room: int) -> list[tuple[int, int, int]]:
    """One row: the last whole turns that fit, all trained."""
    first, size = len(turns), 0
    while first > 0 and size + _len(turns[first - 1]) <= room:
        first -= 1
        size += _len(turns[first])
    return [(first, first, len(turns))]


def _len(turn: tuple[int, int]) -> int:
    return turn[1] - turn[0]
