"""The built-in task's rollouts as the benches time them: one step's groups and its tokens/s."""

from __future__ import annotations

import time

import journeyman as jm
from journeyman import tasks
from openai import AsyncOpenAI


async def rollout_step(
    model: jm.TrainableModel,
    client: AsyncOpenAI,
    scenarios: list[tasks.Scenario],
    group_size: int,
    max_tokens: int,
) -> tuple[list[jm.TrajectoryGroup], float]:
    """(groups with rewards that differ in each group, so every step trains; completion tokens/s)."""
    t0 = time.perf_counter()
    groups = await jm.gather_trajectory_groups(
        (
            jm.TrajectoryGroup(
                tasks.rollout(model, client, s, max_tokens=max_tokens) for _ in range(group_size)
            )
            for s in scenarios
        ),
        pbar_desc=None,
    )
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for g in groups for t in g.trajectories for r in t.records())
    for g in groups:
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2)
    return groups, tokens / elapsed
