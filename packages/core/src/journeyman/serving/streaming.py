"""Chat completions streamed as the engine samples: text deltas while the completion runs, then what
only the whole completion can say (tool calls, reasoning, the finish reason, the token record).

The engine tells the endpoint of each token (`Engine.generate`'s `on_token`); `TextDeltas` turns the
tokens of each completion into the text a client may be shown so far and hands on what is new. It
holds back what the finished message might not contain: the start of a tool call (the family's
opening marker, or a prefix of it at the end), a stop string or its start, a character still being
decoded, and whitespace at either end (a message's content is stripped). A family that writes
reasoning, or calls without an opening marker, streams nothing early: its completion is sent whole,
in chunks, at the end. The final content must start with what was sent; what is left of it follows.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi.responses import StreamingResponse

from journeyman.chat.formats import ChatFormat

__all__ = ["OnText", "Streams", "TextDeltas", "final_chunks", "stream_chat_completion", "streaming_tokenizer"]

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
    """What the route needs: a chat completion that tells of its text as it grows (`on_text`)."""

    async def chat_completion(
        self,
        body: dict[str, Any],
        capture_id: str | None = None,
        response_id: str | None = None,
        on_text: OnText | None = None,
    ) -> dict[str, Any]: ...


async def stream_chat_completion(
    served: Streams, body: dict[str, Any], capture_id: str | None, include_usage: bool
) -> StreamingResponse:
    """The completion as OpenAI stream chunks, its text as it is sampled. An error before any text
    is the request's error (a 4xx or 5xx answer); one after it ends the stream with an error event."""
    queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
    task = asyncio.ensure_future(
        served.chat_completion(body, capture_id, on_text=lambda i, d: queue.put_nowait((i, d)))
    )
    task.add_done_callback(lambda _: queue.put_nowait(None))
    first = await queue.get()
    if first is None:
        return StreamingResponse(_lines(final_chunks(task.result(), {}, include_usage)), media_type=EVENTS)
    # the chunks sent before the completion is done carry what the finished one will
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": str(body.get("model")),
    }

    async def chunks() -> AsyncIterator[str]:
        sent: dict[int, str] = {}
        item = first
        while item is not None:
            i, delta = item
            if i not in sent:
                yield _chunk(head, i, {"role": "assistant", "content": ""})
            sent[i] = sent.get(i, "") + delta
            yield _chunk(head, i, {"content": delta})
            item = await queue.get()
        try:
            response = task.result()
        except Exception as e:  # after text was sent: the stream ends with the error
            yield "data: " + json.dumps({"error": {"message": str(e), "type": type(e).__name__}}) + "\n\n"
            return
        for line in final_chunks({**response, **head}, sent, include_usage):
            yield line

    return StreamingResponse(chunks(), media_type=EVENTS)


EVENTS = "text/event-stream"


async def _lines(lines: list[str]) -> AsyncIterator[str]:
    for line in lines:
        yield line


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
