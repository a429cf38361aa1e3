"""One GRPO-family update of the LoRA adapter on a list of trajectory groups.

tokenize (exact sampled ids) -> group advantages -> packed micro-batches -> loss -> AdamW.
The LM head runs only on trained positions: prompt tokens need hidden states, not logits.

A micro-batch is one packed sequence (`pack_rows`): rows sorted by their token ids and laid end to
end, each after the longest prefix it shares with the row before it, which is already in the
sequence. A 4-D attention mask lets every token see the tokens of its own row up to itself, whether
its row put them there or an earlier row did, so a row's hidden states, logprobs and gradients are
those of the row run alone (test_train.py), with no padding and each shared prompt prefix run once
per micro-batch: the step-wide system prompt and tool definitions of agent rows (~570 of ~700
tokens on an MCP server), and also the prompt the rows of one group share. The padded path
(`pad_rows`, `trained_logprobs`: a prefix common to every row of a batch run once and its keys and
values expanded to the batch) is kept as the reference, and for SFT with packing off.

Why one mask over a packed sequence rather than padded batches with a prefix in a KV cache, counted
on the rows of two `bench/grpo_step.py` steps (8 groups x 4 rows of 35-67 tokens; a group's rows
share their ~26-token prompt, all rows only 14, under `MIN_SHARED_PREFIX`): padded, the model ran
2048 and 1569 token positions (7.7% and 12.3% padding); packed, 1132 and 777, 0.55x and 0.50x,
since besides the group prompts, samples that begin alike (or are alike) share those tokens too.
Bucketing by group with each group's prompt in a KV cache would still pad and run each sample's
own tokens in full (~1400 positions). Attention does not run over the whole packed sequence: one
masked (L, L) product cost ~4·L·d FLOPs a token per layer, +30% a token at L=1024 against the
linear layers of SmolLM2-135M (d=576), and SDPA forward and backward took 1.25 s of a 6.8 s step.
`row_attention` runs each row's own span against its own tokens only, so a longer budget, which
lets a long agent prefix (~570 tokens) be shared by more rows, costs no quadratic term.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from journeyman.chat.formats import ChatFormat
from journeyman.data.config import TrainConfig
from journeyman.data.prefix import MIN_SHARED_PREFIX, common_prefix_length
from journeyman.data.types import TrajectoryGroup
from journeyman.policy.lora import LoraPolicy, attention_implementation, cache_kv
from journeyman.training.collective import Collective, balanced_share
from journeyman.training.loss import group_advantages, head_logprobs, policy_loss
from journeyman.training.rows import Row, trajectory_rows

# what each micro-batch adds up (loss.policy_loss's metrics and the logprob gap): the same keys on every rank
METRIC_KEYS = frozenset({"policy_loss", "clip_fraction", "kl", "ratio_mean", "engine_trainer_logprob_gap"})


def build_rows(
    groups: Sequence[TrajectoryGroup], chat_format: ChatFormat, config: TrainConfig
) -> tuple[list[Row], dict[str, float]]:
    """Rows with advantages; groups whose rewards are all equal carry no signal and are dropped."""
    rows: list[Row] = []
    zero = 0
    for gi, group in enumerate(groups):
        rewards = torch.tensor(group.rewards(), dtype=torch.float64)
        if len(rewards) < 2 or float(rewards.max() - rewards.min()) < max(1e-9, config.min_reward_spread):
            zero += 1
            continue
        adv = group_advantages(rewards, scale_by_std=config.scale_rewards)
        for ti, (traj, a) in enumerate(zip(group.trajectories, adv.tolist(), strict=True)):
            rows += trajectory_rows(traj, chat_format, a, where=f"groups[{gi}].trajectories[{ti}]")
    truncated = truncate_rows(rows, config.max_seq_len)
    rows = [r for r in rows if r.num_trained and r.advantage != 0.0]
    return rows, {
        "groups": float(len(groups)),
        "groups_zero_signal": float(zero),
        "rows": float(len(rows)),
        "rows_truncated": float(truncated),
        "rows_retokenized": float(sum(r.retokenized for r in rows)),
    }


def truncate_rows(rows: Sequence[Row], max_seq_len: int) -> int:
    """Cut rows longer than `max_seq_len` tokens in place; returns how many were cut."""
    truncated = 0
    for r in rows:
        if len(r.input_ids) > max_seq_len:
            truncated += 1
            del r.input_ids[max_seq_len:], r.trained[max_seq_len:], r.rollout_logprobs[max_seq_len:]
    return truncated


def shared_prefix_length(rows: Sequence[Row]) -> int:
    """Tokens every row starts with, short of the position that predicts any row's first trained token."""
    limit = min((r.trained.index(True) if True in r.trained else len(r.input_ids)) - 1 for r in rows)
    n = common_prefix_length([r.input_ids for r in rows], limit)
    return n if n >= MIN_SHARED_PREFIX else 0


def micro_batches(rows: list[Row], budget: int, shared: int = 0) -> Iterator[list[Row]]:
    """Length-sorted batches whose padded size, beyond the `shared` prefix, stays under `budget` tokens."""
    batch: list[Row] = []
    width = 0
    for r in sorted(rows, key=lambda r: len(r.input_ids)):
        w = max(width, len(r.input_ids) - shared)
        if batch and w * (len(batch) + 1) > budget:
            yield batch
            batch, w = [], len(r.input_ids) - shared
        batch.append(r)
        width = w
    if batch:
        yield batch


class PackedInputs(NamedTuple):
    ids: torch.Tensor  # (1, L)
    positions: torch.Tensor  # (1, L) each token's position in its row
    mask: torch.Tensor  # (1, 1, L, L) True where a token may attend
    places: torch.Tensor  # (B, T) where row b's token t sits in the sequence (0 past the row's end)
    # per row, (start, end, places): the span of the sequence it put there, and the places of all
    # its tokens (shared prefix included), the keys its span's queries attend to (`row_attention`)
    spans: list[tuple[int, int, torch.Tensor]]


@dataclass
class Pack:
    """Rows run as one sequence, each after the prefix it shares with the row before it (`pack_rows`)."""

    rows: list[Row] = field(default_factory=list)
    # per row, the place in the sequence of each of its tokens: a shared prefix's places are the
    # places the row before it gave that prefix
    places: list[list[int]] = field(default_factory=list)
    # per row, the span [start, end) of the sequence its own tokens (past the shared prefix) fill
    spans: list[tuple[int, int]] = field(default_factory=list)
    length: int = 0

    def add(self, row: Row, shared: int) -> None:
        """Append `row`, of which the first `shared` tokens are those of the last row added."""
        n = len(row.input_ids)
        prefix = self.places[-1][:shared] if shared else []
        self.places.append(prefix + list(range(self.length, self.length + n - shared)))
        self.spans.append((self.length, self.length + n - shared))
        self.rows.append(row)
        self.length += n - shared

    def inputs(self, device: torch.device) -> PackedInputs:
        """The sequence as model inputs; the mask lets a token see the tokens of its row up to
        itself, no other row's, so a row packed here gives the logprobs it gives alone."""
        ids = torch.zeros(self.length, dtype=torch.long)
        positions = torch.zeros(self.length, dtype=torch.long)
        mask = torch.zeros((self.length, self.length), dtype=torch.bool)
        places = torch.zeros((len(self.rows), max(len(p) for p in self.places)), dtype=torch.long)
        for b, (row, where) in enumerate(zip(self.rows, self.places, strict=True)):
            at = torch.tensor(where)
            ids[at] = torch.tensor(row.input_ids)
            positions[at] = torch.arange(len(where))
            # a shared token gets the same mask row from every row that holds it: the shared prefix
            mask[at[:, None], at] = torch.ones((len(where), len(where)), dtype=torch.bool).tril()
            places[b, : len(where)] = at
        spans = [
            (start, end, torch.tensor(where, device=device))
            for (start, end), where in zip(self.spans, self.places, strict=True)
        ]
        return PackedInputs(
            ids[None].to(device),
            positions[None].to(device),
            mask[None, None].to(device),
            places.to(device),
            spans,
        )


def pack_rows(rows: Sequence[Row], budget: int) -> list[Pack]:
    """Rows into sequences of at most `budget` tokens (a longer row alone), each row after the
    longest prefix it shares with the row before it in its sequence.

    Sorted by token ids, a row's longest common prefix with any earlier row is the one with the row
    just before it, so filling sequences in that order puts every shared prefix in once per
    sequence; rows of one group (one prompt) sit side by side."""
    packs: list[Pack] = []
    for row in sorted(rows, key=lambda r: r.input_ids):
        n = len(row.input_ids)
        last = packs[-1] if packs else None
        shared = common_prefix_length([last.rows[-1].input_ids, row.input_ids], n) if last else 0
        if last is None or last.length + n - shared > budget:
            last, shared = Pack(), 0
            packs.append(last)
        last.add(row, shared)
    return packs


def packed_attention_mask(
    config: Any, inputs: PackedInputs, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask `packed_logprobs` hands the model. A model with sliding-window layers (Gemma 3,
    Mistral) builds its window into the masks it makes itself, and uses a given mask as is, so the
    window goes into ours: a token sees its row's last `sliding_window` positions only. Models that
    mix full and sliding layers take one mask per layer type."""
    mask = inputs.mask
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = None
    if window and ("sliding_attention" in layer_types or not layer_types):
        pos = inputs.positions[0]
        sliding = mask & ((pos[:, None] - pos[None, :]) < window)[None, None]
    if config._attn_implementation != "sdpa":  # additive masks
        mask, sliding = (
            None
            if m is None
            else torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
            for m in (mask, sliding)
        )
    assert mask is not None
    if sliding is None:
        return mask
    if not layer_types:  # every layer slides (Mistral with `sliding_window` set)
        return sliding
    return {"full_attention": mask, "sliding_attention": sliding}


ROW_ATTENTION = "journeyman_rows"


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    pack_spans: list[tuple[int, int, torch.Tensor]],
    pack_attention: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed sequence one row at a time: the queries of a row's own span against
    the keys of that row's tokens only, through the model's own attention function (`pack_attention`)
    with the matching block of the packed mask (causal, sliding window). The same numbers as the
    whole (L, L) masked product, for the sum over rows of span x row length instead of L²: on
    `bench/grpo_step.py` packs of ~1000 tokens, ~25x fewer score entries.

    Every row's keys and values are gathered in one index and cut apart with `split`, and the
    queries split by span (the spans tile the sequence in order): the backward of that is one
    concatenation and one scatter-add. Indexing or slicing row by row gave each row's gradient the
    shape of the whole sequence, zero-filled and added up: per layer, rows x (L, head dim) of memory
    traffic for keys, values and queries alike: 8-22% of a CPU train step (two runs on the same groups)."""
    inner = ALL_ATTENTION_FUNCTIONS[pack_attention]
    places = torch.cat([keys for _, _, keys in pack_spans])  # (sum of row lengths,)
    lengths = [len(keys) for _, _, keys in pack_spans]
    row_keys = key[:, :, places].split(lengths, dim=2)
    row_values = value[:, :, places].split(lengths, dim=2)
    row_queries = query.split([end - start for start, end, _ in pack_spans], dim=2)
    outs = []
    for (start, end, keys), q, k, v in zip(pack_spans, row_queries, row_keys, row_values, strict=True):
        if start == end:  # a row the one before it holds whole (the same sample twice)
            continue
        mask = None if attention_mask is None else attention_mask[:, :, start:end][..., keys]
        out, _ = inner(module, q, k, v, mask, **kwargs)
        outs.append(out)  # (1, span, heads, head dim)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(ROW_ATTENTION, row_attention)


def packed_logprobs(
    policy_model: Any, inputs: PackedInputs, rows: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """log π(target) at the trained positions of a packed sequence only, as `trained_logprobs` gives
    them for the same rows padded: (rows, pos) index the (B, T-1) target grid of `Pack.rows`.

    transformers uses a 4-D mask as given: SDPA takes it as a boolean (True = attend), the other
    attention implementations (eager) add it to the scores. Attention runs row by row (`row_attention`)."""
    causal_lm: Any = policy_model.get_base_model()
    mask = packed_attention_mask(causal_lm.config, inputs, causal_lm.dtype)
    with attention_implementation(causal_lm, ROW_ATTENTION) as inner:
        hidden = causal_lm.model(
            input_ids=inputs.ids,
            position_ids=inputs.positions,
            attention_mask=mask,
            use_cache=False,
            pack_spans=inputs.spans,
            pack_attention=inner,
        ).last_hidden_state  # (1, L, H)
    # the hidden state at position p of a row predicts its token p + 1, the target at pos = p
    at, targets = inputs.places[rows, pos], inputs.ids[0, inputs.places[rows, pos + 1]]
    return head_logprobs(hidden[0, at], causal_lm.lm_head, targets)


def pad_rows(batch: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, trained mask, rollout logprobs), each (B, T): rows right-padded to the longest."""
    width = max(len(r.input_ids) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    trained = torch.zeros((len(batch), width), dtype=torch.bool)
    rollout = torch.full((len(batch), width), math.nan)
    for i, r in enumerate(batch):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attn[i, :n] = 1
        trained[i, :n] = torch.tensor(r.trained)
        rollout[i, :n] = torch.tensor(r.rollout_logprobs)
    return ids, attn, trained, rollout


def trained_logprobs(
    policy_model: Any,
    ids: torch.Tensor,
    attn: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    targets: torch.Tensor,
    shared: int = 0,
) -> torch.Tensor:
    """log π(target) at the trained positions only: the LM head skips every prompt token.

    `policy_model` is the PEFT model; (rows, pos) index the (B, T-1) target grid, whose position p
    is predicted by the hidden state at p. The first `shared` tokens, the same in every row and
    never trained, run once (see the module docstring); hidden states are then computed for the
    rest only.
    """
    causal_lm: Any = policy_model.get_base_model()
    if not shared:
        hidden = causal_lm.model(input_ids=ids, attention_mask=attn).last_hidden_state  # (B, T, H)
        # the hidden state at position p predicts token p + 1, the target at pos = p
        return head_logprobs(hidden[rows, pos], causal_lm.lm_head, targets)
    b = ids.shape[0]
    prefix = DynamicCache()
    causal_lm.model(input_ids=ids[:1, :shared], past_key_values=prefix, use_cache=True)
    cache = DynamicCache()
    for layer, (k, v) in enumerate(cache_kv(prefix)):
        cache.update(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1), layer)
    positions = torch.arange(shared, ids.shape[1], device=ids.device)[None].expand(b, -1)
    hidden = causal_lm.model(
        input_ids=ids[:, shared:],
        attention_mask=attn,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state  # (B, T - shared, H): position t of the row is hidden[:, t - shared]
    return head_logprobs(hidden[rows, pos - shared], causal_lm.lm_head, targets)


def _return_freed_memory() -> None:
    """Hand freed activation memory back to the OS after a step (glibc only).

    Measured here: without this, glibc keeps the freed activations of each step in its arenas and
    the process grows by ~2 GB per step (1.5 GB -> 8.6 GB in 4 steps on the 135M model, then OOM
    on a 24 GB machine); with it the process stays at ~1.5 GB between steps.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class GRPOTrainer:
    """Holds the optimizer across steps for one policy."""

    def __init__(self, policy: LoraPolicy, chat_format: ChatFormat) -> None:
        self.policy = policy
        self.chat_format = chat_format
        self.optimizer: torch.optim.Optimizer | None = None
        self._lr: float | None = None

    def _optimizer(self, config: TrainConfig) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                self.policy.trainable_parameters(),
                lr=config.learning_rate,
                betas=config.betas,
                weight_decay=config.weight_decay,
            )
        for g in self.optimizer.param_groups:  # a new config may change these between steps
            g["lr"], g["betas"], g["weight_decay"] = config.learning_rate, config.betas, config.weight_decay
        return self.optimizer

    def save_optimizer(self, path: Path) -> None:
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load_optimizer(self, path: Path) -> None:
        file = path / "optimizer.pt"
        self.optimizer = None  # a checkpoint saved before any step: the next step starts a fresh one
        if file.exists():
            self.optimizer = torch.optim.AdamW(self.policy.trainable_parameters())
            self.optimizer.load_state_dict(torch.load(file, map_location=self.policy.device))

    def step(
        self,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        on_progress: Callable[[int, int], None] | None = None,
        collective: Collective | None = None,
    ) -> tuple[bool, dict[str, float]]:
        """One optimizer step. Returns (updated, metrics); updated is False when there was no signal.

        `on_progress(done, total)` is called after each of this rank's micro-batches (from this
        thread). With a `collective` (data-parallel ranks, `distributed.py`), every rank is given
        the same groups, runs its share of the micro-batches, and the gradients and metric sums are
        summed over the ranks before the one clipped AdamW step that every rank applies."""
        t0 = time.perf_counter()
        rows, metrics = build_rows(groups, self.chat_format, config)
        rewards = [t.reward for g in groups for t in g.trajectories]
        metrics["reward"] = sum(rewards) / max(1, len(rewards))
        metrics["reward_std"] = float(torch.tensor(rewards).std(unbiased=False)) if len(rewards) > 1 else 0.0
        if not rows:
            return False, metrics
        num_tokens = sum(r.num_trained for r in rows)
        metrics["trained_tokens"] = float(num_tokens)
        opt = self._optimizer(config)
        model = self.policy.model
        with self.policy.editing():
            model.train()
            opt.zero_grad(set_to_none=True)
            totals: dict[str, float] = {}
            batches = pack_rows(rows, config.micro_batch_tokens)
            # tokens the model runs, against the rows' own lengths: what running shared prefixes once saves
            metrics["forward_tokens"] = float(sum(b.length for b in batches))
            metrics["row_tokens"] = float(sum(len(r.input_ids) for r in rows))
            if collective is not None:
                sizes = [b.length for b in batches]
                batches = [batches[i] for i in balanced_share(sizes, collective.rank, collective.world)]
            for i, batch in enumerate(batches):
                out = self._micro_step(batch, num_tokens, config)
                if on_progress is not None:
                    on_progress(i + 1, len(batches))
                for k, v in out.items():
                    totals[k] = totals.get(k, 0.0) + v
            if collective is not None:
                totals = self._sum_over_ranks(collective, totals)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.policy.trainable_parameters(), config.max_grad_norm
            )
            if not math.isfinite(float(grad_norm)):
                opt.zero_grad(set_to_none=True)
                model.eval()
                raise FloatingPointError(f"grad_norm={float(grad_norm)}: the step was not applied")
            opt.step()
            self.policy.version += 1
            opt.zero_grad(set_to_none=True)
            model.eval()
        metrics.update(totals)
        metrics["grad_norm"] = float(grad_norm)
        metrics["train_seconds"] = time.perf_counter() - t0
        _return_freed_memory()
        return True, metrics

    def _sum_over_ranks(self, collective: Collective, totals: dict[str, float]) -> dict[str, float]:
        """Gradients and metric sums of every rank, summed (a rank with no micro-batch adds zeros)."""
        params = self.policy.trainable_parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        keys = sorted(METRIC_KEYS | totals.keys())
        sums = torch.tensor([totals.get(k, 0.0) for k in keys], dtype=torch.float64)
        collective.all_reduce([p.grad for p in params if p.grad is not None])
        collective.all_reduce([sums])
        return dict(zip(keys, sums.tolist(), strict=True))

    def _micro_step(self, pack: Pack, num_tokens: int, config: TrainConfig) -> dict[str, float]:
        device = self.policy.device
        inputs = pack.inputs(device)
        # the loss's (B, T) grid of the pack's rows: bookkeeping, no token of it runs through the model
        _, _, trained, rollout = pad_rows(pack.rows)
        trained, rollout = trained.to(device), rollout.to(device)
        # Token t is predicted from position t-1: shift, then keep trained targets only.
        target_mask = trained[:, 1:]  # (B, T-1)
        rows_idx, pos_idx = target_mask.nonzero(as_tuple=True)
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if config.autocast_bf16
            else contextlib.nullcontext()
        )
        with autocast:
            logp_flat = packed_logprobs(self.policy.model, inputs, rows_idx, pos_idx)
            ref_flat = None
            if config.kl_coef > 0:
                with torch.no_grad(), self.policy.base_only():
                    ref_flat = packed_logprobs(self.policy.model, inputs, rows_idx, pos_idx)
        # Back to (B, T-1) for the loss, which normalises per token.
        shape = target_mask.shape
        logp = torch.zeros(shape, device=device).index_put((rows_idx, pos_idx), logp_flat)
        rollout_lp = rollout[:, 1:]
        rollout_lp = torch.where(torch.isnan(rollout_lp), logp.detach(), rollout_lp)  # unknown: on-policy
        tis = None
        if config.tis_cap is not None:
            old = logp.detach()
            tis = torch.exp(old - rollout_lp).clamp(max=config.tis_cap) * target_mask
        else:
            old = rollout_lp
        ref = None
        if ref_flat is not None:
            ref = torch.zeros(shape, device=device).index_put((rows_idx, pos_idx), ref_flat.float())
        advantages = torch.tensor([r.advantage for r in pack.rows], device=device, dtype=torch.float32)
        mask = target_mask.float()
        loss, metrics = policy_loss(
            logp,
            old,
            advantages,
            mask,
            num_tokens,
            kind=config.loss,
            eps=config.eps,
            eps_high=config.eps_high,
            tis_weight=tis,
            ref_logp=ref,
            kl_coef=config.kl_coef,
        )
        loss.backward()
        with torch.no_grad():
            gap = ((logp.detach() - rollout_lp).abs() * mask).sum() / max(num_tokens, 1)
        metrics["engine_trainer_logprob_gap"] = float(gap)
        return metrics
