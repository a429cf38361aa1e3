"""JSON-schema constrained decoding in the in-process engine (xgrammar), through the real endpoint."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
import torch
from _support import ask, function_tool
from journeyman.engine.base import Constraint
from journeyman.engine.grammar import SCHEMA_FIELD, GrammarCache
from journeyman.errors import InvalidFieldError

pytestmark = pytest.mark.integration

# Every value bounded, as a small judge's schema should be: an enum, a capped string, a fixed-size array.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "verdict": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer", "enum": list(range(11))},
        "why": {"type": "string", "maxLength": 12},
        "picks": {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {"type": "integer", "enum": list(range(10))},
        },
    },
    "required": ["verdict", "score", "why", "picks"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Tell me a short story about a cat."}]


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


async def test_output_follows_the_schema(served: tuple[Any, Any]) -> None:
    model, _ = served
    client = model.openai_client()
    free = await client.chat.completions.create(
        model=model.name, messages=PROMPT, max_tokens=16, temperature=0.0
    )
    with pytest.raises(json.JSONDecodeError):  # unconstrained, the model writes prose
        json.loads(free.choices[0].message.content or "")

    out = await ask(
        model, PROMPT, max_tokens=60, temperature=1.0, seed=7, n=3, response_format=_format(SCHEMA)
    )
    for choice in out.choices:
        text = choice.message.content or ""
        assert choice.finish_reason == "stop", text
        assert "\n" not in text  # compact: no whitespace padding
        jsonschema.validate(json.loads(text), SCHEMA)
        # the token record still carries the raw-policy logprobs of what was sampled
        record = choice.model_extra["journeyman"]
        assert len(record["token_ids"]) == len(record["logprobs"]) > 0


async def test_bad_schema_fails_only_its_own_request(served: tuple[Any, Any]) -> None:
    model, _ = served
    client = model.openai_client()
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    bad, good = await asyncio.gather(
        client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=8, response_format=_format({"type": "foo"})
        ),
        client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=12, temperature=0.0, response_format=_format(small)
        ),
        return_exceptions=True,
    )
    assert isinstance(bad, openai.BadRequestError), bad
    assert bad.body["param"] == SCHEMA_FIELD and "foo" in bad.body["message"]
    assert not isinstance(good, BaseException), good
    assert json.loads(good.choices[0].message.content or "") in ({"ok": True}, {"ok": False})


async def test_mask_allows_only_grammar_tokens(served: tuple[Any, Any]) -> None:
    model, backend = served
    tokenizer = backend.service(model).policy.tokenizer
    vocab = backend.service(model).policy.model.config.vocab_size
    cache = GrammarCache(tokenizer, vocab, capacity=2)
    schema = json.dumps({"type": "object", "properties": {"v": {"type": "string", "enum": ["alpha"]}}})

    matcher = cache.matcher(Constraint((("", schema, ""),)))
    logits = torch.zeros(2, vocab + 3)  # a padded LM head: 3 ids beyond the tokenizer
    cache.mask(matcher, logits, row=1)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(i < vocab for i in allowed)
    assert all(tokenizer.decode([i]).startswith("{") for i in allowed)
    assert torch.isfinite(logits[0]).all()  # other rows untouched

    # the only completion the grammar admits, token by token
    for tok in tokenizer('{"v": "alpha"}', add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(tok)
    assert matcher.is_completed()

    for k in range(3):  # bounded cache: the oldest schema is dropped
        cache.compile(Constraint((("", json.dumps({"type": "integer", "enum": [k]}), ""),)))
    assert schema not in cache._compiled and len(cache._compiled) == 2

    with pytest.raises(InvalidFieldError) as err:
        cache.compile(Constraint((("", "{not json", ""),)))
    assert err.value.field == SCHEMA_FIELD


LOOKUP = function_tool(
    "lookup", "Look a city up.", {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, ["city"]
)
ANSWER = {
    "type": "object",
    "properties": {"number": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["number"],
    "additionalProperties": False,
}


async def test_tools_and_a_response_schema_at_once(served: tuple[Any, Any]) -> None:
    """As OpenAI's API has it (and the Agents SDK's `output_type` agents with tools need): unforced,
    the output may be a tool call or the schema's JSON; forced, the call is made and the schema is
    left to the final answer."""
    from journeyman.engine.base import SamplingParams
    from journeyman.serving.endpoint import ChatCompletionRequest, _constraint, _sampling_params

    model, backend = served
    client = model.openai_client()
    forced = await client.chat.completions.create(
        model=model.name,
        messages=[{"role": "user", "content": "How big is Paris?"}],
        tools=[LOOKUP],  # pyright: ignore[reportArgumentType]
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        response_format=_format(ANSWER),  # pyright: ignore[reportArgumentType]
        max_tokens=40,
        seed=1,
    )
    [call] = forced.choices[0].message.tool_calls or []
    assert call.function.name == "lookup" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")  # pyright: ignore[reportAttributeAccessIssue]

    unforced = await client.chat.completions.create(
        model=model.name,
        messages=[{"role": "user", "content": "How big is Paris?"}],
        tools=[LOOKUP],  # pyright: ignore[reportArgumentType]
        response_format=_format(ANSWER),  # pyright: ignore[reportArgumentType]
        max_tokens=40,
        seed=2,
        n=4,
    )
    for choice in unforced.choices:  # each a call of the tool or an answer in the schema
        if choice.message.tool_calls:
            assert choice.message.tool_calls[0].function.name == "lookup"  # pyright: ignore[reportAttributeAccessIssue]
        else:
            jsonschema.validate(json.loads(choice.message.content or ""), ANSWER)

    # the grammar behind it admits both, in the served family's call syntax, and nothing else
    service = backend.service(model)
    family = service.chat_format.family
    request = ChatCompletionRequest.model_validate(
        {"model": model.name, "messages": [], "tools": [LOOKUP], "response_format": _format(ANSWER)}
    )
    params: SamplingParams = _sampling_params(request, 40, _constraint(request, family))
    assert params.constraint is not None and len(params.constraint.shapes) == 2
    cache = GrammarCache(service.policy.tokenizer, service.policy.model.config.vocab_size)
    as_call = (
        family.call_open
        + json.dumps({"name": "lookup", family.arguments_key: {"city": "Rome"}})
        + family.call_close
    )
    for text, admitted in ((as_call, True), ('{"number": 2}', True), ("The answer is 2.", False)):
        matcher = cache.matcher(params.constraint)
        assert matcher.accept_string(text) == admitted and (matcher.is_completed() or not admitted), text
