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

import torch

from .config import LossKind


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


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, eps: float, eps_high: float) -> torch.Tensor:
    """1 where the clip is active in the objective (the token gets no gradient), else 0."""
    return (((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - eps) & (adv < 0))).float()


def policy_loss(
    logp: torch.Tensor,  # (B, T) log π_θ(token), with grad
    old_logp: torch.Tensor,  # (B, T) log π_old(token): the rollout logprobs, or the trainer's own (with TIS)
    advantages: torch.Tensor,  # (B,)
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
    adv = advantages[:, None]  # (B, 1)
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
