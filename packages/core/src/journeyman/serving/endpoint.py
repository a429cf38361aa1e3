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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NamedTuple, Protocol, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError

from journeyman.chat.families import ChatFamily, Shape
from journeyman.chat.formats import ChatFormat, SampledTurns
from journeyman.chat.messages import normalize_messages
from journeyman.client.protocol import REQUEST_TIMEOUT_S
from journeyman.data.budget import Meter
from journeyman.data.types import TokenRecord
from journeyman.engine import Engine, Sample, SamplingParams
from journeyman.engine.base import MAX_STOP, MAX_STOP_CHARS, MAX_TOKENS, SEED_MAX, SEED_MIN
from journeyman.engine.grammar import SCHEMA_FIELD
from journeyman.errors import EngineTimeoutError, InvalidFieldError, UnknownModelError
from journeyman.rollout.capture import CapturedCall, Captures, capture_key
from journeyman.serving.messages_api import add_routes as add_messages_routes
from journeyman.serving.model_limits import ModelLimits
from journeyman.serving.openai_http import (
    MAX_SCHEMA_BYTES,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    Tool,
    ToolChoice,
    ToolChoiceMode,
    Tools,
    chat_completion_body,
    handle_json,
    invalid_field,
)
from journeyman.serving.responses_api import add_routes as add_responses_routes
from journeyman.serving.streaming import (
    OnText,
    Streams,
    TextDeltas,
    stream_chat_completion,
    streaming_tokenizer,
)

T = TypeVar("T")


CHARS_PER_TOKEN = 16
"""Characters a prompt may hold per token of context: text averages ~4 a token, and anything past
16 cannot fit, so it is refused before tokenizing (a 10 MB prompt took ~20 s to tokenize)."""
_NO_CONTEXT_CHARS = CHARS_PER_TOKEN * 2**18  # the bound when the model's context is not known
_MESSAGE_CHARS = 16  # what a message adds to the prompt besides its text: the template's markers

StopStrings = Annotated[
    list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]],
    BeforeValidator(lambda v: [v] if isinstance(v, str) else v),  # OpenAI takes one string or a list
    Field(max_length=MAX_STOP),
]


class ChatCompletionRequest(BaseModel):
    """The request fields we honour, each checked here (shape and range) before the request reaches
    the template, the grammar or the engine. Others (user, store, metadata, parallel_tool_calls, a
    vendor's extras) are accepted and ignored, as vLLM does, rather than refused as api.openai.com
    does: agent frameworks send fields of their own, and a rollout must not fail on one."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Any]  # checked by `normalize_messages`
    tools: Tools[Tool] | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    stop: StopStrings | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's name: e.g. {"enable_thinking": false}


class _Streaming(BaseModel):
    stream: bool = False
    stream_options: StreamOptions | None = None


def _forced_calls(
    tools: list[Tool] | None, choice: ToolChoiceMode | NamedToolChoice | None, family: ChatFamily
) -> list[Shape] | None:
    """The grammar shapes a forced tool call must take (in the family's call syntax), or None when
    the model may answer freely.

    `tool_choice="required"` allows any listed tool; `{"type": "function", "function": {"name": n}}`
    only `n`. Decoding is then constrained, so even a small model emits a well-formed call.
    """
    if choice is None or choice in ("auto", "none"):
        return None
    shown = choice.model_dump() if isinstance(choice, BaseModel) else choice
    if not tools:
        raise InvalidFieldError("tool_choice", shown, "needs `tools` in the same request")
    names = [t.function.name for t in tools]
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if wanted not in names:
            raise InvalidFieldError("tool_choice.function.name", wanted, f"not one of the tools {names}")
        picked = [t for t in tools if t.function.name == wanted]
    else:
        picked = tools
    return _call_shapes(picked, family, "tool_choice", shown)


def _call_shapes(tools: list[Tool], family: ChatFamily, field: str, shown: Any) -> list[Shape]:
    """The grammar shapes of a call (in the family's syntax) of any of `tools`."""
    shapes = family.call_shapes(
        [{"function": {"name": t.function.name, "parameters": t.function.parameters}} for t in tools]
    )
    size = sum(len(schema) for _, schema, _ in shapes)
    if size > MAX_SCHEMA_BYTES:
        raise InvalidFieldError(
            field,
            shown,
            f"allows a call whose schema (the tools' parameters) is {size} bytes of JSON: the grammar "
            f"compiler takes at most {MAX_SCHEMA_BYTES}",
        )
    return shapes


class _Constraint(NamedTuple):
    """What the output must be: `schema` between the literals `prefix` and `suffix`, or else one of
    the tool calls `calls` (a forced call's other tools in a syntax that names the tool outside the
    JSON; any call, when one is allowed beside a response schema)."""

    schema: str
    prefix: str
    suffix: str
    source: str  # the request field the schema comes from
    calls: list[Shape] | None = None


def _constraint(req: ChatCompletionRequest, family: ChatFamily) -> _Constraint | None:
    """The output's grammar, if any. A forced tool call is forced, whatever `response_format` says: the
    schema is for the final answer, a later turn (as OpenAI's API has it). Unforced, with tools and a
    response schema, the output is a tool call or the schema's JSON."""
    forced = _forced_calls(req.tools, req.tool_choice, family)
    if forced is not None:
        (prefix, schema, suffix), *others = forced
        return _Constraint(schema, prefix, suffix, "tool_choice", others or None)
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.json_schema is not None and fmt.type == "json_schema":
        answer, source = json.dumps(fmt.json_schema.schema_), SCHEMA_FIELD
    else:
        answer, source = json.dumps({"type": "object"}), "response_format"
    calls = None
    if req.tools and req.tool_choice != "none":
        calls = _call_shapes(req.tools, family, "tools", len(req.tools))
    return _Constraint(answer, "", "", source, calls)


def _reasoning_first(fmt: ChatFormat, prompt_ids: list[int]) -> tuple[str, str] | None:
    """The reasoning block a constrained output starts with: (open, close) when the model is to
    think first (Qwen3 with thinking on), ("", close) when the prompt already opened the block, None
    when it has none or the prompt closed it (`enable_thinking: false` renders an empty one)."""
    think = fmt.family.think
    if think is None:
        return None
    open_, close = think
    tail = fmt.decode(prompt_ids[-64:])
    for end in fmt.family.end_of_turn:  # the generation prompt: what follows the last ended turn
        tail = tail.rsplit(end, 1)[-1]
    if open_ not in tail:
        return think
    if close.strip() in tail.rsplit(open_, 1)[1]:
        return None  # a closed, empty block: thinking is off (`enable_thinking: false`)
    return ("", close)  # the prompt opened the block: the model thinks on from there


def _sampling_params(
    req: ChatCompletionRequest, default_max_tokens: int, constraint: _Constraint | None
) -> SamplingParams:
    schema, prefix, suffix, source, calls = constraint or (None, "", "", "", None)
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_tokens=_asked_tokens(req) or default_max_tokens,
            stop=req.stop or [],
            seed=req.seed,
            top_logprobs=req.top_logprobs or 0,
            json_schema=schema,
            json_prefix=prefix,
            json_suffix=suffix,
            json_or_call=calls,
        )
    except ValidationError as e:  # the engine's own bounds: named by the request field they came from
        err = invalid_field(e)
        name = err.field.split(".")[0].split("[")[0]
        asked = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        renamed = {
            "max_tokens": asked,
            "json_schema": source,
            "json_prefix": source,
            "json_suffix": source,
            "json_or_call": "tools",
        }
        raise InvalidFieldError(
            renamed.get(name, name) + err.field[len(name) :], err.value, err.reason
        ) from None


def _offers_tools(req: ChatCompletionRequest) -> bool:
    """Whether the model may call tools: listed ones, or built-in ones its template names
    (Llama 3.1's `builtin_tools`: brave_search, wolfram_alpha, code_interpreter)."""
    builtin = bool((req.chat_template_kwargs or {}).get("builtin_tools"))
    return (bool(req.tools) or builtin) and req.tool_choice != "none"


def _asked_tokens(req: ChatCompletionRequest) -> int | None:
    """The completion length the request asks for (OpenAI's newer field first), None for the default."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def affinity_key(messages: list[dict[str, Any]]) -> str:
    """What a group's rollouts share: the conversation up to its first user turn (the scenario)."""
    first = next((k for k, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    return json.dumps(messages[: first + 1], sort_keys=True, default=str)


def _characters(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]
) -> int:
    """The text a prompt renders, counted before rendering: message text, tool calls, tools, variables."""
    n = 0
    for m in messages:
        n += _MESSAGE_CHARS + len(m["content"]) + len(m.get("reasoning_content") or "")
        for call in m.get("tool_calls", []):
            fn = call["function"]
            n += len(fn["name"]) + len(json.dumps(fn["arguments"], ensure_ascii=False))
    for extra in (tools, template_kwargs):
        if extra:
            n += len(json.dumps(extra, ensure_ascii=False, default=str))
    return n


@dataclass
class _Prepared:
    """A request made ready for the engine."""

    req: ChatCompletionRequest
    params: SamplingParams
    messages: list[dict[str, Any]]
    tools: (
        list[dict[str, Any]] | None
    )  # as the client sent them: the template renders (and captures keep) these
    prompt_ids: list[int]
    spliced: int
    schema_field: str  # the request field the output's JSON schema comes from ("" if none)


class Endpoint:
    """Serves one trainable model (its current step) through an engine.

    Rendering, tokenizing and parsing run on one worker thread of the endpoint's own, not on the event
    loop every route shares, and one at a time: a fast tokenizer raises "Already borrowed" when two
    threads use it at once, and the sampled-turn cache is read (splicing) and written (answering)
    there, so a request always sees the turns answered before it.
    """

    def __init__(
        self,
        engine: Engine,
        chat_format: ChatFormat,
        model_name: str,
        default_max_tokens: int = 1024,
        max_context: int | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        base_name: str | None = None,
        limits: ModelLimits | None = None,
        meter: Meter | None = None,
    ) -> None:
        self.engine = engine
        self.chat_format = chat_format
        self.model_name = model_name
        # the base model, served under its own name with the adapter off (as vLLM serves a base
        # beside its LoRAs), for a validator or a comparison rollout; None when it is the model's name
        self.base_name = base_name if base_name not in (None, model_name) else None
        self.default_max_tokens = default_max_tokens
        self.max_context = max_context  # prompt + completion tokens the model takes
        # the longest a request may wait for its samples (queued behind a training step included)
        self.request_timeout_s = request_timeout_s
        # the model's caps on rows in flight and requests a minute (`ModelConfig`), checked as a
        # request enters, before it is prepared or queued; unbounded unless set
        self.limits = limits or ModelLimits(model_name)
        # what the run spent against its budget: a request is refused (402) once a limit on sampling
        # is reached, and each answer's completion tokens count (`data/budget.py`)
        self.meter = meter
        self.sampled = SampledTurns()
        self.captures = Captures()
        # Steps served beside the engine's own (live training's candidate), by checkpoint directory:
        # a request naming `name@<step>` is sampled by that step, and `route(capture id)` may send a
        # request naming the bare model there too (the canary share of episodes); None: the served step.
        self.side_steps: dict[int, Path] = {}
        self.route: Callable[[str | None], int | None] | None = None
        self.completions = 0
        self.cancelled = 0  # requests whose client left before their answer
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journeyman-prepare")
        self._stream_tokenizer: Any = None  # made on the first streamed request

    def admit(self, model: object) -> None:
        """Every request to a model's own endpoint is its business (the name is checked with the body)."""

    def served_names(self) -> list[str]:
        names = [self.model_name, f"{self.model_name}@{self.engine.step}"]
        names += [f"{self.model_name}@{k}" for k in self.side_steps if k != self.engine.step]
        return names if self.base_name is None else [*names, self.base_name]

    def stats(self) -> dict[str, float]:
        """What the endpoint holds in memory and what its bounds dropped (train metrics `endpoint_*`)."""
        return {
            "endpoint_completions": self.completions,
            "endpoint_cancelled": self.cancelled,
            "endpoint_captures_held": len(self.captures),
            "endpoint_captures_dropped": self.captures.dropped,
            "endpoint_turn_cache_tokens": self.sampled.tokens,
            "endpoint_turn_cache_evicted": self.sampled.evicted,
            "endpoint_rows_in_flight": self.limits.rows_in_flight,
            "endpoint_limit_refused": self.limits.refused,
        }

    async def chat_completion(
        self,
        body: dict[str, Any],
        capture_id: str | None = None,
        response_id: str | None = None,
        on_text: OnText | None = None,
    ) -> dict[str, Any]:
        """Serve one chat completion; `response_id` names the Responses API call it answers, if any;
        `on_text(choice, delta)` is told of the content as it is sampled (`streaming`)."""
        capture_id = capture_key(capture_id)  # the caller's token's own (`rollout/capture.py`)
        if self.meter is not None:
            self.meter.check("sampling")  # BudgetExceededError: nothing is sampled past a limit
        n = body.get("n")
        rows = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1  # else refused as read
        with (
            self.limits.admitted(rows),  # its rows go back however it ends (a 429 over a cap)
            self.captures.answering(capture_id),  # live training waits for it before an episode trains
        ):
            try:
                return await self._chat_completion(body, capture_id, response_id, on_text)
            except asyncio.CancelledError:  # the client left (`until_disconnect`): the engine stopped it
                self.cancelled += 1
                if capture_id:
                    self.captures.cancel(capture_id)
                raise

    async def _chat_completion(
        self,
        body: dict[str, Any],
        capture_id: str | None,
        response_id: str | None,
        on_text: OnText | None,
    ) -> dict[str, Any]:
        prepared = await self._serially(self._prepare, body, capture_id)
        req, params = prepared.req, prepared.params
        on_token = None
        if on_text is not None:
            if self._stream_tokenizer is None:
                self._stream_tokenizer = await self._serially(streaming_tokenizer, self.chat_format)
            tools = bool(req.tools) and req.tool_choice != "none"
            on_token = TextDeltas(
                self.chat_format, self._stream_tokenizer, tools, params.stop, on_text
            ).on_token
        sampling = self.engine.generate(prepared.prompt_ids, params, on_token)
        try:
            samples = await asyncio.wait_for(sampling, self.request_timeout_s)
        except TimeoutError:
            raise EngineTimeoutError(
                f"no samples after {self.request_timeout_s:g} s (Endpoint.request_timeout_s): the engine is "
                f"overloaded, stuck, or waiting on a long training step"
            ) from None
        except InvalidFieldError as e:  # the grammar's: named by the field the schema came from
            if e.field == SCHEMA_FIELD and prepared.schema_field not in ("", SCHEMA_FIELD):
                raise InvalidFieldError(prepared.schema_field, e.value, e.reason) from None
            raise
        return await self._serially(self._respond, prepared, samples, capture_id, response_id)

    async def _serially(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the endpoint's worker thread, after the calls queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _side_step(self, model: str, capture_id: str | None) -> int | None:
        """The step beside the served one that samples this request, if any (see `side_steps`)."""
        if model == self.model_name:
            step = self.route(capture_id) if self.route is not None else None
        else:
            step = next((k for k in self.side_steps if model == f"{self.model_name}@{k}"), None)
        return step if step in self.side_steps and step != self.engine.step else None

    def _prepare(self, body: dict[str, Any], capture_id: str | None = None) -> _Prepared:
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise invalid_field(e) from None
        if req.model not in self.served_names():
            raise UnknownModelError(req.model, self.served_names())
        constraint = _constraint(req, self.chat_format.family)
        params = _sampling_params(req, self.default_max_tokens, constraint)
        params.base = req.model == self.base_name
        side = self._side_step(req.model, capture_id)
        if side is not None:
            params.adapter, params.adapter_step = str(self.side_steps[side]), side
        messages = normalize_messages(req.messages)
        params.affinity = affinity_key(messages)
        # validated above as `req.tools`; rendered as sent, since their key order shows in the prompt
        tools: list[dict[str, Any]] | None = body.get("tools") or None
        template_kwargs = self.chat_format.template_kwargs(req.chat_template_kwargs)
        self._fit_characters(_characters(messages, tools, template_kwargs))
        prompt_ids, spliced = self.chat_format.prompt_ids(
            messages, tools, self.sampled, template_kwargs=template_kwargs
        )
        if constraint is not None:
            params.reasoning = _reasoning_first(self.chat_format, prompt_ids)
        self._fit_context(req, params, len(prompt_ids))
        schema_field = constraint.source if constraint is not None else ""
        return _Prepared(req, params, messages, tools, prompt_ids, spliced, schema_field)

    def _fit_characters(self, chars: int) -> None:
        """Refuse, before tokenizing, a prompt with more text than its context could hold."""
        limit = CHARS_PER_TOKEN * self.max_context if self.max_context else _NO_CONTEXT_CHARS
        if chars > limit:
            fits = f"fit the {self.max_context}-token context" if self.max_context else "be tokenized"
            raise InvalidFieldError(
                "messages",
                f"{chars} characters",
                f"cannot {fits}: at most {limit} characters ({CHARS_PER_TOKEN} a token) are tokenized",
            )

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
        prepared: _Prepared,
        samples: list[Sample],
        capture_id: str | None,
        response_id: str | None = None,
    ) -> dict[str, Any]:
        req, params, prompt_ids = prepared.req, prepared.params, prepared.prompt_ids
        self.completions += 1
        if self.meter is not None:
            self.meter.add(sampled_tokens=sum(len(s.token_ids) for s in samples))
        # step 0 is the base model (`serve_step(0)`); else the step the engine stamped on what it
        # sampled (a step may have landed since), or the one it serves
        stamped = next((s.step for s in samples if s.step is not None), self.engine.step)
        step = 0 if params.base else stamped
        name = self.base_name if params.base and self.base_name else f"{self.model_name}@{step}"
        choices = []
        fmt = self.chat_format
        for i, s in enumerate(samples):
            # the engine's text is cut at a stop string; otherwise read the ids with their markers
            text = s.text if params.stop else fmt.completion_text(s.token_ids)
            # tool_choice "none": the model may not call a tool, so call-like text is its answer
            turn = fmt.parse(text, tools=_offers_tools(req))
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
                step=s.step if s.step is not None and not params.base else step,
                finish_reason=finish,
                spliced_turns=prepared.spliced,
            )
            self.sampled.add(content, calls, s.token_ids, reasoning)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choice = {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": self._logprobs(s) if req.logprobs else None,
                "journeyman": record.model_dump(),
            }
            matched = self._stop_string(s, params.stop) if finish == "stop" else None
            if matched is not None:
                choice["stop_reason"] = matched  # vLLM's field: the stop string that ended the text
            choices.append(choice)
        response = chat_completion_body(
            name, choices, len(prompt_ids), sum(len(s.token_ids) for s in samples)
        )
        if capture_id:
            self.captures.add(
                capture_id,
                CapturedCall(
                    request_messages=prepared.messages,
                    tools=prepared.tools,
                    response=response,
                    response_id=response_id,
                ),
            )
        return response

    def _stop_string(self, s: Sample, stop: list[str]) -> str | None:
        """The stop string that ended `s`: the engine cut its text where one begins."""
        if not stop:
            return None
        whole = self.chat_format.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        after = whole[len(s.text) :] if whole.startswith(s.text) else ""
        return next((st for st in sorted(stop, key=len, reverse=True) if after.startswith(st)), None)

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


class Served(Streams, Protocol):
    """What the OpenAI routes need: one `Endpoint`, or a router over several (`journeyman serve`)."""

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
            endpoint.admit(body.get("model"))
            try:
                flags = _Streaming.model_validate(body)
            except ValidationError as e:
                raise invalid_field(e) from None
            if flags.stream:
                usage = flags.stream_options is not None and bool(flags.stream_options.include_usage)
                return await stream_chat_completion(endpoint, body, capture_id, usage)
            return await endpoint.chat_completion(body, capture_id)

        return await handle_json(request, handle)

    add_responses_routes(app, endpoint)  # POST /v1/responses, served through chat_completion
    add_messages_routes(app, endpoint)  # POST /v1/messages (Anthropic's), the same way
    return app


class ServerThread:
    """Runs the app with uvicorn on 127.0.0.1 (a free port) in a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from journeyman.serving.guard import HeaderTimeoutH11

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
