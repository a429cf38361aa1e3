"""Tenants on one `journeyman serve`: an API token scoped to models (`ApiToken.models`) touches those
alone. One real server (a child process with the viewer, as the CLI starts it) for the module, two
models on the embedded base: `alpha`, the tenant's, and `beta`, another's. Every way of naming a
model (the OpenAI routes' body, a Backend route's path, registration, the viewer's run ids) is
refused for `beta` with a 403 naming it and the token, and works for `alpha`."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import journeyman as jm
import pytest
from journeyman.app.cli import app as cli
from journeyman.backends.server import ServerProcess
from journeyman.client.wire import PREFIX
from journeyman.serving.api_tokens import TOKENS_FILE, TokenBook
from typer.testing import CliRunner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MINE, THEIRS = "alpha", "beta"
TENANT = "alpha-team"
PROMPT = [{"role": "user", "content": "Name one colour."}]


@dataclass
class Tenancy:
    server: ServerProcess
    tenant: str  # the secret of TENANT: scope train, models [MINE]
    base: str  # the base model's own name, as /v1/models lists it to an unscoped token

    def http(self, secret: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.server.url, headers={"authorization": f"Bearer {secret}"}, timeout=120
        )


@pytest.fixture(scope="module")
def tenancy(remote_server: ServerProcess) -> Iterator[Tenancy]:
    with httpx.Client(
        base_url=remote_server.url, headers={"authorization": f"Bearer {remote_server.token}"}, timeout=300
    ) as admin:
        r = admin.post(f"{PREFIX}/register", json={"model": {"name": THEIRS, "project": "tenants"}})
        assert r.status_code == 200, r.text
        # the tenant's token, added over HTTP (as an admin's script would), scoped to a model not yet registered
        r = admin.post(f"{PREFIX}/tokens", json={"name": TENANT, "scope": "train", "models": [MINE]})
        assert r.status_code == 200, r.text
        assert r.json()["models"] == [MINE]
        listed = [m["id"] for m in admin.get("/v1/models").json()["data"]]
    (base,) = [n for n in listed if not n.startswith(THEIRS)]
    yield Tenancy(remote_server, r.json()["token"], base)


@pytest.fixture(scope="module")
async def mine(tenancy: Tenancy) -> AsyncIterator[jm.TrainableModel]:
    """`alpha`, registered by the tenant itself through the real client."""
    backend = jm.RemoteBackend(tenancy.server.url, token=tenancy.tenant, progress=False)
    model = jm.TrainableModel(name=MINE, project="tenants")
    await model.register(backend)
    yield model
    backend.close()


def _refused(r: httpx.Response, model: str = THEIRS) -> None:
    """A 403 in the route's dialect that names the model and the token."""
    assert r.status_code == 403, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert repr(model) in message and repr(TENANT) in message, message
    assert r.json()["error"]["type"] == "forbidden"


def test_the_tenant_cannot_sample_another_model_by_any_name_or_route(tenancy: Tenancy) -> None:
    with tenancy.http(tenancy.tenant) as c:
        for name in (THEIRS, f"{THEIRS}@0", tenancy.base, "never-registered"):
            _refused(c.post("/v1/chat/completions", json={"model": name, "messages": PROMPT}), name)
        _refused(c.post("/v1/chat/completions", json={"model": THEIRS, "messages": PROMPT, "stream": True}))
        _refused(c.post("/v1/responses", json={"model": THEIRS, "input": "Hi"}))
        r = c.post("/v1/messages", json={"model": THEIRS, "max_tokens": 4, "messages": PROMPT})
        assert r.status_code == 403 and r.json()["type"] == "error"  # Anthropic's shape on its route
        assert (
            repr(THEIRS) in r.json()["error"]["message"] and r.json()["error"]["type"] == "permission_error"
        )


def test_the_tenant_cannot_read_train_or_capture_another_model(tenancy: Tenancy) -> None:
    model = f"{PREFIX}/models/{THEIRS}"
    with tenancy.http(tenancy.tenant) as c:
        for path in ("step", "history", "run_dir", "live_status"):
            _refused(c.get(f"{model}/{path}"))
        _refused(c.post(f"{model}/captures", json={"capture_ids": ["x"]}))
        _refused(c.post(f"{model}/outcome", json={"episode_id": "x", "reward": 1.0}))
        _refused(c.post(f"{model}/train", json={"groups": [], "idempotency_key": "k"}))
        _refused(c.post(f"{model}/train_sft", json={"trajectories": [], "idempotency_key": "k"}))
        _refused(c.post(f"{model}/log", json={"metrics": {"x": 1.0}}))
        _refused(c.post(f"{model}/serve_step", json={"step": 0}))
        _refused(c.post(f"{model}/live", json={}))
        _refused(c.post(f"{PREFIX}/register", json={"model": {"name": THEIRS, "project": "tenants"}}))
        _refused(
            c.post(f"{PREFIX}/register", json={"model": {"name": "gamma", "project": "tenants"}}), "gamma"
        )
        _refused(c.post(f"{model}/decide", json={"action": "reject"}))
        # a model's checkpoints are its tenant's (scope train): another's is refused by its name
        _refused(c.post(f"{model}/delete_checkpoints", json={}))


def test_the_tenant_cannot_distill_from_another_model_or_a_path(
    tenancy: Tenancy, mine: jm.TrainableModel
) -> None:
    """A teacher is read by the server for the caller: another tenant's model is refused by its name
    (training or live), and a base or checkpoint path or a URL the server would open, outright."""
    train = f"{PREFIX}/models/{mine.name}/train"
    with tenancy.http(tenancy.tenant) as c:
        theirs = {"distill": {"teacher": {"model": THEIRS}}}
        _refused(c.post(train, json={"groups": [], "idempotency_key": "k", "config": theirs}))
        live = {"train": {"advantages": "given", **theirs}}
        _refused(c.post(f"{PREFIX}/models/{mine.name}/live", json={"config": live}))
        for teacher in (
            {"base_model": "smollm2-135m-instruct", "checkpoint": "/srv/runs/beta/checkpoints/0001"},
            {"base_url": "http://10.0.0.1:8000/v1", "model": "internal"},
        ):
            body = {"groups": [], "idempotency_key": "k", "config": {"distill": {"teacher": teacher}}}
            r = c.post(train, json=body)
            assert r.status_code == 403 and "config.distill.teacher" in r.text, r.text


async def test_the_tenant_does_all_of_its_own(tenancy: Tenancy, mine: jm.TrainableModel) -> None:
    """Registered by the tenant: sampled (the captured call popped back), trained, logged, its step
    and history read, its step served, its live training started and an outcome reported."""
    async with mine.capture() as cap:
        response = await mine.openai_client().chat.completions.create(
            model=MINE, messages=[{"role": "user", "content": "Name one colour."}], n=2, seed=5, max_tokens=4
        )
    assert len(cap.calls) == 1 and len(response.choices) == 2
    groups = [
        jm.TrajectoryGroup(
            jm.Trajectory(messages_and_choices=[*PROMPT, c], reward=float(i))
            for i, c in enumerate(response.choices)
        )
    ]
    result = await mine.train(groups, config=jm.TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and await mine.get_step() == 1
    assert (await mine.log(groups, split="val"))["trajectories"] == 2
    assert [h["trained_by"] for h in await mine.history() if h["split"] == "train"] == [TENANT]
    model = f"{PREFIX}/models/{MINE}"
    with tenancy.http(tenancy.tenant) as c:
        for name in (MINE, f"{MINE}@1"):
            r = c.post("/v1/chat/completions", json={"model": name, "messages": PROMPT, "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert c.post(f"{model}/serve_step", json={"step": 1}).status_code == 200
        assert c.post(f"{model}/live", json={}).status_code == 200
        episode = {"x-journeyman-capture": "e1"}  # one live episode: a call, then its outcome
        body = {"model": MINE, "messages": PROMPT, "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=body, headers=episode).status_code == 200
        r = c.post(f"{model}/outcome", json={"episode_id": "e1", "reward": 1.0})
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.text


async def test_the_tenant_deletes_its_own_checkpoints_and_no_others(
    tenancy: Tenancy, mine: jm.TrainableModel
) -> None:
    """Scope train is enough for a tenant's own model (its runs are its business); a sample token
    scoped to it is refused by scope, and an unscoped train token still needs admin for any model."""
    assert await mine.get_step() >= 1  # trained above: a checkpoint to keep or delete
    with tenancy.http(tenancy.tenant) as c:
        r = c.post(f"{PREFIX}/models/{MINE}/delete_checkpoints", json={})
        assert r.status_code == 200 and isinstance(r.json(), list), r.text
        _refused(c.post(f"{PREFIX}/models/{THEIRS}/delete_checkpoints", json={}))
    with tenancy.http(tenancy.server.token) as admin:
        secrets_by_name = {}
        for name, scope, models in (("reader", "sample", [MINE]), ("trainer", "train", None)):
            r = admin.post(f"{PREFIX}/tokens", json={"name": name, "scope": scope, "models": models})
            assert r.status_code == 200, r.text
            secrets_by_name[name] = r.json()["token"]
    for name, needed in (("reader", "'train'"), ("trainer", "'admin'")):
        with tenancy.http(secrets_by_name[name]) as c:
            r = c.post(f"{PREFIX}/models/{MINE}/delete_checkpoints", json={})
            assert r.status_code == 403 and needed in r.json()["error"]["message"], (name, r.text)


def test_a_response_made_for_another_model_cannot_be_continued(tenancy: Tenancy) -> None:
    """No response is stored (`previous_response_id` is refused as unsupported), and a tenant naming
    another's model with it is refused by the model first, streamed or not: nothing of the other
    tenant's response comes back either way."""
    with tenancy.http(tenancy.server.token) as admin:
        r = admin.post("/v1/responses", json={"model": THEIRS, "input": "Hi", "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        theirs = r.json()
    with tenancy.http(tenancy.tenant) as c:
        for stream in (False, True):
            body = {"model": THEIRS, "input": "Go on", "previous_response_id": theirs["id"], "stream": stream}
            _refused(c.post("/v1/responses", json=body))
        body = {"model": MINE, "input": "Go on", "previous_response_id": theirs["id"]}
        r = c.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
        assert theirs["output"][-1]["id"] not in r.text
        # another route's body that is wrong besides naming another tenant's model: the model's 403
        _refused(c.post("/v1/chat/completions", json={"model": THEIRS, "messages": PROMPT, "n": 0}))


async def test_models_and_info_list_the_tenants_models_alone(
    tenancy: Tenancy, mine: jm.TrainableModel
) -> None:
    with tenancy.http(tenancy.tenant) as c:
        listed = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert MINE in listed and all(n.split("@")[0] == MINE for n in listed), listed
        assert c.get(f"{PREFIX}/info").json()["models"] == [MINE]
        r = c.get(f"{PREFIX}/models/{MINE}/step")
        assert r.status_code == 200
    with tenancy.http(tenancy.server.token) as admin:  # an unscoped token sees every tenant
        listed = [m["id"] for m in admin.get("/v1/models").json()["data"]]
        assert {MINE, THEIRS, tenancy.base} <= set(listed)


async def test_the_viewer_shows_the_tenant_its_runs_alone(tenancy: Tenancy, mine: jm.TrainableModel) -> None:
    with tenancy.http(tenancy.server.token) as admin:
        runs = {r["name"]: r["id"] for r in admin.get("/view/api/runs").json()}
    assert {MINE, THEIRS} <= set(runs)
    with tenancy.http(tenancy.tenant) as c:
        assert [r["name"] for r in c.get("/view/api/runs").json()] == [MINE]
        _refused(c.get(f"/view/api/runs/{runs[THEIRS]}/history"))
        _refused(c.get(f"/view//api/runs/{runs[THEIRS]}/version"))  # however the path is spelled
        r = c.get(f"/view/api/runs/{runs[MINE]}/history")
        assert r.status_code == 200 and r.json(), r.text
        assert c.get("/view/").status_code == 200  # the pages themselves name no model


def test_a_hand_written_admin_token_with_models_stays_in_them(tenancy: Tenancy) -> None:
    """`add` refuses admin with models; a tokens.json edited by hand to hold one loads, and the
    token still touches its models alone and cannot manage tokens (every tenant's)."""
    secret = secrets.token_urlsafe(24)
    path = tenancy.server.path / TOKENS_FILE
    raw = json.loads(path.read_text())
    raw.append(
        {
            "name": TENANT + "-admin",
            "scope": "admin",
            "sha256": hashlib.sha256(secret.encode()).hexdigest(),
            "models": [MINE],
        }
    )
    path.write_text(json.dumps(raw))
    with tenancy.http(secret) as c:
        r = c.post(f"{PREFIX}/models/{THEIRS}/delete_checkpoints", json={})
        assert r.status_code == 403 and repr(THEIRS) in r.json()["error"]["message"], r.text
        r = c.get(f"{PREFIX}/tokens")
        assert r.status_code == 403 and "unscoped" in r.json()["error"]["message"], r.text
        assert c.post(f"{PREFIX}/tokens", json={"name": "x", "scope": "sample"}).status_code == 403
        assert c.delete(f"{PREFIX}/tokens/{TENANT}").status_code == 403
    with tenancy.http(tenancy.tenant) as c:  # the tenant's token survives the hand edit and its refusals
        assert c.get(f"{PREFIX}/models/{MINE}/run_dir").status_code == 200


def test_an_old_tokens_file_without_models_loads_and_reaches_every_model(
    tenancy: Tenancy, tmp_path: Path
) -> None:
    old = [
        {
            "name": "ci",
            "scope": "sample",
            "sha256": hashlib.sha256(b"old-secret-0123456789").hexdigest(),
            "created_at": 1.0,
        }
    ]
    (tmp_path / TOKENS_FILE).write_text(json.dumps(old))
    (token,) = TokenBook(tmp_path / TOKENS_FILE).tokens()
    assert token.name == "ci" and token.models is None
    # the same, in the running server's file: that token samples and reads either tenant's model
    path = tenancy.server.path / TOKENS_FILE
    path.write_text(json.dumps([*json.loads(path.read_text()), {**old[0], "name": "old-ci"}]))
    with tenancy.http("old-secret-0123456789") as c:
        assert c.get(f"{PREFIX}/models/{THEIRS}/step").status_code == 200
        assert THEIRS in [m["id"] for m in c.get("/v1/models").json()["data"]]


def test_adding_an_admin_token_with_models_is_refused_naming_the_field(
    tenancy: Tenancy, tmp_path: Path
) -> None:
    with tenancy.http(tenancy.server.token) as admin:
        r = admin.post(f"{PREFIX}/tokens", json={"name": "boss", "scope": "admin", "models": [MINE]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "models", r.text
        r = admin.post(f"{PREFIX}/tokens", json={"name": "nobody", "scope": "sample", "models": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "models", r.text
        names = [t["name"] for t in admin.get(f"{PREFIX}/tokens").json()]
        assert "boss" not in names and "nobody" not in names
    out = CliRunner().invoke(
        cli, ["token", "add", "boss", "--scope", "admin", "--models", MINE, "--path", str(tmp_path)]
    )
    assert out.exit_code != 0 and "--models" in out.output and "admin" in out.output, out.output
    out = CliRunner().invoke(
        cli,
        ["token", "add", "ops", "--scope", "train", "--models", f"{MINE},{THEIRS}", "--path", str(tmp_path)],
    )
    assert out.exit_code == 0, out.output
    out = CliRunner().invoke(cli, ["token", "list", "--path", str(tmp_path)])
    assert out.exit_code == 0 and "ops\ttrain" in out.output and f"{MINE},{THEIRS}" in out.output, out.output


async def test_metrics_show_each_token_its_models_alone(tenancy: Tenancy, mine: jm.TrainableModel) -> None:
    """`/metrics` in Prometheus' text format, behind the token like every route: request latency by
    route template (no model names in it), and per-model series; a tenant's token sees its models'."""
    from prometheus_client.parser import text_string_to_metric_families

    with tenancy.http(tenancy.tenant) as c:
        assert (
            c.post(
                "/v1/chat/completions", json={"model": MINE, "messages": PROMPT, "max_tokens": 2}
            ).status_code
            == 200
        )
        mine_only = c.get("/metrics")
    with tenancy.http(tenancy.server.token) as admin:
        every = admin.get("/metrics")
    with httpx.Client(base_url=tenancy.server.url, timeout=60) as anonymous:
        assert anonymous.get("/metrics").status_code == 401
    assert every.status_code == 200 and every.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(every.text)}
    served = {s.labels["model"]: s.value for s in families["journeyman_requests_served"].samples}
    assert served[MINE] >= 1 and THEIRS in served
    assert {s.labels["model"] for s in families["journeyman_step"].samples} == {MINE, THEIRS}
    routes = {s.labels["route"] for s in families["journeyman_request_seconds"].samples}
    assert "/v1/chat/completions" in routes and not any(MINE in r or THEIRS in r for r in routes), routes
    assert families["journeyman_engine_decode_mixed_steps"].samples  # the two models share one engine
    assert mine_only.status_code == 200 and f'model="{MINE}"' in mine_only.text
    assert f'model="{THEIRS}"' not in mine_only.text
