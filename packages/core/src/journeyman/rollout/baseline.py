"""Advantages for episodes that do not come in groups: live traffic.

A GRPO group compares rollouts of one task with each other. Live episodes rarely share a task, so
each gets a baseline that does not depend on its own reward (which keeps the policy gradient
unbiased: E[b ∇log π(a)] = 0 when b is independent of the action a):

- episodes of one step's batch that share a `group` key are compared with each other, leave-one-out
  (RLOO, Kool et al. 2019): A_i = r_i - mean_{j≠i} r_j;
- a lone episode gets A = r - b, where b is the running mean reward of the episodes of its key that
  arrived before it (of all keys while its key has none; 0 before any).

    baseline = RunningBaseline()
    b = baseline.before("ticket-triage", 1.0)   # the mean of earlier outcomes; then this one joins it
    advantages([("k", 1.0, b1), ("k", 0.0, b2), (None, 0.5, b3)])  # -> [1.0, -1.0, 0.5 - b3]

Every number here stays finite: a reward that is not finite, or that would carry the running sums
past what a float holds, is refused before it joins (live outcomes are bounded well inside that:
`MAX_OUTCOME_REWARD`), and `advantages` of finite inputs are finite.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from journeyman.errors import InvalidFieldError


class RunningBaseline:
    """Running mean reward per key and over all keys, in the order outcomes arrive."""

    def __init__(self) -> None:
        self._sum: dict[Hashable, float] = {}
        self._n: dict[Hashable, int] = {}
        self._total, self._count = 0.0, 0

    def value(self, key: Hashable) -> float:
        """The baseline of a new episode of `key`: its key's mean so far, else the overall mean, else 0."""
        if self._n.get(key):
            return self._sum[key] / self._n[key]
        return self._total / self._count if self._count else 0.0

    def before(self, key: Hashable, reward: float) -> float:
        """`value(key)`, then `reward` joins the means (what the next episode of `key` is compared with)."""
        b = self.value(key)
        self.add(key, reward)
        return b

    def add(self, key: Hashable, reward: float) -> None:
        """`reward` joins the means of `key` and of all keys; one that is not finite, or would make a
        sum so, is refused (InvalidFieldError) and changes nothing."""
        keyed, total = self._sum.get(key, 0.0) + reward, self._total + reward
        if not (math.isfinite(reward) and math.isfinite(keyed) and math.isfinite(total)):
            raise InvalidFieldError("reward", reward, "would make the running baseline not finite")
        self._sum[key], self._total = keyed, total
        self._n[key] = self._n.get(key, 0) + 1
        self._count += 1


def advantages(episodes: Sequence[tuple[Hashable, float, float]]) -> list[float]:
    """The advantage of each (key, reward, baseline at arrival) of one step's batch: leave-one-out
    within a key that two or more of them share (None shares with nobody), else reward - baseline."""
    by_key: dict[Hashable, list[int]] = {}
    for i, (key, _, _) in enumerate(episodes):
        if key is not None:
            by_key.setdefault(key, []).append(i)
    out: list[float] = []
    for key, reward, baseline in episodes:
        peers = by_key.get(key, []) if key is not None else []
        if len(peers) >= 2:
            others = sum(episodes[j][1] for j in peers) - reward
            out.append(reward - others / (len(peers) - 1))
        else:
            out.append(reward - baseline)
    return out


__all__ = ["RunningBaseline", "advantages"]
