"""RemoteBackend against real HTTP peers, no model: what it retries (a server restarting or draining)
and what it does not (nothing listening), and what a train stream's result and errors become."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import journeyman as jm
import pytest
from journeyman.client.operations import TRAIN
from journeyman.client.wire import PREFIX, PROTOCOL_VERSION, TrainEvent
from journeyman.serving.endpoint import ServerThread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Peer:
    """A stand-in `journeyman serve` on 127.0.0.1: `/info` answers 503 + Retry-After `draining`
    times, then its info; the train route streams `events` (one JSON line each)."""

    def __init__(self) -> None:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse

        self.draining = 0
        self.events: list[TrainEvent] = []
        app = FastAPI()

        @app.get(f"{PREFIX}/info")
        def info() -> Any:
            if self.draining:
                self.draining -= 1
                return JSONResponse({"error": {"message": "draining"}}, 503, headers={"retry-after": "1"})
            return {"journeyman": version("journeyman"), "protocol": PROTOCOL_VERSION, "models": []}

        @app.post(TRAIN.url("m"))
        def train() -> Any:
            return PlainTextResponse("".join(e.model_dump_json() + "\n" for e in self.events))

        self.server = ServerThread(app)
        self.url = self.server.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def peer() -> Iterator[_Peer]:
    p = _Peer()
    yield p
    p.server.stop()


async def test_a_refused_first_contact_fails_at_once_naming_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    backend = jm.RemoteBackend(url, token="t")  # the default 120 s reconnect window
    t0 = time.monotonic()
    with pytest.raises(jm.BackendUnavailableError) as e:
        await jm.TrainableModel(name="m", project="p").register(backend)
    assert time.monotonic() - t0 < 5  # it waited out the whole window before
    assert str(e.value).startswith(f"nothing answers at {url} ") and "journeyman serve" in str(e.value)


async def test_a_draining_server_is_asked_again_after_its_retry_after(peer: _Peer) -> None:
    peer.draining = 1
    t0 = time.monotonic()
    info = await jm.RemoteBackend(peer.url, token="t")._check_server()  # pyright: ignore[reportPrivateUsage]
    assert info.protocol == PROTOCOL_VERSION and peer.draining == 0 and time.monotonic() - t0 >= 1
    peer.draining = 5  # longer than the client will wait: the 503 itself, by name
    with pytest.raises(jm.RemoteError) as e:
        await jm.RemoteBackend(peer.url, token="t", reconnect_s=0.5)._check_server()  # pyright: ignore[reportPrivateUsage]
    assert "HTTP 503" in str(e.value)
    peer.draining = 0


async def test_a_server_gone_after_the_first_contact_is_retried_then_named() -> None:
    p = _Peer()
    backend = jm.RemoteBackend(p.url, token="t", reconnect_s=1)
    await backend._check_server()  # pyright: ignore[reportPrivateUsage]
    p.server.stop()  # a restart that does not come back within reconnect_s
    t0 = time.monotonic()
    with pytest.raises(jm.BackendUnavailableError) as e:
        await backend.get_step(jm.TrainableModel(name="m", project="p"))
    assert time.monotonic() - t0 >= 0.5 and "did not answer for 1 s" in str(e.value)


async def test_a_skipped_step_is_logged_where_the_client_is(
    peer: _Peer, caplog: pytest.LogCaptureFixture
) -> None:
    why = "in each of the 2 groups the rewards are all equal"
    skipped = jm.TrainResult(step=3, skipped=True, skip_reason=why)
    peer.events = [TrainEvent(kind="result", result=skipped)]
    backend = jm.RemoteBackend(peer.url, token="t", progress=False)
    group = jm.TrajectoryGroup([jm.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])])
    with caplog.at_level(logging.WARNING, logger="journeyman"):
        result = await backend.train(jm.TrainableModel(name="m", project="p"), [group])
    assert result == skipped
    assert [r.getMessage() for r in caplog.records] == [f"train m: step 3 skipped: {why}"]


async def test_a_refused_step_comes_back_as_the_error_the_server_raised(peer: _Peer) -> None:
    error = {"type": "NoLearningSignalError", "message": "...", "param": "groups"}
    peer.events = [TrainEvent(kind="error", error={**error, "value": "[[0.5, 0.5]]", "reason": "all equal"})]
    backend = jm.RemoteBackend(peer.url, token="t", progress=False)
    group = jm.TrajectoryGroup([jm.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])])
    with pytest.raises(jm.NoLearningSignalError) as e:
        await backend.train(jm.TrainableModel(name="m", project="p"), [group])
    assert e.value.field == "groups" and e.value.reason == "all equal"
