"""Chat completions streamed as the engine samples: text deltas while the completion runs, then what
only the whole completion can say (tool calls, reasoning, the finish reason, the token record).

The engine tells the endpoint of each token (`Engine.generate`'s `on_token`); `TextDeltas` turns the
tokens of each completion into the text a client may be shown so far and hands on what is new. It
holds back what the finished message might not contain: the start of a tool call (the family's
opening marker, or a prefix of it at the end), a stop string or its start, a character still being
decoded, and whitespace at either end (a message's content is stripped). A family that writes
reasoning, or calls without an opening marker, streams nothing early: its completion is sent whole,
in chunks, at the end. The final content must start with what was sent; what is left of it follows.

`stream_events` carries that text to the client, the same way for every route: each API (the chat
route's chunks, Responses' and Messages' events) only says how it writes each part (`StreamEvents`).
`add_translated_route` serves an API that answers through a chat completion (Responses, Messages).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from journeyman.chat.formats import ChatFormat
from journeyman.errors import InvalidFieldError
from journeyman.serving.openai_http import ErrorResponse, error_response, handle_json

__all__ = [
    "EVENTS",
    "OnText",
    "StreamEvents",
    "Streams",
    "TextDeltas",
    "Translated",
    "add_translated_route",
    "final_chunks",
    "named_event",
    "stream_chat_completion",
    "stream_events",
    "streaming_tokenizer",
]

# Called with (choice index, text delta) on the event loop as a completion's text grows.
OnText = Callable[[int, str], None]


class TextDeltas:
    """Per choice, the tokens sampled so far and the text already handed on (see the module)."""

    def __init__(
        self, fmt: ChatFormat, tokenizer: Any, tools: bool, stop: list[str], on_text: OnText
    ) -> None:
        self._tokenizer = tokenizer  # a copy of the format's: the endpoint's worker thread uses that one
        self._holds = [*stop, *([fmt.family.call_open] if tools else [])]
        self._off = fmt.family.reasoning or (tools and not fmt.family.call_open)
        self._stop_ids = fmt.stop_ids
        self._on_text = on_text
        self._tokens: dict[int, list[int]] = {}
        self._sent: dict[int, str] = {}
        self._frozen: set[int] = set()  # a call has begun: nothing more is content for sure
        self._dirty: set[int] = set()
        self._loop = asyncio.get_running_loop()

    def on_token(self, index: int, token: int) -> None:
        """The engine's callback, from its own thread."""
        self._loop.call_soon_threadsafe(self._add, index, token)

    def _add(self, index: int, token: int) -> None:
        if self._off:
            return
        self._tokens.setdefault(index, []).append(token)
        if not self._dirty:  # one decode for all the tokens that arrived together
            self._loop.call_soon(self._flush)
        self._dirty.add(index)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for i in sorted(dirty):
            if i in self._frozen:
                continue
            ids = [t for t in self._tokens[i] if t not in self._stop_ids]
            text = self._tokenizer.decode(ids, skip_special_tokens=True)
            safe, frozen = self._safe(text)
            if frozen:
                self._frozen.add(i)
            sent = self._sent.get(i, "")
            if len(safe) > len(sent) and safe.startswith(sent):
                self._sent[i] = safe
                self._on_text(i, safe[len(sent) :])

    def _safe(self, text: str) -> tuple[str, bool]:
        """The part of `text` that will stay the message's content, and whether a held marker is
        complete in it (a call or a stop: no later text is content for sure)."""
        cut, frozen = len(text), False
        if "\ufffd" in text:  # a character whose bytes are still arriving
            cut = text.index("\ufffd")
        for marker in self._holds:
            at = text.find(marker)
            if at >= 0:
                cut, frozen = min(cut, at), True
                continue
            for k in range(min(len(marker) - 1, len(text)), 0, -1):  # the marker's start at the end
                if text.endswith(marker[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return text[:cut].strip(), frozen


class Streams(Protocol):
    """What the route needs: a chat completion that tells of its text as it grows (`on_text`), and
    `admit`, which may refuse a request by the model its body names before anything else of the
    body is read (`journeyman serve`: another tenant's model is a 403, whatever else the body holds)."""

    def admit(self, model: object) -> None: ...

    async def chat_completion(
        self,
        body: dict[str, Any],
        capture_id: str | None = None,
        response_id: str | None = None,
        on_text: OnText | None = None,
    ) -> dict[str, Any]: ...


class StreamEvents(Protocol):
    """How one API writes a streamed completion as server-sent event lines (`stream_events`)."""

    def whole(self, completion: dict[str, Any]) -> list[str]:
        """Every line of a completion that finished before any of its text was sampled."""
        ...

    def opened(self, index: int) -> list[str]:
        """The lines that go before choice `index`'s first text."""
        ...

    def delta(self, index: int, text: str) -> str:
        """The line for text just sampled in choice `index`."""
        ...

    def ending(self, completion: dict[str, Any], sent: dict[int, str]) -> list[str]:
        """What only the finished completion says, after the text `sent` per choice."""
        ...

    def error(self, e: Exception) -> str:
        """The line that ends a stream whose completion failed after text was sent."""
        ...


async def stream_events(
    complete: Callable[[OnText], Awaitable[dict[str, Any]]], events: StreamEvents
) -> StreamingResponse:
    """The one bridge from a chat completion's text, as it is sampled (`complete(on_text)`), to an
    API's event stream (`events`: the chat route's chunks, Responses' or Messages' events). An error
    before any text is the request's error (a 4xx or 5xx answer); one after it ends the stream with
    `events.error`. A completion done before any text was sent goes whole."""
    queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
    task = asyncio.ensure_future(complete(lambda i, d: queue.put_nowait((i, d))))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        first = await queue.get()
    except asyncio.CancelledError:  # the client left before any text (`until_disconnect`)
        task.cancel()
        raise
    if first is None:
        return StreamingResponse(_lines(events.whole(await task)), media_type=EVENTS)

    async def lines() -> AsyncIterator[str]:
        sent: dict[int, str] = {}
        item = first
        try:
            while item is not None:
                i, delta = item
                if i not in sent:
                    for line in events.opened(i):
                        yield line
                sent[i] = sent.get(i, "") + delta
                yield events.delta(i, delta)
                item = await queue.get()
            try:
                completion = await task
            except Exception as e:  # after text was sent: the stream ends with the error
                yield events.error(e)
                return
            for line in events.ending(completion, sent):
                yield line
        finally:  # the client disconnected mid-stream (Starlette cancels the stream): nobody reads on
            task.cancel()

    return StreamingResponse(lines(), media_type=EVENTS)


EVENTS = "text/event-stream"


class Translated(StreamEvents, Protocol):
    """One request to a route that answers through a chat completion of the same endpoint
    (`/v1/responses`, `/v1/messages`): the chat body it translates into, and how the route names a
    field, answers and streams (`add_translated_route`)."""

    chat: dict[str, Any]  # the chat-completions body equivalent to the request
    response_id: str  # the id the route answers with, filed with the capture
    stream: bool

    def field(self, chat_field: str) -> str:
        """A chat-route field name as this route's request spells it (for its errors)."""
        ...

    def answer(self, completion: dict[str, Any]) -> dict[str, Any]:
        """The route's answer for a finished chat completion."""
        ...


def add_translated_route(
    app: FastAPI,
    path: str,
    served: Streams,
    translate: Callable[[dict[str, Any]], Translated],
    error: ErrorResponse = error_response,
) -> None:
    """Register `POST path`, answered by translating each request body (`translate`) into a chat
    completion of `served`: one data path (the same splicing of sampled turns, token records and
    capture filing) for every API, streamed or not. Errors are shaped by `error`."""

    async def handle(body: dict[str, Any], capture_id: str | None) -> Any:
        served.admit(body.get("model"))
        # off the event loop: a large request (tools, messages) takes a while to check and translate
        call = await asyncio.to_thread(translate, body)

        async def complete(on_text: OnText | None = None) -> dict[str, Any]:
            try:
                return await served.chat_completion(
                    call.chat, capture_id, response_id=call.response_id, on_text=on_text
                )
            except InvalidFieldError as e:  # named as the route's request spells the field
                raise InvalidFieldError(call.field(e.field), e.value, e.reason) from None

        if call.stream:
            return await stream_events(complete, call)
        return call.answer(await complete())

    async def route(request: Request) -> Any:
        return await handle_json(request, handle, error=error)

    app.post(path, name=path.rsplit("/", 1)[-1])(route)  # the name: the operation's id in /openapi.json


def named_event(event: dict[str, Any]) -> str:
    """An event as the Responses and Messages APIs stream it: its type, then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def _lines(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


class _ChatChunks:
    """The chat route's stream: OpenAI's `chat.completion.chunk`s, one per delta, every choice."""

    def __init__(self, model: str, include_usage: bool) -> None:
        # the chunks sent before the completion is done carry what the finished one will
        self._head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self._include_usage = include_usage

    def whole(self, completion: dict[str, Any]) -> list[str]:
        return final_chunks(completion, {}, self._include_usage)

    def opened(self, index: int) -> list[str]:
        return [_chunk(self._head, index, {"role": "assistant", "content": ""})]

    def delta(self, index: int, text: str) -> str:
        return _chunk(self._head, index, {"content": text})

    def ending(self, completion: dict[str, Any], sent: dict[int, str]) -> list[str]:
        return final_chunks({**completion, **self._head}, sent, self._include_usage)

    def error(self, e: Exception) -> str:
        return "data: " + json.dumps({"error": {"message": str(e), "type": type(e).__name__}}) + "\n\n"


async def stream_chat_completion(
    served: Streams, body: dict[str, Any], capture_id: str | None, include_usage: bool
) -> StreamingResponse:
    """The completion as OpenAI stream chunks, its text as it is sampled (`stream_events`)."""
    return await stream_events(
        lambda on_text: served.chat_completion(body, capture_id, on_text=on_text),
        _ChatChunks(str(body.get("model")), include_usage),
    )


def _chunk(
    head: dict[str, Any], i: int, delta: dict[str, Any], finish: str | None = None, **extra: Any
) -> str:
    choice = {"index": i, "delta": delta, "finish_reason": finish, **extra}
    return "data: " + json.dumps({**head, "choices": [choice]}) + "\n\n"


def final_chunks(response: dict[str, Any], sent: dict[int, str], include_usage: bool) -> list[str]:
    """A finished completion as stream chunks, after the text `sent` per choice: the role (where
    nothing was), the content not yet sent, reasoning, tool calls, then the finish with the record."""
    head = {k: response[k] for k in ("id", "object", "created", "model")}
    head["object"] = "chat.completion.chunk"
    out: list[str] = []
    for c in response["choices"]:
        i, msg = c["index"], c["message"]
        deltas: list[dict[str, Any]] = [] if i in sent else [{"role": "assistant", "content": ""}]
        if msg.get("reasoning_content"):
            deltas.append({"reasoning_content": msg["reasoning_content"]})
        content, already = msg.get("content") or "", sent.get(i, "")
        rest = content[len(already) :] if content.startswith(already) else ""
        if rest:
            deltas.append({"content": rest})
        for k, call in enumerate(msg.get("tool_calls", [])):
            deltas.append({"tool_calls": [{"index": k, **call}]})
        out += [_chunk(head, i, d) for d in deltas]
        out.append(
            _chunk(head, i, {}, c["finish_reason"], logprobs=c["logprobs"], journeyman=c["journeyman"])
        )
    if include_usage:
        out.append("data: " + json.dumps({**head, "choices": [], "usage": response["usage"]}) + "\n\n")
    out.append("data: [DONE]\n\n")
    return out


def streaming_tokenizer(fmt: ChatFormat) -> Any:
    """A copy of the format's tokenizer for the event loop (a fast tokenizer refuses two threads)."""
    return copy.deepcopy(fmt.tokenizer)
