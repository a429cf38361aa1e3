"""Property-based fuzzing (hypothesis) of what crosses a boundary: the OpenAI routes of the real
endpoint on the real model, and the Trajectory / TrajectoryGroup JSON a remote backend receives.

Bodies are drawn field by field: each field is either a plausible value (so requests get past the
first check and reach the template, the grammar and the engine) or any JSON at all. The property:
never a 500 and never a hang; a 4xx names the field (`error.param`). Budgets are fixed and
derandomized so CI tries the same inputs every run; `JOURNEYMAN_FUZZ_EXAMPLES` raises them.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
from collections.abc import Mapping
from typing import Any

import httpx
import journeyman as jm
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

pytestmark = pytest.mark.integration

# 60 until 2026-11-28, when the schema fuzzer (backends/test_schema_fuzz.py) began sending its own
# bodies to these routes on the same model: the two files' time held level
EXAMPLES = int(os.environ.get("JOURNEYMAN_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
REQUEST_TIMEOUT_S = 60.0

# any JSON value; ints kept small (a valid n or max_tokens must not become minutes of decoding)
# except a few extremes
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.sampled_from([2**31, 2**63, -(2**63)])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
# lone surrogates: JSON may spell them (`"\ud800"`, json.dumps writes them so), UTF-8 cannot encode them
surrogate = st.sampled_from(["\ud800", "\udfff", "a\udc00b", "\ud83d"])
text = st.text(max_size=40)
hostile_text = text | surrogate | st.tuples(text, surrogate).map("".join)
tool_name = st.sampled_from(["get_weather", "f", "", " ", "a" * 300, "a.b-c:d"]) | hostile_text
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]), "content": text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.just([{"type": "text", "text": "hi"}])}),
    st.just({"role": "assistant", "content": None, "tool_calls": [CALL]}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("c1"), "content": text}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": text}),
)
hostile_message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": hostile_text | json_values},
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": json_values | hostile_text}),
                max_size=2,
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.none(),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": json_values | hostile_text,
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries(
                            {"name": tool_name, "arguments": json_values | hostile_text}
                        ),
                    }
                ),
                max_size=2,
            )
            | json_values,
        }
    ),
    st.fixed_dictionaries({"role": json_values | hostile_text, "content": text}),
)


def nested_schema(depth: int, kind: str) -> dict[str, Any]:
    """An object (or array) schema `depth` levels deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        if kind == "object":
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        else:
            schema = {"type": "array", "items": schema}
    return schema


# JSON schemas: plausible ones, wrongly typed ones, ones too deep or too large for the grammar compiler
schemas = st.one_of(
    st.just({"type": "object"}),
    st.fixed_dictionaries(
        {
            "type": st.just("object"),
            "properties": st.dictionaries(
                hostile_text.map(lambda t: t[:8]),
                st.sampled_from(
                    [{"type": "string"}, {"type": "integer"}, {"enum": [1, "a"]}, {"type": "frob"}]
                ),
                max_size=3,
            ),
        }
    ),
    st.builds(nested_schema, st.sampled_from([2, 20, 40, 300]), st.sampled_from(["object", "array"])),
    st.sampled_from(
        [
            {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}},
            {"type": "string", "pattern": "a{1,99999}"},
            {"$ref": "#/$defs/missing"},
            {"type": "string", "maxLength": 3},
        ]
    ),
    json_values,
)
function = st.fixed_dictionaries(
    {"name": tool_name},
    optional={"description": hostile_text | json_values, "parameters": schemas, "strict": json_values},
)
tool = st.one_of(
    st.just(TOOL),
    st.fixed_dictionaries({"type": st.just("function"), "function": function}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "tool", "web_search"]) | json_values, "function": json_values}
    ),
    json_values,
)
tools = st.lists(tool, min_size=1, max_size=3) | json_values
tool_choice = st.one_of(
    st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "tool"]) | json_values,
            "function": st.fixed_dictionaries({"name": tool_name}) | json_values,
        }
    ),
    st.sampled_from(["Auto", "any", ""]) | json_values,
)
response_format = st.one_of(
    st.sampled_from(
        [
            {"type": "json_object"},
            {"type": "text"},
            {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        ]
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "json_object", "text", "xml"]) | json_values},
        optional={
            "json_schema": st.fixed_dictionaries(
                {"name": hostile_text}, optional={"schema": schemas, "strict": json_values}
            )
            | json_values
        },
    ),
    json_values,
)
# template variables: a known one, names the renderer owns (its arguments, special tokens, helpers)
template_kwargs = st.one_of(
    st.just({"enable_thinking": False}),
    st.dictionaries(
        st.sampled_from(
            [
                "enable_thinking",
                "messages",
                "tools",
                "add_generation_prompt",
                "tokenize",
                "chat_template",
                "return_dict",
                "raise_exception",
                "bos_token",
                "eos_token",
                "namespace",
                "x y",
            ]
        )
        | hostile_text,
        json_values,
        max_size=3,
    ),
    json_values,
)


@st.composite
def mutated(
    draw: st.DrawFn,
    valid: st.SearchStrategy[dict[str, Any]],
    keep: str,
    hostile: Mapping[str, st.SearchStrategy[Any]] | None = None,
    item: st.SearchStrategy[Any] = json_values,
) -> dict[str, Any]:
    """A plausible body with up to two fields replaced (by a hostile value of their own kind: a
    mistyped or nested shape, invalid unicode, a value out of range; or by any JSON) or dropped
    (never `keep`, which bounds decoding), and sometimes one message or input item replaced."""
    hostile = hostile or {}
    body = dict(draw(valid))
    for name in draw(st.sets(st.sampled_from(sorted({*body, *hostile})), max_size=2)):
        how = draw(st.integers(0, 3))  # 0, 1: a hostile value of its kind; 2: any JSON; 3: dropped
        if name == keep:  # wrong but never absent: the default (1024 tokens) would decode for minutes
            body[name] = draw(st.integers(-2, 8) | st.sampled_from([False, 2**31, "4", 4.5, [4], {"n": 4}]))
        elif how <= 1 and name in hostile:
            body[name] = draw(hostile[name])
        elif how <= 2:
            body[name] = draw(json_values)
        else:
            body.pop(name, None)
    items = body.get("messages", body.get("input"))
    if isinstance(items, list) and items and draw(st.integers(0, 3)) == 0:
        items[draw(st.integers(0, len(items) - 1))] = draw(item | message.map(_scramble))
    return body


def _scramble(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "role": m["role"].upper()} if m["role"] != "tool" else {**m, "tool_call_id": 7}


# sampling values a whole batch would fail on: seeds past what torch.Generator takes, too many or
# too long stop strings, counts out of range
SAMPLING = {
    "seed": st.sampled_from([2**64, 2**63, 2**60, -(2**63) - 1, -(2**50), 2**44 + 1]) | json_values,
    "stop": st.sampled_from(["", [""], ["x"] * 500, "y" * 5000]) | st.lists(hostile_text, max_size=3),
    "n": st.sampled_from([0, 129, 2**63]),
    "top_logprobs": st.sampled_from([-1, 21, 2**70]),
    "temperature": st.sampled_from([-0.1, 2.5, 1e308]),
    "top_p": st.sampled_from([0, 1.5, -1]),
    "max_completion_tokens": st.sampled_from([0, -1, 2**31, 2**63]),
    "logprobs": json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": json_values}) | json_values,
    "logit_bias": st.dictionaries(hostile_text, json_values, max_size=2) | json_values,
}


def chat_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    valid = st.fixed_dictionaries(
        {
            "model": st.sampled_from([model, f"{model}@0"]),
            "messages": st.lists(message, min_size=1, max_size=4),
            "max_tokens": st.integers(1, 4),
        },
        optional={
            "n": st.integers(1, 3),
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.05, 1),
            "stop": text.map(lambda t: t[:3]).filter(bool)
            | st.lists(text.map(lambda t: t[:3]).filter(bool), max_size=2),
            "seed": st.integers(0, 2**40),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 20),
            "stream": st.booleans(),
            "tools": st.just([TOOL]),
            "tool_choice": st.sampled_from(
                ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]
            ),
            "response_format": st.sampled_from(
                [
                    {"type": "json_object"},
                    {"type": "text"},
                    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                ]
            ),
            "chat_template_kwargs": st.just({"enable_thinking": False}),
            "a_field_we_do_not_know": json_values,
        },
    )
    hostile = {
        **SAMPLING,
        "model": hostile_text,
        "messages": st.lists(hostile_message, min_size=1, max_size=3),
        "tools": tools,
        "tool_choice": tool_choice,
        "response_format": response_format,
        "chat_template_kwargs": template_kwargs,
    }
    return mutated(valid, keep="max_tokens", hostile=hostile, item=json_values | hostile_message)


roles = (
    st.sampled_from(["user", "assistant", "system", "developer", "tool", "USER"]) | json_values | hostile_text
)
content_part = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["input_text", "output_text", "text", "input_image", "refusal"])
        | json_values,
        "text": hostile_text | json_values,
    }
)
input_item = st.one_of(
    st.fixed_dictionaries(
        {"role": roles, "content": hostile_text | json_values | st.lists(content_part, max_size=2)},
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": json_values | hostile_text,
            "name": tool_name | json_values,
            "arguments": json_values | hostile_text,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": json_values,
            "output": json_values | hostile_text,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["reasoning", "web_search_call", "item_reference"]) | json_values}
    ),
)
responses_tools = (
    st.lists(
        st.one_of(
            st.just({"type": "function", "name": "get_weather", "parameters": {}}),
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["function", "web_search"]) | json_values,
                    "name": tool_name | json_values,
                },
                optional={"parameters": schemas, "description": json_values, "strict": json_values},
            ),
            json_values,
        ),
        min_size=1,
        max_size=3,
    )
    | json_values
)
text_format = st.one_of(
    st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema", "schema": {}}]),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "json_object", "text", "xml"]) | json_values},
        optional={"name": hostile_text | json_values, "schema": schemas, "strict": json_values},
    ),
    json_values,
)


def responses_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    item = message.filter(lambda m: m["role"] != "tool" and not m.get("tool_calls")) | st.sampled_from(
        [
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "summary": []},
        ]
    )
    valid = st.fixed_dictionaries(
        {
            "model": st.just(model),
            "input": text | st.lists(item, min_size=1, max_size=3),
            "max_output_tokens": st.integers(1, 4),
        },
        optional={
            "instructions": text,
            "tools": st.just([{"type": "function", "name": "get_weather", "parameters": {}}]),
            "tool_choice": st.sampled_from(
                ["auto", "none", "required", {"type": "function", "name": "get_weather"}]
            ),
            "text": st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "text"}}]),
            "temperature": st.floats(0, 2),
            "stream": st.booleans(),
        },
    )
    hostile = {
        "model": hostile_text,
        "input": st.lists(input_item, min_size=1, max_size=3) | hostile_text,
        "instructions": hostile_text | json_values,
        "tools": responses_tools,
        "tool_choice": st.fixed_dictionaries({"type": json_values, "name": tool_name | json_values})
        | st.sampled_from(["required", {"type": "function", "name": "get_weather"}])
        | json_values,
        "text": st.fixed_dictionaries({"format": text_format}) | json_values,
        "top_logprobs": SAMPLING["top_logprobs"] | json_values,
        "top_p": SAMPLING["top_p"],
        "metadata": json_values,
        "parallel_tool_calls": json_values,
        "previous_response_id": json_values,
    }
    return mutated(valid, keep="max_output_tokens", hostile=hostile, item=json_values | input_item)


class Tally:
    def __init__(self) -> None:
        self.statuses: dict[int, int] = {}

    def __str__(self) -> str:
        return " ".join(f"{k}:{v}" for k, v in sorted(self.statuses.items()))


async def _check(http: httpx.AsyncClient, path: str, body: dict[str, Any] | bytes, tally: Tally) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        r = await asyncio.wait_for(
            http.post(path, content=content, headers={"content-type": "application/json"}), REQUEST_TIMEOUT_S
        )
    except TimeoutError:
        faulthandler.dump_traceback(all_threads=True)  # where the server side is stuck
        raise
    tally.statuses[r.status_code] = tally.statuses.get(r.status_code, 0) + 1
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:500], body)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["param"] and error["message"], (error, body)


def _fuzz_route(served: Any, path: str, bodies: Any) -> Tally:
    model, _ = served
    tally = Tally()
    loop = asyncio.new_event_loop()
    http = _client(model)
    try:

        @FUZZ
        @given(bodies(model.name))
        def property_(body: dict[str, Any]) -> None:
            loop.run_until_complete(_check(http, path, body, tally))

        property_()
        for b in raw_bodies(model.name):
            loop.run_until_complete(_check(http, path, b, tally))
    finally:
        loop.run_until_complete(http.aclose())
        loop.close()
    return tally


def raw_bodies(model: str) -> list[bytes]:
    """Bodies that are not a JSON object, or not JSON: bytes that are not UTF-8 (in a string too),
    numbers JSON has no spelling for (echoed back, they made the response unwritable), nesting past
    any parser's limit, an integer of 5,000 digits."""
    m = json.dumps(model).encode()
    return [
        b"",
        b"{",
        b"[]",
        b"null",
        b'"text"',
        b"\xff\xfe",
        b"[" * 5000 + b"]" * 5000,
        b'{"a": ' * 900 + b"1" + b"}" * 900,
        b'{"model": NaN}',
        b'{"model": "\xff\xfe\xc3\x28"}',
        b'{"model": ' + m + b', "input": "hi", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
        b'{"model": ' + m + b', "input": "hi", "max_tokens": 2, "max_output_tokens": 2, "messages": '
        b'[{"role": "user", "content": "hi"}], "metadata": {"x": 1e400}}',
        b'{"model": ' + m + b', "n": ' + b"9" * 5000 + b"}",
    ]


def test_chat_completions_route_never_fails_or_hangs_on_any_body(served) -> None:
    tally = _fuzz_route(served, "/chat/completions", chat_bodies)
    print(f"\n/v1/chat/completions: {EXAMPLES} fuzzed + raw bodies -> statuses {tally}")
    assert tally.statuses.get(200), "no fuzzed body was valid: the strategy no longer reaches the engine"


def _deep_arguments(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


USER = [{"role": "user", "content": "hi"}]
# (route, body fields besides the model, the field its 400 names): bodies these strategies found
# answered with a 500 (or a 400 naming another field) before each field was checked up front
FOUND = [
    ("chat", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "\ud800"}}]}, "tools[0].function.name"),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"properties": {"\udc00": {}}}},
            }
        },
        "response_format.json_schema.schema.properties",
    ),
    (
        "chat",
        {"chat_template_kwargs": {"add_generation_prompt": False}},
        "chat_template_kwargs.add_generation_prompt",
    ),
    (
        "chat",
        {"tool_choice": {"type": "function", "function": "get_weather"}, "tools": [TOOL]},
        "tool_choice.function",
    ),
    ("chat", {"tools": ["get_weather"], "tool_choice": "required"}, "tools[0]"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": 5}}, "response_format.json_schema"),
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    ("chat", {"seed": 2**64}, "seed"),
    (
        "chat",
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": _deep_arguments(900)}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ("responses", {"text": {"format": "json"}}, "text.format"),
    ("responses", {"input": [{"role": [], "content": "hi"}]}, "input[0].role"),
    ("responses", {"instructions": "\ud800"}, "instructions"),
    ("responses", {"input": [{"type": "function_call", "call_id": "c", "name": 5}]}, "input[0].name"),
    ("responses", {"max_output_tokens": 0}, "max_output_tokens"),
]


@pytest.mark.parametrize(("route", "fields", "param"), FOUND)
async def test_found_by_fuzzing_bodies_that_were_500s_are_400s_naming_the_field(
    served, route: str, fields: dict[str, Any], param: str
) -> None:
    """Each body is refused with a 400 whose `error.param` names the offending field."""
    model, _ = served
    base = {"messages": USER, "max_tokens": 2} if route == "chat" else {"input": "hi", "max_output_tokens": 2}
    body = json.dumps({"model": model.name, **base, **fields}).encode()
    path = "/chat/completions" if route == "chat" else "/responses"
    async with _client(model) as http:
        r = await http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["param"] == param, r.json()


async def test_found_by_fuzzing_numbers_json_cannot_spell_are_refused_not_echoed(served) -> None:
    """The Responses route echoes `metadata`; 1e400 parsed as infinity and came back as `Infinity`,
    which no JSON client parses. Such bodies are not JSON: a 400 naming the body."""
    model, _ = served
    body = b'{"model": ' + json.dumps(model.name).encode() + b', "input": "hi", "max_output_tokens": 1, '
    async with _client(model) as http:
        for tail in (b'"metadata": {"x": 1e400}}', b'"metadata": {"x": NaN}}'):
            r = await http.post(
                "/responses", content=body + tail, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text[:300]


def _client(model: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=model.inference_base_url,
        timeout=REQUEST_TIMEOUT_S,
        headers={"authorization": f"Bearer {model.inference_api_key}"},
    )


async def test_found_by_fuzzing_a_conversation_that_opens_with_a_sampled_turn(served) -> None:
    """The splice looked for a template header before the first message: transformers refuses to
    render an empty conversation, and the request was a 500."""
    model, _ = served
    client = model.openai_client()
    first = await client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    again = await client.chat.completions.create(
        model=model.name,
        messages=[{"role": "assistant", "content": first.choices[0].message.content}],
        max_tokens=2,
    )
    assert jm.record_of(again.choices[0]).spliced_turns == 1


def test_responses_route_never_fails_or_hangs_on_any_body(served) -> None:
    tally = _fuzz_route(served, "/responses", responses_bodies)
    print(f"\n/v1/responses: {EXAMPLES} fuzzed + raw bodies -> statuses {tally}")
    assert tally.statuses.get(200), "no fuzzed body was valid: the strategy no longer reaches the engine"


trajectory_json = mutated(
    st.fixed_dictionaries(
        {
            "messages_and_choices": st.lists(message, min_size=1, max_size=4),
            "reward": st.floats(allow_nan=True, allow_infinity=True),
        },
        optional={"metrics": st.just({"turns": 2}), "metadata": json_values, "tools": st.just([TOOL])},
    ),
    keep="",
)
group_json = mutated(
    st.fixed_dictionaries(
        {"trajectories": st.lists(trajectory_json, max_size=3)},
        optional={"metadata": json_values, "exceptions": st.just([])},
    ),
    keep="",
)


@settings(max_examples=EXAMPLES * 5, deadline=None, derandomize=True, database=None)
@given(group_json)
def test_trajectory_group_json_is_validated_or_refused_by_name(body: dict[str, Any]) -> None:
    """What a remote backend receives: a valid group round-trips; anything else is refused with a
    ValidationError or an InvalidFieldError naming the field, never another exception."""
    text = json.dumps(body)
    try:
        group = jm.TrajectoryGroup.model_validate_json(text)
    except (ValidationError, jm.InvalidFieldError) as e:
        assert str(e)
        return
    again = jm.TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert again.model_dump() == group.model_dump()
