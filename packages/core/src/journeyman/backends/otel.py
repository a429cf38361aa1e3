"""`journeyman serve --otel-endpoint URL`: the `/metrics` series pushed to an OpenTelemetry collector.

Nothing is counted a second time: every `interval_s` a background thread reads the same Prometheus
registry a scrape reads (`ServerMetrics.registry`), turns each family into its OpenTelemetry kind
(a counter into a cumulative monotonic sum, a gauge into a gauge, a histogram into a cumulative
explicit-bucket histogram, labels into attributes: `model`, `route`, ...), and hands the batch to
the SDK's OTLP/HTTP exporter. The SDK's own instruments would keep a copy of each value; a batch
built from the registry at export time cannot drift from what `/metrics` shows.

Names are the families' (`journeyman_requests_served`, not Prometheus' `_total` sample name: a
collector's Prometheus exporter adds the suffix back). An export that fails (collector down,
refused, slow past `timeout_s`) is logged and counted in `journeyman_otel_export_failures` (on
`/metrics` too); serving never waits on it. opentelemetry is imported when an export is set up:
without the `otel` extra that step raises an ImportError naming `journeyman[otel]`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter

from journeyman.errors import InvalidFieldError

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import (
        HistogramDataPoint,
        Metric,
        MetricExporter,
        MetricsData,
        NumberDataPoint,
    )
    from prometheus_client.metrics_core import Metric as PromMetric

__all__ = ["OTEL_EXTRA", "OtelExport", "OtelSettings", "otel_settings", "require_otel", "to_metrics_data"]

log = logging.getLogger("journeyman.backends.otel")

OTEL_EXTRA = "journeyman[otel]"
DEFAULT_INTERVAL_S = 60.0  # OpenTelemetry's default (OTEL_METRIC_EXPORT_INTERVAL: 60000 ms)
DEFAULT_TIMEOUT_S = 10.0  # one export, retries included; never longer than the interval
METRICS_PATH = "/v1/metrics"  # OTLP/HTTP's path for metrics


class OtelSettings:
    """Where and how often to export: the flag, else the standard OTEL_* variables."""

    def __init__(self, endpoint: str, interval_s: float, source: str) -> None:
        self.endpoint, self.interval_s, self.source = endpoint, interval_s, source

    def __repr__(self) -> str:
        return f"OtelSettings({self.endpoint!r}, interval_s={self.interval_s}, from {self.source})"


def otel_settings(
    endpoint: str | None, interval_s: float | None, env: Mapping[str, str] = os.environ
) -> OtelSettings | None:
    """The export `journeyman serve` runs, or None: `endpoint` (`--otel-endpoint`), else
    OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (the full URL), else OTEL_EXPORTER_OTLP_ENDPOINT (a base URL,
    `/v1/metrics` added). A URL without a path gets `/v1/metrics`. `interval_s`
    (`--otel-interval-s`), else OTEL_METRIC_EXPORT_INTERVAL (milliseconds), else 60 s."""
    field, source = "otel_endpoint", "--otel-endpoint"
    if endpoint is None:
        for var in ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            if env.get(var, "").strip():
                field = source = var
                endpoint = env[var].strip()
                if var == "OTEL_EXPORTER_OTLP_ENDPOINT":
                    endpoint = endpoint.rstrip("/") + METRICS_PATH
                break
        else:
            return None
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidFieldError(
            field,
            endpoint,
            "an OTLP/HTTP URL, as http(s)://host:4318/v1/metrics (OTLP over gRPC is not spoken)",
        )
    if parts.path in ("", "/"):
        endpoint = parts._replace(path=METRICS_PATH).geturl()
    if interval_s is None:
        raw = env.get("OTEL_METRIC_EXPORT_INTERVAL", "").strip()
        try:
            interval_s = float(raw) / 1000 if raw else DEFAULT_INTERVAL_S
        except ValueError:
            raise InvalidFieldError(
                "OTEL_METRIC_EXPORT_INTERVAL", raw, "milliseconds between exports, a number"
            ) from None
    if not (interval_s > 0 and math.isfinite(interval_s)):
        raise InvalidFieldError("otel_interval_s", interval_s, "seconds between exports: a number above 0")
    return OtelSettings(endpoint, interval_s, source)


def require_otel(feature: str = "the OpenTelemetry export") -> None:
    """Import the SDK and the OTLP/HTTP exporter now, or raise an ImportError naming the extra."""
    try:
        import opentelemetry.exporter.otlp.proto.http.metric_exporter
        import opentelemetry.sdk.metrics.export  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{feature} needs {e.name or 'opentelemetry'}, which is not installed: pip install '{OTEL_EXTRA}'",
            name=e.name,
        ) from e


class OtelExport:
    """Every `interval_s`, `registry` as OTLP metrics to `endpoint` (a daemon thread; `close` stops
    it after one last export). `export()` runs one export now and says whether it arrived.

    Headers (a collector's auth) come from OTEL_EXPORTER_OTLP_METRICS_HEADERS or
    OTEL_EXPORTER_OTLP_HEADERS, as the SDK reads them; resource attributes from OTEL_SERVICE_NAME
    and OTEL_RESOURCE_ATTRIBUTES (service.name defaults to `journeyman`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        endpoint: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        require_otel()
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.registry, self.endpoint, self.interval_s = registry, endpoint, interval_s
        self.timeout_s = min(timeout_s, interval_s)
        self.failures = Counter(
            "journeyman_otel_export_failures",
            "OpenTelemetry exports that did not arrive (journeyman serve --otel-endpoint)",
            registry=registry,
        )
        release = version("journeyman")
        self._resource = Resource.create({"service.name": "journeyman", "service.version": release})
        self._scope = InstrumentationScope("journeyman", release)
        self._exporter: MetricExporter = OTLPMetricExporter(endpoint=endpoint, timeout=self.timeout_s)
        self._start_ns = time.time_ns()  # counters without a `_created` sample count from here
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one export at a time: the thread's and a caller's
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> OtelExport:
        self._thread = threading.Thread(target=self._run, name="journeyman-otel-export", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export()

    def export(self) -> bool:
        """One export of the registry as it is now; False (logged, counted) when it did not arrive."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        with self._lock:
            try:
                data = to_metrics_data(self.registry, self._resource, self._scope, self._start_ns)
                ok = (
                    self._exporter.export(data, timeout_millis=self.timeout_s * 1000)
                    is MetricExportResult.SUCCESS
                )
                error = "" if ok else "the collector refused it or did not answer"
            except Exception as e:  # an export must never take the server down
                ok, error = False, f"{type(e).__name__}: {e}"
        if ok:
            if self._failing:
                log.info("OpenTelemetry export to %s arrives again", self.endpoint)
            self._failing = False
            return True
        self.failures.inc()
        if not self._failing:  # once per outage, not once per interval
            log.warning(
                "OpenTelemetry export to %s failed (%s); retrying every %g s",
                self.endpoint,
                error,
                self.interval_s,
            )
        self._failing = True
        return False

    def close(self) -> None:
        """Stop the thread, export once more (bounded by `timeout_s`), release the exporter."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)
            self._thread = None
            self.export()
        self._exporter.shutdown()


def to_metrics_data(
    registry: CollectorRegistry, resource: Any, scope: Any, start_ns: int, now_ns: int | None = None
) -> MetricsData:
    """The registry's families, read now, as one OpenTelemetry batch (cumulative: the values are
    Prometheus' running totals). Kinds other than counter, gauge and histogram are left out."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics

    now = time.time_ns() if now_ns is None else now_ns
    metrics = [m for family in registry.collect() if (m := _metric(family, start_ns, now)) is not None]
    scoped = ScopeMetrics(scope=scope, metrics=metrics, schema_url="")
    return MetricsData(
        resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scoped], schema_url="")]
    )


def _metric(family: PromMetric, start_ns: int, now: int) -> Metric | None:
    """One family as its OpenTelemetry kind; None for another kind, or a family with no series yet
    (a labelled histogram before its first observation)."""
    from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Histogram, Metric, Sum

    cumulative = AggregationTemporality.CUMULATIVE
    if family.type == "counter":
        data: Sum | Gauge | Histogram = Sum(
            data_points=_numbers(family, "_total", start_ns, now),
            aggregation_temporality=cumulative,
            is_monotonic=True,
        )
    elif family.type == "gauge":
        data = Gauge(data_points=_numbers(family, "", 0, now))
    elif family.type == "histogram":
        data = Histogram(data_points=_histograms(family, start_ns, now), aggregation_temporality=cumulative)
    else:
        return None
    if not data.data_points:
        return None
    return Metric(name=family.name, description=family.documentation, unit=family.unit or "", data=data)


def _numbers(family: PromMetric, suffix: str, start_ns: int, now: int) -> list[NumberDataPoint]:
    """The samples `<name><suffix>`, one point per label set; a counter's start is its `_created`."""
    from opentelemetry.sdk.metrics.export import NumberDataPoint

    created = {_key(s.labels): s.value for s in family.samples if s.name == f"{family.name}_created"}
    return [
        NumberDataPoint(
            attributes=dict(s.labels),
            start_time_unix_nano=int(created[_key(s.labels)] * 1e9)
            if _key(s.labels) in created
            else start_ns,
            time_unix_nano=now,
            value=float(s.value),
        )
        for s in family.samples
        if s.name == family.name + suffix
    ]


def _histograms(family: PromMetric, start_ns: int, now: int) -> list[HistogramDataPoint]:
    """Prometheus' cumulative `_bucket{le}` counts as OpenTelemetry's per-bucket counts (the last
    bucket is `+Inf`'s, its bound implied), with `_count` and `_sum`, one point per label set."""
    from opentelemetry.sdk.metrics.export import HistogramDataPoint

    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k != "le"}
        one = series.setdefault(_key(labels), {"labels": labels, "buckets": [], "start": start_ns})
        if s.name == f"{family.name}_bucket":
            one["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name == f"{family.name}_count":
            one["count"] = int(s.value)
        elif s.name == f"{family.name}_sum":
            one["sum"] = float(s.value)
        elif s.name == f"{family.name}_created":
            one["start"] = int(s.value * 1e9)
    found: list[HistogramDataPoint] = []
    for one in series.values():
        buckets: list[tuple[float, float]] = sorted(one["buckets"])  # by upper bound, +Inf last
        below = [0.0, *(c for _, c in buckets[:-1])]
        found.append(
            HistogramDataPoint(
                attributes=one["labels"],
                start_time_unix_nano=one["start"],
                time_unix_nano=now,
                count=one.get("count", int(buckets[-1][1]) if buckets else 0),
                sum=one.get("sum", 0.0),
                bucket_counts=[int(c - b) for (_, c), b in zip(buckets, below, strict=True)],
                explicit_bounds=[le for le, _ in buckets if math.isfinite(le)],
                min=cast(float, None),  # Prometheus keeps neither: unset in the OTLP message
                max=cast(float, None),
            )
        )
    return found


def _key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))
