"""Rows on the policy's model: each in a KV slot of its own (`kv`), joining and leaving between two
decode steps, its prompt prefilled in chunks, a token sampled for every ready row at each step.

A row's prompt is not prefilled where its keys and values already exist (`prompt_kv`): the part a
shared prompt prefix covers is read from `SharedPrefix` by every row at once, and the part an earlier
turn covers is copied from `PrefixCache`. Identical prompts (n > 1) are prefilled once. Each row
keeps its own temperature, top-p, seed, stop strings and JSON-schema mask (`sampler`, `rows`).

A `BatchRunner` knows the model, not the queue: a step reports which requests it answered or
failed, and the scheduler (`scheduler`) tells their callers.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, Literal

import torch

from journeyman.engine.base import Constraint, SamplingParams
from journeyman.engine.decode_graph import DecodeGraphs, row_bucket
from journeyman.engine.grammar import LazyGrammars
from journeyman.engine.kv import KVPlan
from journeyman.engine.prompt_kv import PromptKV
from journeyman.engine.rows import Answer, Request, RequestT, Row, Step
from journeyman.engine.sampler import generator, sample
from journeyman.engine.slot_attention import slot_attention_on, unsupported_attention
from journeyman.engine.slots import RowSlots
from journeyman.engine.tenants import Tenants
from journeyman.errors import InvalidFieldError
from journeyman.policy.lora import LoraPolicy

__all__ = ["BatchRunner", "Request", "RunnerConfig", "Step"]


@dataclass
class RunnerConfig:
    """The runner's memory and prefill settings."""

    # Prompt tokens prefilled per forward pass (rows padded to the longest chunk count in full): a
    # long prompt is prefilled over several passes with decode steps between them, so it does not
    # stall every running row for its whole prefill.
    prefill_chunk_tokens: int = 512
    # Bytes of finished turns' KV kept for the turns that extend them (`PrefixCache`); the least
    # recently used go first. ~46 KB a token for the embedded 135M model in fp32.
    prefix_cache_bytes: int = 1 << 30
    # How a decode step runs (`decode_graph`): "fixed" pads it to bucketed shapes and, on CUDA,
    # captures each shape once as a CUDA graph and replays it; "eager" runs every step at its own
    # shape. "auto": "fixed" on CUDA, "eager" elsewhere (on the CPU a step is not launch-bound, and
    # padded rows would be computed for nothing).
    decode: Literal["auto", "eager", "fixed"] = "auto"


class BatchRunner(Generic[RequestT]):
    """Prefills and decodes rows on `policy`'s model, the rows in their KV slots (`slots`); with
    other models on the same base (`tenants`), rows of each in one batch. Its methods run on the
    scheduler's thread inside `sampling()`, except `check_prompt` and `compile`, which any thread
    may call."""

    def __init__(self, policy: LoraPolicy, stop_ids: set[int], config: RunnerConfig | None = None) -> None:
        self.policy = policy  # the first model's: the device, the tokenizer and the shapes are its base's
        self.tenants = Tenants(policy, stop_ids)
        self.config = config or RunnerConfig()
        self.tokenizer = policy.tokenizer
        self.device = policy.device
        causal_lm = policy.model.get_base_model()
        why = unsupported_attention(causal_lm.config)
        if why is not None:
            raise InvalidFieldError(
                "base_model",
                causal_lm.config.model_type,
                f"the in-process engine serves full attention only ({why}): use the vLLM engine",
            )
        self._use(causal_lm)
        text = causal_lm.config.get_text_config()
        heads = text.num_attention_heads
        layout = (
            text.num_hidden_layers,
            getattr(text, "num_key_value_heads", None) or heads,
            getattr(text, "head_dim", None) or text.hidden_size // heads,
            next(causal_lm.parameters()).dtype,
            policy.device,
        )
        self.prompt_kv = PromptKV(layout, self.config.prefix_cache_bytes, self._run)
        self.shared, self.cache = self.prompt_kv.shared, self.prompt_kv.cache
        self.slots: RowSlots[RequestT] = RowSlots(layout, self.prompt_kv)
        self.prefill_tokens = 0  # prompt tokens prefilled
        self.decode_steps = 0
        self.decode_rows = 0  # rows summed over decode steps: their mean is the batch decoded
        self.mixed_steps = 0  # decode steps whose rows were of two or more models
        self.decode_ms = 0.0  # time in decode forward passes
        self.prefill_ms = 0.0  # time in prefill passes (the shared prefix's included)
        embeddings = policy.model.get_input_embeddings()
        self._vocab = int(embeddings.weight.shape[0])  # token ids the model can embed
        self._context: int | None = getattr(text, "max_position_embeddings", None)
        self._grammars = LazyGrammars(self.tokenizer, policy.model.config.vocab_size)
        decode = self.config.decode
        if decode not in ("auto", "eager", "fixed"):
            raise InvalidFieldError("decode", decode, 'one of "auto", "eager", "fixed"')
        fixed = decode == "fixed" or (decode == "auto" and policy.device.type == "cuda")
        self.graphs = DecodeGraphs(self._run, self._head, policy.device, replay=True) if fixed else None
        if self.graphs is not None and self.graphs.replay:
            policy.before_edit(self._release)

    # -- any thread ----------------------------------------------------------------------------------

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse, before queueing, a prompt the model cannot read: an id past its embeddings fails
        the prefill of every request batched with it (on CUDA, a device assert ends the process)."""
        _check_prompt(prompt_ids, params, self._vocab, self._context)

    def compile(self, constraint: Constraint) -> None:
        """Compile a (prefix, schema, suffix) grammar ahead of its prefill; a bad schema raises
        InvalidFieldError here, for its own request alone."""
        self._grammars.get().compile(constraint)

    def matcher(self, constraint: Constraint | None) -> Any:
        """A grammar matcher for one row sampled outside the batches (None: unconstrained)."""
        return self._grammars.matcher(constraint)

    def allowed(self, matcher: Any, logits: torch.Tensor) -> torch.Tensor:
        """(1, V) the tokens `matcher` allows after what it accepted, for one row's logits (1, V)."""
        forbidden = logits.new_zeros(logits.shape)
        self._grammars.get().mask(matcher, forbidden, 0)
        return forbidden == 0

    # -- the scheduler's thread ----------------------------------------------------------------------

    @property
    def prefix_computes(self) -> int:
        """Times the shared prefix was computed or extended."""
        return self.prompt_kv.computes

    @property
    def prefix_tokens_saved(self) -> int:
        """Prompt tokens read from the shared prefix instead of prefilled."""
        return self.prompt_kv.tokens_saved

    @property
    def weights_wanted(self) -> bool:
        """Whether the runner should drain and go idle: a model joins or leaves, or (one model) a
        training step waits for the weights. With several models a step waits for its own model's
        rows alone (`split`)."""
        tenants = self.tenants
        return tenants.changing or (not tenants.mixed and bool(tenants.active[0].policy.editors_waiting))

    @property
    def busy(self) -> bool:
        """Whether any row is being prefilled or sampled."""
        return self.slots.count > 0

    @property
    def filling(self) -> bool:
        return self.slots.filling

    @property
    def ready(self) -> int:
        """Rows ready to sample."""
        return self.slots.ready

    @property
    def row_count(self) -> int:
        """Rows held: ready, prefilling, and waiting for a row with the same prompt."""
        return self.slots.count

    def filling_jobs(self) -> list[RequestT]:
        """The requests whose rows are still prefilling."""
        return self.slots.filling_jobs()

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Hold the weights to sample, with `slot_attention` in place, while rows are served;
        leaving frees them for a training step. One model: its `LoraPolicy.sampling` (the adapter
        merged in); several: the engine's own module, each model's lock taken as its rows join
        (`split`) and let go as they leave. Models join and leave here (the runner is idle), and
        keys and values computed under older weights are dropped."""
        tenants = self.tenants
        if tenants.apply():
            self._release()  # decode graphs hold the old module's shapes
            self.prompt_kv.refresh(tenants.versions())
        module = tenants.module
        weights = self.policy.attention_kernels() if tenants.mixed else tenants.active[0].policy.sampling()
        with weights, slot_attention_on(module):
            self._use(module)
            self.prompt_kv.refresh(tenants.versions())
            try:
                yield
            finally:
                tenants.release_all()
                # Idle: the slots go. One long row sizes every slot's capacity (rows x longest), so
                # a pool kept would hold its peak between rollout phases; regrowing it is cheap.
                # With decode graphs (which hold the pool's addresses) they stay until a training
                # step takes the weights (`_release`): an agent's tool call idles the engine often.
                if self.graphs is None or not self.graphs.replay:
                    self._release()

    def _release(self) -> None:
        """Let the slots and the decode graphs go (called while no row runs)."""
        self.slots.release()
        if self.graphs is not None:
            self.graphs.clear()

    def _use(self, causal_lm: Any) -> None:
        """Sample with `causal_lm`'s decoder and head."""
        self._decoder = causal_lm.get_decoder()
        self._head = causal_lm.get_output_embeddings()

    def split(self, jobs: list[RequestT]) -> tuple[list[RequestT], list[RequestT], list[RequestT]]:
        """`jobs` as (to admit now, to keep queued, refused: their model left the engine). With several
        models, a job is admitted only once its model's lock is held (`Tenants.hold`): a model whose
        training step waits gets no new rows while the others' join."""
        tenants = self.tenants
        now: list[RequestT] = []
        later: list[RequestT] = []
        refused: list[RequestT] = []
        active = {t.index for t in tenants.active}
        for job in jobs:
            tenant = tenants.all[job.tenant]
            if tenant.closed:
                refused.append(job)
            elif job.tenant not in active or (tenants.mixed and not tenants.hold(job.tenant)):
                later.append(job)
            else:
                now.append(job)
        return now, later, refused

    def _let_go(self) -> None:
        """Let go the locks of models no held row belongs to any more (mixed batches)."""
        self.tenants.release_unused(r.tenant for r in self.slots.held())

    @torch.inference_mode()
    def admit(self, jobs: list[RequestT]) -> None:
        """Give `jobs`' rows slots, with what of each prompt is already computed (the shared prefix, a
        cached earlier turn) in place; `fill` prefills the rest."""
        answers = [Answer(j, [None] * j.params.n, j.params.n) for j in jobs]
        if self.tenants.mixed:
            self.prompt_kv.refresh(self.tenants.versions())  # a model may have trained since
        # the shared prefix is one model's: the one with the most requests here
        tenant = collections.Counter(j.tenant for j in jobs).most_common(1)[0][0]
        prompts = list(dict.fromkeys(tuple(j.prompt_ids) for j in jobs if j.tenant == tenant))
        chunk = self.config.prefill_chunk_tokens
        self.prefill_tokens += self.prompt_kv.extend(prompts, self.slots.held(), chunk, tenant)
        leaders: dict[tuple[int, ...], Row[RequestT]] = {}
        added: list[Row[RequestT]] = []
        for a in answers:
            params = a.job.params
            for k in range(params.n):
                gen = generator(params.seed, k, self.device)
                row = Row(a, k, gen, self._grammars.matcher(params.constraint))
                key = (a.job.tenant, *a.job.prompt_ids)
                if key in leaders:
                    leaders[key].followers.append(row)
                    self.slots.waiting.append(row)
                else:
                    leaders[key] = row
                    added.append(row)
        self.slots.add(added)

    @torch.inference_mode()
    def drop(self, jobs: list[RequestT]) -> None:
        """Take `jobs`' rows out (their admission or prefill failed, or their callers left), ready or
        not; the others stay as they are."""
        self.slots.drop(jobs)
        self._let_go()

    @torch.inference_mode()
    def fill(self) -> None:
        """One prefill pass over the oldest prefilling rows, at most `prefill_chunk_tokens` (padded)
        tokens; rows whose prompt is then in the cache become ready to sample."""
        slots, pool = self.slots, self.slots.pool
        budget = max(1, self.config.prefill_chunk_tokens)
        chunks: list[int] = []
        for row in slots.rows[slots.ready :]:
            c = min(len(row.pending), budget)
            if chunks and (len(chunks) + 1) * max(*chunks, c) > budget:
                break
            chunks.append(c)
        lo, hi = slots.ready, slots.ready + len(chunks)
        rows = slots.rows[lo:hi]
        width = max(chunks)
        device = self.device
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, c) in enumerate(zip(rows, chunks, strict=True)):
            ids[i, :c] = torch.tensor(row.pending[:c])
        starts = torch.tensor([r.length for r in rows])
        pool.reserve(0, max(r.length for r in rows) + width)
        write = (starts[:, None] + torch.arange(width)).to(device)  # (n, width): right-padded
        own_k, own_v = pool.rows_view(lo, hi)
        plan = KVPlan.causal(own_k, own_v, write, max(r.length for r in rows) + width - 1)
        self.prompt_kv.attach(plan, rows)
        prefixes = torch.tensor([r.prefix for r in rows], device=device)
        t0 = time.perf_counter()
        hidden = self._run(ids.to(device), write + prefixes[:, None], plan, [r.tenant for r in rows])
        self.prefill_ms += (time.perf_counter() - t0) * 1000
        last = hidden[torch.arange(len(rows), device=device), torch.tensor(chunks, device=device) - 1]
        self.prefill_tokens += sum(chunks)
        done: list[int] = []
        for i, (row, c) in enumerate(zip(rows, chunks, strict=True)):
            row.length += c
            del row.pending[:c]
            if not row.pending:
                done.append(i)
        if done:
            logits = self._head(last[done]).float()
            for i, d in enumerate(done):  # promoting moves rows: each is found where it is now
                slots.promote(slots.rows.index(rows[d]), logits[i])

    @torch.inference_mode()
    def advance(self) -> Step[RequestT]:
        """Sample one token for every ready row; retire the rows that finished. A row that raises (its
        matcher, its stop strings) fails its own request, whose other rows stop too."""
        rows = self.slots.rows[: self.slots.ready]
        step: Step[RequestT] = Step()
        logits = self.slots.logits
        assert logits is not None
        allowed = self._allowed(rows, logits, step)
        draw = sample(
            logits,
            [r.params.temperature for r in rows],
            [r.params.top_p for r in rows],
            [r.generator for r in rows],
            allowed=allowed,
            top_logprobs=max(r.params.top_logprobs for r in rows),
        )
        # one transfer from the device: ids (< 2**53) and float32 logprobs are exact as float64
        ids_, chosen = torch.stack([draw.ids.double(), draw.logprobs.double()]).tolist()
        ids = [int(i) for i in ids_]
        for b, row in enumerate(rows):
            if row.answer.failed:  # another of its rows failed (here or in its grammar mask)
                continue
            try:
                k = row.params.top_logprobs
                top = None
                if k and draw.top_ids is not None and draw.top_logprobs is not None:
                    top = list(
                        zip(draw.top_ids[b, :k].tolist(), draw.top_logprobs[b, :k].tolist(), strict=True)
                    )
                row.accept(ids[b], chosen[b], top)
                row.check_finished(self.tenants.stop_ids(row.tenant), self.tokenizer)
                if row.finish is not None:
                    step.retire(row, row.sample(self.tokenizer, self.tenants.policy(row.tenant).step))
            except Exception as e:  # this row's own trouble
                step.fail(row.answer, e)
                continue
            if row.finish is None:
                step.keep.append(b)
        # rows kept before a later row of their request failed leave too
        step.keep = [b for b in step.keep if not rows[b].answer.failed]
        return step

    @torch.inference_mode()
    def forward(self, keep: list[int]) -> None:
        """Retire the ready rows not in `keep` (a step's) and run the model on each kept row's
        latest token: they are then ready to sample the next."""
        slots = self.slots
        slots.settle(keep)
        self._let_go()
        if not slots.ready:
            return
        rows = slots.rows[: slots.ready]
        t0 = time.perf_counter()
        fixed = self.graphs is not None and not self.tenants.mixed  # graphs hold one model's weights
        slots.logits = self._decode_fixed(rows) if fixed else self._decode_eager(rows)
        for r in rows:
            r.length += 1
        self.decode_steps += 1
        self.decode_rows += len(rows)
        self.mixed_steps += len({r.tenant for r in rows}) > 1
        self.decode_ms += (time.perf_counter() - t0) * 1000

    def reset(self) -> list[RequestT]:
        """Drop every row (a forward pass failed where no row can be singled out); returns their
        requests."""
        jobs = self.slots.reset()
        self._let_go()
        return jobs

    def counters(self) -> dict[str, int]:
        """What the runner counted since it was made (the step metrics take differences)."""
        return {
            "prefill_tokens": self.prefill_tokens,
            "decode_steps": self.decode_steps,
            "decode_rows": self.decode_rows,
            "decode_mixed_steps": self.mixed_steps,
            "decode_ms": round(self.decode_ms),
            "prefill_ms": round(self.prefill_ms),
            "prefix_computes": self.prefix_computes,
            "prefix_tokens_saved": self.prefix_tokens_saved,
            "prefix_cache_hits": self.cache.hits,
            "prefix_cache_tokens_reused": self.cache.tokens_reused,
            "prefix_cache_evictions": self.cache.evictions,
            "decode_graph_captures": self.graphs.captures if self.graphs is not None else 0,
            "decode_graph_replays": self.graphs.replays if self.graphs is not None else 0,
        }

    # -- internals -----------------------------------------------------------------------------------

    def _decode_eager(self, rows: list[Row[RequestT]]) -> torch.Tensor:
        """(n, V) the next-token logits of the ready `rows`, at this step's own shape."""
        device = self.device
        lengths = torch.tensor([r.length for r in rows])
        pool = self.slots.pool
        pool.reserve(0, int(lengths.max()) + 1)
        write = lengths[:, None].to(device)  # (n, 1)
        own_k, own_v = pool.rows_view(0, len(rows))
        plan = KVPlan.causal(own_k, own_v, write, int(lengths.max()))
        self.prompt_kv.attach(plan, rows)
        latest = torch.tensor([[r.tokens[-1]] for r in rows], device=device)
        prefixes = torch.tensor([[r.prefix] for r in rows], device=device)
        hidden = self._run(latest, write + prefixes, plan, [r.tenant for r in rows])
        return self._head(hidden[:, -1]).float()

    def _decode_fixed(self, rows: list[Row[RequestT]]) -> torch.Tensor:
        """The same at a bucketed shape (`DecodeGraphs`): replayed on CUDA."""
        assert self.graphs is not None
        padded = row_bucket(len(rows))
        lengths = [r.length for r in rows]
        held = [r.length for r in self.slots.rows[len(rows) : padded]]  # prefilling rows under the padding
        kv_len = self.graphs.attended(lengths, held)
        pool = self.slots.pool
        pool.reserve(padded, kv_len)
        shared = self.shared if any(r.prefix for r in rows) else None
        return self.graphs.logits(
            pool, shared, [r.tokens[-1] for r in rows], lengths, [r.prefix for r in rows], kv_len
        )

    def _run(
        self, ids: torch.Tensor, positions: torch.Tensor, plan: KVPlan, models: list[int] | None = None
    ) -> torch.Tensor:
        """The decoder's last hidden states (n, q, hidden) for `ids` at `positions` under `plan`; with
        several models, each row through its model's adapter (`models`: a model index a row)."""
        if self.tenants.mixed and models is None:
            raise RuntimeError("a forward pass of a mixed batch names no row's model")
        with self.tenants.forward(models or [], self.device):
            out = self._decoder(
                input_ids=ids, position_ids=positions, past_key_values=plan, use_cache=True, jm_plan=plan
            )
        return out.last_hidden_state

    def _allowed(
        self, rows: list[Row[RequestT]], logits: torch.Tensor, step: Step[RequestT]
    ) -> torch.Tensor | None:
        """(B, V) the tokens each row's grammar allows now; None when no row is constrained. A
        matcher that raises fails its request; that row samples unmasked, then leaves."""
        constrained = [b for b, r in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return None
        grammars = self._grammars.get()
        forbidden = logits.new_zeros(logits.shape)  # `mask` writes -inf where forbidden
        for b in constrained:
            row = rows[b]
            try:
                grammars.mask(row.grammar, forbidden, b)
            except Exception as e:
                forbidden[b] = 0.0
                step.fail(row.answer, e)
        return forbidden == 0


def _check_prompt(prompt_ids: list[int], params: SamplingParams, vocab: int, context: int | None) -> None:
    """`BatchRunner.check_prompt`, for a model of `vocab` token ids and `context` positions."""
    if not prompt_ids:
        raise InvalidFieldError("messages", prompt_ids, "the prompt has no tokens")
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise InvalidFieldError("messages", bad, f"token id outside the model's vocabulary [0, {vocab})")
    if context is not None and len(prompt_ids) + params.max_tokens > context:
        room = context - len(prompt_ids)
        if room < 1:
            raise InvalidFieldError(
                "messages",
                f"{len(prompt_ids)} tokens",
                f"the prompt leaves no room in the model's {context}-token context",
            )
        raise InvalidFieldError(
            "max_tokens",
            params.max_tokens,
            f"the prompt has {len(prompt_ids)} tokens: at most {room} fit the model's "
            f"{context}-token context",
        )
