"""GRPO-family losses as plain functions of tensors.

Shapes: B rows, T tokens. `mask` (B, T) is 1 on trained (sampled) tokens. All losses are
token-level normalised: summed over every trained token of the step, divided by `num_tokens`
(the step's total, so micro-batches add up to the same loss as one big batch).

Papers: GRPO (Shao et al. 2024, DeepSeekMath), PPO clip (Schulman et al. 2017), asymmetric
clip-higher (DAPO, Yu et al. 2025), CISPO (MiniMax-M1, 2025), GSPO (Zheng et al. 2025),
truncated importance sampling for engine/trainer mismatch (Yao et al. 2025), k3 KL estimator
(Schulman 2020).
"""

from __future__ import annotations

from typing import Any

import torch

from journeyman.data.config import LossKind


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean(r)) / (std(r) + eps) within one group (population std); (G,) -> (G,)."""
    centered = rewards - rewards.mean()
    if not scale_by_std:
        return centered
    return centered / (rewards.std(unbiased=False) + eps)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per position; (..., V), (...) -> (...), in fp32."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# rows of logits per chunk in `head_logprobs`: 16 MiB of fp32 logits, a buffer the allocator reuses
# (glibc maps a larger one afresh every time, and its first touch page-faults)
_CHUNK_BYTES = 1 << 24


class _HeadLogprobs(torch.autograd.Function):
    """log softmax(h Wᵀ)[target] with the gradient for h worked out in the forward pass, chunk by
    chunk: ∂ log p(y) / ∂h = (onehot(y) - softmax(h Wᵀ)) W, so the (N, V) logits never outlive their
    chunk. Autograd on `token_logprobs(lm_head(h), y)` keeps them and makes five more tensors of
    that size in the backward pass: filling and page-faulting them is a sizeable share of a CPU
    train step (docs/)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n, vocab = hidden.shape[0], weight.shape[0]
        rows = max(1, _CHUNK_BYTES // (4 * vocab))
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, n, rows):
            h, y = hidden[start : start + rows], targets[start : start + rows]
            logits = (h @ weight.T).float()  # (c, V)
            picked = logits.gather(1, y[:, None]).squeeze(1)
            top = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place: unnormalised softmax
            total = probs.sum(dim=1, keepdim=True)
            out[start : start + rows] = picked - (top + total.log()).squeeze(1)
            if grad is not None:
                probs.div_(total)
                probs.scatter_add_(1, y[:, None], probs.new_full((len(y), 1), -1.0))  # softmax - onehot
                grad[start : start + rows] = -(probs.to(weight.dtype) @ weight)
        ctx.save_for_backward(grad)
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (grad,), (upstream,) = ctx.saved_tensors, grad_outputs
        return (upstream[:, None] * grad).to(grad.dtype), None, None


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """`token_logprobs(head(hidden), targets)`, (N, H), (N,) -> (N,) in fp32, without keeping the
    (N, V) logits (`_HeadLogprobs`) when `head` is a plain frozen linear layer, as an LM head that
    LoRA leaves alone is; any other head goes through autograd as is."""
    if type(head) is not torch.nn.Linear or head.bias is not None or head.weight.requires_grad:
        return token_logprobs(head(hidden), targets)
    return _HeadLogprobs.apply(hidden, head.weight, targets)


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, eps: float, eps_high: float) -> torch.Tensor:
    """1 where the clip is active in the objective (the token gets no gradient), else 0."""
    return (((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - eps) & (adv < 0))).float()


def policy_loss(
    logp: torch.Tensor,  # (B, T) log π_θ(token), with grad
    old_logp: torch.Tensor,  # (B, T) log π_old(token): the rollout logprobs, or the trainer's own (with TIS)
    advantages: torch.Tensor,  # (B,) one per row, or (B, T) one per token (distillation)
    mask: torch.Tensor,  # (B, T) 1.0 on trained tokens
    num_tokens: int,
    *,
    kind: LossKind = "ppo",
    eps: float = 0.2,
    eps_high: float | None = None,
    tis_weight: torch.Tensor | None = None,  # (B, T) min(π_old / π_rollout, C), no grad
    ref_logp: torch.Tensor | None = None,  # (B, T) log π_ref (adapter off), for KL
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (loss, metrics) for one micro-batch.

    ppo:   -min(r A, clip(r, 1-eps, 1+eps_high) A),               r = π_θ / π_old per token
    cispo: -sg(min(r, 1+eps_high)) A log π_θ                          (gradient through every token)
    gspo:  -min(s A, clip(s, 1-eps, 1+eps_high) A),  s = exp(mean_t log r) per sequence, token-wise
           s_t = sg(s) π_θ / sg(π_θ) so each token carries the sequence ratio's gradient
    plus kl_coef * k3(π_θ || π_ref) = exp(ref - logp) - (ref - logp) - 1 per token.
    """
    eps_high = eps if eps_high is None else eps_high
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    log_ratio = (logp - old_logp) * mask  # (B, T)
    ratio = torch.exp(log_ratio)
    if kind == "ppo":
        clipped = ratio.clamp(1 - eps, 1 + eps_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        clip_frac = _clipped(ratio, adv, eps, eps_high)
    elif kind == "cispo":
        weight = ratio.clamp(max=1 + eps_high).detach()
        per_token = -weight * adv * logp
        clip_frac = (ratio > 1 + eps_high).float()
    elif kind == "gspo":
        lengths = mask.sum(-1).clamp(min=1)  # (B,)
        seq_ratio = torch.exp(log_ratio.sum(-1) / lengths)  # (B,)
        token_ratio = seq_ratio.detach()[:, None] * torch.exp(logp - logp.detach())  # (B, T)
        clipped = token_ratio.clamp(1 - eps, 1 + eps_high)
        per_token = -torch.minimum(token_ratio * adv, clipped * adv)
        clip_frac = _clipped(token_ratio, adv, eps, eps_high)
    else:
        raise ValueError(f"kind={kind!r}: use 'ppo', 'cispo' or 'gspo'")
    if tis_weight is not None:
        per_token = per_token * tis_weight
    kl = torch.zeros_like(logp)
    if ref_logp is not None and kl_coef > 0:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + kl_coef * kl
    denom = max(num_tokens, 1)
    loss = (per_token * mask).sum() / denom
    metrics = {
        "policy_loss": float(loss.detach()),
        "clip_fraction": float((clip_frac * mask).sum() / denom),
        "kl": float((kl.detach() * mask).sum() / denom),
        "ratio_mean": float((ratio.detach() * mask).sum() / denom),
    }
    return loss, metrics
