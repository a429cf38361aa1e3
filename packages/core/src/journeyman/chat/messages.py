"""OpenAI chat messages: their roles, their text, one normal shape, and the way back to OpenAI's shape.

Every stop of the data path reads messages (the endpoint renders them, the trainer re-renders
imported ones, RULER shows them to a judge, the integrations rebuild histories from them); this module
is the one place that knows what a message looks like.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from journeyman.errors import InvalidFieldError

if TYPE_CHECKING:
    from openai.types.chat.chat_completion import Choice

Message = dict[str, Any]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""The chat roles a conversation may hold (`developer` is rendered as `system`)."""

_TEXT_PARTS = ("text", "input_text", "output_text")
MAX_ARGUMENTS_DEPTH = 64  # a template writes arguments back with a recursive `tojson`


def json_depth(value: Any, limit: int) -> int:
    """How deep `value` nests (a scalar is 0, `[1]` is 1); counting stops past `limit`. Iterative:
    JSON may nest as deep as its parser allows."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and deepest <= limit:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def text_of(content: Any, field: str = "content", *, strict: bool = True) -> str:
    """The text of a message's content: a string, or OpenAI content parts joined.

    `strict` refuses parts that are not text (an image cannot be rendered for a text model) with an
    error naming `field`; `strict=False` keeps what text there is (for showing a message to a judge).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
                text = part.get("text", "")
                if strict and not isinstance(text, str):
                    raise InvalidFieldError(f"{field}[{j}].text", text, "must be a string")
                parts.append(str(text))
            elif strict:
                raise InvalidFieldError(f"{field}[{j}]", part, "only text content parts are supported")
            elif isinstance(part, dict) and "text" in part:
                parts.append(str(part["text"]))
        return "".join(parts)
    if strict:
        raise InvalidFieldError(field, content, "content must be a string or a list of text parts")
    return str(content)


def tool_arguments(raw: Any, field: str) -> dict[str, Any]:
    """A tool call's arguments (a JSON string, or already an object) as an object, refused by `field`
    if they are not one, nest past MAX_ARGUMENTS_DEPTH, or spell a lone surrogate."""
    args = raw
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except (json.JSONDecodeError, RecursionError) as e:
            raise InvalidFieldError(field, raw, f"not JSON: {e}") from e
    if not isinstance(args, dict):
        raise InvalidFieldError(field, raw, "must be a JSON object")
    if json_depth(args, MAX_ARGUMENTS_DEPTH) > MAX_ARGUMENTS_DEPTH:
        raise InvalidFieldError(field, raw, f"nests more than {MAX_ARGUMENTS_DEPTH} levels deep")
    try:  # a JSON string may spell a lone surrogate ("\\ud800"), which no tokenizer can encode
        json.dumps(args, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise InvalidFieldError(field, raw, "holds a lone surrogate") from e
    return args


def normalize_messages(messages: Sequence[Any]) -> list[Message]:
    """Validate OpenAI chat messages and bring them to the one shape the chat template renders:
    text content, `developer` as `system`, tool-call arguments parsed into objects."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidFieldError("messages", messages, "must be a non-empty list of chat messages")
    out: list[Message] = []
    for i, raw in enumerate(messages):
        m = raw.model_dump(exclude_none=True) if hasattr(raw, "model_dump") else raw
        if not isinstance(m, dict):
            raise InvalidFieldError(f"messages[{i}]", raw, "each message must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidFieldError(f"messages[{i}].role", role, f"must be one of {sorted(ROLES)}")
        msg: Message = {"role": "system" if role == "developer" else role}
        msg["content"] = text_of(m.get("content"), f"messages[{i}].content")
        if role == "assistant":
            calls = []
            raw_calls = m.get("tool_calls") or []
            if not isinstance(raw_calls, list):
                raise InvalidFieldError(f"messages[{i}].tool_calls", raw_calls, "must be a list of calls")
            for j, call in enumerate(raw_calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidFieldError(f"messages[{i}].tool_calls[{j}]", call, "needs function.name")
                if not isinstance(call.get("id"), str | None):
                    raise InvalidFieldError(
                        f"messages[{i}].tool_calls[{j}].id", call.get("id"), "must be a string"
                    )
                args = tool_arguments(
                    fn.get("arguments", "{}"), f"messages[{i}].tool_calls[{j}].function.arguments"
                )
                calls.append(
                    {
                        "id": call.get("id"),
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": args},
                    }
                )
            if calls:
                msg["tool_calls"] = calls
            if isinstance(m.get("reasoning_content"), str):  # reasoning models' templates show it
                msg["reasoning_content"] = m["reasoning_content"]
        elif role == "tool" and "tool_call_id" in m:
            if not isinstance(m["tool_call_id"], str):
                raise InvalidFieldError(f"messages[{i}].tool_call_id", m["tool_call_id"], "must be a string")
            msg["tool_call_id"] = m["tool_call_id"]
        if role != "assistant" and "content" not in m:
            raise InvalidFieldError(f"messages[{i}].content", None, f"a {role} message needs content")
        out.append(msg)
    return out


def openai_message(m: Message) -> Message:
    """A message in the shape OpenAI sends it: tool-call arguments as a JSON string."""
    if not m.get("tool_calls"):
        return dict(m)
    calls = []
    for c in m["tool_calls"]:
        fn = c["function"]
        args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
        calls.append({**c, "function": {"name": fn["name"], "arguments": args}})
    return {**m, "tool_calls": calls}


def message_of_choice(choice: Choice) -> Message:
    """The assistant message of a completion choice, as a plain dict (no refusal/audio/annotations)."""
    return choice.message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"})


def assistant_key(content: str | None, tool_calls: Sequence[dict[str, Any]] | None) -> str:
    """What identifies an assistant turn across frameworks: its text and calls, not the call ids."""
    calls = []
    for call in tool_calls or []:
        args = call["function"]["arguments"]
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args or "{}")
        calls.append([call["function"]["name"], args])
    return json.dumps([(content or "").strip(), calls], sort_keys=True, ensure_ascii=False)


def message_key(m: Message) -> str:
    """A message as a later request carries it back: assistant turns by `assistant_key` (frameworks
    rewrite call ids and whitespace), every other message by its content."""
    if m.get("role") == "assistant":
        return "assistant:" + assistant_key(m.get("content"), m.get("tool_calls"))
    return json.dumps(m, sort_keys=True, default=str)


__all__ = [
    "MAX_ARGUMENTS_DEPTH",
    "ROLES",
    "Message",
    "assistant_key",
    "json_depth",
    "message_key",
    "message_of_choice",
    "normalize_messages",
    "openai_message",
    "text_of",
    "tool_arguments",
]
