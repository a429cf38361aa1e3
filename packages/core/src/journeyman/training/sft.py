"""Supervised fine-tuning of the LoRA adapter on good trajectories: the warm start before RL.

trajectories -> rows (`rows.trajectory_rows`: the sampled ids where a call was recorded, else
the chat template; only assistant turns trained, prompts and tool results masked) -> each epoch,
shuffled optimizer batches of `batch_size` trajectories -> micro-batches -> masked cross-entropy
-> AdamW, learning rate warmed up then decayed over the call. One call is one step of the run (one
checkpoint, one history row), as a GRPO step is, so RL continues from the adapter it leaves.

A micro-batch never lets one row attend to another. With `packing` (the default) it is one packed
sequence, as in GRPO (`packing.pack_rows`): rows end to end with no padding, a prompt prefix that
rows share (agent rows: system prompt and tool definitions) run once, and a mask that keeps each
row to its own tokens, so a packed row's logprobs are those of the row alone (test_sft.py).
Without, rows are right-padded into length-sorted batches (`packing.pad_rows`), a prefix common to
the whole batch run once.

The optimizer is AdamW of its own, fresh for each call (its warmup and decay belong to the call);
the checkpoint keeps the GRPO optimizer's state as it was, so RL's moments never see SFT gradients.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence

import torch

from journeyman.chat.formats import ChatFormat
from journeyman.data.config import LongRows, SFTConfig, micro_batch_tokens
from journeyman.data.types import Trajectory
from journeyman.policy.lora import LoraPolicy
from journeyman.training.packing import (
    Pack,
    micro_batches,
    pack_rows,
    packed_logprobs,
    pad_rows,
    shared_prefix_length,
    trained_logprobs,
)
from journeyman.training.rows import Row, fit_rows, trajectory_rows
from journeyman.training.trainer import (
    activation_offload,
    gradient_checkpointing,
    return_freed_memory,
    uses_checkpointing,
)


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
    trajectories: Sequence[Trajectory],
    chat_format: ChatFormat,
    max_seq_len: int,
    long_rows: LongRows = "split",
) -> tuple[list[list[Row]], dict[str, float]]:
    """Rows of each trajectory, a row longer than `max_seq_len` fitted by `long_rows`
    (`rows.fit_rows`); a trajectory with nothing to train raises NoTrainableTokensError naming it
    (`trajectories[i]`)."""
    rows = [
        trajectory_rows(t, chat_format, 1.0, where=f"trajectories[{i}]") for i, t in enumerate(trajectories)
    ]
    retokenized = sum(r.retokenized for rs in rows for r in rs)
    counts: dict[str, float] = {}
    fitted: list[list[Row]] = []
    for rs in rows:
        kept, c = fit_rows(rs, max_seq_len, long_rows)
        fitted.append([r for r in kept if predicted_tokens(r)])
        counts = {k: counts.get(k, 0.0) + v for k, v in c.items()}
    return fitted, {
        "trajectories": float(len(trajectories)),
        "rows": float(sum(len(rs) for rs in fitted)),
        "rows_retokenized": float(retokenized),
        "trained_tokens": float(sum(predicted_tokens(r) for rs in fitted for r in rs)),
        **counts,
    }


class SFTTrainer:
    """Supervised fine-tuning of one policy's adapter (the GRPO trainer's weights, its own optimizer)."""

    def __init__(self, policy: LoraPolicy, chat_format: ChatFormat) -> None:
        self.policy = policy
        self.chat_format = chat_format

    def micro_batches(self, rows: list[Row], config: SFTConfig) -> list[Pack] | list[list[Row]]:
        """One packed sequence, or one padded batch of rows, per forward pass (`config.packing`)."""
        budget = micro_batch_tokens(config.micro_batch_tokens, config.max_seq_len, self.policy.device.type)
        if config.packing:
            return pack_rows(rows, budget)
        return list(micro_batches(rows, budget, shared_prefix_length(rows)))

    def logprobs(self, batch: Pack | list[Row]) -> torch.Tensor:
        """log π_θ of every trained token of `batch` (bar each row's first), with grad; (n,)."""
        device = self.policy.device
        rows = batch.rows if isinstance(batch, Pack) else batch
        ids, attn, trained, _ = pad_rows(rows)
        rows_idx, pos_idx = trained[:, 1:].to(device).nonzero(as_tuple=True)  # token t is predicted at t - 1
        if isinstance(batch, Pack):
            return packed_logprobs(self.policy.model, batch.inputs(device), rows_idx, pos_idx)
        ids, attn = ids.to(device), attn.to(device)
        targets = ids[:, 1:][rows_idx, pos_idx]
        shared = shared_prefix_length(batch)
        return trained_logprobs(self.policy.model, ids, attn, rows_idx, pos_idx, targets, shared)

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
        for batch in batches:
            with autocast, activation_offload(self.policy.device, config.offload_activations):
                loss = sft_loss(self.logprobs(batch), num_tokens)
            if backward:
                loss.backward()
            total += float(loss.detach())
            if not isinstance(batch, Pack):
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
        # packed micro-batches only: a padded batch's shared prefix fills a KV cache, which a
        # checkpointed layer leaves empty
        longest = max((len(r.input_ids) for rs in rows for r in rs), default=0)
        checkpointing = config.packing and uses_checkpointing(
            config.gradient_checkpointing, self.policy.device, longest
        )
        with self.policy.editing(), gradient_checkpointing(self.policy, checkpointing):
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
        return_freed_memory()
        return {
            "loss": epoch_losses[-1],
            "loss_first_epoch": epoch_losses[0],
            "grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
            "learning_rate": config.learning_rate,
            "epochs": float(config.epochs),
            "optimizer_steps": float(total),
            "micro_batches": float(micro),
            "padded_tokens": float(padded),
            "gradient_checkpointing": float(checkpointing),
            "offload_activations": float(config.offload_activations and self.policy.device.type == "cuda"),
            "train_seconds": time.perf_counter() - t0,
        }


__all__ = ["SFTTrainer", "lr_factor", "sft_loss", "sft_rows"]
