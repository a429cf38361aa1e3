"""`open_backend`: the backend a command line names — local, or a `journeyman serve` URL.

One place for the choice, so every command that trains (`journeyman demo`, `mcp-rl train|eval`)
takes the same `--backend URL --token T` and means the same by it.
"""

from __future__ import annotations

from pathlib import Path

from journeyman.backends.local import LocalBackend
from journeyman.client.protocol import Backend
from journeyman.client.remote import RemoteBackend
from journeyman.engine.vllm_server import VLLMConfig


def open_backend(
    url: str | None = None,
    *,
    token: str | None = None,
    path: str | Path = ".journeyman",
    engine: str | VLLMConfig = "torch",
) -> Backend:
    """A `RemoteBackend` for `url` (token: `token` or $JOURNEYMAN_TOKEN), else a `LocalBackend` at
    `path` with `engine`. On a remote backend, `path` and `engine` are the server's business."""
    if url:
        return RemoteBackend(url, token=token)
    return LocalBackend(path=path, engine=engine)


__all__ = ["open_backend"]
