"""`journeyman serve` in a real subprocess on 127.0.0.1, driven through `jm.RemoteBackend`."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import journeyman as jm
import pytest
from _support import task_groups, tiny_model_dir
from fastapi.routing import APIRoute
from journeyman.backends.server import ServerProcess, create_app
from journeyman.client.wire import PREFIX

pytestmark = pytest.mark.integration

TOKEN = "test-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(path: Path) -> ServerProcess:
    return ServerProcess(path, TOKEN, args=["--max-body-mb", "1"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = _server(tmp_path_factory.mktemp("serve")).start()
    yield s
    s.kill()


def _routes() -> list[tuple[str, str]]:
    app = create_app(jm.LocalBackend(path="/nonexistent"), TOKEN)  # no model is loaded to list routes
    out = []
    for r in app.routes:
        if isinstance(r, APIRoute):
            out += [(m, r.path.replace("{name}", "m")) for m in sorted(r.methods)]
    return out


def test_every_route_needs_the_token(server: ServerProcess) -> None:
    routes = _routes()
    assert len(routes) >= 12 and ("POST", "/v1/chat/completions") in routes
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path in routes:
            for headers in ({}, {"authorization": "Bearer wrong-token-0123456789"}, {"authorization": TOKEN}):
                r = http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers)
                if path == "/v1/messages":  # the Anthropic route answers in Anthropic's error shape
                    assert r.json() == {
                        "type": "error",
                        "error": {"type": "authentication_error", "message": "unauthorized"},
                    }
                    continue
                assert r.json() == {
                    "error": {"message": "unauthorized", "type": "unauthorized", "param": None}
                }


def test_oversized_bodies_get_413_naming_the_limit(server: ServerProcess) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    big = b"x" * (2 * 2**20)
    with httpx.Client(base_url=server.url, timeout=30, headers=auth) as http:
        r = http.post(f"{PREFIX}/register", content=big)
        assert r.status_code == 413 and str(2**20) in r.json()["error"]["message"]
        chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))  # no content-length: counted
        r = http.post("/v1/chat/completions", content=chunks)
        assert r.status_code == 413


async def test_remote_backend_errors_are_named(server: ServerProcess) -> None:
    with pytest.raises(jm.AuthenticationError):
        await jm.RemoteBackend(server.url, token="wrong-token-0123456789").register(
            jm.TrainableModel(name="x", project="p")
        )
    backend = jm.RemoteBackend(server.url, token=TOKEN)
    with pytest.raises(jm.UnknownModelError) as unknown:
        await backend.get_step(jm.TrainableModel(name="never-registered", project="p"))
    assert unknown.value.name == "never-registered"
    down = jm.RemoteBackend(f"http://127.0.0.1:{_free_port()}", token=TOKEN, reconnect_s=1)
    with pytest.raises(jm.BackendUnavailableError):
        await down.get_step(jm.TrainableModel(name="x", project="p"))


@pytest.mark.slow
async def test_rollouts_captures_and_a_train_step_through_the_server(server: ServerProcess) -> None:
    backend = jm.RemoteBackend(server.url, token=TOKEN, progress=False)
    model = jm.TrainableModel(name="remote", project="p")
    await model.register(backend)
    assert model.run_dir == server.path / "p" / "models" / "remote"
    client = model.openai_client()

    async def one(i: int) -> jm.CapturedCall:
        async with model.capture() as cap:
            await client.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=4
            )
        (call,) = cap.calls
        return call

    calls = await asyncio.gather(*(one(i) for i in range(64)), return_exceptions=True)
    errors = [c for c in calls if isinstance(c, BaseException)]
    assert not errors, errors[:3]
    records = [jm.TokenRecord.model_validate(c.response["choices"][0]["journeyman"]) for c in calls]  # type: ignore[union-attr]
    assert all(r.token_ids and len(r.logprobs) == len(r.token_ids) and r.step == 0 for r in records)

    groups = await task_groups(model)  # two groups of two, rewards forced apart
    before = backend.sent_bytes
    result = await model.train(
        groups, config=jm.TrainConfig(learning_rate=1e-3), idempotency_key="step-one-key"
    )
    per_trajectory = (backend.sent_bytes - before) / sum(len(g.trajectories) for g in groups)
    print(f"train body: {per_trajectory:.0f} compressed bytes per trajectory")
    assert result.step == 1 and not result.skipped and await model.get_step() == 1
    again = await model.train(  # a retry (the same call): no second step
        groups, config=jm.TrainConfig(learning_rate=1e-3), idempotency_key="step-one-key"
    )
    assert again == result and await model.get_step() == 1
    await model.log(groups, split="val", metrics={"reward_sem": 0.1})
    history = await model.history()
    assert [h["split"] for h in history] == ["train", "val"] and history[1]["val/reward_sem"] == 0.1
    assert history[0]["trained_by"] == "env"  # the step's row names the token that trained it
    await model.serve_step(0)
    await model.serve_step(1)
    # RULER's judge="local" is the server's model, found through the backend (bearer token and all)
    scored = await jm.ruler_score_group(
        groups[0], judge="local", config=jm.RulerConfig(explanation_chars=4, use_cache=False)
    )
    assert scored.metadata["ruler"]["judge"] == "local:remote@1"
    assert all(0 <= t.reward <= 1 for t in scored.trajectories)


async def test_an_idempotency_key_is_scoped_to_the_model_and_operation(
    server: ServerProcess, tmp_path: Path
) -> None:
    """Issue 53: key K trained model ka, then K on kb answered ka's step and trained nothing. Now K
    names one call of one model and operation: kb trains its own step, ka's train_sft its own; K on
    ka again with the same call is its result, with another call the server's 409, IdempotencyKeyReusedError as well,
    and, when only the run directory remembers K (a LocalBackend here), IdempotencyKeyReusedError
    before anything is written."""
    backend = jm.RemoteBackend(server.url, token=TOKEN, progress=False)
    ka, kb = (
        jm.TrainableModel(
            name=name, project="keys", base_model=str(tiny_model_dir()), lora=jm.LoraConfig(r=4), max_tokens=8
        )
        for name in ("ka", "kb")
    )
    await ka.register(backend)
    await kb.register(backend)
    ga, gb = await task_groups(ka), await task_groups(kb)
    config = jm.TrainConfig(learning_rate=1e-3)
    first = await ka.train(ga, config=config, idempotency_key="K")
    other = await kb.train(gb, config=config, idempotency_key="K")
    assert (first.step, other.step, await kb.get_step()) == (1, 1, 1) and other.metrics != first.metrics
    assert await ka.train(ga, config=config, idempotency_key="K") == first
    with pytest.raises(jm.IdempotencyKeyReusedError) as e:
        await ka.train(gb, config=config, idempotency_key="K")
    assert e.value.field == "idempotency_key" and "another train call to ka" in e.value.reason
    assert (await ka.train_sft(ga, idempotency_key="K")).step == 2 and await ka.get_step() == 2

    local = jm.LocalBackend(path=tmp_path)  # no job table: the run directory's record answers
    try:
        kc = jm.TrainableModel(
            name="kc", project="keys", base_model=str(tiny_model_dir()), lora=jm.LoraConfig(r=4), max_tokens=8
        )
        await kc.register(local)
        groups = await task_groups(kc)
        done = await kc.train(groups, config=config, idempotency_key="K")
        with pytest.raises(jm.IdempotencyKeyReusedError) as refused:
            await kc.train(groups, config=jm.TrainConfig(learning_rate=1e-4), idempotency_key="K")
        assert refused.value.field == "idempotency_key" and "made step 1" in refused.value.reason
        assert await kc.train(groups, config=config, idempotency_key="K") == done
        assert await kc.get_step() == 1 and not list(kc.run_dir.glob("trajectories/train/*failed*"))
    finally:
        local.close()


async def _greedy(
    model: jm.TrainableModel, prompts: tuple[str, ...] = ("Name a color.", "Count."), max_tokens: int = 6
) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy completion through the server: its token ids and logprobs."""
    out = []
    for prompt in prompts:
        done = await model.openai_client().chat.completions.create(
            model=model.name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0.0,
        )
        record = jm.record_of(done.choices[0])
        assert record is not None
        out.append((record.token_ids, record.logprobs))
    return out


def _engine_counts(server: ServerProcess, key: str) -> dict[str, float]:
    """`journeyman_engine_<key>` by model, as the server's /metrics shows it."""
    auth = {"authorization": f"Bearer {TOKEN}"}
    text = httpx.get(f"{server.url}/metrics", headers=auth, timeout=30).text
    series = re.compile(rf'^journeyman_engine_{key}(?:_total)?{{model="([^"]+)"}} (\S+)$', re.MULTILINE)
    return {model: float(value) for model, value in series.findall(text)}


async def _probe_until(
    model: jm.TrainableModel, done: asyncio.Future[Any], loops: int = 4
) -> list[tuple[float, float]]:
    """One-token requests to `model`, `loops` at a time, until `done`: each one's (asked, answered)
    wall-clock times."""
    out: list[tuple[float, float]] = []

    async def loop() -> None:
        while not done.done():
            asked = time.time()
            await _greedy(model, ("Count.",), max_tokens=1)
            out.append((asked, time.time()))

    await asyncio.gather(*(loop() for _ in range(loops)))
    return out


async def test_two_models_on_one_base_share_the_servers_engine_and_train_apart(server: ServerProcess) -> None:
    """Issue 55 through `journeyman serve`: two models registered at once on one base share one
    engine (their rows decode in the same steps, its counts on /metrics are one engine's), a row
    of each answers as it does alone, one model's step runs while the other's requests are served,
    and neither's step moves the other's greedy answers by a token or a logprob."""
    backend = jm.RemoteBackend(server.url, token=TOKEN, progress=False)
    a, b = (
        jm.TrainableModel(
            name=name, project="pair", base_model=str(tiny_model_dir()), lora=jm.LoraConfig(r=4), max_tokens=6
        )
        for name in ("pa", "pb")
    )
    await asyncio.gather(a.register(backend), b.register(backend))
    a_alone, b_alone = await _greedy(a), await _greedy(b)
    mixed = _engine_counts(server, "decode_mixed_steps")
    together = await asyncio.gather(*(_greedy(m) for m in (a, b, a, b)))
    for got, alone in zip(together, [a_alone, b_alone, a_alone, b_alone], strict=True):
        for (ids, lps), (ids_alone, lps_alone) in zip(got, alone, strict=True):
            assert ids == ids_alone  # the logprobs within float rounding: batched with other rows
            assert max(abs(x - y) for x, y in zip(lps, lps_alone, strict=True)) < 1e-4
    now = _engine_counts(server, "decode_mixed_steps")
    assert now["pa"] > mixed["pa"] and now["pa"] == now["pb"]  # one engine, rows of both in its steps

    for trains, other, other_before in ((a, b, b_alone), (b, a, None)):
        if other_before is None:
            other_before = await _greedy(other)
        groups = await task_groups(trains, groups=8, size=8, max_tokens=16)  # a step of a few seconds
        config = jm.TrainConfig(learning_rate=1e-2, micro_batch_tokens=64)
        step = asyncio.create_task(trains.train(groups, config=config))
        probes = await _probe_until(other, step)
        result = await step
        assert result.step == 1 and not result.skipped and await other.get_step() == (1 if other is a else 0)
        # the other model's requests, asked and answered while the step ran on the server
        (row,) = [h for h in await trains.history() if h["step"] == 0 and h["split"] == "train"]
        end = float(row["recorded_at"])
        start = end - float(row["train/train_seconds"])
        inside = [(x, y) for x, y in probes if start <= x and y <= end]
        print(f"{other.name}: {len(inside)} of {len(probes)} requests inside {trains.name}'s step")
        assert inside, (start, end, probes)
        assert await _greedy(other) == other_before  # token ids and logprobs, bit for bit
    assert await _greedy(a) != a_alone  # the step did change the trained model's answers


def _train_body(groups: list[jm.TrajectoryGroup], key: str) -> bytes:
    from journeyman.client.wire import TrainBody, gzip_json

    return gzip_json(
        TrainBody(groups=groups, config=jm.TrainConfig(micro_batch_tokens=64), idempotency_key=key)
    )


@pytest.mark.slow
async def test_a_server_killed_mid_step_resumes_and_trains_it_exactly_once(tmp_path: Path) -> None:
    """SIGKILL during step 1: the restarted server resumes step 1's checkpoint, and the client's retry
    (same idempotency key) trains step 1 once; no group is lost or written twice."""
    server = _server(tmp_path).start()
    try:
        backend = jm.RemoteBackend(server.url, token=TOKEN, progress=False, reconnect_s=240)
        model = jm.TrainableModel(name="killed", project="p")
        await model.register(backend)
        groups = await task_groups(model)
        assert (await model.train(groups, idempotency_key="kill-test-step-0")).step == 1
        key = "kill-test-step-1"
        headers = {
            "authorization": f"Bearer {TOKEN}",
            "content-encoding": "gzip",
            "content-type": "application/json",
        }
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=120) as http,
            http.stream(
                "POST", f"{PREFIX}/models/killed/train", content=_train_body(groups, key), headers=headers
            ) as r,
        ):
            async for line in r.aiter_lines():
                if json.loads(line)["kind"] == "progress":
                    break  # mid-step: the first micro-batch is done, the step is not
            server.kill()
        server.start()  # re-registers the model from its run directory
        assert await model.get_step() == 1  # resumed at the last checkpoint (the client reconnected)
        result = await model.train(groups, config=jm.TrainConfig(micro_batch_tokens=64), idempotency_key=key)
        assert result.step == 2 and await model.get_step() == 2
        run = model.run_dir
        assert (run / "checkpoints" / "0002" / "adapter_model.safetensors").exists()
        history = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
        assert [(h["split"], h["step"]) for h in history] == [("train", 0), ("train", 1)]
        for step in (0, 1):  # every group on disk once: none lost, none twice
            saved = (run / "trajectories" / "train" / f"{step:04d}.jsonl").read_text().splitlines()
            assert len(saved) == len(groups)
    finally:
        server.kill()
