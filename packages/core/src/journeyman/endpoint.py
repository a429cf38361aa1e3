"""The OpenAI-compatible endpoint on 127.0.0.1 that agent code talks to.

It renders messages (splicing earlier sampled turns), asks the engine for samples, parses tool
calls, and attaches a `TokenRecord` to every choice (extra field `journeyman`). It also files each
completion under the request's capture id for frameworks that drop extra fields.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from .backend import REQUEST_TIMEOUT_S
from .capture import CapturedCall, Captures
from .chat_families import ChatFamily
from .chat_format import ChatFormat, SampledTurns
from .engine import Engine, Sample, SamplingParams
from .errors import EngineTimeoutError, InvalidFieldError, UnknownModelError
from .messages import normalize_messages
from .openai_http import chat_completion_body, handle_json
from .responses_api import add_routes as add_responses_routes
from .types import TokenRecord


class ChatCompletionRequest(BaseModel):
    """The request fields we honour. Others (user, store, metadata, parallel_tool_calls, a vendor's
    extras) are accepted and ignored, as vLLM does, rather than refused as api.openai.com does:
    agent frameworks send fields of their own, and a rollout must not fail on one."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Any]
    tools: list[dict[str, Any]] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's name: e.g. {"enable_thinking": false}


def _tool_call_schema(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, family: ChatFamily
) -> str | None:
    """The JSON schema a forced tool call must match (in the family's call shape), or None when the
    model may answer freely.

    `tool_choice="required"` allows any listed tool; `{"type": "function", "function": {"name": n}}`
    only `n`. Decoding is then constrained, so even a small model emits a well-formed call.
    """
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidFieldError("tool_choice", choice, "needs `tools` in the same request")
    names = [(t.get("function") or {}).get("name") for t in tools]
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        if wanted not in names:
            raise InvalidFieldError("tool_choice.function.name", wanted, f"not one of the tools {names}")
        picked = [t for t, n in zip(tools, names, strict=True) if n == wanted]
    elif choice == "required":
        picked = tools
    else:
        raise InvalidFieldError("tool_choice", choice, "use auto, none, required or a named function")
    options = [family.call_schema(t) for t in picked]
    return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})


def _sampling_params(
    req: ChatCompletionRequest, default_max_tokens: int, family: ChatFamily
) -> SamplingParams:
    checks = [
        ("n", req.n, req.n >= 1 and req.n <= 128, "must be between 1 and 128"),
        (
            "temperature",
            req.temperature,
            req.temperature is None or 0 <= req.temperature <= 2,
            "must be in [0, 2]",
        ),
        ("top_p", req.top_p, req.top_p is None or 0 < req.top_p <= 1, "must be in (0, 1]"),
        (
            "top_logprobs",
            req.top_logprobs,
            req.top_logprobs is None or 0 <= req.top_logprobs <= 20,
            "must be in [0, 20]",
        ),
    ]
    for name, value, ok, reason in checks:
        if not ok:
            raise InvalidFieldError(name, value, reason)
    for name, value in (("max_tokens", req.max_tokens), ("max_completion_tokens", req.max_completion_tokens)):
        if value is not None and value < 1:
            raise InvalidFieldError(name, value, "must be >= 1")
    max_tokens = _asked_tokens(req) or default_max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    schema = _tool_call_schema(req.tools, req.tool_choice, family)
    prefix, suffix = (family.call_open, family.call_close) if schema is not None else ("", "")
    if req.response_format is not None and schema is not None:
        raise InvalidFieldError(
            "response_format", req.response_format, "cannot be combined with a forced tool_choice"
        )
    if req.response_format is not None:
        kind = req.response_format.get("type")
        if kind == "json_schema":
            spec = req.response_format.get("json_schema") or {}
            if "schema" not in spec:
                raise InvalidFieldError("response_format.json_schema.schema", None, "is required")
            schema = json.dumps(spec["schema"])
        elif kind == "json_object":
            schema = json.dumps({"type": "object"})
        elif kind != "text":
            raise InvalidFieldError("response_format.type", kind, "use text, json_object or json_schema")
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=max_tokens,
        stop=stop,
        seed=req.seed,
        top_logprobs=req.top_logprobs or 0,
        json_schema=schema,
        json_prefix=prefix,
        json_suffix=suffix,
    )


def _asked_tokens(req: ChatCompletionRequest) -> int | None:
    """The completion length the request asks for (OpenAI's newer field first), None for the default."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def affinity_key(messages: list[dict[str, Any]]) -> str:
    """What a group's rollouts share: the conversation up to its first user turn (the scenario)."""
    first = next((k for k, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    return json.dumps(messages[: first + 1], sort_keys=True, default=str)


class Endpoint:
    """Serves one trainable model (its current step) through an engine."""

    def __init__(
        self,
        engine: Engine,
        chat_format: ChatFormat,
        model_name: str,
        default_max_tokens: int = 1024,
        max_context: int | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.chat_format = chat_format
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.max_context = max_context  # prompt + completion tokens the model takes
        # the longest a request may wait for its samples (queued behind a training step included)
        self.request_timeout_s = request_timeout_s
        self.sampled = SampledTurns()
        self.captures = Captures()
        self.completions = 0

    def served_names(self) -> list[str]:
        return [self.model_name, f"{self.model_name}@{self.engine.step}"]

    def stats(self) -> dict[str, float]:
        """What the endpoint holds in memory and what its bounds dropped (train metrics `endpoint_*`)."""
        return {
            "endpoint_completions": self.completions,
            "endpoint_captures_held": len(self.captures),
            "endpoint_captures_dropped": self.captures.dropped,
            "endpoint_turn_cache_tokens": self.sampled.tokens,
            "endpoint_turn_cache_evicted": self.sampled.evicted,
        }

    async def chat_completion(
        self, body: dict[str, Any], capture_id: str | None = None, response_id: str | None = None
    ) -> dict[str, Any]:
        """Serve one chat completion; `response_id` names the Responses API call it answers, if any."""
        req, params, messages, prompt_ids, spliced = self._prepare(body)
        try:
            samples = await asyncio.wait_for(self.engine.generate(prompt_ids, params), self.request_timeout_s)
        except TimeoutError:
            raise EngineTimeoutError(
                f"no samples after {self.request_timeout_s:g} s (Endpoint.request_timeout_s): the engine is "
                f"overloaded, stuck, or waiting on a long training step"
            ) from None
        return self._respond(req, params, messages, prompt_ids, spliced, samples, capture_id, response_id)

    def _prepare(
        self, body: dict[str, Any]
    ) -> tuple[ChatCompletionRequest, SamplingParams, list[dict[str, Any]], list[int], int]:
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"])
            raise InvalidFieldError(field, err.get("input"), err["msg"]) from e
        if req.model not in self.served_names():
            raise UnknownModelError(req.model, self.served_names())
        params = _sampling_params(req, self.default_max_tokens, self.chat_format.family)
        messages = normalize_messages(req.messages)
        params.affinity = affinity_key(messages)
        prompt_ids, spliced = self.chat_format.prompt_ids(
            messages, req.tools, self.sampled, template_kwargs=req.chat_template_kwargs
        )
        self._fit_context(req, params, len(prompt_ids))
        return req, params, messages, prompt_ids, spliced

    def _fit_context(self, req: ChatCompletionRequest, params: SamplingParams, prompt: int) -> None:
        """Refuse, before the engine sees it, what cannot fit the context; a default max_tokens
        shrinks to what is left (as OpenAI does when none is given)."""
        if self.max_context is None:
            return
        room = self.max_context - prompt
        if room < 1:
            raise InvalidFieldError(
                "messages",
                f"{prompt} tokens",
                f"the prompt leaves no room in the {self.max_context}-token context",
            )
        asked = _asked_tokens(req)
        if asked is None:
            params.max_tokens = min(params.max_tokens, room)
        elif asked > room:
            field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise InvalidFieldError(
                field,
                asked,
                f"the prompt has {prompt} tokens: at most {room} fit the {self.max_context}-token context",
            )

    def _respond(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        messages: list[dict[str, Any]],
        prompt_ids: list[int],
        spliced: int,
        samples: list[Sample],
        capture_id: str | None,
        response_id: str | None = None,
    ) -> dict[str, Any]:
        self.completions += 1
        name = f"{self.model_name}@{self.engine.step}"
        choices = []
        fmt = self.chat_format
        for i, s in enumerate(samples):
            # the engine's text is cut at a stop string; otherwise read the ids with their markers
            text = s.text if params.stop else fmt.completion_text(s.token_ids)
            # tool_choice "none": the model may not call a tool, so call-like text is its answer
            turn = fmt.parse(text, tools=bool(req.tools) and req.tool_choice != "none")
            content, reasoning = turn.content, turn.reasoning
            calls = [{"id": fmt.family.call_id(), "type": "function", "function": c} for c in turn.tool_calls]
            # Complete calls win, as vLLM reports them (an agent runs them even if text after them was
            # cut); a call that max_tokens left open never parses, stays text, and the turn is "length".
            finish = "tool_calls" if calls else s.finish_reason
            record = TokenRecord(
                prompt_token_ids=prompt_ids,
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                model=name,
                step=self.engine.step,
                finish_reason=finish,
                spliced_turns=spliced,
            )
            self.sampled.add(content, calls, s.token_ids, reasoning)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": self._logprobs(s) if req.logprobs else None,
                    "journeyman": record.model_dump(),
                }
            )
        response = chat_completion_body(
            name, choices, len(prompt_ids), sum(len(s.token_ids) for s in samples)
        )
        if capture_id:
            self.captures.add(
                capture_id,
                CapturedCall(
                    request_messages=messages, tools=req.tools, response=response, response_id=response_id
                ),
            )
        return response

    def _logprobs(self, s: Sample) -> dict[str, Any]:
        tok = self.chat_format.tokenizer
        content = []
        for t, (tid, lp) in enumerate(zip(s.token_ids, s.logprobs, strict=True)):
            text = tok.decode([tid])
            top = s.top_logprobs[t] if t < len(s.top_logprobs) else []
            content.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": tok.decode([i]), "logprob": v, "bytes": list(tok.decode([i]).encode())}
                        for i, v in top
                    ],
                }
            )
        return {"content": content, "refusal": None}


def _chunks(response: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """The finished completion as OpenAI stream chunks (role, content, tool calls, finish)."""

    async def gen() -> AsyncIterator[str]:
        base = {
            "id": response["id"],
            "object": "chat.completion.chunk",
            "created": response["created"],
            "model": response["model"],
        }
        for c in response["choices"]:
            i, msg = c["index"], c["message"]
            deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
            if msg.get("reasoning_content"):
                deltas.append({"reasoning_content": msg["reasoning_content"]})
            if msg.get("content"):
                deltas.append({"content": msg["content"]})
            for k, call in enumerate(msg.get("tool_calls", [])):
                deltas.append({"tool_calls": [{"index": k, **call}]})
            for d in deltas:
                yield (
                    "data: "
                    + json.dumps({**base, "choices": [{"index": i, "delta": d, "finish_reason": None}]})
                    + "\n\n"
                )
            last = {
                "index": i,
                "delta": {},
                "finish_reason": c["finish_reason"],
                "logprobs": c["logprobs"],
                "journeyman": c["journeyman"],
            }
            yield "data: " + json.dumps({**base, "choices": [last]}) + "\n\n"
        if include_usage:
            yield "data: " + json.dumps({**base, "choices": [], "usage": response["usage"]}) + "\n\n"
        yield "data: [DONE]\n\n"

    return gen()


class Served(Protocol):
    """What the OpenAI routes need: one `Endpoint`, or a router over several (`journeyman serve`)."""

    async def chat_completion(
        self, body: dict[str, Any], capture_id: str | None = None, response_id: str | None = None
    ) -> dict[str, Any]: ...

    def served_names(self) -> list[str]: ...


def build_app(endpoint: Served) -> FastAPI:
    app = FastAPI(title="Journeyman endpoint")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "owned_by": "journeyman"} for n in endpoint.served_names()],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        async def handle(body: dict[str, Any], capture_id: str | None) -> Any:
            response = await endpoint.chat_completion(body, capture_id)
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return StreamingResponse(_chunks(response, include_usage), media_type="text/event-stream")
            return response

        return await handle_json(request, handle)

    add_responses_routes(app, endpoint)  # POST /v1/responses, served through chat_completion
    return app


class ServerThread:
    """Runs the app with uvicorn on 127.0.0.1 (a free port) in a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from .guard import HeaderTimeoutH11

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_keep_alive=30, http=HeaderTimeoutH11
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="journeyman-endpoint"
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"endpoint on {self.host}:{self.port} did not start")
            time.sleep(0.01)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
