"""Supervised fine-tuning of the LoRA adapter on good trajectories: the warm start before RL.

trajectories -> rows (`tokenize.trajectory_rows`: the sampled ids where a call was recorded, else
the chat template; only assistant turns trained, prompts and tool results masked) -> each epoch,
shuffled optimizer batches of `batch_size` trajectories -> micro-batches -> masked cross-entropy
-> AdamW, learning rate warmed up then decayed over the call. One call is one step of the run (one
checkpoint, one history row), as a GRPO step is, so RL continues from the adapter it leaves.

A micro-batch never lets one row attend to another:
- rows that share a prompt prefix (agent rows: system prompt and tool definitions, ~570 of ~700
  tokens on an MCP server) are padded into a batch and the prefix runs once for all of them
  (`train.trained_logprobs`, as in GRPO): that saves more than packing could;
- other rows are packed: concatenated into one sequence whose position ids restart at each row.
  Given no 2-D attention mask, transformers reads the restarts as separate sequences and builds a
  block-diagonal causal mask from them (`masking_utils.find_packed_sequence_indices`), so a packed
  row's logprobs are those of the row alone (test_sft.py), with no padding computed.

The optimizer is AdamW of its own, fresh for each call (its warmup and decay belong to the call);
the checkpoint keeps the GRPO optimizer's state as it was, so RL's moments never see SFT gradients.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .adapter import LoraPolicy
from .chat_format import ChatFormat
from .config import SFTConfig
from .loss import token_logprobs
from .tokenize import Row, trajectory_rows
from .train import (
    _return_freed_memory,
    micro_batches,
    pad_rows,
    shared_prefix_length,
    trained_logprobs,
    truncate_rows,
)
from .types import Trajectory


def sft_loss(logp: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Mean cross-entropy of the trained tokens: L = -(1/N) Σ_t log π_θ(x_t | x_<t).

    `logp` (n,): log π_θ of this micro-batch's trained tokens. N: the trained tokens of the whole
    optimizer batch, so the micro-batches' losses (and gradients) add up to the batch mean.
    """
    return -logp.sum() / max(num_tokens, 1)


def lr_factor(step: int, total: int, config: SFTConfig) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based) of `total`.

    Linear warmup over the first round(warmup_ratio x total) steps (the first step already moves),
    then cosine or linear decay from 1 to `min_lr_ratio` over the rest, or constant.
    """
    warmup = round(config.warmup_ratio * total)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.lr_schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)  # [0, 1)
    lo = config.min_lr_ratio
    if config.lr_schedule == "linear":
        return lo + (1 - lo) * (1 - progress)
    return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))


def predicted_tokens(row: Row) -> int:
    """Trained tokens a row can be trained on: every one but a row's first (nothing predicts it)."""
    return sum(row.trained[1:])


def sft_rows(
    trajectories: Sequence[Trajectory], chat_format: ChatFormat, max_seq_len: int
) -> tuple[list[list[Row]], dict[str, float]]:
    """Rows of each trajectory (cut to `max_seq_len`); a trajectory with nothing to train raises
    NoTrainableTokensError naming it (`trajectories[i]`)."""
    rows = [
        trajectory_rows(t, chat_format, 1.0, where=f"trajectories[{i}]") for i, t in enumerate(trajectories)
    ]
    flat = [r for rs in rows for r in rs]
    truncated = truncate_rows(flat, max_seq_len)
    rows = [[r for r in rs if predicted_tokens(r)] for rs in rows]
    return rows, {
        "trajectories": float(len(trajectories)),
        "rows": float(sum(len(rs) for rs in rows)),
        "rows_truncated": float(truncated),
        "rows_retokenized": float(sum(r.retokenized for r in flat)),
        "trained_tokens": float(sum(predicted_tokens(r) for rs in rows for r in rs)),
    }


def pack_rows(rows: Sequence[Row], budget: int) -> list[list[Row]]:
    """First-fit decreasing: rows into sequences of at most `budget` tokens (a longer row alone)."""
    packs: list[list[Row]] = []
    room: list[int] = []
    for r in sorted(rows, key=lambda r: -len(r.input_ids)):
        n = len(r.input_ids)
        fit = next((i for i, left in enumerate(room) if n <= left), None)
        if fit is None:
            packs.append([r])
            room.append(budget - n)
        else:
            packs[fit].append(r)
            room[fit] -= n
    return packs


class SFTTrainer:
    """Supervised fine-tuning of one policy's adapter (the GRPO trainer's weights, its own optimizer)."""

    def __init__(self, policy: LoraPolicy, chat_format: ChatFormat) -> None:
        self.policy = policy
        self.chat_format = chat_format

    def micro_batches(self, rows: list[Row], config: SFTConfig) -> list[tuple[str, list[Row]]]:
        """("packed" | "padded", rows) per forward pass; see the module docstring for the choice."""
        shared = shared_prefix_length(rows)
        if config.packing and not shared:
            return [("packed", p) for p in pack_rows(rows, config.micro_batch_tokens)]
        return [("padded", b) for b in micro_batches(rows, config.micro_batch_tokens, shared)]

    def logprobs(self, kind: str, batch: list[Row]) -> torch.Tensor:
        """log π_θ of every trained token of `batch` (bar each row's first), with grad; (n,)."""
        device = self.policy.device
        if kind == "padded":
            ids, attn, trained, _ = pad_rows(batch)
            ids, attn, trained = ids.to(device), attn.to(device), trained.to(device)
            rows_idx, pos_idx = trained[:, 1:].nonzero(as_tuple=True)  # token t is predicted at t - 1
            targets = ids[:, 1:][rows_idx, pos_idx]
            shared = shared_prefix_length(batch)
            return trained_logprobs(self.policy.model, ids, attn, rows_idx, pos_idx, targets, shared)
        ids = torch.tensor([[t for r in batch for t in r.input_ids]], device=device)  # (1, L)
        # positions restart at each row: the rows are separate sequences to the attention mask
        positions = torch.cat([torch.arange(len(r.input_ids)) for r in batch])[None].to(device)
        starts = [0]
        for r in batch:
            starts.append(starts[-1] + len(r.input_ids))
        # a trained token at offset o of a row is predicted at o - 1 of the same row (never o = 0)
        pos = torch.tensor(
            [
                s + o - 1
                for r, s in zip(batch, starts, strict=False)
                for o in range(1, len(r.input_ids))
                if r.trained[o]
            ],
            device=device,
        )
        causal_lm: Any = self.policy.model.get_base_model()
        # no attention mask and no cache: transformers then masks by the position-id restarts
        hidden = causal_lm.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        return token_logprobs(causal_lm.lm_head(hidden[0, pos]), ids[0, pos + 1])

    def loss(self, rows: list[Row], config: SFTConfig, *, backward: bool = False) -> tuple[float, int, int]:
        """The optimizer batch's mean cross-entropy over its trained tokens (gradients accumulated
        when `backward`); returns (loss, micro-batches, padded tokens)."""
        num_tokens = sum(predicted_tokens(r) for r in rows)
        autocast = (
            torch.autocast(self.policy.device.type, dtype=torch.bfloat16)
            if config.autocast_bf16
            else contextlib.nullcontext()
        )
        total, padded = 0.0, 0
        batches = self.micro_batches(rows, config)
        for kind, batch in batches:
            with autocast:
                loss = sft_loss(self.logprobs(kind, batch), num_tokens)
            if backward:
                loss.backward()
            total += float(loss.detach())
            if kind == "padded":
                padded += max(len(r.input_ids) for r in batch) * len(batch) - sum(
                    len(r.input_ids) for r in batch
                )
        return total, len(batches), padded

    def train(
        self,
        rows: list[list[Row]],
        config: SFTConfig,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, float]:
        """`config.epochs` passes over the trajectories' `rows` (one list per trajectory, from
        `sft_rows`); returns the call's metrics. `on_progress(done, total)` after each optimizer step.

        A non-finite gradient raises FloatingPointError: the caller restores the last checkpoint,
        since earlier optimizer steps of this call have already changed the adapter."""
        t0 = time.perf_counter()
        steps_per_epoch = math.ceil(len(rows) / config.batch_size)
        total = steps_per_epoch * config.epochs
        params = self.policy.trainable_parameters()
        opt = torch.optim.AdamW(
            params, lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, config))
        rng = random.Random(config.seed)
        epoch_losses: list[float] = []
        grad_norms: list[float] = []
        micro, padded, done = 0, 0, 0
        model = self.policy.model
        with self.policy.editing():
            model.train()
            try:
                for _ in range(config.epochs):
                    order = rng.sample(range(len(rows)), len(rows))
                    loss_sum, tokens = 0.0, 0
                    for b in range(steps_per_epoch):
                        batch = [
                            r
                            for i in order[b * config.batch_size : (b + 1) * config.batch_size]
                            for r in rows[i]
                        ]
                        n = sum(predicted_tokens(r) for r in batch)
                        if n:
                            loss, k, pad = self.loss(batch, config, backward=True)
                            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
                            if not math.isfinite(grad_norm):
                                raise FloatingPointError(
                                    f"grad_norm={grad_norm} at optimizer step {done}: the call was not completed"
                                )
                            opt.step()
                            loss_sum, tokens = loss_sum + loss * n, tokens + n
                            grad_norms.append(grad_norm)
                            micro, padded = micro + k, padded + pad
                        opt.zero_grad(set_to_none=True)
                        schedule.step()
                        done += 1
                        if on_progress is not None:
                            on_progress(done, total)
                    epoch_losses.append(loss_sum / max(tokens, 1))
            finally:
                opt.zero_grad(set_to_none=True)
                model.eval()
                self.policy.version += 1  # the weights may have changed, even on a failure
        _return_freed_memory()
        return {
            "loss": epoch_losses[-1],
            "loss_first_epoch": epoch_losses[0],
            "grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
            "learning_rate": config.learning_rate,
            "epochs": float(config.epochs),
            "optimizer_steps": float(total),
            "micro_batches": float(micro),
            "padded_tokens": float(padded),
            "train_seconds": time.perf_counter() - t0,
        }


__all__ = ["SFTTrainer", "lr_factor", "pack_rows", "sft_loss", "sft_rows"]
