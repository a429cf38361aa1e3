"""The OpenAPI document `journeyman serve` publishes: behind the token, valid by a real validator
(openapi-spec-validator), and the same as the routes it serves: every route, the operations
table's methods, bodies and scopes, and docs/protocol.md naming every route. No model is loaded."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx
import journeyman as jm
import pytest
from fastapi.routing import APIRoute
from journeyman.backends.server import create_app
from journeyman.client.operations import OPERATIONS
from journeyman.client.wire import PREFIX
from journeyman.serving.guard import Guard, needed_scope
from openapi_spec_validator import validate

ADMIN = "openapi-admin-0123456789abcdef"
PROTOCOL_PAGE = Path(__file__).parents[4] / "docs" / "protocol.md"
HIDDEN = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # FastAPI's own pages


@pytest.fixture(scope="module")
async def served() -> tuple[Any, dict[str, Any]]:
    """(the app, its document as a client fetches it with the admin token)."""
    app = create_app(jm.LocalBackend(path=Path(tempfile.mkdtemp(prefix="journeyman-openapi-"))), ADMIN)
    guarded = Guard(app, ADMIN, 2**20)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://t") as c:
        assert (await c.get("/openapi.json")).status_code == 401  # behind the token, like every route
        r = await c.get("/openapi.json", headers={"x-api-key": ADMIN})
    assert r.status_code == 200
    return app, r.json()


def test_the_document_is_valid_openapi(served) -> None:
    _, doc = served
    validate(doc)  # raises OpenAPIValidationError naming what is wrong
    assert doc["openapi"].startswith("3.1") and {"bearer", "x-api-key"} <= set(
        doc["components"]["securitySchemes"]
    )


def test_every_route_is_documented_and_nothing_else(served) -> None:
    app, doc = served
    routes = {
        (r.path, m.lower())
        for r in app.routes
        if isinstance(r, APIRoute) and r.path not in HIDDEN
        for m in r.methods
    }
    documented = {(p, m) for p, methods in doc["paths"].items() for m in methods}
    assert documented == routes
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert op["x-journeyman-scope"] == needed_scope(path), (path, method)
            assert {"401", "403"} <= set(op["responses"]) and "422" not in op["responses"]
            if method == "post":
                assert op["requestBody"]["content"]["application/json"]["schema"], path


def test_the_operations_table_is_what_the_document_says(served) -> None:
    _, doc = served
    for op in OPERATIONS:
        documented = doc["paths"][PREFIX + op.path][op.http.lower()]
        assert documented["x-journeyman-scope"] == op.scope, op.name
        if op.body is not None:
            schema = documented["requestBody"]["content"]["application/json"]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{op.body.__name__}"}, op.name
            assert set(doc["components"]["schemas"][op.body.__name__]["properties"]) == set(
                op.body.model_fields
            )
        if op.progress_unit is not None:
            assert "application/x-ndjson" in documented["responses"]["200"]["content"], op.name
    messages = doc["paths"]["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert messages == {"$ref": "#/components/schemas/MessagesRequest"}


def test_the_protocol_page_names_every_route(served) -> None:
    _, doc = served
    page = PROTOCOL_PAGE.read_text()
    missing = [
        f"{m.upper()} {p}"
        for p, methods in doc["paths"].items()
        for m in methods
        if f"{m.upper()} `{p}`" not in page
    ]
    assert not missing, f"docs/protocol.md does not document {missing}"
