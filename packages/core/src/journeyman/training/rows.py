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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from journeyman.chat.formats import ChatFormat
from journeyman.chat.messages import normalize_messages
from journeyman.data.types import History, TokenRecord, Trajectory
from journeyman.errors import NoTrainableTokensError
from journeyman.rollout.histories import extends

__all__ = ["Row", "history_rows", "trajectory_rows", "truncate_rows"]

NAN = math.nan


@dataclass
class Row:
    input_ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    # log π_rollout of each trained token (NaN where unknown: re-tokenised turns, prompt tokens)
    rollout_logprobs: list[float] = field(default_factory=list)
    advantage: float = 0.0
    retokenized: bool = False

    def extend(self, ids: list[int], trained: bool, logprobs: list[float] | None = None) -> None:
        self.input_ids += ids
        self.trained += [trained] * len(ids)
        self.rollout_logprobs += logprobs if logprobs is not None else [NAN] * len(ids)

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
        row.extend(rec.token_ids, trained=True, logprobs=rec.logprobs)
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


def truncate_rows(rows: Sequence[Row], max_seq_len: int) -> int:
    """Cut rows longer than `max_seq_len` tokens in place; returns how many were cut."""
    truncated = 0
    for r in rows:
        if len(r.input_ids) > max_seq_len:
            truncated += 1
            del r.input_ids[max_seq_len:], r.trained[max_seq_len:], r.rollout_logprobs[max_seq_len:]
    return truncated
