"""The episode seam, model-free: a fake endpoint files hand-made calls under the episode's capture ids."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import journeyman as jm
import pytest
from _support import captured_call
from journeyman.integrations import Episode, EpisodeCall
from journeyman.rollout.capture import current_capture_id
from openai.types.chat.chat_completion import Choice

SYSTEM = {"role": "system", "content": "Use the tools."}
USER = {"role": "user", "content": "Where is order 7?"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "shipped"}


def _call(
    messages: list[dict[str, Any]], prompt: list[int] | None, sampled: list[int], text: str
) -> jm.CapturedCall:
    """A served call; `prompt=None`: a foreign call without a token record."""
    return captured_call(messages, prompt, sampled, {"role": "assistant", "content": text}, TOOLS)


ASK = _call([SYSTEM, USER], [1, 2, 3], [10, 11], "lookup 7")
# continues ASK: its prompt is ASK's prompt + sampled ids + the tool result's ids
ANSWER = _call(
    [SYSTEM, USER, {"role": "assistant", "content": "lookup 7"}, RESULT],
    [1, 2, 3, 10, 11, 20],
    [12],
    "shipped",
)
SIDE = _call([{"role": "user", "content": "Summarise."}], [5, 6], [7], "ok")  # a fresh prompt


class FakeEndpoint:
    """Files calls under capture ids and hands them out once, as the endpoint's `pop_captures`."""

    def __init__(self) -> None:
        self.filed: dict[str, list[jm.CapturedCall]] = {}
        self.pops: list[list[str]] = []

    def serve(self, call: jm.CapturedCall) -> None:
        cid = current_capture_id()
        if cid is not None:
            self.filed.setdefault(cid, []).append(call)

    async def pop_captures(self, capture_ids: Sequence[str]) -> dict[str, list[jm.CapturedCall]]:
        self.pops.append(list(capture_ids))
        return {cid: self.filed.pop(cid, []) for cid in capture_ids}


def _kinds(items: Sequence[Any]) -> list[str]:
    return ["choice" if isinstance(x, Choice) else x["role"] for x in items]


async def test_a_run_is_captured_popped_once_joined_and_settled() -> None:
    endpoint = FakeEndpoint()
    episode = Episode(endpoint)
    with episode.running():
        endpoint.serve(ASK)
        endpoint.serve(SIDE)
        endpoint.serve(ANSWER)
    assert current_capture_id() is None  # the scope ended with the block
    assert not episode.error
    t = await episode.finish()

    assert endpoint.pops == [[f"{episode.id}.0"]] and not endpoint.filed
    assert t is episode.trajectory and t.metrics == {"errored": False} and t.error is None
    # the tool loop is one history (the main one), the fresh prompt another
    assert _kinds(t.messages_and_choices) == ["system", "user", "choice", "tool", "choice"]
    assert [r.token_ids for r in t.records()] == [[10, 11], [12]]
    assert [_kinds(h.messages_and_choices) for h in t.additional_histories] == [["user", "choice"]]
    assert [h.calls for h in episode.histories] == [[0, 2], [1]]
    # popped once: later calls are the same calls, and no second round trip
    assert [c.call for c in await episode.calls()] == [ASK, SIDE, ANSWER]
    assert len(endpoint.pops) == 1


async def test_calls_come_per_capture_id_in_the_order_the_ids_were_handed_out() -> None:
    endpoint = FakeEndpoint()
    episode = Episode(endpoint)
    first, second = episode.new_capture_id(), episode.new_capture_id()
    endpoint.filed = {second: [ANSWER], first: [ASK, SIDE], "someone-else": [SIDE]}
    calls = await episode.calls()
    assert calls == [EpisodeCall(first, ASK), EpisodeCall(first, SIDE), EpisodeCall(second, ANSWER)]
    assert first == f"{episode.id}.0" and second == f"{episode.id}.1"
    assert endpoint.filed == {"someone-else": [SIDE]}  # another episode's calls stay filed


async def test_join_partitions_keep_earlier_histories_and_untrained_partitions() -> None:
    earlier = jm.History(messages_and_choices=[USER], trainable=False)
    episode = Episode(trajectory=jm.Trajectory(additional_histories=[earlier], reward=0.5))
    hs = episode.join([SIDE, ASK, ANSWER], ["judge", "agent", "agent"], trained={"agent"})
    assert [(h.partition, h.trainable, h.calls) for h in hs] == [
        ("agent", True, [1, 2]),
        ("judge", False, [0]),
    ]
    t = episode.settle()
    assert t.reward == 0.5 and len(t.records()) == 2
    assert [h.trainable for h in t.additional_histories] == [False, False]
    assert t.additional_histories[0] == earlier  # what the run put there first, then the judge's


async def test_recorded_foreign_calls_join_by_their_messages() -> None:
    """A loop that holds its completions (a baseline without token records) records them."""
    ask = _call([SYSTEM, USER], None, [], "lookup 7")
    answer = _call([SYSTEM, USER, {"role": "assistant", "content": "lookup 7"}, RESULT], None, [], "shipped")
    episode = Episode(on_error="raise")
    episode.record(ask)
    episode.record(answer)
    t = await episode.finish(exact=False)
    assert _kinds(t.messages_and_choices) == ["system", "user", "choice", "tool", "choice"]
    assert not t.additional_histories and t.records() == []
    with pytest.raises(jm.InvalidFieldError, match="token record"):
        Episode().join([ask])  # exact: a call without its record is refused


async def test_on_error_score_keeps_the_calls_before_the_error_with_error_reward() -> None:
    endpoint = FakeEndpoint()
    episode = Episode(endpoint, error_reward=lambda t: -float(len(t.records())))
    with episode.running():
        endpoint.serve(ASK)
        raise ValueError("turn limit")
    assert isinstance(episode.error, ValueError)
    t = await episode.finish()
    assert t.error is not None and t.error.type == "ValueError" and "turn limit" in t.error.message
    assert t.reward == -1.0 and t.metrics == {"errored": True}
    assert t.logs == ["the run raised ValueError: turn limit (kept: on_error='score')"]
    assert [r.token_ids for r in t.records()] == [[10, 11]]


async def test_a_reward_the_run_set_before_it_raised_wins() -> None:
    endpoint = FakeEndpoint()
    episode = Episode(endpoint, error_reward=-2.0)
    with episode.running():
        endpoint.serve(ASK)
        episode.trajectory.reward = 0.25
        raise RuntimeError("guardrail")
    t = await episode.finish()
    assert t.reward == 0.25 and t.metrics["errored"] is True


async def test_on_error_drop_and_raise_and_what_is_never_kept() -> None:
    async def failed(on_error: jm.OnError, error: Exception, *, served: bool = True) -> jm.Trajectory:
        endpoint = FakeEndpoint()
        episode = Episode(endpoint, on_error=on_error)
        with episode.running():
            if served:
                endpoint.serve(ASK)
            raise error
        try:
            return await episode.finish()
        finally:
            assert not endpoint.filed  # whatever the outcome, nothing stays on the endpoint

    boom = ValueError("boom")
    with pytest.raises(jm.RolloutDroppedError):
        await failed("drop", boom)
    with pytest.raises(ValueError, match="boom") as raised:
        await failed("raise", boom)
    assert raised.value is boom
    with pytest.raises(jm.EngineDownError):  # the service failing says nothing about the policy
        await failed("score", jm.EngineDownError("engine down"))
    with pytest.raises(ValueError, match="boom"):  # no call reached the endpoint: nothing to train
        await failed("score", boom, served=False)


async def test_cancellation_passes_through_and_discard_frees_the_calls() -> None:
    endpoint = FakeEndpoint()
    episode = Episode(endpoint)
    with pytest.raises(asyncio.CancelledError), episode.running():
        endpoint.serve(ASK)
        raise asyncio.CancelledError
    assert episode.error is None and endpoint.filed
    await episode.discard()
    assert not endpoint.filed


async def test_a_failure_outside_running_is_settled_too() -> None:
    endpoint = FakeEndpoint()
    episode = Episode(endpoint)
    with episode.capture():  # e.g. a stream started here and consumed later
        endpoint.serve(ASK)
    episode.fail(KeyError("late"))
    t = await episode.finish()
    assert t.metrics == {"errored": True} and t.error is not None and t.error.type == "KeyError"


async def test_concurrent_episodes_never_share_calls() -> None:
    endpoint = FakeEndpoint()

    async def one(call: jm.CapturedCall) -> jm.Trajectory:
        episode = Episode(endpoint)
        with episode.running():
            await asyncio.sleep(0.01)
            endpoint.serve(call)
            await asyncio.sleep(0.01)
        return await episode.finish()

    a, b = await asyncio.gather(one(ASK), one(SIDE))
    assert [r.token_ids for r in a.records()] == [[10, 11]] and [r.token_ids for r in b.records()] == [[7]]


def test_bad_on_error_and_error_reward_are_refused_by_field() -> None:
    with pytest.raises(jm.InvalidFieldError, match="on_error"):
        Episode(on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(jm.InvalidFieldError, match="error_reward"):
        Episode(error_reward="low")  # type: ignore[arg-type]


def test_the_integrations_face_resolves_every_name_and_stays_light() -> None:
    code = (
        "import sys, journeyman.integrations as a\n"
        "heavy = sorted({'torch', 'transformers', 'fastapi', 'matplotlib'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "missing = [n for n in a.__all__ if getattr(a, n, None) is None]\n"
        "assert not missing, missing\n"
        "print(a.plot_history.__module__, a.tasks.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["journeyman.app.plot", "journeyman.app.tasks"]


def test_the_old_name_of_the_integrations_face_still_works() -> None:
    """`journeyman.adapters` (the seam's name before "adapter" meant LoRA weights only) gives the
    same objects, the lazy ones included."""
    import journeyman.adapters as old
    import journeyman.integrations as new

    assert old.__all__ == new.__all__
    assert old.Episode is new.Episode and old.with_fields is new.with_fields
