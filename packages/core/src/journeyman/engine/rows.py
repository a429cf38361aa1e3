"""A request's rows in the in-process engine's batch (`batch`): one per sample it asked for, each
taking a token per decode step until a stop token, a stop string, its grammar's end or `max_tokens`
finishes it. A request is answered when its last row finishes, and fails as a whole when one of its
rows raises (its matcher, its stop strings): its other rows leave at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from journeyman.engine.base import FinishReason, OnToken, Sample, SamplingParams

__all__ = ["Answer", "Request", "RequestT", "Row", "Step"]

# enough characters to hold the longest stop string, in tokens (a token is at least one character)
_STOP_TAIL = 24


class Request(Protocol):
    """What a runner reads of a queued request (the scheduler's job)."""

    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def on_token(self) -> OnToken | None: ...
    @property
    def tenant(self) -> int:
        """The model it samples from, among the engine's (`tenants`)."""
        ...


RequestT = TypeVar("RequestT", bound=Request)


@dataclass(eq=False)
class Answer(Generic[RequestT]):
    """One request's samples, filled in by row as its rows finish."""

    job: RequestT
    samples: list[Sample | None]
    left: int  # rows still sampling
    failed: bool = False  # reported failed: its rows leave


@dataclass(eq=False)
class Row(Generic[RequestT]):
    """One sample of a request, from its prompt's prefill to its last token."""

    answer: Answer[RequestT]
    index: int
    generator: torch.Generator | None
    grammar: Any = None  # xgrammar's matcher, when the output is constrained
    prefix: int = 0  # leading prompt tokens read from the shared prefix
    length: int = 0  # filled slots: the prompt after `prefix`, then every sampled token but the last
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    followers: list[Row[RequestT]] = field(default_factory=list)  # rows of the same prompt, copied
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: FinishReason | None = None
    text: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.answer.job.params

    @property
    def prompt(self) -> list[int]:
        return self.answer.job.prompt_ids

    @property
    def tenant(self) -> int:
        return self.answer.job.tenant

    def accept(self, token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
        """Take the token sampled for this row (`top`: its top logprobs, when the request asks)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.answer.job.on_token is not None:
            self.answer.job.on_token(self.index, token)
        if top is not None:
            self.top.append(top)
        if self.grammar is not None:
            self.grammar.accept_token(token)

    def check_finished(self, stop_ids: set[int], tokenizer: Any) -> None:
        """Set `finish` when the latest token ends the row (and `text` when a stop string cut it)."""
        p = self.params
        if self.tokens[-1] in stop_ids or (self.grammar is not None and self.grammar.is_terminated()):
            self.finish = "stop"
        elif p.stop:
            tail = tokenizer.decode(
                self.tokens[-(_STOP_TAIL + max(map(len, p.stop))) :], skip_special_tokens=True
            )
            if any(s in tail for s in p.stop):
                text = tokenizer.decode(self.tokens, skip_special_tokens=True)
                cut = min(text.find(s) for s in p.stop if s in text)
                self.text, self.finish = text[:cut], "stop"
        if self.finish is None and len(self.tokens) >= p.max_tokens:
            self.finish = "length"

    def sample(self, tokenizer: Any, step: int) -> Sample:
        """The finished row as its request's sample, sampled under the weights of training `step`."""
        text = self.text if self.text is not None else tokenizer.decode(self.tokens, skip_special_tokens=True)
        return Sample(self.tokens, self.logprobs, self.finish or "length", text, self.top, step=step)


@dataclass(eq=False)
class Step(Generic[RequestT]):
    """What one pass settled: requests whose last row finished (with their samples), requests that
    failed, and (from `advance`) the ready rows, by slot, that sample on."""

    answered: list[tuple[RequestT, list[Sample]]] = field(default_factory=list)
    failed: list[tuple[RequestT, Exception]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)

    def retire(self, row: Row[RequestT], sample: Sample) -> None:
        """A finished row's sample goes to its request, which is answered when its last row is
        done, not when the batch is."""
        answer = row.answer
        answer.samples[row.index] = sample
        answer.left -= 1
        if answer.left == 0:
            self.answered.append((answer.job, [s for s in answer.samples if s is not None]))

    def fail(self, answer: Answer[RequestT], error: Exception) -> None:
        """Fail `answer`'s request (once): its rows leave."""
        if not answer.failed:
            answer.failed = True
            self.failed.append((answer.job, error))
