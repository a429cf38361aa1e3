"""The door of `journeyman serve` under hostile input, with no model loaded: scoped tokens added and
revoked while it runs, bodies capped however they are framed, deadlines for a request's head and
body, registration that cannot re-point the registry or leak server paths, and TLS."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import journeyman as jm
import pytest
from journeyman.backends.server import ServerProcess, create_app
from journeyman.client.wire import PREFIX
from journeyman.serving.api_tokens import TOKENS_FILE, TokenBook
from journeyman.serving.endpoint import ServerThread
from journeyman.serving.guard import Guard, HeaderTimeoutH11, needed_scope

ADMIN = "admin-secret-0123456789abcdef"
LIMIT = 4096


class Door:
    """A server app (no model registered) behind the Guard on 127.0.0.1, and its token book."""

    def __init__(self, path: Path, *, body_timeout_s: float = 30.0) -> None:
        self.path = path
        self.book = TokenBook(path / TOKENS_FILE, admin_secret=ADMIN)
        app = create_app(jm.LocalBackend(path=path), self.book, max_body_bytes=LIMIT)
        self.thread = ServerThread(Guard(app, self.book, LIMIT, body_timeout_s=body_timeout_s))
        self.url = f"http://{self.thread.host}:{self.thread.port}"

    def http(self, secret: str | None = ADMIN) -> httpx.Client:
        headers = {"authorization": f"Bearer {secret}"} if secret else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@pytest.fixture
def door(tmp_path: Path) -> Iterator[Door]:
    d = Door(tmp_path)
    yield d
    d.thread.stop()


def test_scopes_nest_and_each_route_needs_its_own() -> None:
    """sample < train < admin: the OpenAI routes and reads need sample, training train, deletion and
    token management admin; a route nobody listed needs admin."""
    assert needed_scope("/v1/chat/completions") == "sample"
    assert needed_scope(f"{PREFIX}/info") == "sample"
    assert needed_scope(f"{PREFIX}/models/m/captures") == "sample"
    assert needed_scope(f"{PREFIX}/register") == "train"
    assert needed_scope(f"{PREFIX}/models/m/train") == "train"
    assert needed_scope(f"{PREFIX}/models/m/delete_checkpoints") == "admin"
    assert needed_scope(f"{PREFIX}/tokens/someone") == "admin"
    assert needed_scope(f"{PREFIX}/models/m/something_new") == "admin"


def test_named_tokens_are_added_scoped_and_revoked_without_a_restart(door: Door) -> None:
    """A token added over HTTP (admin) or in the file (as `journeyman token add` does) works on the
    next request; its scope holds (403 naming the scope needed); revoked, it gets a 401."""
    with door.http() as admin:
        r = admin.post(f"{PREFIX}/tokens", json={"name": "viewer", "scope": "sample"})
        assert r.status_code == 200, r.text
        viewer_secret = r.json()["token"]
    trainer_secret = TokenBook(door.path / TOKENS_FILE).add("ci-trainer", "train")  # another process's edit
    assert (
        ADMIN not in (door.path / TOKENS_FILE).read_text()
        and viewer_secret not in (door.path / TOKENS_FILE).read_text()
    )

    with door.http(viewer_secret) as viewer:
        assert viewer.get("/v1/models").status_code == 200
        assert viewer.get(f"{PREFIX}/info").status_code == 200
        r = viewer.post(f"{PREFIX}/register", json={"model": {"name": "m", "project": "p"}})
        assert r.status_code == 403 and "'train'" in r.json()["error"]["message"]
        r = viewer.post(f"{PREFIX}/models/m/delete_checkpoints", json={})
        assert r.status_code == 403 and "'admin'" in r.json()["error"]["message"]
    with door.http(trainer_secret) as trainer:
        assert trainer.post(f"{PREFIX}/models/m/delete_checkpoints", json={}).status_code == 403
        assert trainer.get(f"{PREFIX}/tokens").status_code == 403
        assert trainer.post(f"{PREFIX}/models/nope/log", json={}).status_code == 404  # allowed through

    with door.http() as admin:
        listed = admin.get(f"{PREFIX}/tokens").json()
        assert [(t["name"], t["scope"]) for t in listed] == [
            ("env", "admin"),
            ("viewer", "sample"),
            ("ci-trainer", "train"),
        ]
        assert all("sha256" not in t for t in listed)
        assert admin.delete(f"{PREFIX}/tokens/viewer").status_code == 200
        assert admin.delete(f"{PREFIX}/tokens/viewer").status_code == 400  # named: no such token
    with door.http(viewer_secret) as viewer:
        assert viewer.get("/v1/models").status_code == 401


def _raw(door: Door, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send raw bytes on a fresh connection; what the server answers before it closes (or wait_s)."""
    with socket.create_connection((door.thread.host, door.thread.port), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def test_the_body_cap_holds_whatever_the_framing(door: Door) -> None:
    """A small Content-Length beside chunked transfer is refused outright (400); a chunked body is
    counted as read and stopped at the cap (413); a declared length over the cap is refused unread."""
    auth = f"Authorization: Bearer {ADMIN}\r\n".encode()
    chunk = b"x" * 1000
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
    smuggled = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        + auth
        + b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n"
        + body
    )
    answer = _raw(door, smuggled)
    assert answer.startswith(b"HTTP/1.1 400") or answer == b"", answer[:200]  # refused by us or by h11
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Transfer-Encoding: chunked\r\n\r\n"
    )
    assert _raw(door, chunked + body).startswith(b"HTTP/1.1 413")
    with door.http() as admin:
        r = admin.post("/v1/chat/completions", content=b"{" + b" " * (LIMIT + 10) + b"}")
        assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"]


def test_a_request_head_or_body_that_never_comes_is_cut_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slowloris: a connection that never finishes its headers is closed (before any token is
    checked); a body that stops arriving gets a 408. Deadlines are shortened for the test."""
    monkeypatch.setattr(HeaderTimeoutH11, "header_timeout_s", 0.5)
    d = Door(tmp_path, body_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        assert _raw(d, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") == b""
        assert time.monotonic() - t0 < 4
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
        answer = _raw(d, (head + "Content-Length: 100\r\n\r\n{").encode())
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        with d.http() as admin:  # the server still answers
            assert admin.get("/v1/models").status_code == 200
    finally:
        d.thread.stop()


def test_registration_cannot_repoint_a_name_or_leak_server_paths(door: Door) -> None:
    """A name registered under one project is refused under another (400 naming model.project)
    before anything loads; names are checked strictly (a trailing newline is refused); a bad
    base_model is a 400 whose answer is the same whether or not the path exists on the server."""
    (door.path / "server-models.json").write_text(
        json.dumps({"shared": jm.ModelConfig(name="shared", project="first").model_dump(mode="json")})
    )
    with door.http() as admin:
        r = admin.post(f"{PREFIX}/register", json={"model": {"name": "shared", "project": "second"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model.project", r.text
        r = admin.post(f"{PREFIX}/register", json={"model": {"name": "bad\n", "project": "p"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model.name", r.text
        answers = []
        for base in (str(door.path), "/definitely/not/here", "/etc"):
            r = admin.post(
                f"{PREFIX}/register", json={"model": {"name": "m", "project": "p", "base_model": base}}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "model.base_model", r.text
            answers.append(r.json())
            assert base not in r.text
        assert answers[0] == answers[1] == answers[2]
    assert json.loads((door.path / "server-models.json").read_text())["shared"]["project"] == "first"


@pytest.mark.integration
async def test_tls_when_given_a_certificate_and_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`journeyman serve --ssl-certfile --ssl-keyfile` speaks HTTPS: a RemoteBackend that trusts the
    certificate (SSL_CERT_FILE, as httpx reads it) is served; plain HTTP on that port is not."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    server = ServerProcess(
        tmp_path / "run", ADMIN, args=["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    ).start()
    try:
        assert server.url.startswith("https://")
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        backend = jm.RemoteBackend(server.url, token=ADMIN, reconnect_s=1)
        assert (await backend._check_server()).models == []  # pyright: ignore[reportPrivateUsage]
        with pytest.raises(httpx.HTTPError):
            await asyncio.to_thread(httpx.get, server.url.replace("https", "http") + "/v1/models", timeout=5)
    finally:
        server.kill()


@pytest.mark.integration
async def test_a_models_own_endpoint_demands_the_backends_key(served: tuple[object, object]) -> None:
    """Nothing that serves a model listens without a token: the per-model endpoint a LocalBackend
    opens on 127.0.0.1 answers 401 to a request without the backend's key (another local user),
    and serves the key `inference()` hands out. The same name under another project is refused."""
    model, backend = served
    assert isinstance(model, jm.TrainableModel) and isinstance(backend, jm.LocalBackend)
    where = backend.inference(model.name)
    async with httpx.AsyncClient(base_url=where.base_url, timeout=30) as http:
        body = {"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer journeyman"}):
            assert (await http.post("/chat/completions", json=body, headers=headers)).status_code == 401
        r = await http.post(
            "/chat/completions", json=body, headers={"authorization": f"Bearer {where.api_key}"}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["journeyman"]["token_ids"]
    with pytest.raises(jm.InvalidFieldError) as e:
        await backend.register(jm.ModelConfig(name=model.name, project="another-project"))
    assert e.value.field == "model.project"


class _QuickTrainer:
    """A `ServedBackend` stand-in whose training calls take a blink (or wait for `gate`): each call
    makes the next step of the model it names. The server's job table is what is under test."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: dict[str, int] = {}
        self.calls = 0
        self.gate = asyncio.Event()
        self.gate.set()

    def registered(self) -> list[str]:
        return ["ma", "mb"]

    def registered_model(self, name: str) -> jm.ModelConfig:
        if name not in self.registered():
            raise jm.UnknownModelError(name, self.registered())
        return jm.ModelConfig(name=name, project="p")

    def served_names(self) -> list[str]:
        return self.registered()

    async def train(self, model: jm.ModelConfig, **arguments: list[jm.TrajectoryGroup]) -> jm.TrainResult:
        self.calls += 1
        await self.gate.wait()
        (group, *_) = arguments.get("groups") or arguments["trajectories"]  # train's, or train_sft's
        if group.trajectories[0].messages_and_choices[0] == {"role": "user", "content": "boom"}:
            raise jm.InvalidFieldError("groups", "boom", "refused")
        self.steps[model.name] = self.steps.get(model.name, 0) + 1
        return jm.TrainResult(step=self.steps[model.name])

    train_sft = train


def _groups(text: str) -> list[dict[str, object]]:
    t = jm.Trajectory(messages_and_choices=[{"role": "user", "content": text}], reward=1.0)
    return [jm.TrajectoryGroup([t]).model_dump(mode="json")]


async def test_an_idempotency_key_names_one_call_of_one_model_and_operation(tmp_path: Path) -> None:
    """Issue 53: key K on model ma, then K on mb, answered ma's step and trained nothing. The job
    table is keyed by (model, operation, key): mb and ma's train_sft train their own steps; K again on
    ma with the same body reattaches, with another body it is a 409 naming the key, while the call
    runs and after it ran; a failed call's key may be sent again with anything."""
    trainer = _QuickTrainer(tmp_path)
    book = TokenBook(admin_secret=ADMIN)
    app = Guard(create_app(trainer, book), book, LIMIT * 16)  # pyright: ignore[reportArgumentType]
    auth = {"authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", headers=auth
    ) as c:

        async def train(model: str, body: dict[str, object], route: str = "train") -> httpx.Response:
            return await c.post(f"{PREFIX}/models/{model}/{route}", json=body)

        def result(r: httpx.Response) -> object:
            assert r.status_code == 200, r.text
            return json.loads(r.text.splitlines()[-1])["result"]["step"]

        a = {"groups": _groups("a"), "idempotency_key": "K"}
        assert result(await train("ma", a)) == 1
        assert result(await train("mb", {**a, "groups": _groups("b")})) == 1  # its own step, not ma's
        assert result(await train("ma", a)) == 1 and trainer.calls == 2  # a retry: reattached
        sft = {"trajectories": [], "groups": _groups("s"), "idempotency_key": "K"}
        assert result(await train("ma", sft, "train_sft")) == 2  # another operation: another call
        other = await train("ma", {**a, "groups": _groups("other")})
        assert other.status_code == 409, other.text
        error = other.json()["error"]
        assert error["param"] == "idempotency_key" and "another train call to ma" in error["reason"]
        assert trainer.steps == {"ma": 2, "mb": 1} and trainer.calls == 3

        trainer.gate.clear()  # while a call runs under a key, another body under it is refused too
        running = asyncio.create_task(train("mb", {"groups": _groups("slow"), "idempotency_key": "L"}))
        while trainer.calls < 4:
            await asyncio.sleep(0.01)
        refused = await train("mb", {"groups": _groups("fast"), "idempotency_key": "L"})
        assert refused.status_code == 409 and "which runs under it" in refused.json()["error"]["reason"]
        trainer.gate.set()
        assert result(await running) == 2 and trainer.calls == 4

        failed = await train("mb", {"groups": _groups("boom"), "idempotency_key": "M"})
        assert json.loads(failed.text.splitlines()[-1])["kind"] == "error"
        assert result(await train("mb", {"groups": _groups("fixed"), "idempotency_key": "M"})) == 3


def test_captures_are_the_tokens_that_filed_them() -> None:
    """Issue 53: any `sample` token could pop another token's capture by id. An id is filed and found
    under the token whose request is answered (`owned_by`, which `journeyman serve` wraps every request
    in): the same id of two tokens is two captures, in process an id is its own. An id past
    MAX_CAPTURE_ID_CHARS, or a request past MAX_CALLS_PER_CAPTURE, is refused before it is sampled,
    naming the header, and the calls held stay."""
    from journeyman.errors import InvalidFieldError
    from journeyman.rollout.capture import (
        CAPTURE_HEADER,
        MAX_CALLS_PER_CAPTURE,
        MAX_CAPTURE_ID_CHARS,
        CapturedCall,
        Captures,
        capture_key,
        owned_by,
    )

    captures, call = Captures(), CapturedCall(request_messages=[], response={})
    for token in ("alice", "mallory"):
        with owned_by(token), captures.answering(capture_key("ep")):
            captures.add(capture_key("ep"), call)
    with owned_by("mallory"):
        assert captures.pop(capture_key("ep")) == [call]  # her own, once
        assert captures.pop(capture_key("ep")) == []
    assert capture_key("ep") == "ep" and captures.pop("ep") == []  # in process: the bare id
    with owned_by("alice"):
        assert captures.peek(capture_key("ep")) == [call]  # alice's is still there
        with pytest.raises(InvalidFieldError) as e:
            capture_key("x" * (MAX_CAPTURE_ID_CHARS + 1))
        assert e.value.field == CAPTURE_HEADER and "MAX_CAPTURE_ID_CHARS" in e.value.reason
        key = capture_key("ep")
        for _ in range(MAX_CALLS_PER_CAPTURE - 1):
            captures.add(key, call)
        with pytest.raises(InvalidFieldError) as e, captures.answering(key):
            pass
        assert e.value.field == CAPTURE_HEADER and "MAX_CALLS_PER_CAPTURE" in e.value.reason
        assert len(captures.peek(key)) == MAX_CALLS_PER_CAPTURE and not captures.in_flight(key)
        captures.take(key, 2)
        assert len(captures.peek(key)) == MAX_CALLS_PER_CAPTURE - 2
