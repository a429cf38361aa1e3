"""`POST /v1/messages`: the Anthropic Messages API, served by translating each request into a chat
completion of the same endpoint (as `/v1/responses` is), so agents written against the Anthropic
SDKs train unchanged.

Supported: `system` (a string or text blocks), `messages` whose content is a string or blocks
(`text`; `tool_use` in assistant turns; `tool_result` in user turns; `thinking` blocks are
dropped), custom tools with `input_schema`, `tool_choice` (auto / any / tool / none: `any` and
`tool` are grammar-constrained, as the chat route's `required` and named choice are),
`stop_sequences` (the one that matched comes back as `stop_sequence`), `max_tokens` (required, as
Anthropic has it), `temperature`, `top_p`, and `stream` (Anthropic's event sequence: the text as it
is sampled, then the tool_use blocks and the stop reason; see `_MessagesCall`). Accepted and ignored:
`top_k`, `metadata`, `thinking`, `service_tier`, `cache_control` on blocks. Not supported (refused
by name): image and document blocks, server tools, and a final assistant turn (prefill).

Going through `Endpoint.chat_completion` keeps one data path: the same splicing of sampled turns
(a `tool_use` block keeps the id of the call the endpoint made, so the turn splices back by it), the
same `TokenRecord`, the same capture filing under `x-journeyman-capture`. The message carries the
records in an extra field `journeyman` (a list; streamed, on the `message_delta` event).

Errors are Anthropic's: `{"type": "error", "error": {"type": "invalid_request_error", "message":
"max_tokens=0: ..."}}`, the message naming the field as this route's request spells it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any, Literal, cast

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from journeyman.errors import InvalidFieldError
from journeyman.serving.openai_http import JsonSchema, ToolName, Tools, invalid_field
from journeyman.serving.streaming import Streams, add_translated_route, named_event

# Anthropic's error type for each status this route answers
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error(status: int, message: str, param: str | None = None, kind: str = "") -> JSONResponse:
    """An error as the Anthropic API sends it (`param` is in the message: our messages name it)."""
    del param, kind  # the status says the type; the message names the field
    message = message.encode(errors="backslashreplace").decode()
    return JSONResponse(status_code=status, content=error_body(status, message))


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class CustomTool(BaseModel):
    """A `tools` entry: a client tool, its arguments' JSON schema in `input_schema`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["custom"] | None = None  # server tools (web_search_...) have other types: refused
    name: ToolName
    description: str | None = None
    input_schema: JsonSchema


class MessagesToolChoice(BaseModel):
    """`tool_choice`: auto, any (some tool must be called), tool (`name` must be), or none."""

    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named_for_tool(self) -> MessagesToolChoice:
        if self.type == "tool" and self.name is None:
            raise InvalidFieldError("tool_choice.name", None, 'is required when type is "tool"')
        return self


class MessagesRequest(BaseModel):
    """The Messages fields we honour, checked (shape) before translation; ranges are the chat
    route's, named back in Messages terms (`stop` -> `stop_sequences`)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: Tools[CustomTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # accepted, not applied: the engine samples with temperature and top_p
    stream: bool = False
    metadata: dict[str, Any] | None = None


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def messages_request(body: dict[str, Any]) -> MessagesRequest:
    """A Messages request body, checked; errors name the field as Anthropic spells it."""
    try:
        return MessagesRequest.model_validate(body)
    except ValidationError as e:
        raise invalid_field(e) from None


def _text_blocks(content: Any, field: str) -> str:
    """A string, or text blocks joined (`system`, a `tool_result`'s content)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidFieldError(field, content, "must be a string or a list of text blocks")
    texts = []
    for where, kind, block in _blocks(content, field):
        if kind != "text":
            raise InvalidFieldError(f"{where}.type", kind, "only text blocks are supported")
        texts.append(_text(block, where))
    return "\n\n".join(texts) if field == "system" else "".join(texts)


def _blocks(blocks: list[Any], field: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Each content block with the field that names it (`messages[2].content[1]`) and its type."""
    for j, block in enumerate(blocks):
        where = f"{field}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise InvalidFieldError(where, block, 'each content block must be an object with a "type"')
        yield where, block["type"], cast(dict[str, Any], block)


def _text(block: dict[str, Any], field: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidFieldError(f"{field}.text", text, "must be a string")
    return text


def _string(block: dict[str, Any], key: str, field: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidFieldError(f"{field}.{key}", value, "must be a non-empty string")
    return value


def chat_messages(system: Any, messages: list[Any]) -> list[dict[str, Any]]:
    """`system` + Messages `messages` as chat messages, every block checked and named
    (`messages[2].content[1].tool_use_id`): an assistant turn's text and tool_use blocks become one
    chat message (so a turn the endpoint produced splices back by its call ids), a user turn's
    tool_result blocks become tool messages, its text a user message."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidFieldError(where, m, "each message must be an object")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise InvalidFieldError(
                f"{where}.role", role, 'must be "user" or "assistant" (system is top-level)'
            )
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidFieldError(
                f"{where}.content", content, "must be a string or a list of content blocks"
            )
        if role == "assistant":
            out.append(_assistant_turn(content, f"{where}.content"))
        else:
            out += _user_turn(content, f"{where}.content")
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        last = len(messages) - 1
        raise InvalidFieldError(
            f"messages[{last}].role", "assistant", "a final assistant turn (prefill) is not supported"
        )
    return out


def _assistant_turn(blocks: list[Any], field: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for where, kind, block in _blocks(blocks, field):
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use":
            call_input = block.get("input", {})
            if not isinstance(call_input, dict):
                raise InvalidFieldError(f"{where}.input", call_input, "must be an object")
            calls.append(
                {
                    "id": _string(block, "id", where),
                    "type": "function",
                    "function": {
                        "name": _string(block, "name", where),
                        "arguments": json.dumps(call_input, ensure_ascii=False),
                    },
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the model has no thinking to replay
        else:
            raise InvalidFieldError(f"{where}.type", kind, "an assistant turn holds text and tool_use blocks")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user_turn(blocks: list[Any], field: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for where, kind, block in _blocks(blocks, field):
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            result = _text_blocks(block.get("content"), f"{where}.content")
            out.append(
                {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where), "content": result}
            )
        else:
            raise InvalidFieldError(
                f"{where}.type", kind, "a user turn holds text and tool_result blocks (this model reads text)"
            )
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_request(req: MessagesRequest) -> dict[str, Any]:
    """The chat-completions body equivalent to a Messages request."""
    chat: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.system, req.messages),
        "max_tokens": req.max_tokens,
    }
    if req.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None and (req.tools or choice.type != "auto"):
        modes = {"auto": "auto", "any": "required", "none": "none"}
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if choice.type == "tool"
            else modes[choice.type]
        )
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    chat.update({k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p)) if v is not None})
    return chat


# What the chat route names a field, and what a Messages request calls it (longest first).
_MESSAGES_FIELDS = (
    ("tool_choice.function.name", "tool_choice.name"),
    ("stop", "stop_sequences"),
)


def messages_field(field: str) -> str:
    """A chat-route field name in Messages terms: `stop[1]` -> `stop_sequences[1]`,
    `tools[0].function.parameters` -> `tools[0].input_schema`; a chat message's index is not the
    request's (system and tool results move), so `messages[3].content` names `messages`."""
    for chat, ours in _MESSAGES_FIELDS:
        if field == chat or field.startswith((f"{chat}.", f"{chat}[")):
            return ours + field[len(chat) :]
    if field.startswith("messages["):
        return "messages"
    field = re.sub(r"^(tools\[\d+\])\.function\.parameters\b", r"\1.input_schema", field)
    return re.sub(r"^(tools\[\d+\])\.function\b", r"\1", field)


def message_from_chat(completion: dict[str, Any], mid: str) -> dict[str, Any]:
    """An Anthropic `message` for a chat completion (its first choice)."""
    choice = completion["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("content") or not msg.get("tool_calls"):
        content.append({"type": "text", "text": msg.get("content") or ""})
    for call in msg.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"] or "{}")
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                # a parsed call's arguments are an object; anything else is kept under "value"
                "input": arguments if isinstance(arguments, dict) else {"value": arguments},
            }
        )
    stop_sequence = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
    finish = choice["finish_reason"]
    stop_reason = (
        "tool_use"
        if finish == "tool_calls"
        else "max_tokens"
        if finish == "length"
        else "stop_sequence"
        if stop_sequence is not None
        else "end_turn"
    )
    usage = completion["usage"]
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": completion["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
        "journeyman": [c["journeyman"] for c in completion["choices"]],
    }


def _started(message: dict[str, Any]) -> dict[str, Any]:
    """`message_start`: the message with no content and no stop reason yet."""
    usage = {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 0}
    opened = {**message, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    opened.pop("journeyman")
    return {"type": "message_start", "message": opened}


def _block_events(index: int, block: dict[str, Any]) -> list[dict[str, Any]]:
    """One content block, opened empty, its whole content in one delta, closed."""
    if block["type"] == "text":
        opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        opened = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    events = [{"type": "content_block_start", "index": index, "content_block": opened}]
    if delta.get("text") != "":
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
    return [*events, {"type": "content_block_stop", "index": index}]


def _ending(message: dict[str, Any]) -> list[dict[str, Any]]:
    """`message_delta` (stop reason, cumulative usage, the token records) and `message_stop`."""
    return [
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
            "usage": message["usage"],
            "journeyman": message["journeyman"],
        },
        {"type": "message_stop"},
    ]


def events_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream events of a finished message, in the order Anthropic sends them."""
    events = [_started(message)]
    for i, block in enumerate(message["content"]):
        events += _block_events(i, block)
    return [*events, *_ending(message)]


class _MessagesCall:
    """One `/v1/messages` request (`add_translated_route`). Streamed: `message_start` and the text
    block open with the first text, each delta follows, and what only the whole completion says (the
    rest of the text, tool_use blocks, the stop reason, usage) comes at the end."""

    def __init__(self, body: dict[str, Any]) -> None:
        req = messages_request(body)
        self.chat = chat_request(req)
        self.response_id = new_message_id()
        self.stream = req.stream

    def field(self, chat_field: str) -> str:
        return messages_field(chat_field)

    def answer(self, completion: dict[str, Any]) -> dict[str, Any]:
        return message_from_chat(completion, self.response_id)

    def whole(self, completion: dict[str, Any]) -> list[str]:
        return [named_event(e) for e in events_of(self.answer(completion))]

    def opened(self, index: int) -> list[str]:
        # input tokens are counted once the prompt is rendered: `message_delta` carries them
        opened = {
            "id": self.response_id,
            "type": "message",
            "role": "assistant",
            "model": self.chat["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        block = {"type": "text", "text": ""}
        return [
            named_event({"type": "message_start", "message": opened}),
            named_event({"type": "content_block_start", "index": index, "content_block": block}),
        ]

    def delta(self, index: int, text: str) -> str:
        return named_event(_text_delta(index, text))

    def ending(self, completion: dict[str, Any], sent: dict[int, str]) -> list[str]:
        message = self.answer(completion)
        text = message["content"][0]["text"] if message["content"][0]["type"] == "text" else ""
        already = sent.get(0, "")
        rest = text[len(already) :] if text.startswith(already) else ""
        events = [_text_delta(0, rest)] if rest else []
        events.append({"type": "content_block_stop", "index": 0})
        for i, block in enumerate(message["content"]):
            if block["type"] == "tool_use":
                events += _block_events(i, block)
        return [named_event(e) for e in [*events, *_ending(message)]]

    def error(self, e: Exception) -> str:
        return named_event(error_body(504 if isinstance(e, TimeoutError) else 500, str(e)))


def _text_delta(index: int, text: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}


def add_routes(app: FastAPI, endpoint: Streams) -> None:
    """Register `POST /v1/messages` on the endpoint's app."""
    add_translated_route(app, "/v1/messages", endpoint, _MessagesCall, error=anthropic_error)


__all__ = [
    "MessagesRequest",
    "add_routes",
    "anthropic_error",
    "chat_messages",
    "chat_request",
    "events_of",
    "message_from_chat",
    "messages_field",
    "messages_request",
]
