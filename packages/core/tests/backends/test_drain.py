"""`journeyman serve` stopped by SIGTERM, as Kubernetes, systemd and docker stop it: a real child
process, a request and a training step in flight. New requests get 503 with `Retry-After`, the
request and the step finish, the step commits, and the process exits 0 within the bound."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import journeyman as jm
import pytest
from _support import task_groups
from journeyman.backends.server import ServerProcess
from journeyman.client.wire import PREFIX, TrainBody, gzip_json
from journeyman.serving.drain import DRAIN_TIMEOUT_S, RETRY_AFTER_S, SHUTDOWN_GRACE_S

pytestmark = pytest.mark.integration

TOKEN = "drain-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}


async def _refused(http: httpx.AsyncClient, within_s: float = 5.0) -> httpx.Response:
    """The first answer to a new request after SIGTERM that is not a 200 (the drain starts on the
    server's next tick, within 0.1 s)."""
    deadline = time.monotonic() + within_s
    while True:
        r = await http.get(f"{PREFIX}/info")
        if r.status_code != 200 or time.monotonic() > deadline:
            return r
        await asyncio.sleep(0.02)


async def test_sigterm_mid_request_and_mid_step_drains_commits_and_exits(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, TOKEN).start()
    assert server.proc is not None
    try:
        model = jm.TrainableModel(name="drained", project="p")
        await model.register(jm.RemoteBackend(server.url, token=TOKEN, progress=False))
        groups = await task_groups(model, groups=1)
        body = gzip_json(
            TrainBody(groups=groups, config=jm.TrainConfig(micro_batch_tokens=64), idempotency_key="drain-0")
        )
        chat = {
            "model": model.name,
            "messages": [{"role": "user", "content": "Count to 50."}],
            "max_tokens": 16,
        }
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=120, headers=AUTH) as http,
            http.stream(
                "POST",
                f"{PREFIX}/models/drained/train",
                content=body,
                headers={"content-encoding": "gzip", "content-type": "application/json"},
            ) as train,
        ):
            lines = train.aiter_lines()
            while json.loads(await anext(lines))["kind"] != "progress":
                pass  # mid-step: a micro-batch done, the step not
            answered_at: list[float] = []

            async def ask() -> httpx.Response:
                r = await http.post("/v1/chat/completions", json=chat)
                answered_at.append(time.monotonic())
                return r

            asked = asyncio.create_task(ask())  # waits for the step: the engine sleeps while it trains
            await asyncio.sleep(0.5)
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            refused = await _refused(http)
            assert refused.status_code == 503, (refused.status_code, refused.text[:300])
            assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
            assert refused.json()["error"]["type"] == "unavailable"
            events = [json.loads(line) async for line in lines]
            answer = await asked
        assert events[-1]["kind"] == "result" and events[-1]["result"]["step"] == 1, events[-1]
        assert answer.status_code == 200 and answer.json()["choices"][0]["journeyman"]["token_ids"]
        assert answered_at[0] > sent  # the request was in flight when the signal came
        code = await asyncio.to_thread(server.proc.wait, 120)
        drained_s = time.monotonic() - sent
        print(f"\nSIGTERM -> exit: {drained_s:.1f} s (request and step in flight)")
        assert code == 0, server.proc.stderr.read() if server.proc.stderr else code
        # the step committed: its checkpoint is written and state.json names it
        run = model.run_dir
        assert (run / "checkpoints" / "0001" / "adapter_model.safetensors").exists()
        assert json.loads((run / "state.json").read_text())["step"] == 1
        assert drained_s < DRAIN_TIMEOUT_S + SHUTDOWN_GRACE_S + 30  # the step's rest, then closing
    finally:
        server.kill()
