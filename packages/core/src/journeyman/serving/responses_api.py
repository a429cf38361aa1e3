"""`POST /v1/responses`: the subset of OpenAI's Responses API that agent frameworks use, served by
translating each request into a chat completion of the same endpoint.

Supported: `instructions`, `input` as a string or as items (messages with text parts,
`function_call`, `function_call_output`, `reasoning`: its text becomes the next assistant turn's
`reasoning_content`), function tools,
`tool_choice` (auto / none / required / a named function, the last two grammar-constrained),
`text.format` (json_schema / json_object / text), `max_output_tokens`, `temperature`, `top_p`,
and `stream` (the message's text as it is sampled, then what only the whole response says: see
`_ResponsesCall`). A reasoning model's thinking (Qwen3's `<think>` block) comes back as a `reasoning` output
item before the message, its text as `reasoning_text` content, as vLLM returns it (`summary` stays
empty: nothing summarizes it). Not supported:
`previous_response_id` / `conversation` (no responses are stored) and hosted tools.

Going through `Endpoint.chat_completion` keeps one data path: the same splicing of sampled turns,
the same `TokenRecord`, and the same capture filing under `x-journeyman-capture` (the filed
call carries the Responses id as `CapturedCall.response_id`). The response also carries the records in an extra field
`journeyman` (a list, one per choice).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from journeyman.chat.messages import ROLES, text_of, tool_arguments
from journeyman.errors import InvalidFieldError
from journeyman.serving.openai_http import (
    JsonSchema,
    RequiredForJsonSchema,
    ToolChoiceMode,
    ToolName,
    Tools,
    invalid_field,
    string_or_object,
)
from journeyman.serving.streaming import Streams, add_translated_route, named_event

_MESSAGE_ROLES = ROLES - {"tool"}  # tool results arrive as function_call_output items


def _function_only(kind: str) -> str:
    if kind != "function":
        raise ValueError("only function tools are supported (no hosted tools)")
    return kind


class FunctionTool(BaseModel):
    """A Responses `tools` entry: a function tool, defined at the top level (not under `function`)."""

    model_config = ConfigDict(extra="allow")

    type: Annotated[str, AfterValidator(_function_only)]
    name: ToolName
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    name: ToolName


ResponsesToolChoice = Annotated[
    Annotated[ToolChoiceMode, Tag("<mode>")] | Annotated[NamedFunctionChoice, Tag("<object>")],
    Discriminator(
        string_or_object,
        custom_error_type="tool_choice",
        custom_error_message='use "auto", "none", "required" or {"type": "function", "name": ..}',
    ),
]


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: Annotated[JsonSchema | None, RequiredForJsonSchema] = Field(
        default=None, alias="schema", validate_default=True
    )
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The Responses fields we honour, checked (shape) before translation; ranges are the chat
    route's, named back in Responses terms (`max_output_tokens`)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: Annotated[
        Annotated[str, Tag("<text>")] | Annotated[list[Any], Tag("<items>")],
        Discriminator(
            lambda v: "<text>" if isinstance(v, str) else "<items>" if isinstance(v, list) else None,
            custom_error_type="input",
            custom_error_message="must be a string or a list of input items",
        ),
    ]
    instructions: str | None = None
    tools: Tools[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool = False
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    previous_response_id: Any = None
    conversation: Any = None


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _chat_tools(tools: list[FunctionTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.parameters or {"type": "object"}}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | NamedFunctionChoice | None) -> str | dict[str, Any] | None:
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}
    return {"type": "json_object"}


def chat_messages(instructions: str | None, input: Any) -> list[dict[str, Any]]:
    """Responses `instructions` + `input` as chat messages, every item checked and named
    (`input[2].role`).

    Function calls that follow an assistant message (or each other) join that assistant turn, so a
    turn the endpoint produced (text + calls) comes back as the same chat message and its sampled
    ids are spliced.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input, str):
        return [*messages, {"role": "user", "content": input}]
    if not isinstance(input, list):
        raise InvalidFieldError("input", input, "must be a string or a list of input items")
    open_turn: dict[str, Any] | None = None  # the assistant message function calls may still join
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(input):
        if not isinstance(item, dict):
            raise InvalidFieldError(f"input[{i}]", item, "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _MESSAGE_ROLES:
                raise InvalidFieldError(f"input[{i}].role", role, f"must be one of {sorted(_MESSAGE_ROLES)}")
            msg = {"role": role, "content": text_of(item.get("content"), f"input[{i}].content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
            open_turn = msg if role == "assistant" else None
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise InvalidFieldError(f"input[{i}].{key}", item.get(key), "must be a non-empty string")
            arguments = item.get("arguments") or "{}"
            if not isinstance(arguments, str):
                raise InvalidFieldError(f"input[{i}].arguments", arguments, "must be a string of JSON")
            tool_arguments(arguments, f"input[{i}].arguments")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            }
            if open_turn is None:
                open_turn = {"role": "assistant", "content": None}
                if reasoning is not None:
                    open_turn["reasoning_content"], reasoning = reasoning, None
                messages.append(open_turn)
            open_turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidFieldError(f"input[{i}].call_id", item.get("call_id"), "must be a string")
            output = item.get("output")
            content = output if isinstance(output, str) else text_of(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
            open_turn = None
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, i)
            open_turn = None  # the turn it belongs to comes after it
        else:
            raise InvalidFieldError(
                f"input[{i}].type", kind, "use message, function_call or function_call_output"
            )
    return messages


def _reasoning_text(item: dict[str, Any], i: int) -> str | None:
    """The text of a reasoning input item (its `reasoning_text` content, else its summary), or None."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise InvalidFieldError(f"input[{i}].{key}", parts, "must be a list of text parts")
        texts = [p.get("text") if isinstance(p, dict) else None for p in parts]
        strings = [t for t in texts if isinstance(t, str)]
        if len(strings) != len(texts):
            raise InvalidFieldError(f"input[{i}].{key}", parts, "each part needs a string `text`")
        if strings:
            return "\n\n".join(strings)
    return None


def responses_request(body: dict[str, Any]) -> ResponsesRequest:
    """A Responses request body, checked; a field we cannot serve is refused by name."""
    for field in ("previous_response_id", "conversation"):
        if body.get(field):
            raise InvalidFieldError(field, body[field], "is not supported: send the full input each time")
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise invalid_field(e) from None


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body equivalent to a Responses request body."""
    return _chat_request(responses_request(body))


def _chat_request(req: ResponsesRequest) -> dict[str, Any]:
    chat: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.instructions, req.input)}
    tools = _chat_tools(req.tools)
    if tools:
        chat["tools"] = tools
        if req.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
    sampling = {"max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p}
    chat.update({k: v for k, v in sampling.items() if v is not None})
    fmt = _response_format(req.text)
    if fmt is not None:
        chat["response_format"] = fmt
    if req.top_logprobs is not None:
        chat["logprobs"], chat["top_logprobs"] = True, req.top_logprobs
    return chat


# What the chat route names a field, and what a Responses request calls it (longest first).
_RESPONSES_FIELDS = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def responses_field(field: str) -> str:
    """A chat-route field name in Responses terms: `max_tokens` -> `max_output_tokens`,
    `tools[0].function.parameters` -> `tools[0].parameters`."""
    for chat, ours in _RESPONSES_FIELDS:
        if field == chat or field.startswith((f"{chat}.", f"{chat}[")):
            return ours + field[len(chat) :]
    return re.sub(r"^(tools\[\d+\])\.function\b", r"\1", field)


def response_from_chat(completion: dict[str, Any], body: dict[str, Any], rid: str) -> dict[str, Any]:
    """A Responses `response` object for a chat completion (its first choice)."""
    choice = completion["choices"][0]
    msg = choice["message"]
    hexid = rid.removeprefix("resp_")
    output: list[dict[str, Any]] = []
    reasoning = msg.get("reasoning_content")
    if reasoning is not None:
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{hexid}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": "completed",
            }
        )
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{hexid}",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {
                        "type": "output_text",
                        "text": msg.get("content") or "",
                        "annotations": [],
                        "logprobs": [],
                    }
                ],
            }
        )
    for k, call in enumerate(msg.get("tool_calls") or []):
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{hexid}_{k}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    truncated = choice["finish_reason"] == "length"
    usage = completion["usage"]
    tool_choice = body.get("tool_choice") or "auto"
    return {
        "id": rid,
        "object": "response",
        "created_at": completion["created"],
        "model": completion["model"],
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "error": None,
        "instructions": body.get("instructions"),
        "output": output,
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "tool_choice": tool_choice,
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "journeyman": [c["journeyman"] for c in completion["choices"]],
    }


def _events(response: dict[str, Any], streamed: str | None = None, start: int = 0) -> list[dict[str, Any]]:
    """The stream events of a finished response, in the order OpenAI sends them, numbered from
    `start`. `streamed`: the text of its message already sent (`_ResponsesCall`), whose opening events and
    deltas are not repeated."""
    pending = {**response, "status": "in_progress", "output": [], "incomplete_details": None}
    events: list[dict[str, Any]] = []
    if streamed is None:
        events += [
            {"type": "response.created", "response": pending},
            {"type": "response.in_progress", "response": pending},
        ]
    for i, item in enumerate(response["output"]):
        where = {"output_index": i, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            delta = text
            if streamed is not None and i == 0:
                delta = text[len(streamed) :] if text.startswith(streamed) else ""
            else:
                events += _message_opened(item, i)
            if delta:
                events.append(_text_delta(item["id"], i, delta))
            events += [
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                },
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "content": []},
                },
                {"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text},
                {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text},
            ]
        else:
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "arguments": ""},
                },
                {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item["name"],
                    "arguments": item["arguments"],
                },
            ]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.append({"type": final, "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(events, start)]


def _message_opened(item: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """A message item's opening events: the item, then its (empty) text part."""
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        {
            "type": "response.output_item.added",
            "output_index": i,
            "item": {**item, "status": "in_progress", "content": []},
        },
        {
            "type": "response.content_part.added",
            "output_index": i,
            "item_id": item["id"],
            "content_index": 0,
            "part": part,
        },
    ]


def _text_delta(item_id: str, i: int, delta: str) -> dict[str, Any]:
    return {
        "type": "response.output_text.delta",
        "output_index": i,
        "item_id": item_id,
        "content_index": 0,
        "delta": delta,
        "logprobs": [],
    }


class _ResponsesCall:
    """One `/v1/responses` request (`add_translated_route`). Streamed: its message is opened with
    the first text, each delta follows, and what only the whole completion says (the rest of the
    text, function calls, usage) comes at the end; every event is numbered, in order."""

    def __init__(self, body: dict[str, Any]) -> None:
        req = responses_request(body)
        self.chat = _chat_request(req)
        self.response_id = new_response_id()
        self.stream = req.stream
        self._body = body
        self._n = 0  # the next event's sequence_number
        self._message_id = ""

    def field(self, chat_field: str) -> str:
        return responses_field(chat_field)

    def answer(self, completion: dict[str, Any]) -> dict[str, Any]:
        return response_from_chat(completion, self._body, self.response_id)

    def whole(self, completion: dict[str, Any]) -> list[str]:
        return [named_event(e) for e in _events(self.answer(completion))]

    def opened(self, index: int) -> list[str]:
        empty = {"choices": [{"message": {"content": ""}, "finish_reason": "stop", "journeyman": None}]}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        skeleton = self.answer(
            {**empty, "usage": usage, "created": int(time.time()), "model": self.chat["model"]}
        )
        pending = {**skeleton, "status": "in_progress", "output": [], "usage": None}
        message = skeleton["output"][0]
        self._message_id = message["id"]
        head = [
            {"type": "response.created", "response": pending},
            {"type": "response.in_progress", "response": pending},
            *_message_opened(message, index),
        ]
        return [self._numbered(e) for e in head]

    def delta(self, index: int, text: str) -> str:
        return self._numbered(_text_delta(self._message_id, index, text))

    def ending(self, completion: dict[str, Any], sent: dict[int, str]) -> list[str]:
        return [named_event(e) for e in _events(self.answer(completion), sent.get(0, ""), self._n)]

    def error(self, e: Exception) -> str:
        return self._numbered({"type": "error", "message": str(e), "code": type(e).__name__})

    def _numbered(self, event: dict[str, Any]) -> str:
        self._n += 1
        return named_event({**event, "sequence_number": self._n - 1})


def add_routes(app: FastAPI, endpoint: Streams) -> None:
    """Register `POST /v1/responses` on the endpoint's app."""
    add_translated_route(app, "/v1/responses", endpoint, _ResponsesCall)


__all__ = [
    "ResponsesRequest",
    "add_routes",
    "chat_messages",
    "chat_request",
    "new_response_id",
    "response_from_chat",
    "responses_field",
    "responses_request",
]
