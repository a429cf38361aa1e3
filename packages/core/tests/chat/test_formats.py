"""Chat template with tools, tool-call parsing, and splicing of sampled turns (tokenizer only)."""

from __future__ import annotations

import json
import time

import pytest
from _support import weather_tools
from journeyman.chat.formats import SampledTurns
from journeyman.chat.messages import normalize_messages
from journeyman.errors import InvalidFieldError
from journeyman.rollout.capture import CapturedCall, Captures

TOOLS = weather_tools()
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tools_render_into_system_turn_and_calls_round_trip(chat_format) -> None:
    msgs = normalize_messages(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    )
    text = chat_format.render(msgs, TOOLS, True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the rendered assistant turn parses back into the same call
    body = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    turn = chat_format.parse(body)
    assert turn.content is None
    assert turn.tool_calls[0]["name"] == "get_weather"
    assert json.loads(turn.tool_calls[0]["arguments"]) == {"city": "Paris"}


def test_without_tools_matches_the_models_own_template(chat_format) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    own = chat_format.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat_format.render(normalize_messages(msgs), None, True) == own


def test_rendering_is_prefix_stable(chat_format) -> None:
    msgs = normalize_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ]
    )
    for k in range(1, len(msgs)):
        assert chat_format.render(msgs[: k + 1], TOOLS, False).startswith(
            chat_format.render(msgs[:k], TOOLS, False)
        )


def test_malformed_tool_calls_stay_content(chat_format) -> None:
    for text in [
        "<tool_call>{not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        "<tool_call>unclosed",
    ]:
        turn = chat_format.parse(text)
        assert (turn.content, turn.tool_calls) == (text, [])
    turn = chat_format.parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert turn.content == "Sure." and turn.tool_calls == [{"name": "f", "arguments": '{"x": 1}'}]
    # offered no tools, call-like text is the answer
    assert (
        chat_format.parse('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', tools=False).tool_calls
        == []
    )


def test_splices_sampled_ids_for_earlier_assistant_turns(chat_format) -> None:
    user = normalize_messages([{"role": "user", "content": "Say hi"}])
    prompt, _ = chat_format.prompt_ids(user)
    # ids the engine "sampled": a tokenisation that differs from what re-encoding the text gives
    sampled = [*chat_format.encode("H"), *chat_format.encode("i there"), chat_format.eos_id]
    assert sampled[:-1] != chat_format.encode("Hi there")
    turns = SampledTurns()
    turns.add("Hi there", None, sampled)
    msgs = normalize_messages(
        [*user, {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "Again"}]
    )
    ids, spliced = chat_format.prompt_ids(msgs, None, turns)
    assert spliced == 1
    assert (
        ids[: len(prompt) + len(sampled)] == prompt + sampled
    )  # the next prompt extends prompt + completion
    plain, none = chat_format.prompt_ids(msgs, None, None)
    assert none == 0 and plain == chat_format.encode(chat_format.render(msgs, None, True))


def test_same_call_text_with_other_ids_splices_each_rollouts_own_ids(chat_format) -> None:
    """Two rollouts sampled the same tool call as different token ids: each history gets its own."""
    call = {"name": "add_task", "arguments": '{"title": "milk"}'}
    a = [{"id": "call_a", "type": "function", "function": call}]
    b = [{"id": "call_b", "type": "function", "function": call}]
    turns = SampledTurns()
    turns.add(None, a, [1, 2, 3])
    turns.add(None, b, [4, 5, 6])
    assert turns.get(None, a).token_ids == [1, 2, 3] and turns.get(None, b).token_ids == [4, 5, 6]
    # a framework that renamed the ids falls back to the text (the latest sample of it)
    renamed = [{"id": "call_x", "type": "function", "function": call}]
    assert turns.get(None, renamed).token_ids == [4, 5, 6]
    # same ids but edited arguments: the ids no longer describe this text, nothing is spliced
    edited = [{"id": "call_a", "type": "function", "function": {**call, "arguments": "{}"}}]
    assert turns.get(None, edited) is None


def test_memory_held_for_turns_and_captures_is_bounded_and_counted() -> None:
    turns = SampledTurns(capacity_tokens=10)
    for i in range(5):
        turns.add(f"turn {i}", None, [i] * 4)
    assert turns.tokens <= 10 and turns.evicted == 3
    assert turns.get("turn 0", None) is None and turns.get("turn 4", None).token_ids == [4] * 4
    turns.add("turn 4", None, [9] * 4)  # the same turn again replaces, never double-counts
    assert turns.tokens == 8

    call = CapturedCall(request_messages=[], response={})
    captures = Captures(max_ids=2, max_age_s=0.05)
    for cid in ("a", "b", "c"):
        captures.add(cid, call)
    assert len(captures) == 2 and captures.dropped == 1 and captures.pop("a") == []
    time.sleep(0.06)
    captures.add("d", call)  # "b" and "c" were never popped and are now too old
    assert len(captures) == 1 and captures.dropped == 3 and captures.pop("d") == [call]


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        (
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_invalid_messages_name_the_field(messages, field) -> None:
    with pytest.raises(InvalidFieldError) as e:
        normalize_messages(messages)
    assert e.value.field == field
