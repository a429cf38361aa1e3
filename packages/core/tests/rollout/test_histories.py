"""Captured calls to histories, model-free: synthetic calls with hand-made token records."""

from __future__ import annotations

from typing import Any

import journeyman as jm
import pytest
from _support import captured_call
from journeyman.rollout.histories import (
    extends,
    fill_histories,
    histories_of,
    join_calls,
    main_first,
    trajectory_of,
)
from journeyman.training.rows import _rows_from_records
from openai.types.chat.chat_completion import Choice

SYSTEM = {"role": "system", "content": "You answer with the tools."}
USER = {"role": "user", "content": "Where is order 7?"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
PROMPT = [1, 2, 3, 4]  # SYSTEM + USER as the template renders them


def _call(
    messages: list[dict[str, Any]],
    prompt: list[int] | None,
    sampled: list[int],
    *,
    text: str | None = None,
    lookup: int | None = None,
    tools: list[dict[str, Any]] | None = TOOLS,
) -> jm.CapturedCall:
    """A served call as the endpoint files it; `prompt=None`: a foreign call, no token record."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if lookup is not None:
        args = f'{{"order": {lookup}}}'
        message["tool_calls"] = [
            {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": args}}
        ]
    return captured_call(messages, prompt, sampled, message, tools)


def _asked(lookup: int) -> dict[str, Any]:
    """The sampled tool call as the next request carries it back (normalized: arguments as a dict)."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "lookup", "arguments": {"order": lookup}},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "shipped"}
RESULT_IDS = [20, 21]
TURN_2 = [SYSTEM, USER, _asked(7), RESULT]


def _roles(h: jm.History) -> list[str]:
    return ["choice" if isinstance(x, Choice) else x["role"] for x in h.messages_and_choices]


def test_extends_is_a_prefix_test() -> None:
    assert extends([1, 2], [1, 2, 3]) and extends([1, 2], [1, 2]) and extends([], [5])
    assert not extends([1, 2, 3], [1, 2]) and not extends([1, 3], [1, 2, 3])


def test_two_rollouts_sampling_the_same_text_join_their_own() -> None:
    """Same call text, different ids: the requests are equal message by message, the prompts are not."""
    a1 = _call([SYSTEM, USER], PROMPT, [10, 11, 12], lookup=7)
    b1 = _call([SYSTEM, USER], PROMPT, [10, 13, 12], lookup=7)  # one text, another tokenisation
    b2 = _call(TURN_2, [*PROMPT, 10, 13, 12, *RESULT_IDS], [30], text="Shipped.")
    a2 = _call(TURN_2, [*PROMPT, 10, 11, 12, *RESULT_IDS], [31], text="Shipped.")
    joined = join_calls([a1, b1, b2, a2])
    assert [h.calls for h in joined] == [[0, 3], [1, 2]]
    assert not any(h.superseded for h in joined) and all(h.trainable for h in joined)
    for h in joined:
        assert _roles(h.history()) == ["system", "user", "choice", "tool", "choice"]
        first, second = h.history().records()
        assert extends(first.prompt_token_ids + first.token_ids, second.prompt_token_ids)
    # why not messages: without the records the second calls are indistinguishable, and b2 lands
    # in a1's conversation (the latest one its messages continue)
    foreign = [_call(c.request_messages, None, [], **_answer(c)) for c in (a1, b1, b2, a2)]
    assert [h.calls for h in join_calls(foreign, exact=False)] == [[0, 2], [1, 3]]


def _answer(call: jm.CapturedCall) -> dict[str, Any]:
    msg = call.response["choices"][0]["message"]
    return {"text": msg["content"], "lookup": 7 if msg.get("tool_calls") else None}


def test_a_retried_call_supersedes_the_first_which_stays_its_own_untrained_history() -> None:
    """The client sent one request twice (a timeout, say): only the second answer reached the agent."""
    lost = _call([SYSTEM, USER], PROMPT, [10, 11], lookup=7)
    retry = _call([SYSTEM, USER], PROMPT, [10, 14], lookup=7)
    then = _call(TURN_2, [*PROMPT, 10, 14, *RESULT_IDS], [30], text="Shipped.")
    joined = join_calls([lost, retry, then])
    assert [(h.calls, h.superseded, h.trainable) for h in joined] == [
        ([0], True, False),
        ([1, 2], False, True),
    ]
    t = trajectory_of(joined, reward=1.0)
    assert [r.token_ids for r in t.records()] == [[10, 14], [30]]  # the retried call continues
    (side,) = t.additional_histories
    assert not side.trainable and [r.token_ids for r in side.records()] == [[10, 11]]
    assert [len(h.messages_and_choices) for h in histories_of([lost, retry, then])] == [5, 3]

    # a retry of a later call: the conversation keeps its earlier calls, the lost answer leaves it
    c1 = _call([SYSTEM, USER], PROMPT, [10, 11], lookup=7)
    turn_2 = [*PROMPT, 10, 11, *RESULT_IDS]
    lost2 = _call(TURN_2, turn_2, [40], text="Lost.")
    retry2 = _call(TURN_2, turn_2, [41], text="Kept.")
    c3 = _call(
        [*TURN_2, {"role": "assistant", "content": "Kept."}, USER], [*turn_2, 41, 5, 6], [50], text="7."
    )
    joined = join_calls([c1, lost2, retry2, c3])
    assert [(h.calls, h.superseded) for h in joined] == [([0, 2, 3], False), ([1], True)]
    main = main_first(joined)[0].history()
    assert _roles(main) == ["system", "user", "choice", "tool", "choice", "user", "choice"]
    assert len(_rows_from_records(main.records())) == 1  # one token sequence without the lost answer


def test_a_handoff_starts_its_own_history_and_partitions_never_join() -> None:
    triage_sys = {"role": "system", "content": "Route the customer."}
    billing_sys = {"role": "system", "content": "You are a billing specialist."}
    triage = _call([triage_sys, USER], [7, 3, 4], [60], lookup=1)
    billing = _call([billing_sys, USER], [8, 3, 4], [61], text="Refunded.")
    joined = main_first(join_calls([triage, billing], ["Triage", "Billing"], trained={"Billing"}))
    assert [(h.partition, h.trainable) for h in joined] == [("Billing", True), ("Triage", False)]
    t = trajectory_of(joined)
    assert t.messages()[0] == billing_sys and not t.additional_histories[0].trainable

    # token-wise the second call continues the first, but it belongs to another agent
    first = _call([SYSTEM, USER], PROMPT, [10], lookup=7)
    second = _call(TURN_2, [*PROMPT, 10, *RESULT_IDS], [30], text="Shipped.")
    assert [h.calls for h in join_calls([first, second], ["a", "b"])] == [[0], [1]]
    assert [h.calls for h in join_calls([first, second], ["a", "a"])] == [[0, 1]]
    with pytest.raises(jm.InvalidFieldError, match="partition"):
        join_calls([first, second], ["a"])


def test_a_side_call_on_a_fresh_prompt_is_its_own_history_and_main_stays_main() -> None:
    m1 = _call([SYSTEM, USER], PROMPT, [10, 11], lookup=7)
    side = _call([{"role": "user", "content": "Which order?"}], [9, 9], [70], text="7", tools=None)
    m2 = _call(TURN_2, [*PROMPT, 10, 11, *RESULT_IDS], [30], text="Shipped.")
    t = trajectory_of(join_calls([m1, side, m2]))
    assert _roles(t) == ["system", "user", "choice", "tool", "choice"] and t.tools == TOOLS
    (h,) = t.additional_histories
    assert h.trainable and _roles(h) == ["user", "choice"] and h.tools is None


def test_fill_keeps_what_the_trajectory_held_and_needs_a_trainable_main() -> None:
    m1 = _call([SYSTEM, USER], PROMPT, [10, 11], lookup=7)
    side = _call([{"role": "user", "content": "Which order?"}], [9, 9], [70], text="7", tools=None)
    earlier = jm.History(messages_and_choices=[USER], trainable=False)
    t = fill_histories(jm.Trajectory(additional_histories=[earlier], reward=2.0), join_calls([side, m1]))
    # main is the first trainable history (here the side call, served first); earlier ones stay first
    assert _roles(t) == ["user", "choice"] and t.reward == 2.0
    assert [_roles(h) for h in t.additional_histories] == [["user"], ["system", "user", "choice"]]
    # nothing trainable (every partition untrained): the conversation stays as it was
    kept = jm.Trajectory(messages_and_choices=[SYSTEM, USER])
    fill_histories(kept, join_calls([m1], ["judge"], trained=set()))
    assert _roles(kept) == ["system", "user"]
    assert [(h.trainable, _roles(h)) for h in kept.additional_histories] == [
        (False, ["system", "user", "choice"])
    ]


def test_foreign_calls_join_by_messages_when_the_tools_match() -> None:
    first = _call([SYSTEM, USER], None, [], lookup=7)
    second = _call(TURN_2, None, [], text="Shipped.")
    other_tools = _call(TURN_2, None, [], text="Shipped.", tools=None)
    assert [h.calls for h in join_calls([first, second], exact=False)] == [[0, 1]]
    assert [h.calls for h in join_calls([first, other_tools], exact=False)] == [[0], [1]]
    (main,) = histories_of([first, second], exact=False)
    assert _roles(main) == ["system", "user", "choice", "tool", "choice"] and main.records() == []
    # a call that has a record never joins one that has none
    exact = _call(TURN_2, [*PROMPT, 10, *RESULT_IDS], [30], text="Shipped.")
    assert [h.calls for h in join_calls([first, exact], exact=False)] == [[0], [1]]
    with pytest.raises(jm.InvalidFieldError, match="journeyman"):
        join_calls([first])


def test_tokenize_rows_agree_with_the_join() -> None:
    """Each joined history is one training row: the last call's prompt + its sampled ids."""
    calls = [
        _call([SYSTEM, USER], PROMPT, [10, 11, 12], lookup=7),
        _call([SYSTEM, USER], PROMPT, [10, 13, 12], lookup=7),
        _call([{"role": "user", "content": "Which order?"}], [9, 9], [70], text="7", tools=None),
        _call(TURN_2, [*PROMPT, 10, 13, 12, *RESULT_IDS], [30], text="Shipped."),
        _call(TURN_2, [*PROMPT, 10, 11, 12, *RESULT_IDS], [31], text="Shipped."),
    ]
    joined = join_calls(calls)
    assert [h.calls for h in joined] == [[0, 4], [1, 3], [2]]
    for h in joined:
        records = h.history().records()
        (row,) = _rows_from_records(records)
        assert row.input_ids == records[-1].prompt_token_ids + records[-1].token_ids
        trained = [i for i, m in zip(row.input_ids, row.trained, strict=True) if m]
        assert trained == [i for r in records for i in r.token_ids]
