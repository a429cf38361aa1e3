"""A run directory to and from object storage: any fsspec URL (`s3://bucket/prefix`, `gs://...`, a
local path), so a run trained on one machine resumes on another from the copy.

fsspec (and s3fs for `s3://`) come with `pip install 'journeyman[storage]'`; the light client does
not need them. An S3-compatible server is reached through the usual AWS settings
(`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...) or `storage_options`.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from journeyman.errors import CheckpointError, InvalidFieldError

STORAGE_TIMEOUT_S = 60.0
"""Longest one S3 request may wait to connect or to read before it fails (no hangs)."""

_INSTALL = "pip install 'journeyman[storage]'"


def _filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    if not isinstance(url, str) or not url:
        raise InvalidFieldError(
            "url", url, "an fsspec URL: s3://bucket/prefix, gs://bucket/prefix, or a path"
        )
    try:
        import fsspec
    except ImportError as e:
        raise ImportError(f"object storage needs fsspec: {_INSTALL}") from e
    options = dict(storage_options or {})
    if url.startswith(("s3://", "s3a://")):
        timeouts = {"connect_timeout": STORAGE_TIMEOUT_S, "read_timeout": STORAGE_TIMEOUT_S}
        options["config_kwargs"] = {**timeouts, **options.get("config_kwargs", {})}
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:  # s3fs or gcsfs missing: fsspec names the package
        raise ImportError(f"{url.split(':')[0]}:// needs its fsspec driver: {_INSTALL} ({e})") from e
    return fs, str(root).rstrip("/")


def _local_files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def push_dir(
    local: Path, url: str, *, delete: bool = False, storage_options: dict[str, Any] | None = None
) -> int:
    """Copy every file under `local` to `url` (same relative paths); `delete` also removes what is
    under `url` but not under `local`. Returns the number of files copied."""
    if not local.is_dir():
        raise InvalidFieldError("run_dir", str(local), "no such directory to push")
    fs, root = _filesystem(url, storage_options)
    files = _local_files(local)
    try:
        made: set[str] = set()
        for rel, path in files.items():
            target = f"{root}/{rel}"
            folder = posixpath.dirname(target)
            if folder not in made:  # a local or mounted target needs its folders; object stores ignore this
                fs.makedirs(folder, exist_ok=True)
                made.add(folder)
            fs.put_file(str(path), target)
        if delete and fs.exists(root):
            for remote in fs.find(root):
                if remote[len(root) + 1 :] not in files:
                    fs.rm_file(remote)
    except OSError as e:
        raise CheckpointError(None, url, f"push failed: {type(e).__name__}: {e}") from e
    return len(files)


def pull_dir(
    url: str, local: Path, *, delete: bool = False, storage_options: dict[str, Any] | None = None
) -> int:
    """Copy every file under `url` into `local` (same relative paths); `delete` also removes local
    files that are not under `url`. Returns the number of files copied."""
    fs, root = _filesystem(url, storage_options)
    try:
        if not fs.exists(root):
            raise CheckpointError(None, url, "nothing stored there to pull")
        remote = {p[len(root) + 1 :]: p for p in fs.find(root)}
        local.mkdir(parents=True, exist_ok=True)
        for rel, path in remote.items():
            target = local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(target))
    except OSError as e:
        raise CheckpointError(None, url, f"pull failed: {type(e).__name__}: {e}") from e
    if delete:
        for rel, path in _local_files(local).items():
            if rel not in remote:
                path.unlink()
    return len(remote)


__all__ = ["STORAGE_TIMEOUT_S", "pull_dir", "push_dir"]
