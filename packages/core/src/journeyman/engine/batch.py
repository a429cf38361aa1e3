"""Rows on the policy's model: each in a KV slot of its own (`kv`), joining and leaving between two
decode steps, its prompt prefilled in chunks, a token sampled for every ready row at each step.

A row's prompt is not prefilled where its keys and values already exist: the part a shared prompt
prefix covers (system prompt, tool definitions: ~570 of ~600 tokens on an MCP server) is read from
`SharedPrefix` by every row at once, and the part an earlier turn covers (an agent's turn k+1
extends turn k's prompt and answer) is copied from `PrefixCache`. Identical prompts (n > 1) are
prefilled once. Each row keeps its own temperature, top-p, seed, stop strings and JSON-schema mask
(`sampler`).

A `BatchRunner` knows the model, not the queue: a step reports which requests it answered or
failed, and the scheduler (`scheduler`) tells their callers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import torch

from journeyman.data.prefix import MIN_SHARED_PREFIX, common_prefix_length
from journeyman.engine.base import Constraint, FinishReason, OnToken, Sample, SamplingParams
from journeyman.engine.decode_graph import DecodeGraphs, row_bucket
from journeyman.engine.kv import KVPlan, PrefixCache, PrefixEntry, SharedPrefix, SlotPool
from journeyman.engine.sampler import generator, sample
from journeyman.engine.slot_attention import slot_attention_on, unsupported_attention
from journeyman.errors import InvalidFieldError
from journeyman.policy.lora import LoraPolicy

if TYPE_CHECKING:
    from journeyman.engine.grammar import GrammarCache

__all__ = ["BatchRunner", "Request", "RunnerConfig", "Step"]


class Request(Protocol):
    """What a runner reads of a queued request (the scheduler's job)."""

    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def on_token(self) -> OnToken | None: ...


RequestT = TypeVar("RequestT", bound=Request)


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


@dataclass(eq=False)
class _Answer(Generic[RequestT]):
    """One request's samples, filled in by row as its rows finish."""

    job: RequestT
    samples: list[Sample | None]
    left: int  # rows still sampling
    failed: bool = False  # reported failed: its rows leave


@dataclass(eq=False)
class _Row(Generic[RequestT]):
    answer: _Answer[RequestT]
    index: int
    generator: torch.Generator | None
    grammar: Any = None  # xgrammar's matcher, when the output is constrained
    prefix: int = 0  # leading prompt tokens read from the shared prefix
    length: int = 0  # filled slots: the prompt after `prefix`, then every sampled token but the last
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    followers: list[_Row[RequestT]] = field(default_factory=list)  # rows of the same prompt, copied
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


@dataclass(eq=False)
class Step(Generic[RequestT]):
    """What one pass settled: requests whose last row finished (with their samples), requests that
    failed, and (from `advance`) the ready rows, by slot, that sample on."""

    answered: list[tuple[RequestT, list[Sample]]] = field(default_factory=list)
    failed: list[tuple[RequestT, Exception]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)


class BatchRunner(Generic[RequestT]):
    """Prefills and decodes rows on `policy`'s model. Rows `rows[:ready]` sample; the rest are being
    prefilled. Row i lives in slot i of `pool`. Its methods run on the scheduler's thread inside
    `sampling()`, except `check_prompt` and `compile`, which any thread may call."""

    def __init__(self, policy: LoraPolicy, stop_ids: set[int], config: RunnerConfig | None = None) -> None:
        self.policy = policy
        self.config = config or RunnerConfig()
        self.tokenizer = policy.tokenizer
        self.stop_ids = stop_ids
        causal_lm = policy.model.get_base_model()
        why = unsupported_attention(causal_lm.config)
        if why is not None:
            raise InvalidFieldError(
                "base_model",
                causal_lm.config.model_type,
                f"the in-process engine serves full attention only ({why}): use the vLLM engine",
            )
        self._decoder = causal_lm.get_decoder()
        self._head = causal_lm.get_output_embeddings()
        text = causal_lm.config.get_text_config()
        heads = text.num_attention_heads
        layout = (
            text.num_hidden_layers,
            getattr(text, "num_key_value_heads", None) or heads,
            getattr(text, "head_dim", None) or text.hidden_size // heads,
            next(causal_lm.parameters()).dtype,
            policy.device,
        )
        self._layout = layout
        self.pool = SlotPool(*layout)
        self.shared = SharedPrefix(*layout)
        self.cache = PrefixCache(self.config.prefix_cache_bytes)
        self.rows: list[_Row[RequestT]] = []
        self.ready = 0  # rows[:ready] sample; rows[ready:] are prefilling
        self.waiting: list[_Row[RequestT]] = []  # followers of a row still prefilling (no slot yet)
        self.logits: torch.Tensor | None = None  # (ready, V): each ready row's next-token logits
        self.prefix_computes = 0  # times the shared prefix was computed or extended
        self.prefix_tokens_saved = 0  # prompt tokens read from the shared prefix instead of prefilled
        self.prefill_tokens = 0  # prompt tokens prefilled
        self.decode_steps = 0
        self.decode_rows = 0  # rows summed over decode steps: their mean is the batch decoded
        self.decode_ms = 0.0  # time in decode forward passes
        self.prefill_ms = 0.0  # time in prefill passes (the shared prefix's included)
        embeddings = policy.model.get_input_embeddings()
        self._vocab = int(embeddings.weight.shape[0])  # token ids the model can embed
        self._context: int | None = getattr(text, "max_position_embeddings", None)
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()
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

    def compile(self, constraint: Constraint) -> None:
        """Compile a (prefix, schema, suffix) grammar ahead of its prefill; a bad schema raises
        InvalidFieldError here, for its own request alone."""
        self._grammar_cache().compile(constraint)

    def matcher(self, constraint: Constraint | None) -> Any:
        """A grammar matcher for one row sampled outside the batches (None: unconstrained)."""
        return self._grammar(constraint)

    def allowed(self, matcher: Any, logits: torch.Tensor) -> torch.Tensor:
        """(1, V) the tokens `matcher` allows after what it accepted, for one row's logits (1, V)."""
        forbidden = logits.new_zeros(logits.shape)
        self._grammar_cache().mask(matcher, forbidden, 0)
        return forbidden == 0

    # -- the scheduler's thread ----------------------------------------------------------------------

    @property
    def weights_wanted(self) -> bool:
        """Whether a training step waits for the weights this runner samples with."""
        return bool(self.policy.editors_waiting)

    @property
    def busy(self) -> bool:
        """Whether any row is being prefilled or sampled."""
        return bool(self.rows or self.waiting)

    @property
    def filling(self) -> bool:
        return len(self.rows) > self.ready

    @property
    def row_count(self) -> int:
        """Rows held: ready, prefilling, and waiting for a row with the same prompt."""
        return len(self.rows) + len(self.waiting)

    def filling_jobs(self) -> list[RequestT]:
        """The requests whose rows are still prefilling."""
        return list(dict.fromkeys(r.answer.job for r in [*self.rows[self.ready :], *self.waiting]))

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Hold the weights to sample (`LoraPolicy.sampling`), with `slot_attention` in place, while
        rows are served; leaving frees them for a training step. Keys and values computed under
        older weights are dropped on entry."""
        with self.policy.sampling(), slot_attention_on(self.policy.model.get_base_model()):
            version = self.policy.version
            if self.cache.version != version:
                self.cache.clear(version)
            if self.shared.version != version:
                self.shared.clear(version)
            try:
                yield
            finally:
                # Idle: the slots go. One long row sizes every slot's capacity (rows x longest), so
                # a pool kept would hold its peak between rollout phases; regrowing it is cheap.
                # With decode graphs (which hold the pool's addresses) they stay until a training
                # step takes the weights (`_release`): an agent's tool call idles the engine often.
                if self.graphs is None or not self.graphs.replay:
                    self._release()

    def _release(self) -> None:
        """Let the slots and the decode graphs go (called while no row runs)."""
        self.pool = SlotPool(*self._layout)
        if self.graphs is not None:
            self.graphs.clear()

    @torch.inference_mode()
    def admit(self, jobs: list[RequestT]) -> None:
        """Give `jobs`' rows slots, with what of each prompt is already computed (the shared prefix, a
        cached earlier turn) in place; `fill` prefills the rest."""
        answers = [_Answer(j, [None] * j.params.n, j.params.n) for j in jobs]
        prompts = list(dict.fromkeys(tuple(j.prompt_ids) for j in jobs))
        self._extend_shared(prompts)
        leaders: dict[tuple[int, ...], _Row[RequestT]] = {}
        added: list[_Row[RequestT]] = []
        for a in answers:
            for k in range(a.job.params.n):
                row = _Row(
                    a,
                    k,
                    generator(a.job.params.seed, k, self.policy.device),
                    self._grammar(a.job.params.constraint),
                )
                key = tuple(a.job.prompt_ids)
                if key in leaders:
                    leaders[key].followers.append(row)
                    self.waiting.append(row)
                else:
                    leaders[key] = row
                    added.append(row)
        self.pool.reserve(len(self.rows) + len(added), 0)
        for row in added:
            self.rows.append(row)
            self._place(row, len(self.rows) - 1)

    def drop(self, jobs: list[RequestT]) -> None:
        """Take `jobs`' rows out (their admission or prefill failed); the others stay as they are."""
        gone = {id(j) for j in jobs}
        self.waiting = [r for r in self.waiting if id(r.answer.job) not in gone]
        leaving = [i for i, r in enumerate(self.rows) if id(r.answer.job) in gone]
        orphans = [f for i in leaving for f in self.rows[i].followers if id(f.answer.job) not in gone]
        self._remove(leaving)
        for f in orphans:  # a row of another request with the same prompt: prefilled on its own now
            self.waiting.remove(f)
            self.pool.reserve(len(self.rows) + 1, 0)
            self.rows.append(f)
            self._place(f, len(self.rows) - 1)

    @torch.inference_mode()
    def fill(self) -> None:
        """One prefill pass over the oldest prefilling rows, at most `prefill_chunk_tokens` (padded)
        tokens; rows whose prompt is then in the cache become ready to sample."""
        budget = max(1, self.config.prefill_chunk_tokens)
        chunks: list[int] = []
        for row in self.rows[self.ready :]:
            c = min(len(row.pending), budget)
            if chunks and (len(chunks) + 1) * max(*chunks, c) > budget:
                break
            chunks.append(c)
        lo, hi = self.ready, self.ready + len(chunks)
        rows = self.rows[lo:hi]
        width = max(chunks)
        device = self.policy.device
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, c) in enumerate(zip(rows, chunks, strict=True)):
            ids[i, :c] = torch.tensor(row.pending[:c])
        starts = torch.tensor([r.length for r in rows])
        self.pool.reserve(0, max(r.length for r in rows) + width)
        write = (starts[:, None] + torch.arange(width)).to(device)  # (n, width): right-padded
        own_k, own_v = self.pool.rows_view(lo, hi)
        plan = KVPlan.causal(own_k, own_v, write, max(r.length for r in rows) + width - 1)
        self._with_prefix(plan, rows)
        prefixes = torch.tensor([r.prefix for r in rows], device=device)
        t0 = time.perf_counter()
        hidden = self._run(ids.to(device), write + prefixes[:, None], plan)
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
                self._promote(self.rows.index(rows[d]), logits[i])

    @torch.inference_mode()
    def advance(self) -> Step[RequestT]:
        """Sample one token for every ready row; retire the rows that finished. A row that raises (its
        matcher, its stop strings) fails its own request, whose other rows stop too."""
        rows = self.rows[: self.ready]
        step: Step[RequestT] = Step()
        assert self.logits is not None
        allowed = self._allowed(rows, step)
        draw = sample(
            self.logits,
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
                row.tokens.append(ids[b])
                row.logprobs.append(chosen[b])
                if row.answer.job.on_token is not None:
                    row.answer.job.on_token(row.index, ids[b])
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
    def forward(self, keep: list[int]) -> None:
        """Retire the ready rows not in `keep` (a step's) and run the model on each kept row's
        latest token: they are then ready to sample the next."""
        kept = set(keep)
        for b, row in enumerate(self.rows[: self.ready]):
            if b not in kept and row.finish is not None and not row.answer.failed:
                self._remember(row, b)
        gone = [b for b in range(self.ready) if b not in kept]
        gone += [i for i in range(self.ready, len(self.rows)) if self.rows[i].answer.failed]
        self.waiting = [r for r in self.waiting if not r.answer.failed]
        self._remove(gone)
        self.logits = None
        if not self.ready:
            return
        rows = self.rows[: self.ready]
        t0 = time.perf_counter()
        if self.graphs is not None:
            self.logits = self._decode_fixed(rows)
        else:
            self.logits = self._decode_eager(rows)
        for r in rows:
            r.length += 1
        self.decode_steps += 1
        self.decode_rows += len(rows)
        self.decode_ms += (time.perf_counter() - t0) * 1000

    def reset(self) -> list[RequestT]:
        """Drop every row (a forward pass failed where no row can be singled out); returns their
        requests."""
        jobs = list(dict.fromkeys(r.answer.job for r in [*self.rows, *self.waiting]))
        self.rows, self.waiting, self.ready, self.logits = [], [], 0, None
        return jobs

    def counters(self) -> dict[str, int]:
        """What the runner counted since it was made (the step metrics take differences)."""
        return {
            "prefill_tokens": self.prefill_tokens,
            "decode_steps": self.decode_steps,
            "decode_rows": self.decode_rows,
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

    def _decode_eager(self, rows: list[_Row[RequestT]]) -> torch.Tensor:
        """(n, V) the next-token logits of the ready `rows`, at this step's own shape."""
        device = self.policy.device
        lengths = torch.tensor([r.length for r in rows])
        self.pool.reserve(0, int(lengths.max()) + 1)
        write = lengths[:, None].to(device)  # (n, 1)
        own_k, own_v = self.pool.rows_view(0, len(rows))
        plan = KVPlan.causal(own_k, own_v, write, int(lengths.max()))
        self._with_prefix(plan, rows)
        latest = torch.tensor([[r.tokens[-1]] for r in rows], device=device)
        prefixes = torch.tensor([[r.prefix] for r in rows], device=device)
        hidden = self._run(latest, write + prefixes, plan)
        return self._head(hidden[:, -1]).float()

    def _decode_fixed(self, rows: list[_Row[RequestT]]) -> torch.Tensor:
        """The same at a bucketed shape (`DecodeGraphs`): replayed on CUDA."""
        assert self.graphs is not None
        padded = row_bucket(len(rows))
        lengths = [r.length for r in rows]
        held = [r.length for r in self.rows[len(rows) : padded]]  # prefilling rows under the padding
        kv_len = self.graphs.attended(lengths, held)
        self.pool.reserve(padded, kv_len)
        shared = self.shared if any(r.prefix for r in rows) else None
        return self.graphs.logits(
            self.pool, shared, [r.tokens[-1] for r in rows], lengths, [r.prefix for r in rows], kv_len
        )

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, plan: KVPlan) -> torch.Tensor:
        """The decoder's last hidden states (n, q, hidden) for `ids` at `positions` under `plan`."""
        out = self._decoder(
            input_ids=ids, position_ids=positions, past_key_values=plan, use_cache=True, jm_plan=plan
        )
        return out.last_hidden_state

    def _with_prefix(self, plan: KVPlan, rows: list[_Row[RequestT]]) -> None:
        """Let `plan` read the shared prefix, as far as each of `rows` uses it."""
        p = max(r.prefix for r in rows)
        if not p:
            return
        k, v = self.shared.per_layer()
        device = self.policy.device
        plan.prefix_k, plan.prefix_v = [t[:, :p] for t in k], [t[:, :p] for t in v]
        plan.prefix_mask = (
            torch.arange(p, device=device) < torch.tensor([r.prefix for r in rows], device=device)[:, None]
        )

    def _extend_shared(self, prompts: list[tuple[int, ...]]) -> None:
        """Compute (or extend) the shared prefix to what `prompts` share, when that is more than it and
        a cached earlier turn cover, by at least `MIN_SHARED_PREFIX` tokens. Each prompt keeps at
        least one token of its own, whose logits start its sampling. The prefix is replaced only
        while no row reads it."""
        want = common_prefix_length(prompts, min(len(p) for p in prompts) - 1)
        tokens = self.shared.tokens
        have = common_prefix_length([tokens, prompts[0]], min(len(tokens), want))
        hit = self.cache.find(prompts[0], want) if len(prompts) == 1 else None
        if want - max(have, hit[1] if hit else 0) < MIN_SHARED_PREFIX:
            return
        if have < len(tokens) and any(r.prefix > have for r in [*self.rows, *self.waiting]):
            return  # another prefix, still read by running rows
        self._prefill_shared(prompts[0][:want], have)

    def _prefill_shared(self, tokens: tuple[int, ...], start: int) -> None:
        """Run `tokens[start:]` at batch 1 after the shared prefix's first `start`, in chunks."""
        device = self.policy.device
        self.shared.reserve(1, len(tokens))
        self.shared.tokens = tokens[:start]
        step = max(1, self.config.prefill_chunk_tokens)
        for lo in range(start, len(tokens), step):
            hi = min(len(tokens), lo + step)
            write = torch.arange(lo, hi, device=device)[None]
            plan = KVPlan.causal(self.shared.k, self.shared.v, write, hi - 1)
            self._run(torch.tensor([tokens[lo:hi]], device=device), write, plan)
            self.shared.tokens = tokens[:hi]
        self.prefix_computes += 1
        self.prefill_tokens += len(tokens) - start

    def _place(self, row: _Row[RequestT], slot: int) -> None:
        """Put what is already computed of `row`'s prompt in its slot: a cached earlier turn's keys and
        values, or else the shared prefix's part; the rest is pending."""
        prompt = tuple(row.prompt)
        shared = common_prefix_length([prompt, self.shared.tokens], len(prompt) - 1)
        hit = self.cache.find(prompt, len(prompt) - 1)
        if hit is not None and hit[1] > shared:
            entry, length = hit
            if self.shared.tokens[: entry.prefix] == entry.prefix_tokens:
                row.prefix, row.length = entry.prefix, length - entry.prefix
                self.pool.reserve(0, row.length)
                self.pool.write(slot, entry.kv, row.length)
                row.pending = list(prompt[length:])
                self.cache.hits += 1
                self.cache.tokens_reused += row.length
                self.prefix_tokens_saved += row.prefix
                return
        row.prefix = shared if shared >= MIN_SHARED_PREFIX else 0
        row.length = 0
        row.pending = list(prompt[row.prefix :])
        self.prefix_tokens_saved += row.prefix

    def _promote(self, slot: int, logits: torch.Tensor) -> None:
        """The prefilling row in `slot` is ready to sample (`logits`: its first token's); so are its
        followers, each with a copy of its slot."""
        first = self.ready
        self._swap(first, slot)
        leader = self.rows[first]
        self._ready_with(logits)
        for f in leader.followers:
            self.waiting.remove(f)
            if f.answer.failed:
                continue
            f.prefix, f.length = leader.prefix, leader.length
            self.rows.append(f)
            last = len(self.rows) - 1
            self.pool.reserve(len(self.rows), f.length)
            self.pool.copy(first, last, f.length)
            self._swap(self.ready, last)  # a prefilling row there moves to the end
            self._ready_with(logits)
        leader.followers = []

    def _swap(self, a: int, b: int) -> None:
        ra, rb = self.rows[a], self.rows[b]
        self.pool.swap(a, ra.length, b, rb.length)
        self.rows[a], self.rows[b] = rb, ra

    def _ready_with(self, logits: torch.Tensor) -> None:
        self.ready += 1
        self.logits = logits[None] if self.logits is None else torch.cat([self.logits, logits[None]])

    def _remove(self, gone: list[int]) -> None:
        """Take the rows in slots `gone` out; the others keep their slots but for moves that close
        the gaps (ready rows first, then the prefilling ones)."""
        if not gone:
            return
        dead = set(gone)
        ready = [i for i in range(self.ready) if i not in dead]
        filling = [i for i in range(self.ready, len(self.rows)) if i not in dead]
        order = ready + filling
        rows: list[_Row[RequestT]] = []
        for dst, src in enumerate(order):  # ascending, each to a slot at or below its own: no clobbering
            self.pool.copy(src, dst, self.rows[src].length)
            rows.append(self.rows[src])
        self.rows, self.ready = rows, len(ready)

    def _remember(self, row: _Row[RequestT], slot: int) -> None:
        """A finished row's keys and values, for a later turn that extends its prompt and answer."""
        if row.length < 1:
            return
        tokens = (*row.prompt, *row.tokens[:-1])
        entry = PrefixEntry(
            tokens, row.prefix, self.shared.tokens[: row.prefix], self.pool.read(slot, row.length)
        )
        self.cache.put(entry)

    def _allowed(self, rows: list[_Row[RequestT]], step: Step[RequestT]) -> torch.Tensor | None:
        """(B, V) the tokens each row's grammar allows now; None when no row is constrained. A
        matcher that raises fails its request; that row samples unmasked, then leaves."""
        assert self.logits is not None
        constrained = [b for b, r in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return None
        grammars = self._grammar_cache()
        forbidden = self.logits.new_zeros(self.logits.shape)  # `mask` writes -inf where forbidden
        for b in constrained:
            row = rows[b]
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
        answer.samples[row.index] = Sample(
            row.tokens, row.logprobs, row.finish or "length", text, row.top, step=self.policy.step
        )
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

    def _grammar(self, constraint: Constraint | None) -> Any:
        if constraint is None:
            return None
        return self._grammar_cache().matcher(constraint)

    def _grammar_cache(self) -> GrammarCache:
        with self._grammars_lock:
            if self._grammars is None:
                from journeyman.engine.grammar import GrammarCache  # xgrammar, only when a schema comes

                self._grammars = GrammarCache(self.tokenizer, self.policy.model.config.vocab_size)
            return self._grammars
