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
(`LoraPolicy.version`), and copied into each row's static cache; on the CPU, decoding then reads
it once for the whole batch (`prefix_attention`).

One request's failure stays that request's: `generate` refuses prompt ids the model cannot embed, a
prefill that raises anyway is redone job by job to find the culprit (a cost paid only on failure),
and a row that raises while decoding takes only its own request out of the batch. A worker thread
that dies fails the requests it held and is replaced, a bounded number of times (`max_restarts`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import DynamicCache, StaticCache

from journeyman.data.prefix import MIN_SHARED_PREFIX, common_prefix_length
from journeyman.engine.base import Engine, FinishReason, Sample, SamplingParams, T, hand_over
from journeyman.engine.prefix_attention import prefix_attention
from journeyman.errors import EngineDownError, InvalidFieldError
from journeyman.policy.lora import LoraPolicy, cache_kv

log = logging.getLogger("journeyman.engine")


@dataclass
class _Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[Sample]]
    samples: list[Sample | None] = field(default_factory=list)  # by row index, as rows finish
    left: int = 0  # rows still sampling
    failed: bool = False  # answered with an error: its rows leave the batch
    alone: bool = False  # prefilled alone after a batch with it failed as a whole: batched alone


@dataclass
class _Call:
    """Torch work handed to the sampling thread (`TorchEngine.call`)."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


_WAKE = object()  # queued by `call`, to wake a take blocked on the queue


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


@dataclass
class _Batch:
    """The rows being sampled, each with its slots in one static KV cache (left-padded to a common
    length) and the logits of its next token."""

    rows: list[_Row]
    cache: StaticCache
    mask: torch.Tensor  # (B, slots filled): which cache slots each row attends to
    pos: torch.Tensor  # (B, 1): position id of each row's latest token
    logits: torch.Tensor  # (B, V): for each row's next token
    temps: torch.Tensor  # (B,)
    top_ps: torch.Tensor  # (B,)
    prefix: int = 0  # leading cache slots that hold the same keys and values in every row


def _room(rows: list[_Row]) -> int:
    """Cache slots the rows may still need: the most tokens any of them may yet sample."""
    return max(r.job.params.max_tokens - len(r.tokens) for r in rows)


def _join(a: _Batch, b: _Batch, config: Any) -> _Batch:
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
    return _Batch(
        rows,
        cache,
        mask,
        torch.cat([a.pos, b.pos]),
        torch.cat([a.logits, b.logits]),
        torch.cat([a.temps, b.temps]),
        torch.cat([a.top_ps, b.top_ps]),
    )


class TorchEngine(Engine):
    def __init__(
        self,
        policy: LoraPolicy,
        stop_ids: set[int],
        max_batch_rows: int = 64,
        batch_wait_s: float = 0.05,
        batch_wait_max_s: float = 0.25,
        continuous: bool = False,
        join_fraction: float = 0.25,
        join_wait_s: float = 1.0,
        max_restarts: int = 3,
        restart_window_s: float = 60.0,
    ) -> None:
        self.policy = policy
        # A worker thread that dies (a bug, a call that raised past `_run_calls`) fails the jobs it
        # held and is replaced, as a dead replica is (`replicas`); one that dies more than
        # `max_restarts` times within `restart_window_s` stays down: a deterministic crash must not spin.
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restarts = 0
        self._deaths: list[float] = []  # when restarts happened, within the window
        # Continuous batching: requests that arrive while a batch samples join it. Off by default:
        # on this 2-core CPU it measured 0.88x static batching at 8 concurrent two-turn rollouts,
        # 1.12x at 32 and 1.02x at 64 (bench/engine_throughput.py), again 0.90x and 0.98x at 8 and
        # 32 once torch work ran on the sampling thread (2026-11-25), 0.98x and 0.92x once a shared
        # prefix was read once per token (static 78.6 and 155.9 tok/s), and a join holds the old and
        # the new cache at once (the 64-rollout soak peaked ~1 GiB higher). A join copies every
        # running row's cache; a slot-allocated cache that new rows write into is what would make it pay.
        self.continuous = continuous
        # A join copies every running row's cache into a new one and prefills the newcomers on
        # their own, so it is worth it only for several rows at once: queued rows join when they
        # are `join_fraction` of the running ones, or the first of them has waited `join_wait_s`.
        # (Joining each arrival alone made 64 concurrent rollouts crawl: one cache copy per row.)
        self.join_fraction = join_fraction
        self.join_wait_s = join_wait_s
        self._queued_since: float | None = None  # when a running batch first saw a queued request
        self.tokenizer = policy.tokenizer
        self.stop_ids = stop_ids
        self.max_batch_rows = max_batch_rows
        # A new batch gathers requests until none has arrived for `batch_wait_s`, for at most
        # `batch_wait_max_s`. The endpoint hands a burst over one by one (rendering each takes a few
        # ms), so a fixed window from the first request split 32 concurrent rollouts into batches
        # of 1 and 31, and the 31 waited for the first to finish decoding.
        self.batch_wait_s = batch_wait_s
        self.batch_wait_max_s = batch_wait_max_s
        self.step = 0
        self.batches = 0
        self.prefix_computes = 0  # times a shared prompt prefix was prefilled (not found cached)
        self.prefix_tokens_saved = 0  # prompt tokens whose prefill a shared prefix spared
        self.rows_joined = 0  # rows admitted into a batch that was already sampling
        self._served = 0
        # why requests are refused (closed, or the worker stays down); None while serving. Read and
        # set under `_lock` with each enqueue, so nothing is queued after the last drain.
        self._down: str | None = None
        self._lock = threading.Lock()
        embeddings = policy.model.get_input_embeddings()
        self._vocab = int(embeddings.weight.shape[0])  # token ids the model can embed
        self._context: int | None = getattr(policy.model.config, "max_position_embeddings", None)
        # requests; None: close; `_WAKE`: a call is pending (in `_calls`), for a take blocked here
        self._queue: queue.Queue[_Job | object | None] = queue.Queue()
        self._calls: collections.deque[_Call] = collections.deque()  # run before the next batch
        self._running: list[_Job] = []  # the batch being sampled
        self._grammars: Any = None
        self._grammars_lock = threading.Lock()
        # (policy version, token ids, per-layer (K, V)) of the last shared prompt prefix
        self._prefix: tuple[int, tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # the model's own attention while `shared_prefix_attention` stands in for it; None: not in use
        self._inner_attention: str | None = None
        self._thread = self._start_worker()

    @property
    def requests_served(self) -> int:
        return self._served

    @property
    def alive(self) -> bool:
        return self._down is None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        self._check_prompt(prompt_ids, params)
        constraint = params.constraint
        if constraint is not None:
            # Compile here, off the worker: a bad schema fails this request alone (InvalidFieldError,
            # a 400), not every request batched with it; the worker then finds it compiled.
            await asyncio.to_thread(lambda: self._grammar_cache().compile(constraint))
        loop = asyncio.get_running_loop()
        job = _Job(prompt_ids, params, loop, loop.create_future())
        with self._lock:
            if self._down is not None:
                raise EngineDownError(self._down)
            self._queue.put(job)
        return await job.future

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
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

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the sampling thread, between two batches, ahead of requests queued.

        Why not a worker thread: libgomp gives every thread that runs parallel torch work a team of
        its own, and once a process holds more OpenMP threads than CPUs its idle threads stop
        spinning and sleep, so each parallel op of a decode step then waits for a futex wake.
        Measured on 2 cores: after one training step on an `asyncio.to_thread` worker, a decode step
        of 32 rows took 160-190 ms instead of 118-140 ms for the rest of the run (rollouts 7.3-8.7 s
        instead of 5.4-6.4 s). One thread doing both keeps one team."""
        loop = asyncio.get_running_loop()
        call = _Call(functools.partial(fn, *args), loop, loop.create_future())
        with self._lock:
            if self._down is not None:
                raise EngineDownError(self._down)
            self._calls.append(call)  # ahead of every queued request, not behind them
            self._queue.put(_WAKE)
        return await call.future

    async def load_adapter(self, path: Path, step: int) -> None:
        # The trainer updated these very weights in place (and a resume loads them into the policy
        # before serving), so there is nothing to transfer: only the served step changes.
        self.step = step

    def close(self) -> None:
        """Stop the worker; requests still queued fail with EngineDownError instead of waiting."""
        with self._lock:
            self._down = self._down or "the in-process engine is closed"
            self._queue.put(None)

    def join(self, timeout: float) -> None:
        """Wait for the worker thread to finish after `close`."""
        self._thread.join(timeout)

    # -- worker thread ---------------------------------------------------------------------------

    def _start_worker(self) -> threading.Thread:
        thread = threading.Thread(target=self._work, name="journeyman-engine", daemon=True)
        thread.start()
        return thread

    def _work(self) -> None:
        carry: list[_Job] = []
        try:
            self._serve(carry)
        except BaseException as e:
            self._died(e, [*self._running, *carry])

    def _died(self, error: BaseException, held: list[_Job]) -> None:
        """The worker is dying of `error`. Never silently: the jobs it held fail (EngineDownError),
        and a fresh worker serves what is queued, unless this one is the `max_restarts`+1-th to die
        within `restart_window_s`; then the engine stays down and every request fails at once."""
        log.error("the in-process engine's worker died", exc_info=error)
        # What the dead worker was doing is dropped with it (its `sampling()` exited as it unwound).
        self._running, self._inner_attention, self._queued_since = [], None, None
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < self.restart_window_s]
        with self._lock:
            if self._down is None and len(self._deaths) >= self.max_restarts:
                self._down = (
                    f"the in-process engine's worker died {len(self._deaths) + 1} times within "
                    f"{self.restart_window_s:g} s (TorchEngine.max_restarts={self.max_restarts}); it "
                    f"stays down. Last error: {error!r}"
                )
            if self._down is None:
                try:
                    self._thread = self._start_worker()
                except RuntimeError as e:  # no thread to be had: nothing left to serve with
                    self._down = (
                        f"the in-process engine's worker died ({error!r}) and could not be restarted: {e}"
                    )
                else:
                    self._deaths.append(now)
                    self.restarts += 1
        restarted = self._down is None
        died = EngineDownError(
            f"the in-process engine's worker died while serving this request ({error!r}); "
            + ("a new worker serves the next requests" if restarted else str(self._down))
        )
        for j in held:
            hand_over(j.loop, j.future, error=died)
        if restarted:
            log.warning(
                "the in-process engine's worker restarted (%d in the last %g s, at most %d)",
                len(self._deaths),
                self.restart_window_s,
                self.max_restarts,
            )
        else:
            log.error("%s", self._down)
            self._fail_queued([], EngineDownError(str(self._down)))

    def _serve(self, carry: list[_Job]) -> None:
        batch: _Batch | None = None
        with contextlib.ExitStack() as held:
            while True:
                if batch is None:
                    held.close()  # idle: the weights are free for a training step
                    self._inner_attention = None
                    self._run_calls()
                    jobs = self._take(carry, self.max_batch_rows, wait=True)
                    if jobs is None:
                        self._fail_queued(carry)
                        return
                    if not jobs:  # a call came first
                        continue
                    self._running = [*self._running, *jobs]  # held now: failed, never lost
                    held.enter_context(self.policy.sampling())
                    self._inner_attention = held.enter_context(
                        prefix_attention(self.policy.model.get_base_model())
                    )
                    self._queued_since = None
                    batch = self._open(jobs, carry)
                elif (
                    self.continuous
                    and not self.policy.editors_waiting
                    and not self._calls
                    and self._worth_joining(batch, carry)
                ):
                    # Continuous batching: requests that arrived during earlier decode steps join
                    # the running batch now. None are admitted while a training step waits for the
                    # weights, so the batch drains and the step gets them.
                    jobs = self._take(carry, self.max_batch_rows - len(batch.rows), wait=False)
                    self._queued_since = None
                    if jobs:
                        self._running = [*self._running, *jobs]
                        batch = self._admit(batch, jobs, carry)
                if batch is not None:
                    batch = self._guarded(self._running, self._decode, batch)

    def _worth_joining(self, batch: _Batch, carry: list[_Job]) -> bool:
        """Whether the requests queued now should join the running batch (see `join_fraction`)."""
        queued = len(carry) + self._queue.qsize()  # jobs, not rows: a close enough count
        if not queued:
            self._queued_since = None
            return False
        if len(batch.rows) >= self.max_batch_rows:
            return False
        now = time.monotonic()
        if self._queued_since is None:
            self._queued_since = now
        return queued >= self.join_fraction * len(batch.rows) or now - self._queued_since >= self.join_wait_s

    def _run_calls(self) -> None:
        while self._calls:
            call = self._calls.popleft()
            if call.future.cancelled():
                continue
            try:
                result = call.fn()
            except Exception as e:
                hand_over(call.loop, call.future, error=e)
            except BaseException as e:  # it kills the worker (`_died`); the caller hears why
                down = EngineDownError(f"the in-process engine's worker died running this call: {e!r}")
                hand_over(call.loop, call.future, error=down)
                raise
            else:
                hand_over(call.loop, call.future, result)

    def _take(self, carry: list[_Job], room: int, wait: bool) -> list[_Job] | None:
        """Jobs for up to `room` rows: with `wait`, block for the first, then gather what arrives
        until a `batch_wait_s` gap (at most `batch_wait_max_s` in all); without, only what is
        queued now. None: the engine is closing. A pending call (`call`) ends the take with no
        jobs: it runs before the next batch, and the jobs gathered so far wait in `carry`."""
        jobs: list[_Job] = []
        rows = 0
        deadline = last_call = 0.0
        while True:
            if self._calls:
                carry[:0] = jobs
                return []
            if carry:
                job: _Job | object | None = carry.pop(0)
            else:
                try:
                    if wait and not jobs:
                        job = self._queue.get()
                    elif wait:
                        job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    else:
                        job = self._queue.get_nowait()
                except queue.Empty:
                    return jobs
            if job is None:
                if jobs or not wait:  # finish what runs; the next blocking take stops
                    self._queue.put(None)
                    return jobs
                return None
            if not isinstance(job, _Job):  # `_WAKE`: the pending call is seen at the loop's top
                continue
            if job.future.cancelled():  # its caller gave up (a timeout): no batch time spent on it
                continue
            # The first job of a new batch always fits; a running batch takes only what fits, and
            # never a job that must be batched alone.
            if (jobs or not wait) and (job.alone or rows + job.params.n > room):
                carry.insert(0, job)
                return jobs
            now = time.monotonic()
            if not jobs:
                last_call = now + self.batch_wait_max_s
            jobs.append(job)
            rows += job.params.n
            if job.alone:
                return jobs
            deadline = min(now + self.batch_wait_s, last_call)

    def _guarded(self, jobs: list[_Job], run: Callable[..., _Batch | None], *args: Any) -> _Batch | None:
        """Run one decode step; if it raises where no row can be singled out (the forward pass),
        the jobs it touched fail with the error (and leave the batch) while the engine goes on."""
        try:
            return run(*args)
        except Exception as e:
            for j in list(jobs):
                hand_over(j.loop, j.future, error=e)
            self._running = [j for j in self._running if j not in jobs]
            return None

    def _fail(self, job: _Job, error: Exception) -> None:
        """`job` alone fails with `error`; its rows leave the batch at the next decode step."""
        job.failed = True
        self._running = [j for j in self._running if j is not job]
        hand_over(job.loop, job.future, error=error)

    def _open(self, jobs: list[_Job], carry: list[_Job]) -> _Batch | None:
        """A new batch of `jobs`, prefilled; None when that raised (see `_isolate`)."""
        try:
            batch = self._prefill(jobs)
        except Exception as e:
            self._isolate(jobs, carry, e)
            return None
        self.batches += 1
        return batch

    @torch.inference_mode()
    def _admit(self, batch: _Batch, jobs: list[_Job], carry: list[_Job]) -> _Batch:
        """The running batch with `jobs` joined; as it was when their prefill or the join raised."""
        try:
            joined = _join(batch, self._prefill(jobs), self.policy.model.config)
        except Exception as e:
            self._isolate(jobs, carry, e)
            return batch
        self.batches += 1
        self.rows_joined += sum(j.params.n for j in jobs)
        return joined

    def _isolate(self, jobs: list[_Job], carry: list[_Job], error: Exception) -> None:
        """The prefill of `jobs` raised: one bad request must not fail the well-formed ones sent
        with it. Each job is prefilled alone (a cost paid only on failure); those that raise alone
        fail with their own error, the others go back to the front of the queue (`carry`). If none
        raises alone, the batch as a whole was the trouble (memory, say): each is then served in a
        batch of its own, so no batch can fail the same way twice."""
        if len(jobs) == 1:
            self._fail(jobs[0], error)
            return
        good: list[_Job] = []
        for j in jobs:
            try:
                self._prefill([j])
            except Exception as e:
                self._fail(j, e)
            else:
                good.append(j)
        if len(good) == len(jobs):
            log.warning("a prefill of %d requests failed (%r) though each alone did not", len(jobs), error)
            for j in good:
                j.alone = True
        self._running = [j for j in self._running if j not in good]
        carry[:0] = good

    def _fail_queued(self, carry: list[_Job], down: BaseException | None = None) -> None:
        down = down or EngineDownError("the in-process engine stopped before serving this request")
        waiting: list[_Job | _Call] = [*carry]
        while self._calls:
            waiting.append(self._calls.popleft())
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Job):
                waiting.append(job)
        for j in waiting:
            hand_over(j.loop, j.future, error=down)

    @torch.inference_mode()
    def _prefill(self, jobs: list[_Job]) -> _Batch:
        """A batch of `jobs`' rows, their prompts run, ready to sample each row's first token."""
        for j in jobs:
            j.samples, j.left = [None] * j.params.n, j.params.n
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
        fan = torch.tensor([slot[tuple(r.job.prompt_ids)] for r in rows], device=device)
        cache.reorder_cache(cast(torch.LongTensor, fan))  # stub wants the legacy LongTensor class
        return _Batch(
            rows,
            cache,
            mask[fan],
            pos[fan][:, -1:],
            out.logits[:, -1, :].float()[fan],
            torch.tensor([r.job.params.temperature for r in rows], device=device),
            torch.tensor([r.job.params.top_p for r in rows], device=device),
            prefix=shared,
        )

    @torch.inference_mode()
    def _decode(self, batch: _Batch) -> _Batch | None:
        """Sample one token for every row; answer the jobs whose rows all finished; run the next
        token of the rest. None when no row is left."""
        rows = batch.rows
        logp = torch.log_softmax(batch.logits, dim=-1)  # (B, V) raw policy, temperature 1
        nxt = self._sample(batch.logits, rows, batch.temps, batch.top_ps)
        chosen = logp.gather(1, nxt[:, None]).squeeze(1).tolist()
        k_top = max(r.job.params.top_logprobs for r in rows)
        top = logp.topk(k_top, dim=-1) if k_top else None
        keep = []
        failed = False
        for b, row in enumerate(rows):
            if row.job.failed:  # another of its rows failed (here or in `_sample`)
                failed = True
                continue
            try:
                tok = int(nxt[b])
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
                if row.finish is not None:
                    self._retire(row)
            except Exception as e:  # this row's own trouble (its matcher, its stop strings)
                self._fail(row.job, e)
                failed = True
                continue
            if row.finish is None:
                keep.append(b)
        if failed:  # rows kept before a later row of their job failed leave too
            keep = [b for b in keep if not rows[b].job.failed]
        if not keep:
            return None
        if len(keep) < len(rows):
            sel = torch.tensor(keep, device=nxt.device)
            batch.cache.reorder_cache(cast(torch.LongTensor, sel))
            batch.rows = [rows[b] for b in keep]
            batch.mask, batch.pos, nxt = batch.mask[sel], batch.pos[sel], nxt[sel]
            batch.temps, batch.top_ps = batch.temps[sel], batch.top_ps[sel]
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        batch.pos = batch.pos + 1
        out = self.policy.model(
            input_ids=nxt[:, None],
            attention_mask=batch.mask,
            position_ids=batch.pos,
            past_key_values=batch.cache,
            use_cache=True,
            **self._prefix_kwargs(batch.prefix),
        )
        batch.logits = out.logits[:, -1, :].float()
        return batch

    def _prefix_kwargs(self, prefix: int) -> dict[str, Any]:
        """What `shared_prefix_attention` needs to read the batch's shared prefix once."""
        if self._inner_attention is None or not prefix:
            return {}
        return {"prefix_slots": prefix, "prefix_attention": self._inner_attention}

    def _retire(self, row: _Row) -> None:
        """A finished row's sample goes to its job; the job is answered when its last row is done,
        not when the batch is."""
        job = row.job
        text = (
            row.text if row.text is not None else self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        )
        job.samples[row.index] = Sample(row.tokens, row.logprobs, row.finish or "length", text, row.top)
        job.left -= 1
        if job.left == 0:
            self._served += 1
            self._running = [j for j in self._running if j is not job]
            hand_over(job.loop, job.future, [s for s in job.samples if s is not None])

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
                try:
                    self._grammars.mask(row.grammar, logits, b)
                except Exception as e:  # its request fails; the row samples unmasked, then leaves
                    self._fail(row.job, e)
        # max's indices, not argmax: the same first maximum, at 0.6 ms instead of 1.4 for 32 rows
        # of SmolLM2's 49k vocabulary on this CPU (argmax's reduction does not vectorise here)
        greedy = logits.max(dim=-1).indices
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
        if bool(bad.any()):
            picks = torch.where(bad, probs.max(dim=-1).indices, picks)
        greedy[sampled_rows] = picks
        return greedy

    def _check_finished(self, row: _Row) -> None:
        p = row.job.params
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

    def _grammar(self, constraint: tuple[str, str, str] | None) -> Any:
        if constraint is None:
            return None
        return self._grammar_cache().matcher(constraint)

    def _grammar_cache(self) -> Any:
        with self._grammars_lock:
            if self._grammars is None:
                from journeyman.engine.grammar import GrammarCache

                self._grammars = GrammarCache(self.tokenizer, self.policy.model.config.vocab_size)
            return self._grammars


def _generator(seed: int | None, k: int, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    mixed = seed * 1_000_003 + k
    if not -(2**63) <= mixed < 2**64:  # what torch takes; seeds that fit keep their old streams
        mixed %= 2**64
    g.manual_seed(mixed)
    return g
