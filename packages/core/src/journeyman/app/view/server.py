"""`journeyman view`: the viewer on 127.0.0.1, from the standard library's HTTP server.

No token here, so it binds the loopback address only and answers only requests addressed to it (a
page elsewhere that points a name at 127.0.0.1, DNS rebinding, gets a 403); to see runs from another
machine, use the `/view/` pages of `journeyman serve`, behind its token. The standard library, not
uvicorn: the viewer runs on a light install (`pip install journeyman`) next to a copied run directory.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from journeyman.app.view.api import handle
from journeyman.app.view.runs import RunFiles

__all__ = ["ViewerServer"]

SOCKET_TIMEOUT_S = 30.0  # a connection that sends nothing for this long is closed
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


class _Handler(BaseHTTPRequestHandler):
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
        if host not in _LOOPBACK_NAMES:
            body = b"the viewer answers requests to 127.0.0.1 or localhost only\n"
            self._send(403, "text/plain", body, {"X-Content-Type-Options": "nosniff"})
            return
        url = urlsplit(self.path)
        assert isinstance(self.server, _Server)
        res = handle(self.server.runs, url.path.lstrip("/"), url.query)
        self._send(res.status, res.content_type, res.body, res.headers)

    def _send(self, status: int, kind: str, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the terminal shows the URL, not every poll


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, runs: RunFiles) -> None:
        self.runs = runs
        super().__init__(("127.0.0.1", port), _Handler)


class ViewerServer:
    """The viewer over `paths` (run directories, or roots holding them) on 127.0.0.1:`port`
    (0 = any free port). `start()` serves on a thread; `serve_forever()` on this one."""

    def __init__(self, paths: list[Path], port: int = 0) -> None:
        self._server = _Server(port, RunFiles(paths))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def start(self) -> ViewerServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="journeyman-view", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
