"""Connections to Langfuse: keys and host from arguments or the SDK's usual environment variables.

Export owns its OpenTelemetry pipeline (a private TracerProvider and an OTLP exporter that counts
what it failed to deliver), so enabling it never replaces the process's global tracer provider.
The SDK keeps one client per public key; connections are cached the same way here.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

try:
    from langfuse import Langfuse
    from langfuse._version import __version__ as langfuse_version
    from langfuse.api import LangfuseAPI
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise ImportError('Langfuse support needs the extra: pip install "journeyman[langfuse]"') from e

from journeyman.errors import InvalidFieldError

log = logging.getLogger("journeyman.langfuse")

DEFAULT_HOST = "https://cloud.langfuse.com"


@dataclass(frozen=True)
class Credentials:
    public_key: str
    secret_key: str
    host: str


def credentials(
    public_key: str | None = None, secret_key: str | None = None, host: str | None = None
) -> Credentials:
    """Explicit values win; else LANGFUSE_PUBLIC_KEY / LANGFUSE_SECRET_KEY / LANGFUSE_BASE_URL (or _HOST)."""
    pk = public_key or os.environ.get("LANGFUSE_PUBLIC_KEY")
    sk = secret_key or os.environ.get("LANGFUSE_SECRET_KEY")
    url = host or os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST") or DEFAULT_HOST
    if not pk:
        raise InvalidFieldError("public_key", pk, "pass public_key= or set LANGFUSE_PUBLIC_KEY")
    if not sk:
        raise InvalidFieldError("secret_key", "<unset>", "pass secret_key= or set LANGFUSE_SECRET_KEY")
    if not url.startswith(("http://", "https://")):
        raise InvalidFieldError("host", url, "must be an http(s) URL, e.g. https://cloud.langfuse.com")
    return Credentials(pk, sk, url.rstrip("/"))


class CountingSpanExporter(SpanExporter):
    """Wraps the OTLP exporter and remembers which traces it failed to deliver (Langfuse down, 4xx/5xx)."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._failed: set[str] = set()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            log.debug("OTLP export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            with self._lock:
                self._failed.update(f"{s.context.trace_id:032x}" for s in spans if s.context is not None)
        return result

    def take_failed(self) -> set[str]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


@dataclass
class ExportConnection:
    """A Langfuse client whose spans go through a pipeline this module owns (None when it does not)."""

    client: Langfuse
    provider: TracerProvider | None = None
    exporter: CountingSpanExporter | None = None
    credentials: Credentials | None = field(default=None, repr=False)


_connections: dict[tuple[str, str], ExportConnection] = {}
_lock = threading.Lock()


def export_connection(creds: Credentials, timeout_s: float) -> ExportConnection:
    """The client for these keys, created once per (public key, host) with a counting OTLP exporter."""
    with _lock:
        key = (creds.public_key, creds.host)
        if key in _connections:
            return _connections[key]
        auth = base64.b64encode(f"{creds.public_key}:{creds.secret_key}".encode()).decode("ascii")
        # The same endpoint and headers the SDK uses for its own exporter (OTLP ingestion, version 4).
        otlp = OTLPSpanExporter(
            endpoint=f"{creds.host}/api/public/otel/v1/traces",
            headers={
                "Authorization": f"Basic {auth}",
                "x-langfuse-sdk-name": "python",
                "x-langfuse-sdk-version": langfuse_version,
                "x-langfuse-public-key": creds.public_key,
                "x-langfuse-ingestion-version": "4",
            },
            timeout=timeout_s,
            compression=Compression.Gzip,
        )
        exporter = CountingSpanExporter(otlp)
        provider = TracerProvider()
        client = Langfuse(
            public_key=creds.public_key,
            secret_key=creds.secret_key,
            base_url=creds.host,
            timeout=max(1, round(timeout_s)),
            tracer_provider=provider,
            span_exporter=exporter,
        )
        # The SDK returns its existing pipeline when this public key was already used in the process.
        owned = getattr(getattr(client, "_resources", None), "tracer_provider", None) is provider
        conn = ExportConnection(client, provider if owned else None, exporter if owned else None, creds)
        if not owned:
            log.info("Langfuse client for %s already existed: exporting through it", creds.public_key)
        _connections[key] = conn
        return conn


def read_api(creds: Credentials, timeout_s: float = 60.0) -> LangfuseAPI:
    """A REST client for the read endpoints; no tracing pipeline, no background threads."""
    return LangfuseAPI(
        base_url=creds.host,
        username=creds.public_key,
        password=creds.secret_key,
        x_langfuse_sdk_name="python",
        x_langfuse_sdk_version=langfuse_version,
        x_langfuse_public_key=creds.public_key,
        timeout=timeout_s,
    )
