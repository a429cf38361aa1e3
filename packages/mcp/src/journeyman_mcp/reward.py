"""Rewards for a group of rollouts of one scenario: RULER's relative score plus the judge-free part.

reward = RULER score in [0, 1] (when a judge is set) + check_weight x end-state success
         + shaping x fraction of valid tool calls            (the last two from `rollout`)

A judge that fails leaves the group with no RULER signal (logged, never fatal): the judge-free part
still ranks the group.
"""

from __future__ import annotations

from journeyman import Backend, RulerConfig, TrajectoryGroup, ruler_score_group
from journeyman.integrations import LLMSpec

RUBRIC = """\
- The agent was given a task and the tools of an MCP server. A trajectory that gets the task done \
with the right tools and correct arguments, and reports the real result, scores highest.
- Calling a tool that has nothing to do with the task, inventing results, or ignoring tool errors \
scores low. A trajectory that never calls a useful tool scores lowest.
- Among trajectories that succeed, fewer needless calls and a clear final summary score higher."""

JUDGE_CONFIG = RulerConfig(explanation_chars=24, max_tool_output_chars=400)
"""RULER settings for MCP groups: short answers, so a small local judge keeps up with the rollouts."""


async def score_group(
    group: TrajectoryGroup,
    *,
    judge: LLMSpec | None = "local",
    judge_model: str | None = None,
    rubric: str = RUBRIC,
    config: RulerConfig | None = None,
    backend: Backend | None = None,
) -> TrajectoryGroup:
    """RULER over the group (unless `judge` is None/"none"), added to each rollout's own reward.

    judge / judge_model: see `journeyman.integrations.resolve_llm` ("local", "local:<name>", a model, a base URL + model
    name, a LiteLLM id). `config` defaults to `JUDGE_CONFIG`: short explanations and tool results,
    so that a small local judge stays fast.
    """
    if not group.trajectories:
        return group
    if judge in (None, "none"):
        for t in group.trajectories:
            t.metrics["independent_reward"] = t.reward
        return group
    own = [t.reward for t in group.trajectories]
    cfg = (config or JUDGE_CONFIG).with_options(
        **({"judge_model": judge_model} if judge_model is not None else {})
    )
    scored = await ruler_score_group(
        group, judge, rubric, swallow_exceptions=True, config=cfg, backend=backend
    )
    skipped = bool(scored.metadata.get("ruler", {}).get("skipped"))
    for t, base in zip(scored.trajectories, own, strict=True):
        ruler = 0.0 if skipped else t.reward
        t.metrics["ruler"] = ruler
        t.reward = ruler + base
    return scored
