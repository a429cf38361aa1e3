"""The in-process engine: batched sampling from the LoRA policy the trainer updates in place.

Why not transformers' continuous batching: its logprobs come after temperature/top-p, and it has no
per-request seed, stop strings or grammar masks. This loop is small: requests that arrive together
share one batch; identical prompts (n > 1, or a GRPO group's first turn) are prefilled once;
finished rows leave the batch; each row keeps its own temperature, top-p, seed, stop strings and
JSON-schema mask; logprobs are those of the raw model distribution (temperature 1), the same
quantity the trainer computes. It samples with the adapter merged into the base weights
(`LoraPolicy.sampling`): with LoRA on every linear layer, PEFT's extra matmuls and dispatch cost
12-23% of a decode step of the embedded model (batch 32 and 8).

Agent prompts are mostly a shared prefix (system prompt, tool definitions: ~570 of ~600 tokens on
an MCP server), and prefill was the larger part of a rollout turn. The KV of the prefix a batch's
prompts share is computed once at batch 1, kept across batches until the weights change
(`LoraPolicy.version`), and copied into each row's static cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import DynamicCache, StaticCache

from ..adapter import LoraPolicy, cache_kv
from ..errors import EngineDownError
from ..tokenize import MIN_SHARED_PREFIX, common_prefix_length
from .base import Engine, FinishReason, Sample, SamplingParams

log = logging.getLogger("journeyman.engine")


@dataclass
class _Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[Sample]]


@dataclass
class _Row:
    job: _Job
    index: int
    generator: torch.Generator | None
    grammar: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: FinishReason | None = None
    text: str | None = None


class TorchEngine(Engine):
    def __init__(
        self, policy: LoraPolicy, stop_ids: set[int], max_batch_rows: int = 64, batch_wait_s: float = 0.02
    ) -> None:
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.stop_ids = stop_ids
        self.max_batch_rows = max_batch_rows
        self.batch_wait_s = batch_wait_s
        self.step = 0
        self.batches = 0
        self.prefix_computes = 0  # times a shared prompt prefix was prefilled (not found cached)
        self.prefix_tokens_saved = 0  # prompt tokens whose prefill a shared prefix spared
        self._served = 0
        self._closed = False
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._running: list[_Job] = []  # the batch being sampled
        self._grammars: Any = None
        self._grammars_lock = threading.Lock()
        # (policy version, token ids, per-layer (K, V)) of the last shared prompt prefix
        self._prefix: tuple[int, tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._thread = threading.Thread(target=self._work, name="journeyman-engine", daemon=True)
        self._thread.start()

    @property
    def requests_served(self) -> int:
        return self._served

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        constraint = params.constraint
        if constraint is not None:
            # Compile here, off the worker: a bad schema fails this request alone (InvalidFieldError,
            # a 400), not every request batched with it; the worker then finds it compiled.
            await asyncio.to_thread(lambda: self._grammar_cache().compile(constraint))
        loop = asyncio.get_running_loop()
        job = _Job(prompt_ids, params, loop, loop.create_future())
        if self._closed:
            raise EngineDownError("the in-process engine is closed")
        self._queue.put(job)
        if self._closed and not self._thread.is_alive():  # closed while this was being queued
            self._fail_queued([])
        return await job.future

    async def load_adapter(self, path: Path, step: int) -> None:
        # The trainer updated these very weights in place (and a resume loads them into the policy
        # before serving), so there is nothing to transfer: only the served step changes.
        self.step = step

    def close(self) -> None:
        """Stop the worker; requests still queued fail with EngineDownError instead of waiting."""
        self._closed = True
        self._queue.put(None)

    # -- worker thread ---------------------------------------------------------------------------

    def _work(self) -> None:
        carry: list[_Job] = []
        try:
            self._serve(carry)
        except BaseException as e:
            # Never a silent dead worker: whatever it held or was queued fails now, later requests
            # fail at once (EngineDownError) instead of waiting on a thread that is gone.
            self._closed = True
            log.exception("the in-process engine's worker died")
            died = EngineDownError(f"the in-process engine's worker died: {e!r}")
            self._fail_queued([*self._running, *carry], died)
            raise

    def _serve(self, carry: list[_Job]) -> None:
        while True:
            job = carry.pop(0) if carry else self._queue.get()
            if job is None:
                self._fail_queued(carry)
                return
            if job.future.cancelled():  # its caller gave up (a timeout): no batch time spent on it
                continue
            jobs, rows = [job], job.params.n
            deadline = time.monotonic() + self.batch_wait_s
            while rows < self.max_batch_rows:
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                if rows + nxt.params.n > self.max_batch_rows:
                    carry.append(nxt)
                    break
                jobs.append(nxt)
                rows += nxt.params.n
            self._running = jobs
            try:
                results = self._run(jobs)
            except Exception as e:
                for j in jobs:
                    _answer(j, _set_exception, e)
                continue
            for j, samples in zip(jobs, results, strict=True):
                self._served += 1
                _answer(j, _set_result, samples)
            self._running = []

    def _fail_queued(self, carry: list[_Job], down: BaseException | None = None) -> None:
        down = down or EngineDownError("the in-process engine stopped before serving this request")
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                carry.append(job)
        for j in carry:
            _answer(j, _set_exception, down)

    @torch.inference_mode()
    def _run(self, jobs: list[_Job]) -> list[list[Sample]]:
        self.batches += 1
        rows = [
            _Row(
                job,
                k,
                _generator(job.params.seed, k, self.policy.device),
                self._grammar(job.params.constraint),
            )
            for job in jobs
            for k in range(job.params.n)
        ]
        model, device = self.policy.model, self.policy.device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        with self.policy.sampling():
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
            max_new = max(r.job.params.max_tokens for r in rows)
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
            cache = StaticCache(config=model.config, max_cache_len=shared + width + max_new)
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
            fan = torch.tensor([slot[tuple(r.job.prompt_ids)] for r in rows], device=device)
            cache.reorder_cache(cast(torch.LongTensor, fan))  # stub wants the legacy LongTensor class
            logits = out.logits[:, -1, :].float()[fan]
            mask, pos = mask[fan], pos[fan][:, -1:]
            live = list(range(len(rows)))  # row index of each batch position
            temps = torch.tensor([r.job.params.temperature for r in rows], device=device)
            top_ps = torch.tensor([r.job.params.top_p for r in rows], device=device)
            for _ in range(max_new):
                logp = torch.log_softmax(logits, dim=-1)  # (B, V) raw policy, temperature 1
                nxt = self._sample(logits, [rows[i] for i in live], temps[live], top_ps[live])
                chosen = logp.gather(1, nxt[:, None]).squeeze(1).tolist()
                k_top = max(rows[i].job.params.top_logprobs for i in live)
                top = logp.topk(k_top, dim=-1) if k_top else None
                keep = []
                for b, i in enumerate(live):
                    row, tok = rows[i], int(nxt[b])
                    row.tokens.append(tok)
                    row.logprobs.append(chosen[b])
                    if top is not None and row.job.params.top_logprobs:
                        k = row.job.params.top_logprobs
                        row.top.append(
                            list(zip(top.indices[b, :k].tolist(), top.values[b, :k].tolist(), strict=True))
                        )
                    if row.grammar is not None:
                        row.grammar.accept_token(tok)
                    self._check_finished(row)
                    if row.finish is None:
                        keep.append(b)
                if not keep:
                    break
                if len(keep) < len(live):
                    sel = torch.tensor(keep, device=device)
                    cache.reorder_cache(cast(torch.LongTensor, sel))
                    mask, pos, nxt = mask[sel], pos[sel], nxt[sel]
                    live = [live[b] for b in keep]
                mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
                pos = pos + 1
                out = model(
                    input_ids=nxt[:, None],
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                )
                logits = out.logits[:, -1, :].float()
        results: list[list[Sample]] = [[] for _ in jobs]
        index = {id(j): i for i, j in enumerate(jobs)}
        for row in rows:
            if row.finish is None:
                row.finish = "length"
            text = (
                row.text
                if row.text is not None
                else self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            )
            results[index[id(row.job)]].append(Sample(row.tokens, row.logprobs, row.finish, text, row.top))
        return results

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

    def _sample(
        self, logits: torch.Tensor, rows: list[_Row], temps: torch.Tensor, top_ps: torch.Tensor
    ) -> torch.Tensor:
        for b, row in enumerate(rows):
            if row.grammar is not None:
                self._grammars.mask(row.grammar, logits, b)
        greedy = logits.argmax(dim=-1)
        sampled_rows = (temps > 0).nonzero().flatten().tolist()
        if not sampled_rows:
            return greedy
        probs = torch.softmax(logits[sampled_rows] / temps[sampled_rows, None], dim=-1)
        p = top_ps[sampled_rows]
        if bool((p < 1).any()):
            # nucleus (top-p): keep the smallest set of tokens whose mass reaches p. The sort is
            # as costly as a decode forward of this model, so it runs only when someone asks for it.
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) > p[:, None]
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        # Inverse-CDF sampling: one uniform per row from that row's own generator (seeded rows
        # reproduce whatever they are batched with), one batched searchsorted for all rows.
        cdf = probs.cumsum(dim=-1)
        u = torch.cat(
            [torch.rand(1, generator=rows[b].generator, device=logits.device) for b in sampled_rows]
        )
        # right=True: the first token whose cumulative mass exceeds the draw, so a zero-mass
        # (e.g. grammar-masked) token is never picked; float round-off at the top falls back to argmax.
        picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        picks = picks.clamp(max=logits.shape[-1] - 1)
        bad = probs.gather(1, picks[:, None]).squeeze(1) <= 0
        picks = torch.where(bad, probs.argmax(dim=-1), picks)
        greedy[sampled_rows] = picks
        return greedy

    def _check_finished(self, row: _Row) -> None:
        p = row.job.params
        if row.tokens[-1] in self.stop_ids or (row.grammar is not None and row.grammar.is_terminated()):
            row.finish = "stop"
        elif p.stop:
            tail = self.tokenizer.decode(row.tokens[-24:], skip_special_tokens=True)
            if any(s in tail for s in p.stop):
                text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
                cut = min(text.find(s) for s in p.stop if s in text)
                row.text, row.finish = text[:cut], "stop"
        if row.finish is None and len(row.tokens) >= p.max_tokens:
            row.finish = "length"

    def _grammar(self, constraint: tuple[str, str, str] | None) -> Any:
        if constraint is None:
            return None
        return self._grammar_cache().matcher(constraint)

    def _grammar_cache(self) -> Any:
        with self._grammars_lock:
            if self._grammars is None:
                from .grammar import GrammarCache

                self._grammars = GrammarCache(self.tokenizer, self.policy.model.config.vocab_size)
            return self._grammars


def _generator(seed: int | None, k: int, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + k)
    return g


def _answer(job: _Job, set_: Any, value: Any) -> None:
    """Hand a result to the requester's event loop; one that has closed meanwhile wants none."""
    with contextlib.suppress(RuntimeError):
        job.loop.call_soon_threadsafe(set_, job.future, value)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
