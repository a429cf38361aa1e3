"""Run many rollout groups concurrently, with a progress bar that shows the live mean reward."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tqdm.auto import tqdm

from journeyman.data.types import RolloutEnd, TrajectoryGroup
from journeyman.errors import InvalidFieldError, TooManyExceptionsError
from journeyman.rollout.observe import GroupContext, emit

AfterEach = Callable[[TrajectoryGroup], TrajectoryGroup | Awaitable[TrajectoryGroup | None] | None]


async def gather_trajectory_groups(
    groups: Iterable[TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """Await every rollout of every group; return the groups in order.

    `max_exceptions`: how many rollouts may raise (an int count, or a fraction in (0, 1) of all
    rollouts) before this raises `TooManyExceptionsError`. That error is raised only after every
    rollout has finished and carries the finished groups, so nothing gathered is lost, and what each
    failed rollout raised (`.exceptions`; its message names the first, and where). Exceptions
    below the limit stay on each group's `exceptions`. A run that raised but was kept by its
    integration (`on_error="score"`, see `journeyman.data.failures`) is a trajectory with `error` set:
    counted as `errored` on the progress bar, never against `max_exceptions`, and trained; one
    its integration dropped is on the group's `dropped`. `after_each` runs on each group as soon as
    its rollouts finish (e.g. `ruler_score_group`) and may return a replacement group.
    """
    if isinstance(max_exceptions, bool) or not isinstance(max_exceptions, int | float) or max_exceptions < 0:
        raise InvalidFieldError(
            "max_exceptions", max_exceptions, "must be a count >= 0 or a fraction in (0, 1)"
        )
    items = [g if isinstance(g, TrajectoryGroup) else await g for g in groups]
    total = sum(len(g.pending) + len(g.trajectories) + len(g.exceptions) + len(g.dropped) for g in items)
    limit = max_exceptions * total if 0 < max_exceptions < 1 else max_exceptions
    bar = tqdm(total=total, desc=pbar_desc, disable=pbar_desc is None, unit="rollout")
    rewards: list[float] = []
    counts: dict[RolloutEnd, int] = {"trajectory": 0, "errored": 0, "dropped": 0, "exception": 0}

    def on_result(group: TrajectoryGroup, end: RolloutEnd) -> None:
        counts[end] += 1
        if end in ("trajectory", "errored"):
            rewards.append(group.trajectories[-1].reward)
        shown: dict[str, object] = {
            "reward": f"{sum(rewards) / max(1, len(rewards)):.3f}",
            "errored": counts["errored"],
            "exceptions": counts["exception"],
        }
        if counts["dropped"]:
            shown["dropped"] = counts["dropped"]
        bar.set_postfix(shown)
        bar.update(1)

    async def run(group: TrajectoryGroup) -> TrajectoryGroup:
        await group.resolve(on_result)
        if after_each is not None and group.trajectories:
            out: Any = after_each(group)
            if inspect.isawaitable(out):
                out = await out
            group = out if isinstance(out, TrajectoryGroup) else group
        return group

    try:
        done = await asyncio.gather(*(run(g) for g in items))
    finally:
        bar.close()
    kept = [g for g in done if g.trajectories]
    emit(kept, GroupContext(source="gather"))
    if counts["exception"] > limit:
        raised = [r.exception for g in done for r in g.exceptions if r.exception is not None]
        raise TooManyExceptionsError(counts["exception"], total, max_exceptions, kept, raised)
    return kept
