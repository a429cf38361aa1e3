"""Trajectory types: JSON round trip, named errors, gather keeps what it collected."""

from __future__ import annotations

import math

import journeyman as jm
import pytest
from openai.types.chat.chat_completion import Choice


def _choice(text: str) -> Choice:
    record = jm.TokenRecord(
        prompt_token_ids=[1, 2],
        token_ids=[5, 6],
        logprobs=[-0.1, -0.2],
        model="m@0",
        step=0,
        finish_reason="stop",
    )
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": text},
            "journeyman": record.model_dump(),
        }
    )


def test_trajectory_round_trips_through_json_with_its_records() -> None:
    traj = jm.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, _choice("hello")],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        reward=0.5,
        metrics={"turns": 1},
        metadata={"scenario": "a"},
        additional_histories=[
            jm.History(messages_and_choices=[{"role": "user", "content": "side"}, _choice("x")])
        ],
    )
    group = jm.TrajectoryGroup([traj])
    back = jm.TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert back == group
    restored = back.trajectories[0]
    assert isinstance(restored.messages_and_choices[1], Choice)
    assert restored.records() == traj.records()
    assert jm.record_of(restored.messages_and_choices[1]).token_ids == [5, 6]
    assert restored.additional_histories[0].records()[0].logprobs == [-0.1, -0.2]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_is_a_named_error_and_keeps_the_old_value(bad: float) -> None:
    traj = jm.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=1.0)
    with pytest.raises(jm.InvalidFieldError) as e:
        traj.reward = bad
    assert e.value.field == "reward"
    assert traj.reward == 1.0


def test_empty_group_is_a_named_error() -> None:
    with pytest.raises(jm.EmptyGroupError) as e:
        jm.TrajectoryGroup([])
    assert e.value.field == "trajectories"


async def test_gather_keeps_finished_groups_when_too_many_rollouts_fail() -> None:
    async def ok(r: float) -> jm.Trajectory:
        return jm.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}], reward=r)

    async def boom() -> jm.Trajectory:
        raise RuntimeError("tool server died")

    groups = [jm.TrajectoryGroup([ok(1.0), ok(0.0)]), jm.TrajectoryGroup([boom(), boom(), ok(0.5)])]
    with pytest.raises(jm.TooManyExceptionsError) as e:
        await jm.gather_trajectory_groups(groups, pbar_desc=None, max_exceptions=1)
    kept = e.value.groups
    assert [len(g.trajectories) for g in kept] == [2, 1]
    assert [x.message for x in kept[1].exceptions] == ["tool server died", "tool server died"]

    seen: list[int] = []
    groups = [jm.TrajectoryGroup([ok(1.0), ok(0.0)]), jm.TrajectoryGroup([boom(), ok(0.5)])]
    out = await jm.gather_trajectory_groups(
        groups, pbar_desc=None, max_exceptions=0.5, after_each=lambda g: seen.append(len(g.trajectories))
    )
    assert [g.rewards() for g in out] == [[1.0, 0.0], [0.5]]
    assert sorted(seen) == [1, 2]


async def test_gather_rejects_a_bad_max_exceptions() -> None:
    with pytest.raises(jm.InvalidFieldError) as e:
        await jm.gather_trajectory_groups([], max_exceptions=-1)
    assert e.value.field == "max_exceptions"
