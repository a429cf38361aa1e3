"""Rewards for a group of rollouts of one scenario: RULER's relative score plus the judge-free part.

reward = RULER score in [0, 1] (when a judge is set) + check_weight x end-state success
         + shaping x fraction of valid tool calls            (the last two from `rollout`)

A judge that fails leaves the group with no RULER signal (logged, never fatal): the judge-free part
still ranks the group.
"""

from __future__ import annotations

from journeyman.ruler import ruler_score_group
from journeyman.types import TrajectoryGroup

RUBRIC = """\
- The agent was given a task and the tools of an MCP server. A trajectory that gets the task done \
with the right tools and correct arguments, and reports the real result, scores highest.
- Calling a tool that has nothing to do with the task, inventing results, or ignoring tool errors \
scores low. A trajectory that never calls a useful tool scores lowest.
- Among trajectories that succeed, fewer needless calls and a clear final summary score higher."""


async def score_group(
    group: TrajectoryGroup,
    *,
    judge: str | None = "local",
    judge_model: str | None = None,
    rubric: str = RUBRIC,
    explanation_chars: int = 24,
    max_tool_output_chars: int = 400,
) -> TrajectoryGroup:
    """RULER over the group (unless `judge` is None/"none"), added to each rollout's own reward."""
    if not group.trajectories:
        return group
    if judge in (None, "none"):
        for t in group.trajectories:
            t.metrics["independent_reward"] = t.reward
        return group
    own = [t.reward for t in group.trajectories]
    scored = await ruler_score_group(
        group,
        judge=judge,
        judge_model=judge_model,
        rubric=rubric,
        swallow_exceptions=True,
        explanation_chars=explanation_chars,
        max_tool_output_chars=max_tool_output_chars,
    )
    skipped = bool(scored.metadata.get("ruler", {}).get("skipped"))
    for t, base in zip(scored.trajectories, own, strict=True):
        ruler = 0.0 if skipped else t.reward
        t.metrics["ruler"] = ruler
        t.reward = ruler + base
    return scored
