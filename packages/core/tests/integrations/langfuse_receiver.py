"""A local stand-in for the Langfuse server's public API, for tests of the real Langfuse SDK.

A real Langfuse server cannot run on this machine (containers only, ClickHouse 25+). This server
speaks exactly the endpoints the SDK 5.x calls, read from its source:

    POST /api/public/otel/v1/traces   OTLP protobuf (gzip), Basic auth -> decoded spans -> observations
    POST /api/public/scores           a JSON list of scores -> 202 {"message": "Accepted"}
    GET  /api/public/v2/observations  field groups, expandMetadata, cursor, query filters or `filter` JSON
    GET  /api/public/v3/scores        name/traceId/source/queueId/dataType filters, field groups, cursor

It keeps what the SDK sent (`spans`, `score_posts`) for tests to assert on, and turns spans into
observations the way the server documents it: observation type from `langfuse.observation.type`,
trace name/tags/session from the `langfuse.trace.*` attributes, metadata values decoded and
truncated to 200 characters unless named in `expandMetadata`, input/output as raw strings.
Anything else is answered 404 and recorded in `unknown`, so a test sees an unexpected call.
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from journeyman.serving.endpoint import ServerThread
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

OBS_META = "langfuse.observation.metadata."
TRACE_META = "langfuse.trace.metadata."
FIELD_GROUPS = {
    "core": ["id", "traceId", "startTime", "endTime", "projectId", "parentObservationId", "type"],
    "basic": [
        "name",
        "level",
        "statusMessage",
        "version",
        "environment",
        "bookmarked",
        "public",
        "userId",
        "sessionId",
        "isRootObservation",
    ],
    "time": ["completionStartTime", "createdAt", "updatedAt"],
    "io": ["input", "output"],
    "metadata": ["metadata"],
    "model": ["model", "internalModelId", "modelParameters"],
    "usage": ["usageDetails", "costDetails", "totalCost"],
    "prompt": ["promptId", "promptName", "promptVersion"],
    "metrics": ["latency", "timeToFirstToken"],
    "trace_context": ["tags", "release", "traceName"],
}
SCORE_GROUPS = {"details", "subject", "annotation"}


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat().replace("+00:00", "Z")


def _parse_time(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def _json_or_raw(s: Any) -> Any:
    if not isinstance(s, str):
        return s
    try:
        return json.loads(s)
    except ValueError:
        return s


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"message": message}, status_code=status)


class LangfuseReceiver:
    """Start with `LangfuseReceiver(public_key, secret_key)`; `host` is the SDK's base URL."""

    def __init__(self, public_key: str = "pk-lf-test", secret_key: str = "sk-lf-test") -> None:
        self.public_key, self.secret_key = public_key, secret_key
        self.lock = threading.Lock()
        self.spans: list[dict[str, Any]] = []  # every span as the SDK sent it (decoded)
        self.observations: dict[tuple[str, str], dict[str, Any]] = {}  # (traceId, id) -> stored observation
        self.traces: dict[str, dict[str, Any]] = {}  # traceId -> name, tags, sessionId, ...
        self.scores: list[dict[str, Any]] = []
        self.score_posts: list[list[dict[str, Any]]] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, query)
        self.unknown: list[str] = []
        self.server = ServerThread(self._app())
        self.host = f"http://{self.server.host}:{self.server.port}"

    def stop(self) -> None:
        self.server.stop()

    # -- test helpers -------------------------------------------------------------------------------
    def add_review_score(
        self,
        trace_id: str,
        name: str,
        value: float | str | bool,
        *,
        queue_id: str = "queue-1",
        author: str = "reviewer-1",
        data_type: str | None = None,
    ) -> dict[str, Any]:
        """A score as a person leaves it in the Langfuse UI (annotation queue): source ANNOTATION."""
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        dtype = data_type or (
            "BOOLEAN" if isinstance(value, bool) else "CATEGORICAL" if isinstance(value, str) else "NUMERIC"
        )
        score = {
            "id": f"ann-{len(self.scores)}",
            "traceId": trace_id,
            "name": name,
            "value": float(value) if isinstance(value, bool) else value,
            "dataType": dtype,
            "source": "ANNOTATION",
            "queueId": queue_id,
            "authorUserId": author,
            "timestamp": now,
        }
        with self.lock:
            self.scores.append(self._stored_score(score, "ANNOTATION"))
        return score

    def roots(self) -> list[dict[str, Any]]:
        with self.lock:
            return [o for o in self.observations.values() if o["isRootObservation"]]

    def trace_observations(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return sorted(
                (o for (t, _), o in self.observations.items() if t == trace_id), key=lambda o: o["_start_ns"]
            )

    # -- server -------------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        expected = "Basic " + base64.b64encode(f"{self.public_key}:{self.secret_key}".encode()).decode()
        return request.headers.get("authorization") == expected

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Response:
            with self.lock:
                self.requests.append((request.method, request.url.path, dict(request.query_params)))
            if not self._authorized(request):
                return _error(401, "Invalid credentials")
            return await call_next(request)

        @app.post("/api/public/otel/v1/traces")
        async def otel(request: Request) -> Response:
            body = await request.body()
            if request.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if request.headers.get("content-type") != "application/x-protobuf":
                return _error(400, "expected application/x-protobuf")
            req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            self._ingest(req)
            return Response(
                trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                media_type="application/x-protobuf",
            )

        @app.post("/api/public/scores")
        async def post_scores(request: Request) -> Response:
            batch = await request.json()
            if not isinstance(batch, list):
                return _error(400, "expected a list of scores")
            for s in batch:
                if (
                    not s.get("name")
                    or "value" not in s
                    or not (s.get("traceId") or s.get("sessionId") or s.get("datasetRunId"))
                ):
                    return _error(400, f"invalid score {s}")
            with self.lock:
                self.score_posts.append(batch)
                self.scores.extend(self._stored_score(s, "API") for s in batch)
            return JSONResponse({"message": "Accepted"}, status_code=202)

        @app.get("/api/public/v2/observations")
        async def observations(request: Request) -> Response:
            return self._list_observations(
                dict(request.query_params), request.query_params.getlist("environment")
            )

        @app.get("/api/public/v3/scores")
        async def scores(request: Request) -> Response:
            return self._list_scores(dict(request.query_params))

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def unknown(path: str, request: Request) -> Response:
            with self.lock:
                self.unknown.append(f"{request.method} /{path}")
            return _error(404, "not served by the test receiver")

        return app

    # -- ingestion ----------------------------------------------------------------------------------
    def _ingest(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in req.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    scope = {kv.key: _value(kv.value) for kv in ss.scope.attributes}
                    for span in ss.spans:
                        attrs = {kv.key: _value(kv.value) for kv in span.attributes}
                        decoded = {
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex() or None,
                            "name": span.name,
                            "start_ns": span.start_time_unix_nano,
                            "end_ns": span.end_time_unix_nano,
                            "attributes": attrs,
                            "scope": {"name": ss.scope.name, **scope},
                            "resource": resource,
                        }
                        self.spans.append(decoded)
                        self._observe(decoded)

    def _observe(self, span: dict[str, Any]) -> None:
        a = span["attributes"]
        tid = span["trace_id"]
        trace = self.traces.setdefault(
            tid, {"name": None, "tags": [], "sessionId": None, "userId": None, "metadata": {}}
        )
        if a.get("langfuse.trace.name"):
            trace["name"] = a["langfuse.trace.name"]
        for tag in a.get("langfuse.trace.tags") or []:
            if tag not in trace["tags"]:
                trace["tags"].append(tag)
        trace["sessionId"] = a.get("session.id") or trace["sessionId"]
        trace["userId"] = a.get("user.id") or trace["userId"]
        trace["metadata"].update(
            {k[len(TRACE_META) :]: _json_or_raw(v) for k, v in a.items() if k.startswith(TRACE_META)}
        )
        is_root = span["parent_span_id"] is None or bool(
            a.get("langfuse.internal.as_root") or a.get("langfuse.internal.is_app_root")
        )
        if is_root and trace["name"] is None:
            trace["name"] = span["name"]
        self.observations[(tid, span["span_id"])] = {
            "_start_ns": span["start_ns"],
            "id": span["span_id"],
            "traceId": tid,
            "startTime": _iso(span["start_ns"]),
            "endTime": _iso(span["end_ns"]),
            "projectId": "test-project",
            "parentObservationId": span["parent_span_id"],
            "type": str(a.get("langfuse.observation.type", "span")).upper(),
            "name": span["name"],
            "level": a.get("langfuse.observation.level", "DEFAULT"),
            "statusMessage": a.get("langfuse.observation.status_message"),
            "version": a.get("langfuse.version"),
            "environment": a.get("langfuse.environment")
            or span["resource"].get("langfuse.environment")
            or "default",
            "bookmarked": False,
            "public": False,
            "isRootObservation": is_root,
            "createdAt": _iso(span["end_ns"]),
            "updatedAt": _iso(span["end_ns"]),
            "completionStartTime": None,
            "input": a.get("langfuse.observation.input"),
            "output": a.get("langfuse.observation.output"),
            # the server decodes the SDK's JSON-encoded values; strings come back as strings
            "metadata": {k[len(OBS_META) :]: _json_or_raw(v) for k, v in a.items() if k.startswith(OBS_META)},
            "model": a.get("langfuse.observation.model.name"),
            "modelParameters": _json_or_raw(a.get("langfuse.observation.model.parameters")),
            "usageDetails": _json_or_raw(a.get("langfuse.observation.usage_details")) or {},
            "costDetails": _json_or_raw(a.get("langfuse.observation.cost_details")) or {},
        }

    def _stored_score(self, s: dict[str, Any], source: str) -> dict[str, Any]:
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        value = s["value"]
        dtype = s.get("dataType") or ("CATEGORICAL" if isinstance(value, str) else "NUMERIC")
        return {
            "id": s.get("id") or f"score-{len(self.scores)}",
            "projectId": "test-project",
            "name": s["name"],
            "value": value,
            "dataType": dtype,
            "source": source,
            "timestamp": s.get("timestamp") or now,
            "environment": s.get("environment") or "default",
            "createdAt": now,
            "updatedAt": now,
            "comment": s.get("comment"),
            "configId": s.get("configId"),
            "metadata": s.get("metadata"),
            "authorUserId": s.get("authorUserId"),
            "queueId": s.get("queueId"),
            "traceId": s.get("traceId"),
            "observationId": s.get("observationId"),
            "sessionId": s.get("sessionId"),
        }

    # -- reads --------------------------------------------------------------------------------------
    def _list_observations(self, q: dict[str, str], environments: list[str]) -> Response:
        if q.get("parseIoAsJson") == "true":
            return _error(400, "parseIoAsJson is deprecated")
        limit = int(q.get("limit", 50))
        if not 1 <= limit <= 1000:
            return _error(400, "limit must be 1..1000")
        groups = [g.strip() for g in q.get("fields", "core,basic").split(",") if g.strip()]
        if unknown := [g for g in groups if g not in FIELD_GROUPS]:
            return _error(400, f"unknown field groups {unknown}")
        expand = {k for k in q.get("expandMetadata", "").split(",") if k}
        with self.lock:
            rows = [(o, self.traces.get(o["traceId"], {})) for o in self.observations.values()]
        try:
            if "filter" in q:
                conditions = json.loads(q["filter"])
                rows = [(o, t) for o, t in rows if all(self._match(o, t, c) for c in conditions)]
            else:
                rows = [(o, t) for o, t in rows if self._match_params(o, t, q, environments)]
        except (KeyError, ValueError, TypeError) as e:
            return _error(400, f"bad filter: {e}")
        rows.sort(key=lambda r: r[0]["_start_ns"], reverse=True)
        offset = int(base64.urlsafe_b64decode(q["cursor"]).decode()) if q.get("cursor") else 0
        page = rows[offset : offset + limit]
        keys = [k for g in ["core", *groups] for k in FIELD_GROUPS[g]]
        data = []
        for o, t in page:
            # the trace's session and user, as Langfuse's observations carry them (field group "basic")
            full = {
                **o,
                "tags": t.get("tags", []),
                "traceName": t.get("name"),
                "release": None,
                "sessionId": t.get("sessionId"),
                "userId": t.get("userId"),
            }
            item = {k: full.get(k) for k in keys}
            if "metadata" in item:
                item["metadata"] = {k: self._meta_value(v, k in expand) for k, v in o["metadata"].items()}
            data.append(item)
        meta: dict[str, Any] = {}
        if offset + limit < len(rows):
            meta["cursor"] = base64.urlsafe_b64encode(str(offset + limit).encode()).decode()
        return JSONResponse({"data": data, "meta": meta})

    @staticmethod
    def _meta_value(v: Any, expanded: bool) -> Any:
        text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        return text if expanded or len(text) <= 200 else text[:200]

    @staticmethod
    def _column(o: dict[str, Any], t: dict[str, Any], column: str) -> Any:
        if column in ("traceTags", "tags"):
            return t.get("tags", [])
        if column == "traceName":
            return t.get("name")
        if column in ("startTime", "endTime"):
            return _parse_time(o[column])
        if column in (
            "id",
            "type",
            "name",
            "traceId",
            "environment",
            "level",
            "userId",
            "sessionId",
            "isRootObservation",
            "version",
            "model",
        ):
            return o.get(column)
        raise KeyError(f"column {column!r} is not supported")

    def _match(self, o: dict[str, Any], t: dict[str, Any], c: dict[str, Any]) -> bool:
        kind, column, op, value = c["type"], c["column"], c["operator"], c.get("value")
        if kind == "stringObject" and column == "metadata":
            v = o["metadata"].get(c["key"])
            v = v if isinstance(v, str) else None if v is None else json.dumps(v)
            return {"=": v == value, "is set": v is not None, "is not set": v is None}[op]
        actual = self._column(o, t, column)
        if kind == "boolean":
            return {"=": actual == value, "<>": actual != value}[op]
        if kind == "datetime":
            v = _parse_time(value)
            return {">": actual > v, "<": actual < v, ">=": actual >= v, "<=": actual <= v}[op]
        if kind == "string":
            actual = actual or ""
            return {
                "=": actual == value,
                "contains": value in actual,
                "does not contain": value not in actual,
                "starts with": actual.startswith(value),
                "ends with": actual.endswith(value),
            }[op]
        if kind in ("stringOptions", "categoryOptions"):
            return {"any of": actual in value, "none of": actual not in value}[op]
        if kind == "arrayOptions":
            have = set(actual or [])
            return {
                "any of": bool(have & set(value)),
                "none of": not have & set(value),
                "all of": set(value) <= have,
            }[op]
        raise ValueError(f"filter type {kind!r} is not supported")

    def _match_params(
        self, o: dict[str, Any], t: dict[str, Any], q: dict[str, str], environments: list[str]
    ) -> bool:
        for key in ("traceId", "name", "type", "userId", "sessionId", "level", "version"):
            if key in q and o.get(key) != q[key]:
                return False
        if "parentObservationId" in q and (o["parentObservationId"] or "") != q["parentObservationId"]:
            return False
        if "isRootObservation" in q and o["isRootObservation"] != (q["isRootObservation"] == "true"):
            return False
        if environments and o["environment"] not in environments:
            return False
        start = _parse_time(o["startTime"])
        if "fromStartTime" in q and start < _parse_time(q["fromStartTime"]):
            return False
        return not ("toStartTime" in q and start >= _parse_time(q["toStartTime"]))

    def _list_scores(self, q: dict[str, str]) -> Response:
        limit = int(q.get("limit", 50))
        if not 1 <= limit <= 100:
            return _error(400, "limit must be 1..100")
        groups = {g for g in q.get("fields", "").split(",") if g}
        if groups - SCORE_GROUPS:
            return _error(400, f"unknown field groups {sorted(groups - SCORE_GROUPS)}")
        if q.get("observationId") and not q.get("traceId"):
            return _error(400, "observationId requires traceId")

        def csv(key: str) -> set[str] | None:
            return {v for v in q[key].split(",") if v} if q.get(key) else None

        names, traces, sources, queues, dtypes, ids, authors = (
            csv("name"),
            csv("traceId"),
            csv("source"),
            csv("queueId"),
            csv("dataType"),
            csv("id"),
            csv("authorUserId"),
        )
        with self.lock:
            rows = list(self.scores)
        out = []
        for s in rows:
            if names and s["name"] not in names:
                continue
            if traces and s["traceId"] not in traces:
                continue
            if sources and s["source"].upper() not in {x.upper() for x in sources}:
                continue
            if queues and s["queueId"] not in queues:
                continue
            if dtypes and s["dataType"].upper() not in {x.upper() for x in dtypes}:
                continue
            if ids and s["id"] not in ids:
                continue
            if authors and s["authorUserId"] not in authors:
                continue
            if q.get("fromTimestamp") and _parse_time(s["timestamp"]) < _parse_time(q["fromTimestamp"]):
                continue
            if q.get("toTimestamp") and _parse_time(s["timestamp"]) >= _parse_time(q["toTimestamp"]):
                continue
            out.append(s)
        out.sort(key=lambda s: s["timestamp"], reverse=True)
        offset = int(base64.urlsafe_b64decode(q["cursor"]).decode()) if q.get("cursor") else 0
        data = []
        for s in out[offset : offset + limit]:
            value = s["value"]
            if s["dataType"] == "BOOLEAN":
                value = bool(value)
            item = {
                k: s[k]
                for k in (
                    "id",
                    "projectId",
                    "name",
                    "dataType",
                    "source",
                    "timestamp",
                    "environment",
                    "createdAt",
                    "updatedAt",
                )
            }
            item["value"] = value
            if "details" in groups:
                item.update(comment=s["comment"], configId=s["configId"], metadata=s["metadata"])
            if "annotation" in groups:
                item.update(authorUserId=s["authorUserId"], queueId=s["queueId"])
            if "subject" in groups:
                if s["observationId"]:
                    item["subject"] = {
                        "kind": "observation",
                        "id": s["observationId"],
                        "traceId": s["traceId"],
                    }
                elif s["traceId"]:
                    item["subject"] = {"kind": "trace", "id": s["traceId"]}
                else:
                    item["subject"] = {"kind": "session", "id": s["sessionId"]}
            data.append(item)
        meta: dict[str, Any] = {"limit": limit}
        if offset + limit < len(out):
            meta["cursor"] = base64.urlsafe_b64encode(str(offset + limit).encode()).decode()
        return JSONResponse({"data": data, "meta": meta})
