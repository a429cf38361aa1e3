"""`/v1/messages` (the Anthropic Messages API) driven by the official `anthropic` SDK: the route's
mechanics (blocks, tools, stop sequences, the event stream, errors, both auth headers) on a
scripted engine through the real endpoint; one tool round trip on the real embedded model, whose
records are token-exact and join into one trajectory."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import journeyman as jm
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from journeyman.rollout.histories import join_calls

pytestmark = pytest.mark.integration

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def _call(name: str, arguments: dict[str, Any]) -> str:
    """A Hermes tool call, as the embedded model's family writes one."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


async def test_a_text_reply_is_a_message_with_its_exact_record(scripted, chat_format) -> None:
    model, backend = scripted
    backend.engine(model).script = ["Blue, mostly."]
    client = model.anthropic_client()
    msg = await client.messages.create(
        model=model.name,
        max_tokens=50,
        system="Answer briefly.",
        messages=[{"role": "user", "content": "Sky?"}],
    )
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Blue, mostly."
    assert msg.stop_reason == "end_turn" and msg.role == "assistant" and msg.id.startswith("msg_")
    (record,) = [jm.TokenRecord.model_validate(r) for r in msg.model_extra["journeyman"]]
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Sky?"}]
    assert record.prompt_token_ids == chat_format.prompt_ids(chat)[0]  # rendered as the chat route does
    assert record.token_ids == [*chat_format.encode("Blue, mostly."), backend.engine(model).end_id]
    assert msg.usage.input_tokens == len(record.prompt_token_ids)
    assert msg.usage.output_tokens == len(record.token_ids)


async def test_a_tool_round_trip_splices_the_call_and_joins_one_history(scripted) -> None:
    """tool_use comes back with the endpoint's call id; sent back with a tool_result, the turn is
    spliced by its sampled ids, and the captured calls join into one token-exact history."""
    model, backend = scripted
    engine = backend.engine(model)
    engine.script = [_call("get_weather", {"city": "Paris"})]
    client = model.anthropic_client()
    async with model.capture() as cap:
        first = await client.messages.create(
            model=model.name, max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}
        )
        (use,) = first.content
        assert first.stop_reason == "tool_use" and use.type == "tool_use"
        assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
        engine.script = ["Sunny in Paris."]
        second = await client.messages.create(
            model=model.name,
            max_tokens=60,
            tools=[WEATHER],
            messages=[
                *ASK,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C, sunny"}],
                },
            ],
        )
    assert second.content[0].text == "Sunny in Paris." and second.stop_reason == "end_turn"
    rec1, rec2 = (jm.TokenRecord.model_validate(m.model_extra["journeyman"][0]) for m in (first, second))
    assert rec2.spliced_turns == 1
    assert rec2.prompt_token_ids[: len(rec1.prompt_token_ids) + len(rec1.token_ids)] == [
        *rec1.prompt_token_ids,
        *rec1.token_ids,
    ]
    (history,) = join_calls(cap.calls)
    assert [r.token_ids for r in history.history().records()] == [rec1.token_ids, rec2.token_ids]
    assert history.tools is not None and history.tools[0]["function"]["name"] == "get_weather"


async def test_a_named_tool_choice_and_none(scripted) -> None:
    model, backend = scripted
    client = model.anthropic_client()
    backend.engine(model).script = [_call("get_weather", {"city": "Oslo"})]
    named = await client.messages.create(
        model=model.name,
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert named.content[0].type == "tool_use"
    # tool_choice none: the model may not call a tool, so call-like text is its answer
    refused = await client.messages.create(
        model=model.name, max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert [b.type for b in refused.content] == ["text"] and refused.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(
            model=model.name,
            max_tokens=60,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "nope"},
        )
    assert e.value.body["error"]["message"].startswith("tool_choice.name='nope'")


async def test_a_stop_sequence_ends_the_text_and_is_named(scripted) -> None:
    model, backend = scripted
    backend.engine(model).script = ["Hello there. END and more"]
    msg = await model.anthropic_client().messages.create(
        model=model.name, max_tokens=50, messages=ASK, stop_sequences=["STOP", "END"]
    )
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == (
        "Hello there. ",  # the text up to the stop string, as the chat route cuts it
        "stop_sequence",
        "END",
    )
    backend.engine(model).script = ["one two three four five six"]
    cut = await model.anthropic_client().messages.create(model=model.name, max_tokens=2, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


async def test_a_stream_has_anthropics_event_sequence(scripted) -> None:
    """Text streamed as sampled, then the tool_use block; the SDK's own accumulator rebuilds the
    message the unstreamed request returns."""
    model, backend = scripted
    reply = "Let me look that up. " + _call("get_weather", {"city": "Paris"})
    backend.engine(model).script = [reply]
    client = model.anthropic_client()
    ask: dict[str, Any] = {"model": model.name, "max_tokens": 80, "messages": ASK, "tools": [WEATHER]}
    kinds: list[str] = []
    texts: list[str] = []
    ending: Any = None
    async with client.messages.stream(**ask) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                texts.append(event.text)
            if event.type == "message_delta":
                ending = event
        final = await stream.get_final_message()
    whole = await client.messages.create(**ask)
    raw = [k for k in kinds if k not in ("text", "input_json")]  # the SDK's derived events left out
    assert (
        raw[0] == "message_start"
        and raw[1] == "content_block_start"
        and raw[-2:] == ["message_delta", "message_stop"]
    )
    assert len(raw) > 8 and raw[2:-2] == [
        *["content_block_delta"] * (len(raw) - 8),
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    ], raw
    assert "".join(texts) == final.content[0].text == whole.content[0].text == "Let me look that up."
    assert final.content[1].input == whole.content[1].input == {"city": "Paris"}
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert final.usage.input_tokens == whole.usage.input_tokens > 0
    assert ending.model_extra["journeyman"][0]["token_ids"] == whole.model_extra["journeyman"][0]["token_ids"]


async def test_errors_are_anthropics_and_both_auth_headers_work(scripted) -> None:
    model, _ = scripted
    client = model.anthropic_client()
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model=model.name, max_tokens=0, messages=ASK)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert bad.value.body["error"]["message"].startswith("max_tokens=0")
    with pytest.raises(anthropic.BadRequestError) as image:
        await client.messages.create(
            model=model.name,
            max_tokens=5,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
            ],
        )
    assert image.value.body["error"]["message"].startswith("messages[0].content[0].type='image'")
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await client.messages.create(model="nobody", max_tokens=5, messages=ASK)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await model.anthropic_client(api_key="wrong").messages.create(
            model=model.name, max_tokens=5, messages=ASK
        )
    assert denied.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "unauthorized"},
    }
    where = model.inference()  # the bearer token the OpenAI clients send works here too
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{where.base_url}/messages",
            headers={"authorization": f"Bearer {where.api_key}"},
            json={"model": model.name, "max_tokens": 5, "messages": ASK},
        )
    assert r.status_code == 200 and r.json()["type"] == "message"


async def test_the_real_model_calls_a_tool_and_answers_token_exactly(served) -> None:
    """The embedded model through the Anthropic SDK: a forced call under the grammar, the tool's
    result, a free answer; one history whose records decode to what the SDK was shown."""
    model, backend = served
    client = model.anthropic_client()
    system = "You answer weather questions. Always call get_weather first."
    async with model.capture() as cap:
        first = await client.messages.create(
            model=model.name,
            max_tokens=60,
            system=system,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 0.7},  # this SDK release no longer spells temperature
        )
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
        second = await client.messages.create(
            model=model.name,
            max_tokens=30,
            system=system,
            tools=[WEATHER],
            extra_body={"temperature": 0.0},
            messages=[
                *ASK,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C, sunny"}],
                },
            ],
        )
    (history,) = join_calls(cap.calls)
    rec1, rec2 = history.history().records()
    assert rec2.spliced_turns == 1
    assert rec2.prompt_token_ids[: len(rec1.prompt_token_ids) + len(rec1.token_ids)] == [
        *rec1.prompt_token_ids,
        *rec1.token_ids,
    ]
    tok = backend.service(model).chat_format.tokenizer
    answer = "".join(b.text for b in second.content if b.type == "text")
    assert tok.decode(rec2.token_ids, skip_special_tokens=True).strip() == answer


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_block = (
    st.sampled_from(
        [
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "thinking", "thinking": "hm", "signature": "x"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
        ]
    )
    | _json
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]) | _json,
        "content": st.text(max_size=20) | st.lists(_block, max_size=3) | _json,
    }
)
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(-2, 6) | _json,
    "messages": st.lists(_message, max_size=3) | _json,
    "system": st.text(max_size=20) | st.just([{"type": "text", "text": "Be brief."}]) | _json,
    "tools": st.just([WEATHER])
    | st.lists(st.fixed_dictionaries({"name": _json, "input_schema": _json}))
    | _json,
    "tool_choice": st.sampled_from(
        [
            {"type": "auto"},
            {"type": "any"},
            {"type": "none"},
            {"type": "tool", "name": "get_weather"},
            {"type": "tool"},
        ]
    )
    | _json,
    "stop_sequences": st.lists(st.text(max_size=4), max_size=3) | _json,
    "temperature": st.floats(-1, 3) | _json,
    "stream": st.booleans() | _json,
}


@st.composite
def _bodies(draw: st.DrawFn, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": draw(st.just(model) | st.text(max_size=5)),
        "max_tokens": 4,
        "messages": ASK,
    }
    for name in draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=4, unique=True)):
        body[name] = draw(_FIELDS[name])
    return body


def test_any_body_is_answered_or_refused_in_anthropics_shape(scripted) -> None:
    """Fuzzed Messages bodies (blocks, tools, choices, every field replaced by any JSON): a message or
    event stream, else a 400 / 404 in Anthropic's error shape naming what was wrong; never a 5xx."""
    model, backend = scripted
    backend.engine(model).script = ["Fine. " + _call("get_weather", {"city": "Rome"})]
    where = model.inference()
    seen: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, derandomize=True, database=None)
    @given(_bodies(model.name))
    def check(body: dict[str, Any]) -> None:
        r = httpx.post(
            f"{where.base_url}/messages", json=body, headers={"x-api-key": where.api_key}, timeout=60
        )
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300], body)
        if r.status_code == 200:
            assert r.headers["content-type"].startswith("text/event-stream") or r.json()["type"] == "message"
        else:
            error = r.json()
            assert error["type"] == "error" and error["error"]["type"] in (
                "invalid_request_error",
                "not_found_error",
            )
            assert error["error"]["message"], body

    check()
    assert seen.get(200) and seen.get(400), seen
