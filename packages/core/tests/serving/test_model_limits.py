"""Per-model limits (`serving/model_limits.py`): a model's caps on rows in flight and requests a
minute, through the real endpoint on a scripted engine. Over a cap a request is a 429 with
`Retry-After`, naming the model and the field, in each route's dialect; its rows go back when it
finishes, fails or its client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _support import wait_until
from journeyman.data.config import ModelConfig
from journeyman.serving.model_limits import RATE_WINDOW_S, ModelLimitError, ModelLimits
from pydantic import ValidationError

PROMPT = [{"role": "user", "content": "Hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def limited(scripted: Any) -> Iterator[tuple[Any, Any]]:
    """(endpoint, inference) of the scripted model; its limits put back after the test."""
    model, backend = scripted
    endpoint = backend.endpoint(model)
    saved = endpoint.limits
    yield endpoint, backend.inference(model.name)
    endpoint.limits = saved


def _client(inference: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=inference.base_url.removesuffix("/v1"),
        headers={"authorization": f"Bearer {inference.api_key}"},
        timeout=30,
    )


def _caps(endpoint: Any, clock: Clock | None = None, **caps: int) -> ModelLimits:
    config = ModelConfig(name=endpoint.model_name, project="tests", **caps)
    limits = ModelLimits.of(config) if clock is None else ModelLimits(config.name, clock=clock)
    limits.configure(config)
    endpoint.limits = limits
    return limits


def _over(r: httpx.Response, field: str, model: str = "scripted") -> str:
    """A 429 naming the model and the field, with a Retry-After; returns the message."""
    assert r.status_code == 429, (r.status_code, r.text)
    assert 1 <= int(r.headers["retry-after"]) <= RATE_WINDOW_S
    error = r.json()["error"]
    message = error["message"]
    assert field in message and repr(model) in message, message
    return message


async def test_rows_over_the_cap_are_refused_until_the_rows_in_flight_finish(limited: Any) -> None:
    endpoint, inference = limited
    limits = _caps(endpoint, max_rows_in_flight=2)
    endpoint.engine.delay_s = 0.5
    async with _client(inference) as c:
        body = {"model": inference.model, "messages": PROMPT, "max_tokens": 2}
        held = asyncio.ensure_future(c.post("/v1/chat/completions", json={**body, "n": 2}))
        await wait_until(lambda: limits.rows_in_flight == 2, 10)
        r = await c.post("/v1/chat/completions", json=body)
        _over(r, "max_rows_in_flight")
        assert r.json()["error"]["param"] == "max_rows_in_flight"
        _over(
            await c.post("/v1/responses", json={"model": inference.model, "input": "Hi"}),
            "max_rows_in_flight",
        )
        r = await c.post("/v1/messages", json=body)  # Anthropic's shape
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
        assert "max_rows_in_flight" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
        assert (await held).status_code == 200
        assert limits.rows_in_flight == 0
        r = await c.post("/v1/chat/completions", json={**body, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = await c.post("/v1/chat/completions", json={**body, "n": 3})  # never fits: no use waiting
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert limits.rows_in_flight == 0 and limits.refused == 3


async def test_rows_go_back_when_a_request_fails_or_its_client_leaves(limited: Any) -> None:
    endpoint, inference = limited
    limits = _caps(endpoint, max_rows_in_flight=2)
    async with _client(inference) as c:
        r = await c.post(
            "/v1/chat/completions", json={"model": inference.model, "messages": PROMPT, "n": 2, "top_p": 0}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
        assert limits.rows_in_flight == 0
        endpoint.engine.delay_s = 30.0  # a stuck engine: the clients give up
        for stream in (False, True):
            body = {"model": inference.model, "messages": PROMPT, "n": 2, "stream": stream}
            request = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
            await wait_until(lambda: limits.rows_in_flight == 2, 10)
            request.cancel()  # the connection closes: the endpoint cancels the request
            await wait_until(lambda: limits.rows_in_flight == 0, 10)
    endpoint.engine.delay_s = 0.0
    async with _client(inference) as c:
        body = {"model": inference.model, "messages": PROMPT, "n": 2, "max_tokens": 2}
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200


async def test_requests_over_the_rate_wait_until_the_minute_has_passed(limited: Any) -> None:
    endpoint, inference = limited
    clock = Clock()
    limits = _caps(endpoint, clock, max_requests_per_minute=2)
    async with _client(inference) as c:
        body = {"model": inference.model, "messages": PROMPT, "max_tokens": 2}
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        clock.now += 20
        assert (
            await c.post("/v1/responses", json={"model": inference.model, "input": "Hi"})
        ).status_code == 200
        clock.now += 10
        r = await c.post("/v1/chat/completions", json={**body, "stream": True})
        _over(r, "max_requests_per_minute")
        assert r.headers["retry-after"] == "30"  # the first request leaves the window in 30 s
        assert r.json()["error"]["param"] == "max_requests_per_minute"
        clock.now += 30  # the first request is out of the window: one more fits
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        _over(await c.post("/v1/chat/completions", json=body), "max_requests_per_minute")
    assert limits.refused == 2


def test_the_caps_are_checked_naming_the_field_and_none_is_unbounded() -> None:
    for field in ("max_rows_in_flight", "max_requests_per_minute"):
        with pytest.raises(ValidationError, match=field):
            ModelConfig(name="m", project="p", **{field: 0})  # pyright: ignore[reportArgumentType]
    limits = ModelLimits.of(ModelConfig(name="m", project="p"))
    with limits.admitted(128), limits.admitted(128):
        assert limits.rows_in_flight == 256
    assert limits.rows_in_flight == 0
    capped = ModelLimits("m", max_rows_in_flight=1)
    with capped.admitted(1), pytest.raises(ModelLimitError) as e, capped.admitted(1):
        pass
    assert e.value.field == "max_rows_in_flight" and e.value.model == "m" and e.value.retry_after_s >= 1
    assert capped.rows_in_flight == 0
