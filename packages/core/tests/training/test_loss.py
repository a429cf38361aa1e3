"""Each loss against a small case worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from journeyman.training.loss import group_advantages, head_logprobs, policy_loss, token_logprobs


def test_group_advantages() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))  # mean 0.5, std 0.5
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages(torch.tensor([3.0, 1.0]), scale_by_std=False).tolist() == [1.0, -1.0]
    assert group_advantages(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]


def test_token_logprobs_is_log_softmax_at_target() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    expected = 2.0 - math.log(math.exp(2) + 1 + math.exp(-1))
    assert float(token_logprobs(logits, torch.tensor([0]))[0]) == pytest.approx(expected)


@pytest.mark.parametrize("vocab", [7, 50_000])  # one chunk; several chunks, the last one short
def test_head_logprobs_match_autograd_through_the_full_logits(vocab: int) -> None:
    """The LM head's logprobs with their gradient worked out chunk by chunk in the forward pass give
    the values and the gradient autograd gives through the whole (N, V) logits; no gradient is
    worked out where none is asked for."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, vocab, bias=False).requires_grad_(False)
    torch.nn.init.normal_(head.weight, generator=g)
    hidden = torch.randn(300, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (300,), generator=g)
    weights = torch.randn(300, generator=g)  # a different upstream gradient per token

    expected = token_logprobs(head(hidden), targets)
    (want,) = torch.autograd.grad((expected * weights).sum(), hidden)
    got = head_logprobs(hidden, head, targets)
    (grad,) = torch.autograd.grad((got * weights).sum(), hidden)
    assert torch.allclose(got, expected, atol=1e-5) and torch.allclose(grad, want, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(head_logprobs(hidden, head, targets), expected, atol=1e-5)
    # a head that trains (or carries a bias) goes through autograd as is: its own gradient is kept
    head.requires_grad_(True)
    head_logprobs(hidden, head, targets).sum().backward()
    assert head.weight.grad is not None


def _case(log_ratio: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((len(log_ratio), len(log_ratio[0])), -1.0)
    logp = (old + torch.tensor(log_ratio)).requires_grad_(True)
    return logp, old


def test_ppo_clips_each_side() -> None:
    # row 0: ratio 1.5, A=+1 -> clipped at 1.2 -> -1.2 (no gradient); row 1: ratio 1.5, A=-1 -> -1.5*-1 = 1.5
    logp, old = _case([[math.log(1.5)], [math.log(1.5)]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = policy_loss(logp, old, adv, torch.ones(2, 1), num_tokens=2, kind="ppo", eps=0.2)
    assert float(loss.detach()) == pytest.approx((-1.2 + 1.5) / 2)
    loss.backward()
    # d/dlogp of -A*r = -A*r: row 0 clipped -> 0; row 1 -> +1.5, over 2 tokens
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, 0.75])
    assert m["clip_fraction"] == pytest.approx(0.5)


def test_ppo_eps_high_and_mask_normalise_per_token() -> None:
    logp, old = _case([[math.log(1.5), math.log(1.1), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # third token is a prompt token: ignored
    loss, _ = policy_loss(
        logp, old, torch.tensor([2.0]), mask, num_tokens=4, kind="ppo", eps=0.2, eps_high=0.28
    )
    # tokens: min(1.5, 1.28)*2 = 2.56 ; min(1.1, 1.1)*2 = 2.2 ; summed over the step's 4 tokens
    assert loss.item() == pytest.approx(-(2.56 + 2.2) / 4)


def test_cispo_keeps_gradient_through_clipped_tokens() -> None:
    logp, old = _case([[math.log(1.5), 0.0]])
    loss, _ = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 2), num_tokens=2, kind="cispo", eps_high=0.2
    )
    # -sg(min(r, 1.2)) * A * logp: weights 1.2 and 1.0; logp values -1+log1.5 and -1
    expected = -(1.2 * (-1 + math.log(1.5)) + 1.0 * -1.0) / 2
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.6, -0.5])  # the clipped token still learns


def test_gspo_uses_the_sequence_ratio_for_every_token() -> None:
    logp, old = _case([[0.2, 0.0]])  # sequence ratio exp(mean(0.2, 0)) = exp(0.1)
    seq = math.exp(0.1)
    loss, _ = policy_loss(
        logp, old, torch.tensor([-1.0]), torch.ones(1, 2), num_tokens=2, kind="gspo", eps=3e-4, eps_high=4e-4
    )
    # A < 0: min(-s, -clip(s)) = -s (unclipped side is smaller) for both tokens
    assert loss.item() == pytest.approx(seq)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([seq / 2, seq / 2])


def test_k3_kl_and_tis_weight() -> None:
    logp, old = _case([[0.0]])
    ref = logp.detach() + 0.5
    loss, m = policy_loss(
        logp, old, torch.tensor([0.0]), torch.ones(1, 1), num_tokens=1, ref_logp=ref, kl_coef=0.1
    )
    k3 = math.exp(0.5) - 0.5 - 1
    assert m["kl"] == pytest.approx(k3) and loss.item() == pytest.approx(0.1 * k3)
    logp, old = _case([[0.0]])
    loss, _ = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 1), num_tokens=1, tis_weight=torch.tensor([[0.5]])
    )
    assert loss.item() == pytest.approx(-0.5)
