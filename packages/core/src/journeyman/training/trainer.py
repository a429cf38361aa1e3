"""One GRPO-family update of the LoRA adapter on a list of trajectory groups.

tokenize (exact sampled ids) -> group advantages -> packed micro-batches (`packing`) -> loss ->
backward -> AdamW. The LM head runs only on trained positions: prompt tokens need hidden states,
not logits.

Long rows: rows past `max_seq_len` are fitted between sampled turns (`rows.fit_rows`), and the
decoder layers can be checkpointed (`gradient_checkpointing`, on by default on CUDA) with what they
keep offloaded to host memory (`offload_activations`). Checkpointing is switched on for the step
alone: the engine samples from the same module, and its forward never recomputes anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from journeyman.chat.formats import ChatFormat
from journeyman.data.config import TrainConfig, micro_batch_tokens
from journeyman.data.types import TrajectoryGroup
from journeyman.policy.lora import LoraPolicy, attention_implementation
from journeyman.training.collective import Collective
from journeyman.training.loss import group_advantages, policy_loss
from journeyman.training.packing import Pack, pack_rows, pack_tree, packed_logprobs, pad_rows
from journeyman.training.rows import Row, check_teacher_logprobs, fit_rows, trajectory_rows

__all__ = [
    "LONG_ROW_TOKENS",
    "METRIC_KEYS",
    "GRPOTrainer",
    "activation_offload",
    "build_rows",
    "gradient_checkpointing",
    "return_freed_memory",
    "uses_checkpointing",
]

log = logging.getLogger("journeyman.training")

# what each micro-batch adds up (loss.policy_loss's metrics and the logprob gap): the same keys on every rank
METRIC_KEYS = frozenset(
    {
        "policy_loss",
        "clip_fraction",
        "kl",
        "ratio_mean",
        "engine_trainer_logprob_gap",
        "is_weight_mean",
        "is_weight_outside_2x",
        "is_truncated",
        "teacher_kl",
        "teacher_advantage",
    }
)


def build_rows(
    groups: Sequence[TrajectoryGroup], chat_format: ChatFormat, config: TrainConfig
) -> tuple[list[Row], dict[str, float]]:
    """Rows with advantages; groups whose rewards are all equal carry no signal and are dropped.

    With distillation (`config.distill`) the teacher's logprobs carry the signal: every group trains,
    its task advantages scaled by `reward_weight` (zero where its rewards are equal), and a trained
    token without a teacher logprob is refused (`TeacherLogprobsError`)."""
    distill = config.distill
    rows: list[Row] = []
    zero = 0
    for gi, group in enumerate(groups):
        rewards = torch.tensor(group.rewards(), dtype=torch.float64)
        if config.advantages == "given":  # the caller's advantages: a group of one teaches too
            signal = bool(rewards.numel()) and bool(rewards.abs().max() > 0)
            adv = rewards
        else:
            spread = float(rewards.max() - rewards.min()) if len(rewards) >= 2 else 0.0
            signal = spread >= max(1e-9, config.min_reward_spread)
            adv = group_advantages(rewards, scale_by_std=config.scale_rewards) if signal else rewards * 0
        if not signal:
            zero += 1
            if distill is None:
                continue
        if distill is not None:
            adv = adv * distill.reward_weight
        for ti, (traj, a) in enumerate(zip(group.trajectories, adv.tolist(), strict=True)):
            where = f"groups[{gi}].trajectories[{ti}]"
            got = trajectory_rows(traj, chat_format, a, where=where)
            if distill is not None:
                check_teacher_logprobs(got, where)
            rows += got
    rows, long_rows = fit_rows(rows, config.max_seq_len, config.long_rows)
    rows = [r for r in rows if r.num_trained and (r.advantage != 0.0 or distill is not None)]
    return rows, {
        "groups": float(len(groups)),
        "groups_zero_signal": float(zero),
        "rows": float(len(rows)),
        "rows_retokenized": float(sum(r.retokenized for r in rows)),
        **long_rows,
    }


LONG_ROW_TOKENS = 8192
"""On a CPU, checkpointing is on by default for a step with a row this long: SmolLM2-135M's 30 layers
keep ~0.4 GB of activations per layer at 8k tokens without it (docs/scale.md, 'Long rows')."""


def uses_checkpointing(setting: bool | None, device: torch.device, longest_row: int = 0) -> bool:
    """`gradient_checkpointing` as set, or when None: on for CUDA, and on a CPU for a step whose
    longest row has `LONG_ROW_TOKENS` or more (the config's help says why)."""
    if setting is not None:
        return setting
    return device.type == "cuda" or longest_row >= LONG_ROW_TOKENS


@contextlib.contextmanager
def gradient_checkpointing(policy: LoraPolicy, enabled: bool = True) -> Iterator[None]:
    """The policy's decoder layers checkpointed for the block (transformers' own switch, torch's
    non-reentrant checkpoint, which needs no input that requires grad). A layer checkpoints only
    in train mode, so a forward in eval mode inside the block runs as usual; the switch is undone
    on exit, before the engine samples from the same module again."""
    if not enabled:
        yield
        return
    causal_lm: Any = policy.model.get_base_model()
    # transformers 5 renamed the switch; the old name warns there and is all 4.x has
    enable = (
        getattr(causal_lm, "activation_checkpointing_enable", None) or causal_lm.gradient_checkpointing_enable
    )
    disable = (
        getattr(causal_lm, "activation_checkpointing_disable", None)
        or causal_lm.gradient_checkpointing_disable
    )
    enable({"use_reentrant": False, "context_fn": _recompute_as_run(causal_lm)})
    # It also hooks the embeddings' output to require grad, which only the reentrant checkpoint
    # needs: removed, so no forward (the engine's in inference mode least of all) meets the hook.
    with contextlib.suppress(AttributeError):  # transformers 4.x adds no hook to a PEFT-wrapped model
        causal_lm.disable_input_require_grads()
    try:
        yield
    finally:
        disable()


def _recompute_as_run(
    causal_lm: Any,
) -> Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]:
    """torch checkpoint's `context_fn`: a layer's recompute, in the backward pass, runs under the
    attention implementation its forward ran with. The packed forward switches it for the forward
    alone (`packing.packed_logprobs`), and the backward comes after the switch back."""

    def context_fn() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        return contextlib.nullcontext(), _attention_as(causal_lm, causal_lm.config._attn_implementation)

    return context_fn


@contextlib.contextmanager
def _attention_as(causal_lm: Any, name: str) -> Iterator[None]:
    if causal_lm.config._attn_implementation == name:
        yield
        return
    with attention_implementation(causal_lm, name):
        yield


_offload_noted = False


def activation_offload(device: torch.device, enabled: bool) -> AbstractContextManager[Any]:
    """Around a training forward: the tensors autograd saves for the backward go to pinned host
    memory (with checkpointing, each layer's input alone) and come back in the backward pass. On a
    CPU they are in host memory already: nothing to do, noted once in the log."""
    global _offload_noted
    if enabled and device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if enabled and not _offload_noted:
        _offload_noted = True
        log.info(
            "offload_activations does nothing on %s: activations are in host memory already", device.type
        )
    return contextlib.nullcontext()


def return_freed_memory() -> None:
    """Hand freed activation memory back to the OS after a step (glibc only): glibc otherwise keeps
    each step's freed activations in its arenas and the process grows by gigabytes a step."""
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
        longest = max(len(r.input_ids) for r in rows)
        checkpointing = uses_checkpointing(config.gradient_checkpointing, self.policy.device, longest)
        metrics["gradient_checkpointing"] = float(checkpointing)
        metrics["offload_activations"] = float(
            config.offload_activations and self.policy.device.type == "cuda"
        )
        with self.policy.editing(), gradient_checkpointing(self.policy, checkpointing):
            model.train()
            opt.zero_grad(set_to_none=True)
            totals: dict[str, float] = {}
            budget = micro_batch_tokens(
                config.micro_batch_tokens, config.max_seq_len, self.policy.device.type
            )
            # One rank: each prompt prefix that rows share (system prompt, tools, a group's task) runs
            # once for the step (`pack_tree`). Ranks that shard the base gather every layer together,
            # so all of them run the same passes: there, prefixes are shared within a micro-batch.
            tree = pack_tree(rows, budget) if collective is None else None
            batches = tree.packs if tree is not None else pack_rows(rows, budget)
            # tokens the model runs, against the rows' own lengths: what running shared prefixes once saves
            metrics["forward_tokens"] = float(
                tree.forward_tokens if tree is not None else sum(b.length for b in batches)
            )
            metrics["row_tokens"] = float(sum(len(r.input_ids) for r in rows))
            idle, spare = 0, min(batches, key=lambda b: b.length)
            if collective is not None:
                share, idle = collective.share([b.length for b in batches])
                batches = [batches[i] for i in share]
            for i, batch in enumerate(batches):
                out = self._micro_step(batch, num_tokens, config)
                if on_progress is not None:
                    on_progress(i + 1, len(batches))
                for k, v in out.items():
                    totals[k] = totals.get(k, 0.0) + v
            if tree is not None:
                tree.backward()  # the prefixes' share of the gradient, through their forward once
            # a sharded base gathers every layer with the other ranks in each forward and backward:
            # a rank short of the busiest one's micro-batches runs passes that add nothing
            for _ in range(idle):
                self._micro_step(spare, num_tokens, config, weight=0.0)
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
        return_freed_memory()
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

    def _micro_step(
        self, pack: Pack, num_tokens: int, config: TrainConfig, weight: float = 1.0
    ) -> dict[str, float]:
        """Forward and backward of one micro-batch, its loss scaled by `weight` (0: a pass that only
        keeps a sharded base's ranks in step); returns its metric sums."""
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
        with autocast, activation_offload(device, config.offload_activations):
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
        distilled: dict[str, float] = {}
        if config.distill is not None:
            advantages, distilled = self._distilled(pack, advantages, rollout_lp, mask, num_tokens, config)
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
        (loss * weight).backward()
        with torch.no_grad():
            denom = max(num_tokens, 1)
            gap = ((logp.detach() - rollout_lp).abs() * mask).sum() / denom
            # π_θ / π_behaviour per token: how far off-policy each sampled token is (an older
            # step's rollout, or the engine's numerics), before any clip or truncation
            is_weight = torch.exp((logp.detach() - rollout_lp).clamp(max=30.0))
            far = ((is_weight > 2.0) | (is_weight < 0.5)).float()
            cap = config.tis_cap
            truncated = (is_weight > cap).float() if cap is not None else torch.zeros_like(far)
        metrics["engine_trainer_logprob_gap"] = float(gap)
        metrics["is_weight_mean"] = float((is_weight * mask).sum() / denom)
        metrics["is_weight_outside_2x"] = float((far * mask).sum() / denom)
        metrics["is_truncated"] = float((truncated * mask).sum() / denom)
        return {**metrics, **distilled}

    def _distilled(
        self,
        pack: Pack,
        advantages: torch.Tensor,  # (B,) the task's, already scaled by reward_weight
        student_lp: torch.Tensor,  # (B, T-1) log π of each sampled token as it was sampled
        mask: torch.Tensor,
        num_tokens: int,
        config: TrainConfig,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(B, T-1) per-token advantages: the task's plus teacher_weight * (log π_teacher - log π_student),
        the negative of the reverse-KL estimate at the sampled token (on-policy distillation: the
        student is pushed toward what the teacher would have sampled, token by token)."""
        assert config.distill is not None
        device = advantages.device
        width = mask.shape[1] + 1
        teacher = torch.full((len(pack.rows), width), math.nan)
        for i, r in enumerate(pack.rows):
            teacher[i, : len(r.teacher_logprobs)] = torch.tensor(r.teacher_logprobs)
        teacher_lp = teacher[:, 1:].to(device)
        gap = torch.where(mask > 0, teacher_lp - student_lp, torch.zeros_like(student_lp))
        per_token = advantages[:, None] + config.distill.teacher_weight * gap
        denom = max(num_tokens, 1)
        return per_token, {
            "teacher_kl": float(-(gap * mask).sum() / denom),  # mean log π_student - log π_teacher
            "teacher_advantage": float((config.distill.teacher_weight * gap * mask).sum() / denom),
        }
