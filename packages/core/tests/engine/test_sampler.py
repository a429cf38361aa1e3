"""The sampler against hand-built logits: no model, no thread. Each expected token comes from the
row's own uniform draw and the distribution worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from journeyman.engine.sampler import generator, sample

CPU = torch.device("cpu")


def _log_softmax(row: list[float]) -> list[float]:
    total = math.log(sum(math.exp(x) for x in row))
    return [x - total for x in row]


def _draws(seeds: range) -> list[float]:
    """The uniform each seeded row draws: one from its own stream."""
    return [float(torch.rand(1, generator=torch.Generator().manual_seed(s))) for s in seeds]


def _expected(probs: list[float], u: float) -> int:
    """Inverse-CDF pick: the first token whose cumulative (normalised) mass exceeds `u`."""
    total, mass = sum(probs), 0.0
    for i, p in enumerate(probs):
        mass += p / total
        if u < mass:
            return i
    return len(probs) - 1


def _rows(logits: list[float], seeds: range, temperature: float, top_p: float = 1.0):
    b = len(seeds)
    return (
        torch.tensor([logits] * b),
        torch.full((b,), temperature),
        torch.full((b,), top_p),
        [torch.Generator().manual_seed(s) for s in seeds],
    )


def test_greedy_takes_the_first_maximum_and_reports_temperature_one_logprobs() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.0], [2.0, 2.0, 1.0]])
    before = torch.random.get_rng_state()
    draw = sample(logits, torch.zeros(3), torch.ones(3), [None] * 3)
    assert draw.ids.tolist() == [1, 0, 0]  # the last row ties: the first maximum
    want = [_log_softmax(r)[i] for r, i in zip(logits.tolist(), [1, 0, 0], strict=True)]
    assert draw.logprobs.tolist() == pytest.approx(want, abs=1e-6)
    assert want[0] == pytest.approx(3 - math.log(math.e + math.e**3 + math.e**2))
    assert draw.top_ids is None and draw.top_logprobs is None
    assert torch.equal(torch.random.get_rng_state(), before)  # greedy rows draw nothing


def test_top_logprobs_are_the_highest_log_softmax_values() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -2.0], [0.0, 0.0, 4.0, 1.0]])
    draw = sample(logits, torch.zeros(2), torch.ones(2), [None, None], top_logprobs=2)
    assert draw.top_ids is not None and draw.top_logprobs is not None
    assert draw.top_ids.tolist() == [[1, 2], [2, 3]]
    first, second = _log_softmax([1.0, 3.0, 2.0, -2.0]), _log_softmax([0.0, 0.0, 4.0, 1.0])
    assert draw.top_logprobs.tolist()[0] == pytest.approx([first[1], first[2]], abs=1e-6)
    assert draw.top_logprobs.tolist()[1] == pytest.approx([second[2], second[3]], abs=1e-6)
    assert second[2] == pytest.approx(4 - math.log(2 + math.e**4 + math.e))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_reshapes_the_draw_but_not_the_logprobs(temperature: float) -> None:
    """p = (0.6, 0.4) at temperature t samples from p^(1/t), normalised; the logprobs reported stay
    log 0.6 and log 0.4."""
    p = [0.6, 0.4]
    seeds = range(64)
    logits, temps, top_ps, gens = _rows([math.log(x) for x in p], seeds, temperature)
    draw = sample(logits, temps, top_ps, gens)
    sharpened = [x ** (1 / temperature) for x in p]
    want = [_expected(sharpened, u) for u in _draws(seeds)]
    assert draw.ids.tolist() == want and set(want) == {0, 1}
    assert draw.logprobs.tolist() == pytest.approx([math.log(p[i]) for i in want], abs=1e-6)


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [(0.7, [0.5, 0.3]), (0.9, [0.5, 0.3, 0.15]), (0.3, [0.5]), (1.0, [0.5, 0.3, 0.15, 0.05])],
)
def test_top_p_samples_from_the_smallest_set_whose_mass_reaches_it(
    top_p: float, nucleus: list[float]
) -> None:
    """p = (0.5, 0.3, 0.15, 0.05): top_p 0.7 keeps {0, 1} (0.5 falls short, 0.8 reaches it), 0.9
    keeps {0, 1, 2}, 0.3 keeps {0}; the kept mass is renormalised and logprobs stay the raw ones."""
    p = [0.5, 0.3, 0.15, 0.05]
    seeds = range(200)
    logits, temps, top_ps, gens = _rows([math.log(x) for x in p], seeds, 1.0, top_p)
    draw = sample(logits, temps, top_ps, gens)
    want = [_expected(nucleus, u) for u in _draws(seeds)]
    assert draw.ids.tolist() == want
    assert set(want) == set(range(len(nucleus)))
    assert draw.logprobs.tolist() == pytest.approx([math.log(p[i]) for i in want], abs=1e-6)


def test_a_seeded_row_draws_the_same_tokens_whatever_it_is_batched_with() -> None:
    flat = torch.zeros(8, 1000)  # 1000 equally likely tokens: a repeat by chance is 1 in 10^24

    def ids(seed: int) -> list[int]:
        gens = [generator(seed, k, CPU) for k in range(8)]  # completions 0..7 of one request
        return sample(flat, torch.ones(8), torch.ones(8), gens).ids.tolist()

    assert ids(3) == ids(3)
    assert ids(3) != ids(4)
    assert len(set(ids(3))) > 1  # each completion has a stream of its own
    # row 5 of seed 3, batched with a greedy row, an unseeded row and a top-p row
    logits = torch.zeros(4, 1000)
    logits[0, 7] = 1.0
    mixed = sample(
        logits,
        torch.tensor([0.0, 1.0, 1.0, 0.7]),
        torch.tensor([1.0, 1.0, 1.0, 0.5]),
        [None, None, generator(3, 5, CPU), generator(9, 0, CPU)],
    )
    assert mixed.ids[0] == 7 and mixed.ids[2] == ids(3)[5]


def test_generator_streams() -> None:
    assert generator(None, 0, CPU) is None
    g = generator(7, 2, CPU)
    assert g is not None and g.initial_seed() == 7 * 1_000_003 + 2
    # the ends of the 64-bit seed range wrap into what torch takes, and still reproduce
    for seed in (2**63 - 1, -(2**63)):
        a, b = generator(seed, 1, CPU), generator(seed, 1, CPU)
        assert a is not None and b is not None
        assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    top = generator(2**63 - 1, 1, CPU)
    assert top is not None and top.initial_seed() == ((2**63 - 1) * 1_000_003 + 1) % 2**64


def test_only_allowed_tokens_are_sampled_and_logprobs_stay_unmasked() -> None:
    """A grammar's mask: the best allowed token when greedy, a draw among the allowed ones by their
    renormalised mass when sampling; logprobs are the raw distribution's; `logits` is untouched."""
    row = [5.0, 1.0, 0.0, 2.0]
    seeds = range(100)
    logits, temps, top_ps, gens = _rows(row, seeds, 1.0)
    temps[0] = 0.0  # the first row greedy
    allowed = torch.tensor([[False, True, False, True]] * len(seeds))
    kept = logits.clone()
    draw = sample(logits, temps, top_ps, gens, allowed=allowed)
    assert torch.equal(logits, kept)
    us = _draws(seeds)
    want = [3] + [[1, 3][_expected([math.e**1, math.e**2], u)] for u in us[1:]]  # 1 w.p. 1/(1+e)
    assert draw.ids.tolist() == want and set(want) == {1, 3}
    raw = _log_softmax(row)
    assert draw.logprobs.tolist() == pytest.approx([raw[i] for i in want], abs=1e-6)
    # a token the grammar forbids is never drawn, however likely
    only = torch.zeros(1, 4, dtype=torch.bool)
    only[0, 2] = True
    draw = sample(torch.tensor([row]), torch.ones(1), torch.ones(1), [None], allowed=only)
    assert draw.ids.tolist() == [2] and draw.logprobs.tolist() == pytest.approx([raw[2]], abs=1e-6)
