"""journeyman.rewards.llm without a model: each spec kind, the errors that name the field, the served step in
a local model's identity, and the timeout. Local models are served by a small OpenAI-shaped server
on 127.0.0.1 behind a stand-in backend that only answers `inference()`."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import time
from collections.abc import Coroutine
from typing import Any

import journeyman as jm
import pytest
from _support import ChatServer
from fastapi import FastAPI, Request
from journeyman.client.protocol import set_current_backend
from journeyman.rewards.llm import LLM, LLMTimeoutError, chat_client, complete_json, resolve_llm

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


class Served(ChatServer):
    """/v1/models lists `judge` and `judge@3`; chat answers {"ok": true}, or sleeps when told to."""

    def __init__(self) -> None:
        self.auth: list[str | None] = []
        self.keys: list[tuple[str, str | None]] = []  # (path, Authorization) of every request
        self.delay = 0.0
        super().__init__()

    def routes(self, app: FastAPI) -> None:
        @app.middleware("http")
        async def keys(request: Request, call_next: Any) -> Any:
            self.keys.append((request.url.path, request.headers.get("authorization")))
            return await call_next(request)

        @app.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self.auth.append(request.headers.get("authorization"))
            return {"object": "list", "data": [{"id": "judge"}, {"id": "judge@3"}]}

    async def answer(self, body: dict[str, Any]) -> str:
        await asyncio.sleep(self.delay)
        return '{"ok": true}'


class StandIn:
    """The one Backend method the resolver uses."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def inference(self, model_name: str | None = None) -> jm.Inference:
        name = model_name or "judge"
        if name != "judge":
            raise jm.InvalidFieldError("model", name, "is not registered with this backend")
        return jm.Inference(base_url=self.base_url, api_key="secret", model=name)


served = Served.module_fixture("served")


@pytest.fixture
def backend(served: Served) -> StandIn:
    served.requests.clear()
    served.delay = 0.0
    return StandIn(served.server.base_url)


def in_fresh_context(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """Run `coro` where no model was ever registered (a context of its own)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


async def test_local_identity_includes_the_served_step(backend: StandIn, served: Served) -> None:
    for spec in ("local", "local:judge"):
        llm = await resolve_llm(spec, backend=backend)
        assert llm == LLM(
            kind="local", model="judge", base_url=backend.base_url, api_key="secret", identity="local:judge@3"
        )
    assert served.auth[-1] == "Bearer secret"


async def test_local_through_the_current_backend(backend: StandIn) -> None:
    async def resolve() -> LLM:
        set_current_backend(backend)  # what `await model.register(backend)` does
        return await resolve_llm("local")

    assert (await in_fresh_context(resolve())).identity == "local:judge@3"


async def test_local_with_no_backend_is_a_clear_error() -> None:
    with pytest.raises(jm.InvalidFieldError) as err:
        await in_fresh_context(resolve_llm("local", field="judge"))
    assert err.value.field == "judge" and "register a model first" in err.value.reason
    assert "backend=" in str(err.value)


async def test_a_model_object_names_a_local_model(backend: StandIn) -> None:
    judge = jm.TrainableModel(name="judge", project="tests")  # not registered: found on `backend`
    assert (await resolve_llm(judge, backend=backend)).identity == "local:judge@3"
    with pytest.raises(jm.InvalidFieldError) as err:
        await resolve_llm(jm.TrainableModel(name="other", project="tests"), backend=backend, field="judge")
    assert err.value.field == "judge" and err.value.value == "local:other"
    with pytest.raises(jm.InvalidFieldError) as err:
        await resolve_llm(judge, "x", backend=backend, field="judge")
    assert err.value.field == "judge_model"


async def test_unknown_local_model_names_the_field(backend: StandIn) -> None:
    with pytest.raises(jm.InvalidFieldError) as err:
        await resolve_llm("local:nobody", backend=backend, field="generator")
    assert err.value.field == "generator" and err.value.value == "local:nobody"
    assert "not registered" in err.value.reason


async def test_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    llm = await resolve_llm("http://127.0.0.1:8000/v1/", "Qwen/Qwen3-8B")
    assert llm.kind == "openai" and llm.base_url == "http://127.0.0.1:8000/v1"
    assert llm.identity == "http://127.0.0.1:8000/v1#Qwen/Qwen3-8B" and llm.api_key == "EMPTY"
    assert "EMPTY" not in repr(llm)  # keys stay out of logs
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    assert (await resolve_llm("https://api.example.com/v1", "m")).api_key == "from-env"
    assert (await resolve_llm("https://api.example.com/v1", "m", api_key="given")).api_key == "given"


@pytest.mark.parametrize(
    ("spec", "model", "field"),
    [
        ("", None, "judge"),
        ("   ", None, "judge"),
        ("openai/gpt 4o", None, "judge"),
        (42, None, "judge"),
        ("local:", None, "judge"),
        ("http://", "m", "judge"),
        ("http://127.0.0.1:8000/v1", None, "judge_model"),
        ("local", "m", "judge_model"),
        ("local:judge", "m", "judge_model"),
        ("openai/gpt-4o", "m", "judge_model"),
    ],
)
async def test_bad_specs_name_the_field(spec: Any, model: str | None, field: str, backend: StandIn) -> None:
    with pytest.raises(jm.InvalidFieldError) as err:
        await resolve_llm(spec, model, backend=backend, field="judge")
    assert err.value.field == field


async def test_litellm_missing_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "litellm", None)  # as on an install without the extra: import fails
    with pytest.raises(ImportError, match=r'generator=.openai/gpt-4o.*pip install "journeyman\[litellm\]"'):
        await resolve_llm("openai/gpt-4o", field="generator")


async def test_litellm_spec_and_call(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real LiteLLM, as `openai/<name>` with `api_base`, against the OpenAI-compatible stand-in
    (a paid provider cannot be reached here): what it sends arrives on the wire."""
    import litellm

    calls: list[dict[str, Any]] = []
    real = litellm.acompletion

    async def acompletion(**kwargs: Any) -> Any:  # a spy: records what LiteLLM is handed, calls it
        calls.append(kwargs)
        return await real(**kwargs)

    monkeypatch.setattr(litellm, "acompletion", acompletion)
    seen = len(served.requests)
    llm = await resolve_llm("openai/judge", api_key="k")
    assert (llm.kind, llm.model, llm.identity) == ("litellm", "openai/judge", "litellm:openai/judge")
    text, finish = await complete_json(
        llm,
        [{"role": "user", "content": "hi"}],
        SCHEMA,
        params={"temperature": 0, "api_base": served.base_url},
    )
    assert (text, finish) == ('{"ok": true}', "stop")
    body = served.requests[seen]
    assert body["model"] == "judge" and body["temperature"] == 0  # the provider prefix taken off
    fmt = body["response_format"]["json_schema"]
    assert fmt["schema"] == SCHEMA and fmt["strict"] is False  # providers differ in strict keywords
    assert served.keys[-1] == ("/v1/chat/completions", "Bearer k")
    assert calls[0]["api_key"] == "k" and calls[0]["timeout"] > 0
    # a LiteLLM player (mcp-rl's --against) goes through the same client, key included
    reply = await chat_client(llm, timeout=5).chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "again"}], api_base=served.base_url
    )
    assert reply.choices[0].message.content == '{"ok": true}' and calls[1]["api_key"] == "k"
    assert served.requests[seen + 1]["messages"] == [{"role": "user", "content": "again"}]
    assert served.keys[-1] == ("/v1/chat/completions", "Bearer k")


async def test_complete_json_sends_the_schema(backend: StandIn, served: Served) -> None:
    llm = await resolve_llm("local", backend=backend)
    text, finish = await complete_json(
        llm, [{"role": "user", "content": "ok?"}], SCHEMA, name="probe", params={"max_tokens": 9, "seed": 1}
    )
    assert (text, finish) == ('{"ok": true}', "stop")
    body = served.requests[-1]
    assert body["model"] == "judge" and body["max_tokens"] == 9 and body["seed"] == 1
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "probe", "schema": SCHEMA, "strict": True},
    }


async def test_every_call_has_a_timeout(backend: StandIn, served: Served) -> None:
    llm = await resolve_llm("local", backend=backend)
    served.delay = 1.5
    start = time.monotonic()
    with pytest.raises(LLMTimeoutError) as err:
        await complete_json(llm, [{"role": "user", "content": "ok?"}], SCHEMA, timeout=0.3)
    assert time.monotonic() - start < 1.2 and isinstance(err.value, TimeoutError)
    assert "local:judge@3" in str(err.value) and "timeout=0.3s" in str(err.value)
    with pytest.raises(jm.InvalidFieldError) as bad:
        await complete_json(llm, [], SCHEMA, timeout=0)
    assert bad.value.field == "timeout"
