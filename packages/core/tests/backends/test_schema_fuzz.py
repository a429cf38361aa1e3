"""A schema fuzzer nobody here wrote (schemathesis) against the server's published OpenAPI document,
request bodies included, and a hypothesis fuzzer for the run viewer's routes (not in the document):
no route answers a 5xx to anything they generate, and every 400 names the field.

Stateful: the server is `journeyman serve`'s app on a real socket with the embedded model registered
(most cases name it, so the per-model routes read their bodies and call the backend instead of
answering 404), one captured request and one logged group, so the captures, history and viewer
routes have something to read. Training routes train when a body is valid, live mode starts, a
checkpoint may be served: all on this module's own run directory. Bounded (a fixed, derandomized
budget per route, decoding capped at a couple of tokens) so CI runs the same inputs every time;
test_fuzz.py drives the OpenAI routes' every field on the model."""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from journeyman.app.view.mount import add_viewer
from journeyman.backends.server import create_app
from journeyman.client.wire import PREFIX, LogBody, RegisterBody
from journeyman.data.config import ModelConfig
from journeyman.serving.api_tokens import TOKENS_FILE, TokenBook
from journeyman.serving.endpoint import ServerThread
from journeyman.serving.guard import Guard
from schemathesis.core.result import Ok
from schemathesis.schemas import APIOperation

pytestmark = pytest.mark.integration

ADMIN = "schema-fuzz-admin-0123456789"
AUTH = {"authorization": f"Bearer {ADMIN}"}
MODEL = ModelConfig(name="fuzzed", project="fuzz", max_tokens=2)
MAX_BODY = 2**20
EXAMPLES = 15
# Drawing a body of whole trajectory groups from the schema takes most of this file's time (78 of
# 163 s for the train route, 2026-11-28): fewer of them, each aimed past the name and key checks.
FEWER = {f"POST {PREFIX}/models/{{name}}/train": 8, f"POST {PREFIX}/models/{{name}}/train_sft": 8}
# request fields that set how much is decoded or trained: capped, so a valid body samples a token or
# two, and a valid training call is one short step
DECODE = {"max_tokens": 2, "max_completion_tokens": 2, "max_output_tokens": 2, "n": 2, "top_logprobs": 2}
DECODE.update(epochs=1, batch_size=2)  # and how much a valid training call trains (SFTConfig)


def _app(backend: jm.LocalBackend) -> Guard:
    """The server as `journeyman serve` assembles it, the run viewer included."""
    book = TokenBook(backend.path / TOKENS_FILE, admin_secret=ADMIN)
    app = create_app(backend, book, max_body_bytes=MAX_BODY, routes=lambda app: add_viewer(app, backend.path))
    return Guard(app, book, MAX_BODY)


# The document of a server that loads nothing: every xdist worker collects this file, so collecting
# stays cheap. One pytest parameter per route, named by it: schemathesis' own `parametrize()` gives
# every route the same node id, and pytest-xdist, which schedules by node id, then ran one route of
# 21 (2026-11-26).
def _operations() -> list[APIOperation]:
    app = _app(jm.LocalBackend(path=Path(tempfile.mkdtemp(prefix="journeyman-schema-fuzz-"))))
    schema = schemathesis.openapi.from_dict(app.app.openapi())  # pyright: ignore[reportAttributeAccessIssue]
    found = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # a route the fuzzer cannot read fails here, never skipped
        found.append(result.ok())
    return found


OPERATIONS = _operations()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's URL, its model registered, one request captured and one group logged."""
    backend = jm.LocalBackend(path=tmp_path_factory.mktemp("schema-fuzz"))
    thread = ServerThread(_app(backend))
    url = f"http://{thread.host}:{thread.port}"
    try:
        with requests.Session() as http:
            http.headers.update(AUTH)
            r = http.post(url + PREFIX + "/register", data=RegisterBody(model=MODEL).model_dump_json())
            assert r.status_code == 200, r.text
            hi = [{"role": "user", "content": "hi"}]
            r = http.post(
                url + "/v1/chat/completions",
                json={"model": MODEL.name, "messages": hi},
                headers={"x-journeyman-capture": "fuzz-episode"},
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            group = jm.TrajectoryGroup(
                [jm.Trajectory(messages_and_choices=[*hi, choice], reward=r) for r in (0.0, 1.0)]
            )
            r = http.post(
                f"{url}{PREFIX}/models/{MODEL.name}/log",
                data=LogBody(groups=[group], split="val").model_dump_json(),
            )
            assert r.status_code == 200, r.text
        yield url
    finally:
        thread.stop()
        backend.close()


KEYS = itertools.count()


def _aim(case: Any, data: st.DataObject) -> None:
    """Most cases name the served model (a random name is a 404 before the body is read), carry a
    valid idempotency key and decode a token or two; a register names the served model again
    (another name would load another model)."""
    if "name" in (case.path_parameters or {}) and data.draw(st.integers(0, 3), label="aim") > 0:
        case.path_parameters["name"] = MODEL.name
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path == PREFIX + "/register":
        model = body.get("model")
        if isinstance(model, dict):
            model.update(name=MODEL.name, project=MODEL.project)
            if not isinstance(model.get("max_tokens"), int) or model["max_tokens"] > 2:
                model["max_tokens"] = 2
    elif case.path.startswith("/v1/") and data.draw(st.integers(0, 3), label="aim body") > 0:
        body["model"] = MODEL.name
    if "idempotency_key" in body and data.draw(st.integers(0, 3), label="aim key") > 0:
        body["idempotency_key"] = f"fuzz-{next(KEYS)}"  # a new step each time, past the key's check
    for where in (body, body.get("config")):  # a training call's config: one pass over its data
        for key, most in DECODE.items():
            value = where.get(key) if isinstance(where, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                where[key] = most


def _check(method: str, path: str, r: requests.Response, sent: Any) -> None:
    """No 5xx; a 400 names the field (`error.param`; Anthropic's shape has none: its message does)."""
    assert r.status_code < 500, (method, path, r.status_code, r.text[:300], sent)
    if r.status_code == 400:
        error = r.json()["error"]
        named = error["message"] if path == "/v1/messages" else error.get("param")
        assert named, (method, path, r.text[:300], sent)


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_no_route_answers_a_server_error(server: str, operation: APIOperation) -> None:
    @settings(
        max_examples=FEWER.get(operation.label, EXAMPLES),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def property_(data: st.DataObject) -> None:
        case = data.draw(operation.as_strategy())
        _aim(case, data)
        response = case.call(base_url=server, headers=AUTH, timeout=120)
        _check(case.method, case.path, response, (case.path_parameters, case.query, case.body))

    property_()


# the viewer's API: a run, a split, a step, a group, a trajectory; its pages and static files
segment = st.sampled_from(
    ["0", "1", "-1", "val", "train", "..", "%2e%2e", "x" * 300, "0000", "9" * 30]
) | st.text(max_size=12)
query_value = st.sampled_from(["0", "1", "-1", "50", "100000", "x", "1e3", "", "9" * 40]) | st.text(
    max_size=8
)


@st.composite
def view_paths(draw: st.DrawFn, run: str, step: str) -> str:
    """A viewer path under a real run (or none), a real step among the segments after it."""
    head = draw(
        st.sampled_from(
            [
                "/view",
                "/view/",
                "/view/index.html",
                "/view/api/runs",
                f"/view/api/runs/{run}/history",
                f"/view/api/runs/{run}/version",
                f"/view/api/runs/{run}/steps",
                f"/view/api/runs/{run}/step",
                f"/view/api/runs/{run}/trajectory",
                "/view/api/runs/nope/steps",
                "/view/api",
            ]
        )
    )
    tail = draw(st.lists(segment | st.just(step), max_size=4))
    query = draw(
        st.dictionaries(st.sampled_from(["split", "offset", "limit", "token", "x"]), query_value, max_size=3)
    )
    return "/".join([head, *tail]) + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


def test_the_run_viewer_answers_no_server_error(server: str) -> None:
    with requests.Session() as http:
        http.headers.update(AUTH)
        (run,) = [r["id"] for r in http.get(server + "/view/api/runs").json()]
        (logged,) = http.get(f"{server}/view/api/runs/{run}/steps?split=val").json()["items"]
        group = http.get(f"{server}/view/api/runs/{run}/trajectory/val/{logged['name']}/0/1")
        assert group.status_code == 200, group.text[:300]  # the fuzzer reaches a real file

        @settings(max_examples=EXAMPLES * 4, deadline=None, derandomize=True, database=None)
        @given(view_paths(run, logged["name"]))
        def property_(path: str) -> None:
            _check("GET", path, http.get(server + path, timeout=60, allow_redirects=False), path)

        property_()


def test_every_route_is_fuzzed() -> None:
    assert len({op.label for op in OPERATIONS}) == len(OPERATIONS) >= 22
