"""The OpenTelemetry export of `/metrics` (`backends/otel.py`), received for real: a wire-level OTLP/HTTP
receiver on 127.0.0.1 decodes each POST with the protocol's own `ExportMetricsServiceRequest`, and
what the registry counted must arrive under the same names, labels and values."""

from __future__ import annotations

import gzip
import logging
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from journeyman.backends.metrics import LATENCY_BUCKETS, ModelSource, ServerMetrics
from journeyman.backends.otel import OtelExport, otel_settings, require_otel
from journeyman.backends.server import ServerProcess
from journeyman.errors import InvalidFieldError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE in OTLP
TOKEN = "otel-test-token-0123456789abcdef"


class Receiver:
    """An OTLP/HTTP metrics receiver: each POST to /v1/metrics decoded, answered `status`."""

    def __init__(self) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.paths: list[str] = []
        self.status = 200
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                assert self.headers["Content-Type"] == "application/x-protobuf"
                request = ExportMetricsServiceRequest.FromString(body)
                with receiver.arrived:
                    receiver.requests.append(request)
                    receiver.paths.append(self.path)
                    receiver.arrived.notify_all()
                answer = (
                    ExportMetricsServiceResponse().SerializeToString() if receiver.status == 200 else b"no"
                )
                self.send_response(receiver.status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout_s: float = 30.0) -> list[ExportMetricsServiceRequest]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.requests) >= count, timeout_s), self.requests
            return list(self.requests)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


class PerModel(Collector):
    """Series labelled by model, as `ModelCollector` yields them at a scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        step = GaugeMetricFamily("journeyman_step", "The training step the model serves", labels=["model"])
        step.add_metric(["alpha"], 3)
        step.add_metric(["beta"], 7)
        yield step


def metrics_of(request: ExportMetricsServiceRequest) -> dict[str, Any]:
    """name -> the OTLP Metric, over every resource and scope of one request."""
    return {m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def attributes(point: Any) -> dict[str, str]:
    return {a.key: a.value.string_value for a in point.attributes}


def test_the_registry_arrives_as_otlp_metrics(receiver: Receiver) -> None:
    metrics = ServerMetrics(ModelSource(lambda: [], None))
    metrics.registry.register(PerModel())
    metrics.observe("/v1/chat/completions", 200, 0.3)
    metrics.observe("/v1/chat/completions", 200, 0.02)
    metrics.observe("/journeyman/v1/models/{name}/train", 404, 0.004)
    metrics.errors.labels("/journeyman/v1/models/{name}/train", "404").inc(2)  # 3 in all
    export = OtelExport(metrics.registry, receiver.url, interval_s=3600, timeout_s=5)
    assert export.export()
    [first] = receiver.wait(1)
    assert receiver.paths == ["/v1/metrics"]
    resource = {a.key: a.value.string_value for a in first.resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "journeyman"
    got = metrics_of(first)

    errors = got["journeyman_request_errors"]  # the family's name: a collector adds `_total` back
    assert errors.sum.is_monotonic and errors.sum.aggregation_temporality == CUMULATIVE
    [point] = errors.sum.data_points
    assert attributes(point) == {"route": "/journeyman/v1/models/{name}/train", "code": "404"}
    assert point.as_double == 3.0 and 0 < point.start_time_unix_nano <= point.time_unix_nano

    latency = got["journeyman_request_seconds"].histogram
    assert latency.aggregation_temporality == CUMULATIVE
    chat = next(p for p in latency.data_points if attributes(p)["route"] == "/v1/chat/completions")
    assert attributes(chat) == {"route": "/v1/chat/completions", "status": "2xx"}
    assert chat.count == 2 and chat.sum == pytest.approx(0.32)
    assert list(chat.explicit_bounds) == list(LATENCY_BUCKETS)
    expected = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, +Inf last
    expected[LATENCY_BUCKETS.index(0.05)] += 1  # 0.02 s
    expected[LATENCY_BUCKETS.index(0.5)] += 1  # 0.3 s
    assert list(chat.bucket_counts) == expected
    assert not chat.HasField("min") and not chat.HasField("max")  # Prometheus keeps neither

    step = got["journeyman_step"].gauge
    assert {attributes(p)["model"]: p.as_double for p in step.data_points} == {"alpha": 3.0, "beta": 7.0}
    assert got["journeyman_otel_export_failures"].sum.data_points[0].as_double == 0.0

    # values are read at each export, never kept twice: the next export sees the later count
    metrics.errors.labels("/journeyman/v1/models/{name}/train", "404").inc()
    assert export.export()
    export.close()  # never started: no thread to stop, no last export
    [later] = metrics_of(receiver.wait(2)[1])["journeyman_request_errors"].sum.data_points
    assert later.as_double == 4.0 and later.start_time_unix_nano == point.start_time_unix_nano


def test_the_thread_exports_every_interval(receiver: Receiver) -> None:
    metrics = ServerMetrics(ModelSource(lambda: [], None))
    export = OtelExport(metrics.registry, receiver.url, interval_s=0.2, timeout_s=5).start()
    try:
        receiver.wait(1)
        metrics.errors.labels("/v1/chat/completions", "429").inc()
        n = len(receiver.requests)
        requests = receiver.wait(n + 2)  # an export after the count: it shows there
    finally:
        export.close()
    [point] = metrics_of(requests[-1])["journeyman_request_errors"].sum.data_points
    assert attributes(point)["code"] == "429" and point.as_double == 1.0
    assert "journeyman_request_errors" not in metrics_of(requests[0])  # no series before the first count


def test_a_failed_export_is_logged_counted_and_never_raised(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = ServerMetrics(ModelSource(lambda: [], None))
    receiver.status = 400  # refused: not retried
    export = OtelExport(metrics.registry, receiver.url, interval_s=3600, timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="journeyman.backends.otel"):
        assert not export.export()
        assert not export.export()
    ours = [r for r in caplog.records if r.name == "journeyman.backends.otel"]
    assert len(ours) == 1 and receiver.url in ours[0].getMessage()  # once per outage
    assert metrics.registry.get_sample_value("journeyman_otel_export_failures_total") == 2
    assert b"journeyman_otel_export_failures_total 2.0" in metrics.render()  # on /metrics too
    receiver.status = 200
    assert export.export()  # back: the count stays, a running total
    export.close()

    # nobody listening: refused connections, bounded by the timeout (retries included)
    closed = Receiver()
    closed.server.shutdown()
    closed.server.server_close()
    gone = OtelExport(
        ServerMetrics(ModelSource(lambda: [], None)).registry, closed.url, interval_s=3600, timeout_s=1
    )
    t0 = time.monotonic()
    assert not gone.export()
    assert time.monotonic() - t0 < 5
    gone.close()  # never started: no last export


def test_settings_come_from_the_flag_else_the_standard_variables() -> None:
    assert otel_settings(None, None, env={}) is None
    s = otel_settings("http://collector:4318", None, env={})
    assert s is not None and (s.endpoint, s.interval_s, s.source) == (
        "http://collector:4318/v1/metrics",
        60.0,
        "--otel-endpoint",
    )
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel.example:4318/",
        "OTEL_METRIC_EXPORT_INTERVAL": "15000",
    }
    s = otel_settings(None, None, env=env)
    assert s is not None and (s.endpoint, s.interval_s) == ("https://otel.example:4318/v1/metrics", 15.0)
    env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = "http://m:9000/custom"
    s = otel_settings(None, 5, env=env)
    assert s is not None and (s.endpoint, s.interval_s, s.source) == (
        "http://m:9000/custom",
        5,
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    )
    s = otel_settings("http://flag:4318/v1/metrics", None, env=env)  # the flag wins
    assert s is not None and s.endpoint == "http://flag:4318/v1/metrics"
    with pytest.raises(InvalidFieldError, match="otel_endpoint"):
        otel_settings("collector:4317", None, env={})  # gRPC's address: not spoken
    with pytest.raises(InvalidFieldError, match="otel_interval_s"):
        otel_settings("http://c:4318", 0, env={})
    with pytest.raises(InvalidFieldError, match="OTEL_METRIC_EXPORT_INTERVAL"):
        otel_settings("http://c:4318", None, env={"OTEL_METRIC_EXPORT_INTERVAL": "soon"})


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.metric_exporter", None)
    with pytest.raises(ImportError, match=r"pip install 'journeyman\[otel\]'") as e:
        require_otel("journeyman serve (--otel-endpoint)")
    assert "journeyman serve (--otel-endpoint) needs opentelemetry" in str(e.value)


def test_journeyman_serve_exports_its_requests(receiver: Receiver, tmp_path: Path) -> None:
    """The flag end to end: `journeyman serve --otel-endpoint` pushes the latency of a request it answered."""
    server = ServerProcess(
        tmp_path, TOKEN, args=["--otel-endpoint", receiver.url, "--otel-interval-s", "0.5"]
    ).start()
    try:
        assert httpx.get(
            f"{server.url}/journeyman/v1/info", headers={"Authorization": f"Bearer {TOKEN}"}
        ).is_success
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            latency = [
                p
                for r in receiver.wait(len(receiver.requests) + 1)
                if "journeyman_request_seconds" in (m := metrics_of(r))
                for p in m["journeyman_request_seconds"].histogram.data_points
                if attributes(p) == {"route": "/journeyman/v1/info", "status": "2xx"}
            ]
            if latency:
                assert latency[-1].count == 1
                break
        else:
            raise AssertionError("the request's latency never arrived")
    finally:
        assert server.terminate(timeout_s=60) == 0
