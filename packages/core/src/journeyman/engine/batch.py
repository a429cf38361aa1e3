"""Batches on the policy's model: prompts prefilled into one static KV cache, a token sampled for
every row at each step, finished rows retired, two batches joined into one.

Identical prompts (n > 1, or a GRPO group's first turn) are prefilled once; each row keeps its own
temperature, top-p, seed, stop strings and JSON-schema mask (`sampler`). Agent prompts are mostly
a shared prefix (system prompt, tool definitions: ~570 of ~600 tokens on an MCP server), and
prefill was the larger part of a rollout turn. The KV of the prefix a batch's prompts share is
computed once at batch 1, kept across batches until the weights change (`LoraPolicy.version`), and
copied into each row's static cache; on the CPU, decoding then reads it once for the whole batch
(`prefix_attention`).

A `BatchRunner` knows the model, not the queue: a step reports which requests it answered or
failed, and the scheduler (`scheduler`) tells their callers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import torch
from transformers import DynamicCache, StaticCache

from journeyman.data.prefix import MIN_SHARED_PREFIX, common_prefix_length
from journeyman.engine.base import FinishReason, Sample, SamplingParams
from journeyman.engine.prefix_attention import prefix_attention
from journeyman.engine.sampler import generator, sample
from journeyman.errors import InvalidFieldError
from journeyman.policy.lora import LoraPolicy, cache_kv

if TYPE_CHECKING:
    from journeyman.engine.grammar import GrammarCache

__all__ = ["Batch", "BatchRunner", "Request", "Step"]


class Request(Protocol):
    """What a batch reads of a queued request (the scheduler's job)."""

    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def params(self) -> SamplingParams: ...


RequestT = TypeVar("RequestT", bound=Request)


@dataclass(eq=False)
class _Answer(Generic[RequestT]):
    """One request's samples, filled in by row as its rows finish."""

    job: RequestT
    samples: list[Sample | None]
    left: int  # rows still sampling
    failed: bool = False  # reported failed: its rows leave the batch


@dataclass(eq=False)
class _Row(Generic[RequestT]):
    answer: _Answer[RequestT]
    index: int
    generator: torch.Generator | None
    grammar: Any = None  # xgrammar's matcher, when the output is constrained
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: FinishReason | None = None
    text: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.answer.job.params


@dataclass(eq=False)
class Batch(Generic[RequestT]):
    """The rows being sampled, each with its slots in one static KV cache (left-padded to a common
    length) and the logits of its next token."""

    rows: list[_Row[RequestT]]
    cache: StaticCache
    mask: torch.Tensor  # (B, slots filled): which cache slots each row attends to
    pos: torch.Tensor  # (B, 1): position id of each row's latest token
    logits: torch.Tensor  # (B, V): for each row's next token
    temps: torch.Tensor  # (B,)
    top_ps: torch.Tensor  # (B,)
    prefix: int = 0  # leading cache slots that hold the same keys and values in every row


@dataclass(eq=False)
class Step(Generic[RequestT]):
    """What sampling one token a row settled: requests whose last row finished (with their samples),
    requests that failed, and the rows (by index) that sample on."""

    answered: list[tuple[RequestT, list[Sample]]] = field(default_factory=list)
    failed: list[tuple[RequestT, Exception]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)


def _room(rows: list[_Row[Any]]) -> int:
    """Cache slots the rows may still need: the most tokens any of them may yet sample."""
    return max(r.params.max_tokens - len(r.tokens) for r in rows)


def _join(a: Batch[RequestT], b: Batch[RequestT], config: Any) -> Batch[RequestT]:
    """One batch of both: each row's filled slots right-aligned to the longer of the two, so every
    row writes its next token into the same slot. Positions are per row (RoPE is applied before
    caching), so where a row's slots sit does not change what it computes."""
    la, lb = a.mask.shape[1], b.mask.shape[1]  # the shorter moves right: no prefix slots in common
    length = max(la, lb)
    rows = [*a.rows, *b.rows]
    cache = StaticCache(config=config, max_cache_len=length + _room(rows))
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(cache_kv(a.cache), cache_kv(b.cache), strict=True)):
        k = ka.new_zeros((len(rows), ka.shape[1], length, ka.shape[3]))
        v = va.new_zeros((len(rows), va.shape[1], length, va.shape[3]))
        k[: len(a.rows), :, length - la :], v[: len(a.rows), :, length - la :] = ka[:, :, :la], va[:, :, :la]
        k[len(a.rows) :, :, length - lb :], v[len(a.rows) :, :, length - lb :] = kb[:, :, :lb], vb[:, :, :lb]
        cache.update(k, v, layer)
    mask = a.mask.new_zeros((len(rows), length))
    mask[: len(a.rows), length - la :], mask[len(a.rows) :, length - lb :] = a.mask, b.mask
    return Batch(
        rows,
        cache,
        mask,
        torch.cat([a.pos, b.pos]),
        torch.cat([a.logits, b.logits]),
        torch.cat([a.temps, b.temps]),
        torch.cat([a.top_ps, b.top_ps]),
    )


class BatchRunner(Generic[RequestT]):
    """Prefills and decodes batches on `policy`'s model, and keeps the shared-prefix KV between
    batches. Its methods run on the scheduler's thread inside `sampling()`, except `check_prompt`
    and `compile`, which any thread may call."""

    def __init__(self, policy: LoraPolicy, stop_ids: set[int]) -> None:
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.stop_ids = stop_ids
        self.prefix_computes = 0  # times a shared prompt prefix was prefilled (not found cached)
        self.prefix_tokens_saved = 0  # prompt tokens whose prefill a shared prefix spared
        embeddings = policy.model.get_input_embeddings()
        self._vocab = int(embeddings.weight.shape[0])  # token ids the model can embed
        self._context: int | None = getattr(policy.model.config, "max_position_embeddings", None)
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()
        # (policy version, token ids, per-layer (K, V)) of the last shared prompt prefix
        self._prefix: tuple[int, tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # the model's own attention while `shared_prefix_attention` stands in for it; None: not in use
        self._inner_attention: str | None = None

    # -- any thread ----------------------------------------------------------------------------------

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse, before queueing, a prompt the model cannot read: an id past its embeddings fails
        the prefill of every request batched with it (on CUDA, a device assert ends the process)."""
        if not prompt_ids:
            raise InvalidFieldError("messages", prompt_ids, "the prompt has no tokens")
        low, high = min(prompt_ids), max(prompt_ids)
        if low < 0 or high >= self._vocab:
            bad = low if low < 0 else high
            raise InvalidFieldError(
                "messages", bad, f"token id outside the model's vocabulary [0, {self._vocab})"
            )
        if self._context is not None and len(prompt_ids) + params.max_tokens > self._context:
            room = self._context - len(prompt_ids)
            if room < 1:
                raise InvalidFieldError(
                    "messages",
                    f"{len(prompt_ids)} tokens",
                    f"the prompt leaves no room in the model's {self._context}-token context",
                )
            raise InvalidFieldError(
                "max_tokens",
                params.max_tokens,
                f"the prompt has {len(prompt_ids)} tokens: at most {room} fit the model's "
                f"{self._context}-token context",
            )

    def compile(self, constraint: tuple[str, str, str]) -> None:
        """Compile a (prefix, schema, suffix) grammar ahead of its prefill; a bad schema raises
        InvalidFieldError here, for its own request alone."""
        self._grammar_cache().compile(constraint)

    # -- the scheduler's thread ----------------------------------------------------------------------

    @property
    def weights_wanted(self) -> bool:
        """Whether a training step waits for the weights this runner samples with."""
        return bool(self.policy.editors_waiting)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Hold the weights to sample (`LoraPolicy.sampling`), with the shared-prefix attention in
        place, for one or more batches; leaving frees them for a training step."""
        with self.policy.sampling(), prefix_attention(self.policy.model.get_base_model()) as inner:
            self._inner_attention = inner
            try:
                yield
            finally:
                self._inner_attention = None

    @torch.inference_mode()
    def prefill(self, jobs: list[RequestT]) -> Batch[RequestT]:
        """A batch of `jobs`' rows, their prompts run, ready to sample each row's first token."""
        device = self.policy.device
        answers = [_Answer(j, [None] * j.params.n, j.params.n) for j in jobs]
        rows = [
            _Row(a, k, generator(a.job.params.seed, k, device), self._grammar(a.job.params.constraint))
            for a in answers
            for k in range(a.job.params.n)
        ]
        model = self.policy.model
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        model.eval()
        # Identical prompts (n > 1, or a GRPO group's first turn) are prefilled once, and the
        # prefix every prompt shares (system prompt, tool definitions) once across batches.
        slot: dict[tuple[int, ...], int] = {}
        for j in jobs:
            slot.setdefault(tuple(j.prompt_ids), len(slot))
        prompts = list(slot)
        shared, kv = self._shared_prefix(prompts)
        suffixes = [p[shared:] for p in prompts]
        self.prefix_tokens_saved += shared * (len(prompts) - 1)
        width = max(len(p) for p in suffixes)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), shared + width), dtype=torch.long)
        mask[:, :shared] = 1
        for i, p in enumerate(suffixes):  # [shared prefix][padding][own suffix]
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, shared + width - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        # A static cache: a growing one re-copies every row's whole history at each token,
        # which cost more than the forward pass at 600-token tool prompts.
        cache = StaticCache(config=model.config, max_cache_len=shared + width + _room(rows))
        for layer, (k, v) in enumerate(kv):
            cache.update(k.expand(len(prompts), -1, -1, -1), v.expand(len(prompts), -1, -1, -1), layer)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos[:, shared:],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        fan = torch.tensor([slot[tuple(r.answer.job.prompt_ids)] for r in rows], device=device)
        cache.reorder_cache(cast(torch.LongTensor, fan))  # stub wants the legacy LongTensor class
        return Batch(
            rows,
            cache,
            mask[fan],
            pos[fan][:, -1:],
            out.logits[:, -1, :].float()[fan],
            torch.tensor([r.params.temperature for r in rows], device=device),
            torch.tensor([r.params.top_p for r in rows], device=device),
            prefix=shared,
        )

    @torch.inference_mode()
    def join(self, batch: Batch[RequestT], jobs: list[RequestT]) -> Batch[RequestT]:
        """The running `batch` with `jobs` prefilled and joined to it (continuous batching)."""
        return _join(batch, self.prefill(jobs), self.policy.model.config)

    @torch.inference_mode()
    def advance(self, batch: Batch[RequestT]) -> Step[RequestT]:
        """Sample one token for every row; retire the rows that finished. A row that raises (its
        matcher, its stop strings) fails its own request, whose other rows stop too. The batch's
        tensors are left as they are until `forward`."""
        rows = batch.rows
        step: Step[RequestT] = Step()
        allowed = self._allowed(batch, step)
        draw = sample(
            batch.logits,
            batch.temps,
            batch.top_ps,
            [r.generator for r in rows],
            allowed=allowed,
            top_logprobs=max(r.params.top_logprobs for r in rows),
        )
        ids, chosen = draw.ids.tolist(), draw.logprobs.tolist()
        for b, row in enumerate(rows):
            if row.answer.failed:  # another of its rows failed (here or in its grammar mask)
                continue
            try:
                row.tokens.append(ids[b])
                row.logprobs.append(chosen[b])
                k = row.params.top_logprobs
                if k and draw.top_ids is not None and draw.top_logprobs is not None:
                    pairs = zip(draw.top_ids[b, :k].tolist(), draw.top_logprobs[b, :k].tolist(), strict=True)
                    row.top.append(list(pairs))
                if row.grammar is not None:
                    row.grammar.accept_token(ids[b])
                self._check_finished(row)
                if row.finish is not None:
                    self._retire(row, step)
            except Exception as e:  # this row's own trouble
                self._fail(row.answer, e, step)
                continue
            if row.finish is None:
                step.keep.append(b)
        # rows kept before a later row of their request failed leave too
        step.keep = [b for b in step.keep if not rows[b].answer.failed]
        return step

    @torch.inference_mode()
    def forward(self, batch: Batch[RequestT], keep: list[int]) -> None:
        """Drop the rows not in `keep` (a step's) and run the model on each kept row's latest token:
        the batch is then ready to sample the next."""
        if len(keep) < len(batch.rows):
            sel = torch.tensor(keep, device=batch.logits.device)
            batch.cache.reorder_cache(cast(torch.LongTensor, sel))
            batch.rows = [batch.rows[b] for b in keep]
            batch.mask, batch.pos = batch.mask[sel], batch.pos[sel]
            batch.temps, batch.top_ps = batch.temps[sel], batch.top_ps[sel]
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        batch.pos = batch.pos + 1
        latest = torch.tensor([[r.tokens[-1]] for r in batch.rows], device=batch.logits.device)
        out = self.policy.model(
            input_ids=latest,
            attention_mask=batch.mask,
            position_ids=batch.pos,
            past_key_values=batch.cache,
            use_cache=True,
            **self._prefix_kwargs(batch.prefix),
        )
        batch.logits = out.logits[:, -1, :].float()

    # -- internals -----------------------------------------------------------------------------------

    def _allowed(self, batch: Batch[RequestT], step: Step[RequestT]) -> torch.Tensor | None:
        """(B, V) the tokens each row's grammar allows now; None when no row is constrained. A
        matcher that raises fails its request; that row samples unmasked, then leaves."""
        constrained = [b for b, r in enumerate(batch.rows) if r.grammar is not None]
        if not constrained:
            return None
        grammars = self._grammar_cache()
        forbidden = batch.logits.new_zeros(batch.logits.shape)  # `mask` writes -inf where forbidden
        for b in constrained:
            row = batch.rows[b]
            try:
                grammars.mask(row.grammar, forbidden, b)
            except Exception as e:
                forbidden[b] = 0.0
                self._fail(row.answer, e, step)
        return forbidden == 0

    def _fail(self, answer: _Answer[RequestT], error: Exception, step: Step[RequestT]) -> None:
        if not answer.failed:
            answer.failed = True
            step.failed.append((answer.job, error))

    def _retire(self, row: _Row[RequestT], step: Step[RequestT]) -> None:
        """A finished row's sample goes to its request, which is answered when its last row is
        done, not when the batch is."""
        answer = row.answer
        text = (
            row.text if row.text is not None else self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        )
        answer.samples[row.index] = Sample(row.tokens, row.logprobs, row.finish or "length", text, row.top)
        answer.left -= 1
        if answer.left == 0:
            step.answered.append((answer.job, [s for s in answer.samples if s is not None]))

    def _check_finished(self, row: _Row[RequestT]) -> None:
        p = row.params
        if row.tokens[-1] in self.stop_ids or (row.grammar is not None and row.grammar.is_terminated()):
            row.finish = "stop"
        elif p.stop:
            # enough tokens to hold the longest stop string (a token is at least one character)
            tail = self.tokenizer.decode(
                row.tokens[-(24 + max(map(len, p.stop))) :], skip_special_tokens=True
            )
            if any(s in tail for s in p.stop):
                text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
                cut = min(text.find(s) for s in p.stop if s in text)
                row.text, row.finish = text[:cut], "stop"
        if row.finish is None and len(row.tokens) >= p.max_tokens:
            row.finish = "length"

    def _prefix_kwargs(self, prefix: int) -> dict[str, Any]:
        """What `shared_prefix_attention` needs to read the batch's shared prefix once."""
        if self._inner_attention is None or not prefix:
            return {}
        return {"prefix_slots": prefix, "prefix_attention": self._inner_attention}

    def _shared_prefix(
        self, prompts: list[tuple[int, ...]]
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(length, per-layer (K, V) at batch 1) of the prefix all `prompts` share, from the cache when
        it was computed under the current weights; (0, []) when the shared part is too short to pay.

        Each prompt keeps at least one token of its own, whose logits start its sampling.
        """
        first = prompts[0]
        common = common_prefix_length(prompts, min(len(p) for p in prompts) - 1)
        if common < MIN_SHARED_PREFIX:
            return 0, []
        cached = self._prefix if self._prefix and self._prefix[0] == self.policy.version else None
        reuse = common_prefix_length([cached[1], first], common) if cached else 0
        if reuse < MIN_SHARED_PREFIX:
            reuse = 0
        kv = [(k[:, :, :reuse], v[:, :, :reuse]) for k, v in cached[2]] if cached and reuse else []
        if common - reuse < MIN_SHARED_PREFIX:
            return reuse, kv
        # Extend the cached prefix by what this batch shares beyond it, at batch 1.
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)
        device = self.policy.device
        self.policy.model(
            input_ids=torch.tensor([first[reuse:common]], device=device),
            position_ids=torch.arange(reuse, common, device=device)[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        kv = cache_kv(cache)
        self.prefix_computes += 1
        self._prefix = (self.policy.version, first[:common], kv)
        return common, kv

    def _grammar(self, constraint: tuple[str, str, str] | None) -> Any:
        if constraint is None:
            return None
        return self._grammar_cache().matcher(constraint)

    def _grammar_cache(self) -> GrammarCache:
        with self._grammars_lock:
            if self._grammars is None:
                from journeyman.engine.grammar import GrammarCache  # xgrammar, only when a schema comes

                self._grammars = GrammarCache(self.tokenizer, self.policy.model.config.vocab_size)
            return self._grammars
