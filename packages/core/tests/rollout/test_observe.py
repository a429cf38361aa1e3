"""Trajectory sinks are scoped per context: concurrent programs each export only their own groups."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import journeyman as jm
import pytest
from journeyman.rollout.observe import GroupContext, add_sink, current_sinks, emit, remove_sink, sink_scope


class Collect:
    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[tuple[str | None, int]] = []

    def on_groups(self, groups: Sequence[jm.TrajectoryGroup], context: GroupContext) -> None:
        self.seen.append((context.model, len(groups)))


def _groups(n: int) -> list[jm.TrajectoryGroup]:
    return [jm.TrajectoryGroup([jm.Trajectory(reward=float(i))]) for i in range(n)]


async def test_two_concurrent_tasks_each_see_only_their_own_sink() -> None:
    both = asyncio.Barrier(2)

    async def program(name: str, n: int) -> Collect:
        sink = Collect(name)
        add_sink(sink)
        await both.wait()  # both sinks are added before either emits
        emit(_groups(n), GroupContext(model=name))
        await asyncio.to_thread(emit, _groups(n), GroupContext(model=f"{name}-thread"))  # threads inherit
        assert current_sinks() == (sink,)
        return sink

    a, b = await asyncio.gather(program("a", 1), program("b", 2))
    assert a.seen == [("a", 1), ("a-thread", 1)] and b.seen == [("b", 2), ("b-thread", 2)]
    assert current_sinks() == ()  # the tasks' sinks never reached the context that started them


async def test_a_sink_added_here_reaches_tasks_started_after_and_remove_and_scope_undo_it() -> None:
    outer, inner = Collect("outer"), Collect("inner")
    add_sink(outer)
    try:
        await asyncio.create_task(asyncio.to_thread(emit, _groups(1), GroupContext(model="child")))
        with sink_scope(inner):
            emit(_groups(2), GroupContext(model="scoped"))
        emit(_groups(3), GroupContext(model="after"))
    finally:
        remove_sink(outer)
    emit(_groups(4), GroupContext(model="removed"))
    remove_sink(outer)  # removing twice is a no-op
    assert outer.seen == [("child", 1), ("scoped", 2), ("after", 3)]
    assert inner.seen == [("scoped", 2)]
    assert current_sinks() == ()


async def test_a_failing_sink_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def on_groups(self, groups: Sequence[jm.TrajectoryGroup], context: GroupContext) -> None:
            raise RuntimeError("exporter down")

    ok = Collect("ok")
    with sink_scope(Broken()), sink_scope(ok):
        emit(_groups(1), GroupContext(model="m"))
    assert ok.seen == [("m", 1)]
    assert "exporter down" in caplog.text and "failed" in caplog.text
