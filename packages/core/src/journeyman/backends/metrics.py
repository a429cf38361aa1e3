"""What `journeyman serve` shows Prometheus at `/metrics` (token-protected like every route).

Two kinds of numbers. Request latency and answers by status are observed as requests pass (a
histogram and a counter by route template and status class). Everything else is read from the
backend when Prometheus scrapes (`ModelCollector`): per model, the step served, requests and
tokens, rows in flight and queued, the engine's counts, the last training step's metrics, what the run
spent against its budget, and under live training its outcomes, decisions by kind, rejections in a row, waiting and open episodes.
Nothing is kept twice: a scrape reads the same counts the step metrics and `journeyman live status`
report. docs/metrics.md lists every series with an example alert.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from journeyman.errors import UnknownModelError

_Family = GaugeMetricFamily | CounterMetricFamily

if TYPE_CHECKING:
    from journeyman.backends.service import ServedModel

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "ModelSource", "ServerMetrics", "TimedRequests"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# a chat completion of the embedded model takes 0.1-5 s on a CPU, a training step minutes
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
# engine counts that are levels, not running totals
_ENGINE_GAUGES = {"requests_queued", "rows_running"}
# a training step's history metrics shown as `journeyman_train_<name>` (the rest stay in history)
_TRAIN_KEYS = ("reward", "loss", "grad_norm", "kl", "train_seconds", "tokens", "staleness")


class ServerMetrics:
    """The server's registry: what requests observe, and a collector of every served model."""

    def __init__(self, served: ModelSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram(
            "journeyman_request_seconds",
            "Time to answer a request (to the end of its body, streams included), by route and status class",
            ("route", "status"),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "journeyman_request_errors",
            "Requests answered with an error, by route and status code",
            ("route", "code"),
            registry=self.registry,
        )
        self.registry.register(ModelCollector(served))

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.latency.labels(route, f"{status // 100}xx").observe(seconds)
        if status >= 400:
            self.errors.labels(route, str(status)).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class TimedRequests:
    """ASGI middleware: each HTTP request's time to the end of its answer, by the route template it
    matched (`/journeyman/v1/models/{name}/train`: model names stay out of the labels) and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500  # what a request that raises before its answer starts gets

        async def timed_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe(route, status, time.perf_counter() - t0)


class ModelSource:
    """The served models by name, as the collector reads them at a scrape: `names()` those the
    caller may see, `service(name)` their parts (`LocalBackend.service`; None: a backend without
    in-process models, whose series are then the requests' alone)."""

    def __init__(self, names: Callable[[], list[str]], service: Callable[[str], ServedModel] | None) -> None:
        self._names, self._service = names, service

    def models(self) -> Iterator[ServedModel]:
        if self._service is None:
            return
        for name in self._names():
            try:
                yield self._service(name)
            except (KeyError, UnknownModelError):  # unregistered between the two calls
                continue


class ModelCollector(Collector):
    """Per-model series, read when Prometheus scrapes."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        label = ["model"]
        step = GaugeMetricFamily("journeyman_step", "The training step the model serves", labels=label)
        latest = GaugeMetricFamily("journeyman_latest_step", "The newest checkpoint of the run", labels=label)
        served = CounterMetricFamily(
            "journeyman_requests_served", "Requests the model's engine answered", labels=label
        )
        endpoint: dict[str, _Family] = {}
        engine: dict[str, _Family] = {}
        train: dict[str, GaugeMetricFamily] = {}
        live: dict[str, _Family] = {}
        spent = GaugeMetricFamily(
            "journeyman_spent",
            "What the run spent, by budget field (data/budget.py)",
            labels=["model", "budget"],
        )
        limit = GaugeMetricFamily(
            "journeyman_budget_limit", "The run's budget limits that are set", labels=["model", "budget"]
        )
        trained_at = GaugeMetricFamily(
            "journeyman_last_step_timestamp_seconds", "When the last training step was recorded", labels=label
        )
        for s in self.source.models():
            name = s.model.name
            step.add_metric([name], s.engine.step)
            latest.add_metric([name], s.store.latest_step())
            served.add_metric([name], s.engine.requests_served)
            for key, value in s.endpoint.stats().items():
                metric = endpoint.get(key)
                if metric is None:
                    gauge = key.endswith(("_held", "_in_flight", "_tokens"))
                    kind = GaugeMetricFamily if gauge else CounterMetricFamily
                    metric = endpoint[key] = kind(f"journeyman_{key}", f"The endpoint's {key}", labels=label)
                metric.add_metric([name], float(value))
            for key, value in s.engine.counters().items():
                metric = engine.get(key)
                if metric is None:
                    kind = GaugeMetricFamily if key in _ENGINE_GAUGES else CounterMetricFamily
                    metric = engine[key] = kind(
                        f"journeyman_engine_{key}", f"The engine's {key}", labels=label
                    )
                metric.add_metric([name], float(value))
            row = s.last_train_row
            if row is not None:
                trained_at.add_metric([name], float(row.get("recorded_at", time.time())))
                for key in _TRAIN_KEYS:
                    value = row.get(key, row.get(f"train/{key}"))
                    if isinstance(value, int | float) and math.isfinite(value):
                        metric = train.get(key) or GaugeMetricFamily(
                            f"journeyman_train_{key}", f"The last training step's {key}", labels=label
                        )
                        train[key] = metric
                        metric.add_metric([name], float(value))
            if s.meter is not None:
                for key, value in s.meter.spent().items():
                    spent.add_metric([name, key], value)
                for key, (_, cap) in s.meter.levels().items():
                    limit.add_metric([name, key], cap)
            _live(s, live)
        yield from (step, latest, served, trained_at, spent, limit)
        yield from endpoint.values()
        yield from engine.values()
        yield from train.values()
        yield from live.values()


def _live(s: ServedModel, out: dict[str, _Family]) -> None:
    """Live training's series of `s`, added to `out` (nothing while it is off)."""
    run: Any = s.live
    if run is None or not hasattr(run, "status"):
        return
    status = run.status()
    name = s.model.name

    def put(key: str, help_: str, value: float, counter: bool = False, **labels: str) -> None:
        metric = out.get(key)
        if metric is None:
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            metric = out[key] = kind(f"journeyman_live_{key}", help_, labels=["model", *labels])
        metric.add_metric([name, *labels.values()], value)

    put("enabled", "Whether live training runs", float(status.enabled))
    put("promoted_step", "The step the bare model name serves", status.promoted)
    put(
        "candidate_step",
        "The candidate being judged (-1: none)",
        -1 if status.candidate is None else status.candidate,
    )
    put("episodes_open", "Episodes with calls and no outcome yet", status.episodes_open)
    put("episodes_waiting", "Scored episodes waiting to train", status.episodes_waiting)
    put("busy", "A step trains or a candidate is judged now", float(status.busy))
    put("error", "1 while the live loop's last attempt failed", float(status.error is not None))
    for key, value in status.counts.items():
        if not key.startswith("decided_"):
            put("episodes", "Episodes by what became of them", value, counter=True, outcome=key)
    for action in ("promote", "reject", "rollback"):
        put(
            "decisions",
            "Gate decisions by kind",
            status.counts.get(f"decided_{action}", 0),
            True,
            action=action,
        )
    in_a_row = 0
    for d in reversed(status.decisions):
        if d.action != "reject":
            break
        in_a_row += 1
    put("rejected_in_a_row", "Candidates rejected since the last promotion or rollback", in_a_row)
