"""OpenAI-style HTTP plumbing shared by the endpoint's routes: JSON bodies in, errors out."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from .capture import CAPTURE_HEADER
from .errors import EngineDownError, EngineTimeoutError, InvalidFieldError, UnknownModelError


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


def error_response(
    status: int, message: str, param: str | None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": None}},
    )


async def handle_json(
    request: Request, handle: Callable[[dict[str, Any], str | None], Awaitable[Any]]
) -> Any:
    """Parse a JSON-object body, run `handle(body, capture_id)`, map our errors to OpenAI's 404/400 (503: engine down)."""
    try:
        body = await request.json()
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the parser's limit
        return error_response(400, f"body is not JSON: {type(e).__name__}: {str(e)[:200]}", "body")
    if not isinstance(body, dict):
        return error_response(400, "body must be a JSON object", "body")
    try:
        return await handle(body, request.headers.get(CAPTURE_HEADER))
    except UnknownModelError as e:
        return error_response(404, str(e), "model", "model_not_found")
    except InvalidFieldError as e:
        return error_response(400, str(e), e.field)
    except EngineDownError as e:  # a 503 the client may retry: another replica (or a restart) serves it
        return error_response(503, str(e), None, "engine_down")
    except EngineTimeoutError as e:
        return error_response(504, str(e), None, "engine_timeout")
