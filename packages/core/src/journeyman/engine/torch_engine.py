"""The in-process engine: batched sampling from the LoRA policy the trainer updates in place.

Why not transformers' continuous batching (`generate_batch`, paged attention): its logprobs come
after temperature/top-p, and it has no per-request seed, stop strings or grammar masks, nor a
prefix read once for every row. This engine is small and in four parts: `scheduler` (one worker
thread: requests join the running rows between decode steps, torch work runs when none runs, a
failure stays its request's, a dead worker is replaced), `batch` (chunked prefill and decode on the
model), `kv` with `slot_attention` (a slot a row, a shared prompt prefix read once, finished
turns' KV reused by the turns that extend them) and `sampler` (a token a row from its logits;
logprobs are those of the raw model distribution at temperature 1, the same quantity the trainer
computes). It samples with the adapter merged into the base weights
(`LoraPolicy.sampling`): with LoRA on every linear layer, PEFT's extra matmuls and dispatch cost
12-23% of a decode step of the embedded model (batch 32 and 8).

Several models on one base share one engine (`share_with`): one worker, one batch, each row through
its own model's adapter (`tenants`). Their weight changes (a training step, a checkpoint load) then
run on a thread of each model's own, taking that model's lock, so the others' rows keep decoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from journeyman.engine.base import Engine, FinishReason, OnToken, Sample, SamplingParams, T
from journeyman.engine.batch import BatchRunner, RunnerConfig
from journeyman.engine.sampler import generator, sample
from journeyman.engine.scheduler import Gone, Scheduler, SchedulerConfig
from journeyman.errors import EngineDownError
from journeyman.policy.lora import LoraPolicy

__all__ = ["TorchEngine"]


class TorchEngine(Engine):
    """Checks each request, hands it to the scheduler, and reports what the parts count. See
    `SchedulerConfig` for the batching and restart settings, `RunnerConfig` for prefill and KV.
    With `share_with` (an engine of another model on the same `BaseWeights`), this model joins
    that engine's batches and the other arguments are that engine's."""

    serves_other_steps = True  # on the slow path, one row at a time (`_sample_alone`)

    def __init__(
        self,
        policy: LoraPolicy,
        stop_ids: set[int],
        max_batch_rows: int = 64,
        batch_wait_s: float = 0.05,
        batch_wait_max_s: float = 0.25,
        prefill_chunk_tokens: int = 512,
        prefix_cache_bytes: int = 1 << 30,
        decode: Literal["auto", "eager", "fixed"] = "auto",
        max_restarts: int = 3,
        restart_window_s: float = 60.0,
        share_with: TorchEngine | None = None,
    ) -> None:
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.stop_ids = stop_ids
        self._calls: concurrent.futures.ThreadPoolExecutor | None = None  # this model's, when shared
        if share_with is not None:
            self.scheduler, self.runner = share_with.scheduler, share_with.runner
            self.tenant = self.runner.tenants.join(policy, stop_ids)
            return
        config = SchedulerConfig(
            max_batch_rows=max_batch_rows,
            batch_wait_s=batch_wait_s,
            batch_wait_max_s=batch_wait_max_s,
            max_restarts=max_restarts,
            restart_window_s=restart_window_s,
        )
        runner = BatchRunner(policy, stop_ids, RunnerConfig(prefill_chunk_tokens, prefix_cache_bytes, decode))
        self.scheduler = Scheduler(runner, config)  # starts the worker thread
        self.runner = self.scheduler.runner
        self.tenant = self.runner.tenants.first

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None = None
    ) -> list[Sample]:
        if self.tenant.closed:
            raise EngineDownError("this model's engine is closed")
        self.runner.check_prompt(prompt_ids, params)
        if params.base or params.adapter is not None:
            if params.constraint is not None:  # compiled off the worker, as below
                await asyncio.to_thread(self.runner.compile, params.constraint)
            # each step's requests in turn, each model's apart
            queue = f"{self.tenant.index}:" + ("base" if params.base else str(params.adapter))
            return await self.scheduler.aside(
                queue, functools.partial(self._sample_alone, prompt_ids, params, on_token)
            )
        constraint = params.constraint
        if constraint is not None:
            # Compile here, off the worker: a bad schema fails this request alone (InvalidFieldError,
            # a 400), not every request batched with it; the worker then finds it compiled.
            await asyncio.to_thread(self.runner.compile, constraint)
        return await self.scheduler.submit(prompt_ids, params, on_token, self.tenant.index)

    def _sample_alone(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None, gone: Gone
    ) -> list[Sample]:
        """Samples of the base model (the adapter switched off) or of another step's adapter (swapped
        in for this call, the served one put back after it). The batch runner's weights have the
        served adapter merged in, so these rows cannot join its batches: they run one at a time
        between two batches, in turn with them (`Scheduler.aside`), with the plain model and its own
        KV cache (slower; for a validator, a comparison rollout, live training's canary). When
        `gone()` (the caller left) it stops at the next token."""
        policy, tok = self.policy, self.tokenizer
        out: list[Sample] = []
        weights = policy.base_only() if params.base else policy.swapped(Path(str(params.adapter)))
        with torch.inference_mode(), policy.editing(), weights:
            for k in range(params.n):
                rng = generator(params.seed, k, policy.device)
                step = policy.model(
                    input_ids=torch.tensor([prompt_ids], device=policy.device), use_cache=True
                )
                ids: list[int] = []
                lps: list[float] = []
                top: list[list[tuple[int, float]]] = []
                finish: FinishReason = "length"
                text: str | None = None
                matcher = self.runner.matcher(params.constraint)  # a grammar, as a batch row has
                while len(ids) < params.max_tokens:
                    if gone():
                        return out  # nobody reads it: the future is cancelled
                    logits = step.logits[:, -1].float()
                    draw = sample(
                        logits,
                        [params.temperature],
                        [params.top_p],
                        [rng],
                        allowed=None if matcher is None else self.runner.allowed(matcher, logits),
                        top_logprobs=params.top_logprobs,
                    )
                    t = int(draw.ids[0])
                    ids.append(t)
                    lps.append(float(draw.logprobs[0]))
                    if draw.top_ids is not None and draw.top_logprobs is not None:
                        top.append(
                            list(zip(draw.top_ids[0].tolist(), draw.top_logprobs[0].tolist(), strict=True))
                        )
                    if on_token is not None:
                        on_token(k, t)
                    if matcher is not None:
                        matcher.accept_token(t)
                    if t in self.stop_ids or (matcher is not None and matcher.is_terminated()):
                        finish = "stop"
                        break
                    if params.stop:
                        done = tok.decode(ids, skip_special_tokens=True)
                        hits = [done.find(s) for s in params.stop if s in done]
                        if hits:
                            text, finish = done[: min(hits)], "stop"
                            break
                    step = policy.model(
                        input_ids=torch.tensor([[t]], device=policy.device),
                        past_key_values=step.past_key_values,
                        use_cache=True,
                    )
                full = text if text is not None else str(tok.decode(ids, skip_special_tokens=True))
                out.append(Sample(ids, lps, finish, full, top, params.adapter_step))
        return out

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the sampling thread, between two batches (`Scheduler.call`). On an
        engine other models share, on this model's own thread instead: what changes its weights
        takes its lock (`LoraPolicy.editing`), which waits for its rows alone to leave the batch; the
        models' calls take turns, first asked first served."""
        if len(self.runner.tenants.all) == 1:
            return await self.scheduler.call(fn, *args)
        if self._calls is None:
            self._calls = concurrent.futures.ThreadPoolExecutor(1, f"journeyman-model-{self.tenant.index}")
        return await asyncio.get_running_loop().run_in_executor(
            self._calls, functools.partial(self._in_turn, fn, *args)
        )

    def _in_turn(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in this model's turn among the engine's models (`Tenants.turns`)."""
        with self.runner.tenants.turns.turn():
            return fn(*args)

    async def load_adapter(self, path: Path, step: int) -> None:
        # The trainer updated these very weights in place (and a resume loads them into the policy
        # before serving), so there is nothing to transfer: the served step changes, and the label
        # the engine stamps on what it samples (set with the weights by a step; here for a resume)
        self.step = self.policy.step = step

    def close(self) -> None:
        """Stop the worker; requests still queued fail with EngineDownError instead of waiting. On a
        shared engine, this model leaves it; the worker stops with the last one."""
        tenants = self.runner.tenants
        tenants.leave(self.tenant)
        if self._calls is not None:
            self._calls.shutdown(wait=False)
        if all(t.closed for t in tenants.all):
            self.scheduler.close()

    def join(self, timeout: float) -> None:
        """Wait for the worker thread to finish after `close`."""
        self.scheduler.join(timeout)

    @property
    def requests_served(self) -> int:
        return self.scheduler.served

    @property
    def alive(self) -> bool:
        return self.scheduler.alive and not self.tenant.closed

    @property
    def batches(self) -> int:
        """Admissions of requests into the runner (a gathered burst, or arrivals joining running rows)."""
        return self.scheduler.batches

    @property
    def rows_joined(self) -> int:
        """Rows admitted while other rows were running."""
        return self.scheduler.rows_joined

    @property
    def restarts(self) -> int:
        """Times a worker thread died and was replaced."""
        return self.scheduler.restarts

    @property
    def prefix_computes(self) -> int:
        """Times a shared prompt prefix was prefilled (not found cached)."""
        return self.runner.prefix_computes

    @property
    def prefix_tokens_saved(self) -> int:
        """Prompt tokens whose prefill a shared prefix spared."""
        return self.runner.prefix_tokens_saved

    def counters(self) -> dict[str, int]:
        """Running counts of prefill and KV reuse (`BatchRunner.counters`): the step metrics report
        their change over each rollout phase."""
        return {
            **self.runner.counters(),
            "requests_served": self.scheduler.served,
            "requests_cancelled": self.scheduler.cancelled,
            "requests_queued": self.scheduler.queued,
            "rows_running": self.runner.row_count,
        }
