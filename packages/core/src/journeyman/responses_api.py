"""`POST /v1/responses`: the subset of OpenAI's Responses API that agent frameworks use, served by
translating each request into a chat completion of the same endpoint.

Supported: `instructions`, `input` as a string or as items (messages with text parts,
`function_call`, `function_call_output`; reasoning items are dropped), function tools,
`tool_choice` (auto / none / required / a named function, the last two grammar-constrained),
`text.format` (json_schema / json_object / text), `max_output_tokens`, `temperature`, `top_p`,
and `stream` (the finished response replayed as Responses stream events). Not supported:
`previous_response_id` / `conversation` (no responses are stored) and hosted tools.

Going through `Endpoint.chat_completion` keeps one data path: the same splicing of sampled turns,
the same `TokenRecord`, and the same capture filing under `x-journeyman-capture` (the filed
call carries the Responses id as `CapturedCall.response_id`). The response also carries the records in an extra field
`journeyman` (a list, one per choice).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from .errors import InvalidFieldError
from .messages import ROLES, text_of
from .openai_http import handle_json


class ChatCompleter(Protocol):
    """What the routes need of `endpoint.Endpoint` (named structurally: endpoint imports this module)."""

    async def chat_completion(
        self, body: dict[str, Any], capture_id: str | None = None, response_id: str | None = None
    ) -> dict[str, Any]: ...


_MESSAGE_ROLES = ROLES - {"tool"}  # tool results arrive as function_call_output items


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise InvalidFieldError(f"tools[{i}]", t, "only function tools are supported")
        fn: dict[str, Any] = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidFieldError(
        "tool_choice", choice, 'use "auto", "none", "required" or {"type": "function", "name": ...}'
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")},
        }
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise InvalidFieldError("text.format.type", fmt.get("type"), "use text, json_object or json_schema")


def chat_messages(instructions: str | None, input: Any) -> list[dict[str, Any]]:
    """Responses `instructions` + `input` as chat messages.

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
    for i, item in enumerate(input):
        if not isinstance(item, dict):
            raise InvalidFieldError(f"input[{i}]", item, "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise InvalidFieldError(f"input[{i}].role", role, f"must be one of {sorted(_MESSAGE_ROLES)}")
            msg = {"role": role, "content": text_of(item.get("content"), f"input[{i}].content")}
            messages.append(msg)
            open_turn = msg if role == "assistant" else None
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            if open_turn is None:
                open_turn = {"role": "assistant", "content": None}
                messages.append(open_turn)
            open_turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else text_of(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
            open_turn = None
        elif kind == "reasoning":
            continue  # the model has no reasoning items to replay
        else:
            raise InvalidFieldError(
                f"input[{i}].type", kind, "use message, function_call or function_call_output"
            )
    return messages


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body equivalent to a Responses request body."""
    for field in ("previous_response_id", "conversation"):
        if body.get(field):
            raise InvalidFieldError(field, body[field], "is not supported: send the full input each time")
    if "model" not in body:
        raise InvalidFieldError("model", None, "is required")
    chat: dict[str, Any] = {
        "model": body["model"],
        "messages": chat_messages(body.get("instructions"), body.get("input")),
    }
    tools = _chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("top_logprobs") is not None:
        chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
    return chat


def response_from_chat(completion: dict[str, Any], body: dict[str, Any], rid: str) -> dict[str, Any]:
    """A Responses `response` object for a chat completion (its first choice)."""
    choice = completion["choices"][0]
    msg = choice["message"]
    hexid = rid.removeprefix("resp_")
    output: list[dict[str, Any]] = []
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


def _events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream events of a finished response, in the order OpenAI sends them."""
    pending = {**response, "status": "in_progress", "output": [], "incomplete_details": None}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": pending},
        {"type": "response.in_progress", "response": pending},
    ]
    for i, item in enumerate(response["output"]):
        where = {"output_index": i, "item_id": item["id"]}
        if item["type"] == "message":
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "content": []},
                }
            )
            part = item["content"][0]
            empty = {**part, "text": ""}
            text = part["text"]
            events += [
                {"type": "response.content_part.added", **where, "content_index": 0, "part": empty},
                {
                    "type": "response.output_text.delta",
                    **where,
                    "content_index": 0,
                    "delta": text,
                    "logprobs": [],
                },
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                },
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
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
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]


async def _sse(response: dict[str, Any]) -> AsyncIterator[str]:
    for e in _events(response):
        yield f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"


def add_routes(app: FastAPI, endpoint: ChatCompleter) -> None:
    """Register `POST /v1/responses` on the endpoint's app."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        async def handle(body: dict[str, Any], capture_id: str | None) -> Any:
            rid = new_response_id()
            completion = await endpoint.chat_completion(chat_request(body), capture_id, response_id=rid)
            response = response_from_chat(completion, body, rid)
            if body.get("stream"):
                return StreamingResponse(_sse(response), media_type="text/event-stream")
            return response

        return await handle_json(request, handle)


__all__ = ["add_routes", "chat_messages", "chat_request", "new_response_id", "response_from_chat"]
