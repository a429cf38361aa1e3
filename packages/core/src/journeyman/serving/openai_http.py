"""OpenAI-style HTTP plumbing shared by the endpoint's routes: JSON bodies in, the shapes of their
structured fields, errors out.

Every field is checked before a request reaches the chat template, the grammar compiler or the
engine, and a value no route can use is a 400 whose `error.param` names it. A large body is parsed
and checked off the event loop: 200,000 short messages (7 MB) took ~1 s on this CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
)

from journeyman.chat.messages import json_depth
from journeyman.data.budget import BudgetExceededError
from journeyman.errors import EngineDownError, EngineTimeoutError, InvalidFieldError, UnknownModelError
from journeyman.rollout.capture import CAPTURE_HEADER
from journeyman.serving.model_limits import ModelLimitError

MAX_BODY_DEPTH = 100  # JSON nesting of a whole body: a tool schema nested MAX_SCHEMA_DEPTH fits in it
# What a JSON schema that may be compiled into a grammar may be. xgrammar's compile time grows with
# size and nesting: 2,000 optional properties (57 KB) took 99 s on 2 cores, an array schema 500
# levels deep 14 s; within these bounds the slowest we found (1,000 optional properties, 28 KB)
# took 9 s, and every compile is timed out besides (`engine.grammar.COMPILE_TIMEOUT_S`).
MAX_SCHEMA_BYTES = 32 * 1024
MAX_SCHEMA_DEPTH = 64
MAX_TOOL_NAME_CHARS = 256
# A request's tools, all rendered into its prompt: 300,000 of them (16 MB) took 11 s to check, and
# every route of the server waited meanwhile. OpenAI takes 128; a forced call chooses among 512
# (`engine.base.MAX_SHAPES`).
MAX_TOOLS = 512
MAX_TOOLS_BYTES = 2**20  # the JSON of all a request's tools: 512 tools of 2 KB each fit
_INLINE_PARSE_BYTES = 64 * 1024  # smaller bodies parse on the loop: a thread hop costs more than they do
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")  # how JSON spells a UTF-16 surrogate
T = TypeVar("T")


def chat_completion_body(
    model: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A `chat.completion` object around its choices, as api.openai.com sends it."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


# -- the shapes of structured fields -------------------------------------------------------------


def _compilable_schema(schema: dict[str, Any]) -> dict[str, Any]:
    depth = json_depth(schema, MAX_SCHEMA_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"nests more than {MAX_SCHEMA_DEPTH} levels deep: the grammar compiler takes at most that"
        )
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"is {size} bytes of JSON: the grammar compiler takes at most {MAX_SCHEMA_BYTES}")
    return schema


def _tool_name(name: str) -> str:
    if not 1 <= len(name) <= MAX_TOOL_NAME_CHARS or any(c.isspace() or not c.isprintable() for c in name):
        raise ValueError(f"must be 1 to {MAX_TOOL_NAME_CHARS} printable characters without spaces")
    return name


def _bounded_tools(tools: Any) -> Any:
    """Refuse more tools than MAX_TOOLS or MAX_TOOLS_BYTES of them before any is checked one by one."""
    if not isinstance(tools, list):
        return tools  # the list's own check names it
    if len(tools) > MAX_TOOLS:
        raise InvalidFieldError("tools", f"{len(tools)} tools", f"at most {MAX_TOOLS} tools are taken")
    size = len(json.dumps(tools, ensure_ascii=False, default=str))
    if size > MAX_TOOLS_BYTES:
        raise InvalidFieldError(
            "tools",
            f"{size} bytes of JSON",
            f"at most {MAX_TOOLS_BYTES} bytes of tools are taken (they are rendered into the prompt)",
        )
    return tools


Tools = Annotated[list[T], BeforeValidator(_bounded_tools)]
"""A request's `tools` list, bounded in count (MAX_TOOLS) and size (MAX_TOOLS_BYTES)."""

JsonSchema = Annotated[dict[str, Any], AfterValidator(_compilable_schema)]
"""A JSON schema (an object) small and shallow enough to compile into a grammar in bounded time."""
ToolName = Annotated[str, AfterValidator(_tool_name)]


class FunctionDef(BaseModel):
    """A function tool's definition, as OpenAI's chat API spells it (other keys are kept)."""

    model_config = ConfigDict(extra="allow")

    name: ToolName
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of a chat request's `tools`: only function tools."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: ToolName


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: FunctionName


ToolChoiceMode = Literal["auto", "none", "required"]


def string_or_object(value: Any) -> str | None:
    """A `tool_choice` union's branch: `<mode>` for a string, `<object>` for a named choice."""
    return "<mode>" if isinstance(value, str) else "<object>" if isinstance(value, dict) else None


# Tags in `<>` name a union's branch; `field_path` leaves them out of the field it names.
ToolChoice = Annotated[
    Annotated[ToolChoiceMode, Tag("<mode>")] | Annotated[NamedToolChoice, Tag("<object>")],
    Discriminator(
        string_or_object,
        custom_error_type="tool_choice",
        custom_error_message='use "auto", "none", "required" or {"type": "function", "function": {"name": ..}}',
    ),
]
"""`tool_choice`: auto, none, required, or `{"type": "function", "function": {"name": ..}}`."""


def _given_for_json_schema(value: Any, info: ValidationInfo) -> Any:
    if value is None and info.data.get("type") == "json_schema":
        raise ValueError("is required when type is json_schema")
    return value


RequiredForJsonSchema = AfterValidator(_given_for_json_schema)
"""A format's schema field, required when its `type` is json_schema (with `validate_default`)."""


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the answer must match."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Annotated[JsonSchemaFormat | None, RequiredForJsonSchema] = Field(
        default=None, validate_default=True
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None


def field_path(loc: Sequence[str | int], prefix: str = "") -> str:
    """A pydantic error location as the field it names: `("tools", 0, "function")` ->
    `tools[0].function` (a union's branch tags, `<...>`, left out)."""
    return _path(
        [p for p in loc if not (isinstance(p, str) and p.startswith("<") and p.endswith(">"))], prefix
    )


def _path(loc: Sequence[str | int], prefix: str = "") -> str:
    path = prefix
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else part
    return path or "body"


def invalid_field(e: ValidationError, prefix: str = "") -> InvalidFieldError:
    """The first error of a ValidationError as an InvalidFieldError naming its field (under `prefix`);
    one a validator raised itself comes back as it was."""
    err = e.errors(include_url=False)[0]
    inner = (err.get("ctx") or {}).get("error")
    if isinstance(inner, InvalidFieldError):
        return inner
    reason = str(err["msg"]).removeprefix("Value error, ")
    value = None if err["type"] == "missing" else err.get("input")  # its input is the enclosing object
    return InvalidFieldError(field_path(err["loc"], prefix), value, reason)


# -- bodies in, errors out ---------------------------------------------------------------------


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of the range of a JSON number (a 64-bit float)")
    return value


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, refused (InvalidFieldError) if it is not JSON, holds numbers
    JSON cannot spell (NaN, Infinity, 1e400: a response echoing one could not be written), lone
    surrogates (`"\\ud800"`: no UTF-8 text holds one) or nests past MAX_BODY_DEPTH."""
    try:
        body = json.loads(raw, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the parser's limit
        raise InvalidFieldError(
            "body", raw[:80], f"is not JSON: {type(e).__name__}: {str(e)[:200]}"
        ) from None
    if not isinstance(body, dict):
        raise InvalidFieldError("body", raw[:80], "must be a JSON object")
    check_json(body, surrogates=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def check_json(value: Any, prefix: str = "", *, surrogates: bool = True) -> None:
    """Refuse JSON nested past MAX_BODY_DEPTH or (if `surrogates`) holding a string with a lone
    surrogate, naming where; iterative, as a body may nest as deep as the parser allows."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        v, loc = stack.pop()
        if len(loc) >= MAX_BODY_DEPTH:
            raise InvalidFieldError(
                _path(loc[:4], prefix) + "...", None, f"nests more than {MAX_BODY_DEPTH} levels deep"
            )
        for k, x in v.items() if isinstance(v, dict) else enumerate(v):
            if surrogates and isinstance(k, str) and not _is_utf8(k):
                raise InvalidFieldError(_path(loc, prefix), k, "has a key that is not valid unicode")
            if isinstance(x, dict | list):
                stack.append((x, (*loc, k)))
            elif surrogates and isinstance(x, str) and not _is_utf8(x):
                raise InvalidFieldError(
                    _path((*loc, k), prefix), x, "is not valid unicode (it holds a lone surrogate)"
                )


def _is_utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def error_response(
    status: int, message: str, param: str | None, kind: str = "invalid_request_error"
) -> JSONResponse:
    # A message quoting a lone surrogate could not be encoded: the error would become a 500.
    message = message.encode(errors="backslashreplace").decode()
    param = param.encode(errors="backslashreplace").decode() if param is not None else None
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": None}},
    )


ErrorResponse = Callable[[int, str, str | None, str], JSONResponse]
"""(status, message, field, OpenAI error type) -> the error as a route's dialect sends it."""


class ClientDisconnected(Exception):
    """The client closed its connection before its answer was ready (`until_disconnect`)."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelled as soon as the client disconnects (then ClientDisconnected is raised):
    uvicorn does not cancel a handler whose client left, and a completion nobody reads kept the
    engine decoding to `max_tokens` (tens of seconds) while its capture stayed in flight."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # cancelled ourselves (a drain at shutdown): the work goes too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # its cleanup (the capture no longer in flight) done before the route returns
    raise ClientDisconnected


async def handle_json(
    request: Request,
    handle: Callable[[dict[str, Any], str | None], Awaitable[Any]],
    *,
    error: ErrorResponse = error_response,
) -> Any:
    """Parse a JSON-object body, run `handle(body, capture_id)` (cancelled if the client leaves),
    map our errors to 404/400 (503: engine down, 504: engine timeout), shaped by `error` (OpenAI's
    by default)."""
    try:
        raw = await request.body()
        body = (
            parse_body(raw) if len(raw) <= _INLINE_PARSE_BYTES else await asyncio.to_thread(parse_body, raw)
        )
        return await until_disconnect(request, handle(body, request.headers.get(CAPTURE_HEADER)))
    except ClientDisconnected:  # nobody reads this answer; the status is for the server's log
        return error(499, "the client disconnected before its answer was ready", None, "client_disconnected")
    except UnknownModelError as e:
        return error(404, str(e), "model", "model_not_found")
    except InvalidFieldError as e:
        return error(400, str(e), e.field, "invalid_request_error")
    except EngineDownError as e:  # a 503 the client may retry: another replica (or a restart) serves it
        return error(503, str(e), None, "engine_down")
    except EngineTimeoutError as e:
        return error(504, str(e), None, "engine_timeout")
    except BudgetExceededError as e:  # no retry helps: a person raises the budget
        return error(402, str(e), f"budget.{e.budget}", "budget_exceeded")
    except ModelLimitError as e:  # a 429 the client may retry after the time it names
        refused = error(429, str(e), e.field, "rate_limit_exceeded")
        refused.headers["retry-after"] = str(e.retry_after_s)
        return refused
