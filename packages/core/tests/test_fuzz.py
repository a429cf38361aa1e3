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
from typing import Any

import httpx
import journeyman as jm
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("JOURNEYMAN_FUZZ_EXAMPLES", "60"))
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
text = st.text(max_size=40)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]), "content": text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.just([{"type": "text", "text": "hi"}])}),
    st.just({"role": "assistant", "content": None, "tool_calls": [CALL]}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("c1"), "content": text}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": text}),
)


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]], keep: str) -> dict[str, Any]:
    """A plausible body with up to two fields replaced by any JSON or dropped (never `keep`, which
    bounds decoding), and sometimes one message of the conversation replaced by any JSON."""
    body = dict(draw(valid))
    for name in draw(st.sets(st.sampled_from(sorted(body)), max_size=2)):
        if name == keep:  # wrong but never absent: the default (1024 tokens) would decode for minutes
            body[name] = draw(st.integers(-2, 40) | st.sampled_from([False, 2**31, "4", 4.5, [4], {"n": 4}]))
        elif draw(st.booleans()):
            body[name] = draw(json_values)
        else:
            del body[name]
    items = body.get("messages", body.get("input"))
    if isinstance(items, list) and items and draw(st.integers(0, 3)) == 0:
        items[draw(st.integers(0, len(items) - 1))] = draw(json_values | message.map(_scramble))
    return body


def _scramble(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "role": m["role"].upper()} if m["role"] != "tool" else {**m, "tool_call_id": 7}


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
            "stop": text.map(lambda t: t[:3]) | st.lists(text.map(lambda t: t[:3]), max_size=2),
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
    return mutated(valid, keep="max_tokens")


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
    return mutated(valid, keep="max_output_tokens")


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


def _fuzz_route(served: Any, path: str, bodies: Any, raw: list[bytes]) -> Tally:
    model, _ = served
    tally = Tally()
    loop = asyncio.new_event_loop()
    http = httpx.AsyncClient(base_url=model.inference_base_url, timeout=REQUEST_TIMEOUT_S)
    try:

        @FUZZ
        @given(bodies(model.name))
        def property_(body: dict[str, Any]) -> None:
            loop.run_until_complete(_check(http, path, body, tally))

        property_()
        for b in raw:  # bodies that are not a JSON object at all
            loop.run_until_complete(_check(http, path, b, tally))
    finally:
        loop.run_until_complete(http.aclose())
        loop.close()
    return tally


RAW = [b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b'{"model": NaN}']


def test_chat_completions_route_never_fails_or_hangs_on_any_body(served) -> None:
    tally = _fuzz_route(served, "/chat/completions", chat_bodies, RAW)
    print(f"\n/v1/chat/completions: {EXAMPLES} fuzzed + {len(RAW)} raw bodies -> statuses {tally}")
    assert tally.statuses.get(200), "no fuzzed body was valid: the strategy no longer reaches the engine"


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
    tally = _fuzz_route(served, "/responses", responses_bodies, RAW)
    print(f"\n/v1/responses: {EXAMPLES} fuzzed + {len(RAW)} raw bodies -> statuses {tally}")
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
