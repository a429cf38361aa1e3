"""Which policy sampled what: the step every sampled token carries, and how far behind it is.

Every token record holds the training step of the weights that sampled it (`TokenRecord.step`,
stamped by the engine as it samples), so staleness is exact per token, turn by turn: a rollout
whose turns straddle a step has early turns one step older than its late ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from journeyman.data.types import TokenRecord, TrajectoryGroup

# the staleness buckets a history row reports (the fraction of sampled tokens in each)
_BUCKETS = ("0", "1", "2", "3+")


def trained_records(groups: Iterable[TrajectoryGroup]) -> list[TokenRecord]:
    """The token records of every trainable history of every trajectory of `groups`."""
    return [
        r
        for g in groups
        for t in g.trajectories
        for h in (t, *t.additional_histories)
        if h.trainable
        for r in h.records()
    ]


def oldest_step(group: TrajectoryGroup) -> int | None:
    """The step of the oldest policy that sampled any token of `group` (None: nothing sampled)."""
    steps = [r.step for r in trained_records([group])]
    return min(steps) if steps else None


def staleness_metrics(groups: Sequence[TrajectoryGroup], step: int) -> dict[str, float]:
    """How many steps behind `step` (the step being trained) each sampled token's policy was:
    the token-weighted mean and max, and the fraction of tokens 0, 1, 2 and 3+ steps behind."""
    behind: Counter[int] = Counter()
    for r in trained_records(groups):
        behind[max(0, step - r.step)] += len(r.token_ids)
    total = sum(behind.values())
    if total == 0:
        return {}
    out = {
        "staleness_mean": sum(k * n for k, n in behind.items()) / total,
        "staleness_max": float(max(behind)),
    }
    for name in _BUCKETS:
        n = sum(c for k, c in behind.items() if k >= 3) if name == "3+" else behind.get(int(name), 0)
        out[f"staleness/{name}"] = n / total
    return out


__all__ = ["oldest_step", "staleness_metrics", "trained_records"]
