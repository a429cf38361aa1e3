"""Win rate of the trained policy against a baseline on the held-out scenarios, by a judge.

A proxy such as "the tool was called without error" saturates: a greedy forced call gets it right
on most servers before any training, and the before/after table then says nothing. Here the judge
(RULER, the same one that rewards training, on a group of two) compares the trained run and the
baseline's run of each held-out scenario, twice, in both orders; a position-biased judge that
prefers whichever it reads first then scores a tie, not a win.

Per order, the verdict is the sign of (trained score - baseline score); the pair's verdict is the
sign of the two verdicts' sum (one order's preference stands unless the other contradicts it).
The rate counts a tie as half a win: (wins + ties / 2) / judged, with a 95% Wilson score interval.
"""

from __future__ import annotations

import asyncio
import math
from typing import Literal

import journeyman as jm
from journeyman import RulerConfig, ruler_score_group
from journeyman.integrations import LLMSpec, spec_label
from pydantic import BaseModel, Field

from .reward import JUDGE_CONFIG, RUBRIC

Verdict = Literal["win", "tie", "loss"]
_SIGN: dict[int, Verdict] = {1: "win", 0: "tie", -1: "loss"}
_VALUE: dict[Verdict, int] = {"win": 1, "tie": 0, "loss": -1}


class PairVerdict(BaseModel):
    scenario_id: str
    forward: Verdict | None = Field(description="the trained run shown first (None: not judged)")
    backward: Verdict | None = Field(description="the baseline's run shown first")
    verdict: Verdict | None = Field(description="both orders together; None when either was not judged")
    scores: list[float] = Field(
        default_factory=list, description="[trained, baseline] forward, then [trained, baseline] backward"
    )
    note: str = ""


class WinRate(BaseModel):
    step: int = Field(description="the trained policy's step")
    against: str = Field(description="the baseline")
    judge: str = Field(description="who judged (identity, with the served step for a local judge)")
    wins: int
    ties: int
    losses: int
    unjudged: int = Field(description="pairs with a failed rollout on either side or a failed judge")
    rate: float = Field(description="(wins + ties / 2) / judged pairs; 0.5 when none were judged")
    low: float = Field(description="95% Wilson score interval of `rate`")
    high: float
    pairs: list[PairVerdict]

    @property
    def judged(self) -> int:
        return self.wins + self.ties + self.losses

    def line(self) -> str:
        skipped = f", {self.unjudged} not judged" if self.unjudged else ""
        return (
            f"win rate vs {self.against} (step {self.step}, judge {self.judge}): {self.wins} wins / "
            f"{self.ties} ties / {self.losses} losses{skipped} -> {self.rate:.2f} "
            f"[{self.low:.2f}, {self.high:.2f}] (ties count half; 95% Wilson)"
        )


def wilson(rate: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion `rate` observed over `n` trials ((0, 1) for n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    denom = 1 + z * z / n
    centre = (rate + z * z / (2 * n)) / denom
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def combine(forward: Verdict, backward: Verdict) -> Verdict:
    total = _VALUE[forward] + _VALUE[backward]
    return _SIGN[(total > 0) - (total < 0)]


async def _order(
    first: jm.Trajectory, second: jm.Trajectory, judge: LLMSpec, cfg: RulerConfig, backend: jm.Backend | None
) -> tuple[list[float] | None, str, str]:
    """([score of first, score of second] or None, judge identity, error) for one order."""
    group = jm.TrajectoryGroup([first, second])
    scored = await ruler_score_group(
        group, judge, RUBRIC, swallow_exceptions=True, config=cfg, backend=backend
    )
    info = scored.metadata.get("ruler", {})
    if info.get("skipped"):
        return None, str(info.get("judge", spec_label(judge))), str(info.get("error", ""))
    return [t.reward for t in scored.trajectories], str(info.get("judge", spec_label(judge))), ""


async def judge_pair(
    scenario_id: str,
    trained: jm.Trajectory,
    baseline: jm.Trajectory,
    judge: LLMSpec,
    cfg: RulerConfig,
    backend: jm.Backend | None = None,
) -> tuple[PairVerdict, str]:
    """The verdict on one scenario, and the judge's identity. The second order is never read from
    RULER's cache: its key is the set of trajectories, not their order, and the point of asking
    again is a fresh look with the positions swapped."""
    (fwd, who, err1), (bwd, _, err2) = await asyncio.gather(
        _order(trained, baseline, judge, cfg, backend),
        _order(baseline, trained, judge, cfg.with_options(use_cache=False), backend),
    )
    forward = _SIGN[(fwd[0] > fwd[1]) - (fwd[0] < fwd[1])] if fwd else None
    backward = _SIGN[(bwd[1] > bwd[0]) - (bwd[1] < bwd[0])] if bwd else None
    verdict = combine(forward, backward) if forward and backward else None
    scores = (fwd or []) + ([bwd[1], bwd[0]] if bwd else [])
    return PairVerdict(
        scenario_id=scenario_id,
        forward=forward,
        backward=backward,
        verdict=verdict,
        scores=scores,
        note=err1 or err2,
    ), who


def _first(groups: list[jm.TrajectoryGroup]) -> dict[str, jm.Trajectory]:
    """Scenario id -> its (first) trajectory; groups whose rollout failed are left out."""
    return {str(g.metadata["scenario_id"]): g.trajectories[0] for g in groups if g.trajectories}


async def win_rate(
    trained: list[jm.TrajectoryGroup],
    baseline: list[jm.TrajectoryGroup],
    *,
    judge: LLMSpec,
    judge_model: str | None = None,
    config: RulerConfig | None = None,
    backend: jm.Backend | None = None,
    step: int,
    against: str,
    scenario_ids: list[str] | None = None,
) -> WinRate:
    """Judge each scenario's trained run against the baseline's run (groups matched by
    `metadata["scenario_id"]`, one trajectory each: greedy episodes). A scenario in `scenario_ids`
    with no run on either side counts as not judged."""
    cfg = (config or JUDGE_CONFIG).with_options(
        **({"judge_model": judge_model} if judge_model is not None else {})
    )
    ours, theirs = _first(trained), _first(baseline)
    ids = scenario_ids or list(dict.fromkeys([*ours, *theirs]))
    both = [i for i in ids if i in ours and i in theirs]
    judged = await asyncio.gather(*(judge_pair(i, ours[i], theirs[i], judge, cfg, backend) for i in both))
    by_id = {p.scenario_id: p for p, _ in judged}
    pairs = [
        by_id.get(i)
        or PairVerdict(scenario_id=i, forward=None, backward=None, verdict=None, note="rollout failed")
        for i in ids
    ]
    who = next((w for _, w in judged), spec_label(judge))
    count = {v: sum(p.verdict == v for p in pairs) for v in ("win", "tie", "loss")}
    n = sum(count.values())
    rate = (count["win"] + count["tie"] / 2) / n if n else 0.5
    low, high = wilson(rate, n)
    return WinRate(
        step=step,
        against=against,
        judge=who,
        wins=count["win"],
        ties=count["tie"],
        losses=count["loss"],
        unjudged=len(pairs) - n,
        rate=rate,
        low=low,
        high=high,
        pairs=pairs,
    )
