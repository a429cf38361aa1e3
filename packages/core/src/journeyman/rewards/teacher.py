"""A distillation teacher's logprobs for the tokens a student sampled: the reward stop, token by token.

`score_groups` fills each token record's `teacher_logprobs` (kept with the trajectory, so a retried
step asks nothing again): the records of a history that extend one another (a multi-turn run is one
growing sequence) are scored as that one sequence, the sequences sent in batches of
`Teacher.batch_tokens`. A `Scorer` answers log π(seq[k] | seq[:k]) for every position:

- `EndpointScorer`: an OpenAI-compatible server, by `/v1/completions` with the token ids as the
  prompt, `echo`, `max_tokens=0` and `logprobs=0` (vLLM answers it; so did OpenAI's legacy API);
- `backends/teachers.py: ModelScorer`: a causal LM in the training process (a model registered on
  the backend, or a base loaded with a run's checkpoint on top).

`check_tokenizer` compares the teacher's reading of a probe text's ids with the student's before the
first scoring: a teacher with another tokenizer would score other tokens, so it is refused.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx
from openai.types.chat.chat_completion import Choice

from journeyman.data.config import Teacher
from journeyman.data.types import History, TokenRecord, TrajectoryGroup, record_of, set_teacher_logprobs
from journeyman.errors import TeacherLogprobsError, TeacherTokenizerError, TeacherUnreachableError
from journeyman.rollout.histories import extends

__all__ = [
    "PROBE",
    "EndpointScorer",
    "Scorer",
    "check_tokenizer",
    "score_groups",
]

# covers what tokenizers differ on: spaces and newlines, digits, accents, CJK, markup
PROBE = 'Journeyman\'s probe:\n  12,345.67 naïve café 漢字 <tool_call>{"x": [1, 2]}</tool_call>\t!'
CONCURRENT_REQUESTS = 4  # batches in flight at once to a teacher server


class Scorer(Protocol):
    async def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """For each sequence, log π(seq[k] | seq[:k]) for k = 1 .. len-1 (len - 1 values)."""
        ...

    async def text_of(self, ids: list[int]) -> str:
        """The teacher's reading of `ids` as text (its detokenizer)."""
        ...


async def check_tokenizer(
    scorer: Scorer, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]
) -> None:
    """Refuse a teacher whose tokenizer reads the student's ids of `PROBE` as other text."""
    ids = encode(PROBE)
    theirs, ours = await scorer.text_of(ids), decode(ids)
    if theirs != ours:
        raise TeacherTokenizerError(
            f"the teacher reads the student's token ids of a probe text as {theirs[:120]!r}, the student as "
            f"{ours[:120]!r}: its tokenizer is another one, so its logprobs would score other tokens "
            "(distill from a teacher with the student's tokenizer: same family, e.g. a larger model of it)"
        )


def _chains(history: History) -> list[list[tuple[Choice, TokenRecord]]]:
    """A history's choices with records, grouped: each chain's later calls extend the earlier ones."""
    chains: list[list[tuple[Choice, TokenRecord]]] = []
    so_far: list[int] | None = None
    for item in history.messages_and_choices:
        if not isinstance(item, Choice) or (rec := record_of(item)) is None:
            continue
        if so_far is not None and extends(so_far, rec.prompt_token_ids):
            chains[-1].append((item, rec))
        else:
            chains.append([(item, rec)])
        so_far = rec.prompt_token_ids + rec.token_ids
    return chains


def _batches(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of sequences, in batches of at most `budget` tokens (a longer one alone)."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if not out or total + n > budget:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


async def score_groups(
    groups: Sequence[TrajectoryGroup], scorer: Scorer, teacher: Teacher
) -> dict[str, float]:
    """Fill `teacher_logprobs` on every record of `groups` that has none; returns counts for the
    step's metrics (`teacher_sequences`, `teacher_tokens` scored, `teacher_seconds`). Nothing is
    written unless every sequence got a finite logprob for each sampled token."""
    t0 = time.perf_counter()
    todo: list[tuple[str, list[tuple[Choice, TokenRecord]]]] = []
    for gi, group in enumerate(groups):
        for ti, traj in enumerate(group.trajectories):
            where = f"groups[{gi}].trajectories[{ti}]"
            histories = [(where, traj)] + [
                (f"{where}.additional_histories[{k}]", h) for k, h in enumerate(traj.additional_histories)
            ]
            for path, h in histories:
                for chain in _chains(h):
                    if any(rec.teacher_logprobs is None for _, rec in chain):
                        todo.append((path, chain))
    if not todo:
        return {"teacher_sequences": 0.0, "teacher_tokens": 0.0, "teacher_seconds": 0.0}
    sequences = [chain[-1][1].prompt_token_ids + chain[-1][1].token_ids for _, chain in todo]
    batches = _batches([len(s) for s in sequences], teacher.batch_tokens)
    limit = asyncio.Semaphore(CONCURRENT_REQUESTS)

    async def one(batch: list[int]) -> list[list[float]]:
        async with limit:
            return await scorer.logprobs([sequences[i] for i in batch])

    answers = await asyncio.gather(*(one(b) for b in batches))
    scored: dict[int, list[float]] = {}
    for batch, answer in zip(batches, answers, strict=True):
        for i, lps in zip(batch, answer, strict=True):
            scored[i] = lps
    fills: list[tuple[Choice, list[float]]] = []
    for i, (path, chain) in enumerate(todo):
        lps = scored[i]
        if len(lps) != len(sequences[i]) - 1:
            raise TeacherLogprobsError(
                f"{path}: the teacher's logprobs",
                len(lps),
                f"expected {len(sequences[i]) - 1}, one per token after the first",
            )
        for choice, rec in chain:
            start = len(rec.prompt_token_ids)
            values = lps[start - 1 : start - 1 + len(rec.token_ids)]
            bad = next((k for k, v in enumerate(values) if not math.isfinite(v)), None)
            if bad is not None:
                raise TeacherLogprobsError(
                    f"{path}: the teacher's logprob of sampled token {bad} (id {rec.token_ids[bad]})",
                    values[bad],
                    "is not a finite number",
                )
            fills.append((choice, values))
    for choice, values in fills:  # all or nothing
        set_teacher_logprobs(choice, values)
    return {
        "teacher_sequences": float(len(sequences)),
        "teacher_tokens": float(sum(len(s) for s in sequences)),
        "teacher_seconds": time.perf_counter() - t0,
    }


class EndpointScorer:
    """A teacher server's logprobs of given tokens: `/v1/completions`, echo, max_tokens=0, logprobs=0."""

    def __init__(self, teacher: Teacher) -> None:
        assert teacher.base_url is not None
        self.teacher = teacher
        self.url = teacher.base_url.rstrip("/") + "/completions"
        headers = {}
        if teacher.api_key_env is not None:
            key = os.environ.get(teacher.api_key_env)
            if not key:
                raise TeacherUnreachableError(
                    f"teacher.api_key_env={teacher.api_key_env!r}: that environment variable is not set here"
                )
            headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.AsyncClient(headers=headers, timeout=teacher.timeout_s)

    async def _post(self, prompt: list[list[int]]) -> list[dict[str, Any]]:
        body = {"model": self.teacher.model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
        try:
            r = await self.client.post(self.url, json=body)
        except httpx.TimeoutException:
            raise TeacherUnreachableError(
                f"teacher.base_url={self.teacher.base_url!r}: no answer in teacher.timeout_s={self.teacher.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as e:
            raise TeacherUnreachableError(
                f"teacher.base_url={self.teacher.base_url!r}: {type(e).__name__}: {e}"
            ) from None
        if r.status_code >= 400:
            raise TeacherUnreachableError(
                f"teacher.base_url={self.teacher.base_url!r} answered {r.status_code} to a scoring request "
                f"(/v1/completions with echo and logprobs): {r.text[:300]}"
            )
        try:
            choices = sorted(r.json()["choices"], key=lambda c: c.get("index", 0))
        except (ValueError, KeyError, TypeError):
            raise TeacherLogprobsError(
                "the teacher's answer", r.text[:200], "is not a completions response"
            ) from None
        if len(choices) != len(prompt):
            raise TeacherLogprobsError(
                "the teacher's answer.choices", len(choices), f"expected one per prompt ({len(prompt)})"
            )
        return choices

    async def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        out: list[list[float]] = []
        for k, choice in enumerate(await self._post(sequences)):
            lps = (choice.get("logprobs") or {}).get("token_logprobs")
            if not isinstance(lps, list) or len(lps) != len(sequences[k]):
                raise TeacherLogprobsError(
                    f"the teacher's answer.choices[{k}].logprobs.token_logprobs",
                    None if not isinstance(lps, list) else len(lps),
                    f"expected one entry per prompt token ({len(sequences[k])}): the server must echo "
                    "prompt logprobs (vLLM does)",
                )
            # the first token has no logprob (nothing predicts it); a missing later one is NaN here
            out.append([math.nan if v is None else float(v) for v in lps[1:]])
        return out

    async def text_of(self, ids: list[int]) -> str:
        (choice,) = await self._post([ids])
        return str(choice.get("text", ""))
