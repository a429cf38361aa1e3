"""Trajectory types: JSON round trip, named errors, gather keeps what it collected."""

from __future__ import annotations

import math

import httpx
import journeyman as jm
import openai
import pytest
from _support import recorded_choice
from journeyman.data.failures import check_on_error, settle_failed_run
from openai.types.chat.chat_completion import Choice


def test_trajectory_round_trips_through_json_with_its_records() -> None:
    traj = jm.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, recorded_choice("hello")],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        reward=0.5,
        metrics={"turns": 1},
        metadata={"scenario": "a"},
        additional_histories=[
            jm.History(messages_and_choices=[{"role": "user", "content": "side"}, recorded_choice("x")])
        ],
    )
    group = jm.TrajectoryGroup([traj])
    back = jm.TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert back == group
    restored = back.trajectories[0]
    assert isinstance(restored.messages_and_choices[1], Choice)
    assert restored.records() == traj.records()
    assert jm.record_of(restored.messages_and_choices[1]).token_ids == [5, 6]
    assert restored.additional_histories[0].records()[0].logprobs == [-0.5, -0.5]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_is_a_named_error_and_keeps_the_old_value(bad: float) -> None:
    traj = jm.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=1.0)
    with pytest.raises(jm.InvalidFieldError) as e:
        traj.reward = bad
    assert e.value.field == "reward"
    assert traj.reward == 1.0


def test_a_group_has_signal_only_when_its_rewards_differ_by_the_spread_asked() -> None:
    def group(*rewards: float) -> jm.TrajectoryGroup:
        return jm.TrajectoryGroup(
            jm.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=r) for r in rewards
        )

    assert not group(1.0, 1.0, 1.0).has_signal() and not group(0.5).has_signal()
    assert group(0.0, 1.0).has_signal() and group(0.0, 1.0).has_signal(min_spread=1.0)
    assert not group(0.0, 0.1).has_signal(min_spread=0.2)


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
    # the cause is shown and reachable: the first failure by name and place, all of them as raised
    assert [repr(x) for x in e.value.exceptions] == [repr(RuntimeError("tool server died"))] * 2
    assert e.value.__cause__ is e.value.exceptions[0] and e.value.exceptions[0].__traceback__ is not None
    assert f"the first: RuntimeError: tool server died (at {__file__}:" in str(e.value)

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


def _partial() -> jm.Trajectory:
    """What an integration built from the calls a run made before it raised."""
    return jm.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, recorded_choice("calling")])


def test_failed_run_policies() -> None:
    err = RuntimeError("max turns (2) exceeded")
    kept = settle_failed_run(_partial(), err, "score", lambda t: -float(len(t.records())))
    assert kept.error is not None and (kept.error.type, kept.error.message) == ("RuntimeError", str(err))
    assert kept.reward == -1.0 and kept.metrics == {"errored": True} and "RuntimeError" in kept.logs[0]
    back = jm.Trajectory.model_validate_json(kept.model_dump_json())
    assert back.error == kept.error and back.records() == kept.records()
    # the exception object itself, for `except`-style handling, in this process only
    assert kept.error.exception is err and back.error is not None and back.error.exception is None
    preset = _partial()
    preset.reward = 0.25  # a reward the run set before it raised wins over error_reward
    assert settle_failed_run(preset, err, "score", 0.0).reward == 0.25
    with pytest.raises(jm.RolloutDroppedError) as dropped:
        settle_failed_run(_partial(), err, "drop")
    assert dropped.value.error is err
    with pytest.raises(RuntimeError):
        settle_failed_run(_partial(), err, "raise")
    with pytest.raises(RuntimeError):  # no call was captured: nothing to train
        settle_failed_run(jm.Trajectory(), err, "score")
    # the service failing says nothing about the policy: re-raised whatever the policy
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    down = openai.InternalServerError("engine_down", response=httpx.Response(503, request=request), body=None)
    for e in (down, openai.APIConnectionError(request=request), jm.EngineDownError("gone")):
        with pytest.raises(type(e)):
            settle_failed_run(_partial(), e, "score")
    too_long = openai.BadRequestError("context", response=httpx.Response(400, request=request), body=None)
    assert settle_failed_run(_partial(), too_long, "score").error is not None  # the run outgrew the context
    with pytest.raises(jm.InvalidFieldError) as bad:
        check_on_error("ignore", 0.0)
    assert bad.value.field == "on_error"
    with pytest.raises(jm.InvalidFieldError) as bad:
        check_on_error("score", "low")
    assert bad.value.field == "error_reward"


async def test_gather_counts_errored_and_dropped_apart_from_exceptions() -> None:
    async def failed() -> jm.Trajectory:
        return settle_failed_run(_partial(), RuntimeError("guardrail"), "score")

    async def dropped() -> jm.Trajectory:
        return settle_failed_run(_partial(), RuntimeError("guardrail"), "drop")

    async def boom() -> jm.Trajectory:
        raise RuntimeError("tool server died")

    counts: list[str] = []
    group = jm.TrajectoryGroup([failed(), dropped(), boom(), failed()])
    await group.resolve(lambda g, outcome: counts.append(outcome))
    assert sorted(counts) == ["dropped", "errored", "errored", "exception"]
    # only the rollout that left nothing counts against max_exceptions
    [group] = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup([failed(), dropped(), boom()])], pbar_desc=None, max_exceptions=1
    )
    assert len(group.errored()) == 1 and len(group.dropped) == 1 and len(group.exceptions) == 1
    assert group.dropped[0].message == "guardrail"
    back = jm.TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert back.dropped == group.dropped and back.errored()[0].error == group.errored()[0].error
