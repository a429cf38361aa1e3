"""`art.gather`: ART's gathering helpers over Journeyman's `gather_trajectory_groups`."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import journeyman as jm
from journeyman.art._unsupported import module_getattr
from journeyman.errors import InvalidFieldError

ArtAfterEach = Callable[[jm.TrajectoryGroup], Any]


async def gather_trajectory_groups(
    groups: Iterable[jm.TrajectoryGroup | Awaitable[jm.TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
    max_metrics: int | None = None,
    after_each: ArtAfterEach | None = None,
) -> list[jm.TrajectoryGroup]:
    """`journeyman.gather_trajectory_groups` with ART's semantics for `after_each`: a `None` it
    returns drops the group (e.g. RULER with `swallow_exceptions=True` when the judge failed)."""
    del pbar_total_completion_tokens, max_metrics  # display options of ART's progress bar
    dropped: set[int] = set()
    hook: Callable[[jm.TrajectoryGroup], Awaitable[jm.TrajectoryGroup]] | None = None
    if after_each is not None:
        fn = after_each

        async def keep_or_drop(group: jm.TrajectoryGroup) -> jm.TrajectoryGroup:
            out = fn(group)
            if inspect.isawaitable(out):
                out = await out
            if out is None:
                dropped.add(id(group))
                return group
            return out

        hook = keep_or_drop

    gathered = await jm.gather_trajectory_groups(
        groups, pbar_desc=pbar_desc, max_exceptions=max_exceptions, after_each=hook
    )
    return [g for g in gathered if id(g) not in dropped]


async def gather_trajectories(
    trajectories: Iterable[jm.Trajectory | Awaitable[jm.Trajectory]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
) -> list[jm.Trajectory]:
    """Await rollouts that are not grouped (an evaluation): the trajectories, in order of finishing."""
    [group] = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup(trajectories)], pbar_desc=pbar_desc, max_exceptions=max_exceptions
    )
    return list(group)


async def trajectory_group_batches(
    groups: Iterable[Awaitable[jm.TrajectoryGroup] | jm.TrajectoryGroup],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 1,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
) -> AsyncIterator[list[jm.TrajectoryGroup]]:
    """Groups gathered `batch_size` at a time (after skipping `skip_batches` batches): each batch is
    yielded as soon as it is gathered, the next one's rollouts run meanwhile up to `max_concurrent_batches`."""
    if batch_size < 1 or max_concurrent_batches < 1:
        raise InvalidFieldError(
            "batch_size", batch_size, "batch_size and max_concurrent_batches must be >= 1"
        )
    items = list(groups)[batch_size * skip_batches :]
    chunks = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]

    def start(chunk: list[Any]) -> asyncio.Task[list[jm.TrajectoryGroup]]:
        return asyncio.ensure_future(
            gather_trajectory_groups(chunk, pbar_desc=pbar_desc, max_exceptions=max_batch_exceptions)
        )

    running = [start(c) for c in chunks[:max_concurrent_batches]]
    queued = chunks[max_concurrent_batches:]
    try:
        while running:
            batch = await running.pop(0)
            if queued:
                running.append(start(queued.pop(0)))
            yield batch
    finally:
        for task in running:
            task.cancel()


__getattr__ = module_getattr("art.gather", __name__)  # ART's gather internals: named errors

__all__ = ["gather_trajectories", "gather_trajectory_groups", "trajectory_group_batches"]
