"""API tokens of `journeyman serve`: named, each with a scope, added and revoked while it runs.

Scopes nest: `sample` may call the OpenAI routes and read (models, steps, history, its captures);
`train` may also register models, train, log and switch the served step; `admin` may also delete
checkpoints and manage tokens. `$JOURNEYMAN_TOKEN` is an admin token named `env`.

A token may name the models it serves (`journeyman token add NAME --models a,b`): tenants stay
apart. Such a token touches those models alone, by name (`a`, `a@<step>`): it samples them, reads
their steps, history, captures and viewer pages, and (scope allowing) registers, trains and logs
them, and with scope train deletes their checkpoints (`guard.needed_scope`); any other model, a base model's own name included, is a 403 naming the model and the token,
and `/v1/models` (and `info`) list its models alone. A token without a list reaches every model, as
before the field existed (files without it load unchanged). An admin token is never scoped to
models: it manages tokens, which are every tenant's, so `add` refuses `admin` with `models`.

Captures are a token's own, whatever its scope: the calls a token's requests file under a capture
id are popped, and scored as a live episode, by that token alone (`rollout/capture.py`); another
token sending the same id files and finds its own calls.

Tokens live in `<server path>/tokens.json` as sha256 digests, never as secrets (a leaked file names
who may call, not how); the server re-reads the file when it changes, so `journeyman token add` or
`revoke` takes effect on the next request, without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from journeyman.data.config import check_name
from journeyman.data.paths import TOKENS_FILE as TOKENS_FILE  # the file name lives with the run layout
from journeyman.errors import InvalidFieldError

Scope = Literal["sample", "train", "admin"]
SCOPES: tuple[Scope, ...] = ("sample", "train", "admin")
ENV_TOKEN_NAME = "env"
MIN_SECRET_CHARS = 16


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def allows(granted: Scope, needed: Scope) -> bool:
    """Whether a token of scope `granted` may call what needs `needed` (scopes nest)."""
    return SCOPES.index(granted) >= SCOPES.index(needed)


class ApiToken(BaseModel):
    """One named token as the server keeps it: the secret's digest, never the secret."""

    name: str = Field(description="who holds it; history rows of the steps it trains name it")
    scope: Scope = Field(description="sample < train < admin: what it may call")
    sha256: str = Field(description="hex sha256 of the secret")
    created_at: float = Field(default_factory=time.time, description="unix time it was added")
    models: list[str] | None = Field(
        default=None, description="the models it may touch (None: every model, as tokens.json before it)"
    )


def may_touch(token: ApiToken, model: str) -> bool:
    """Whether `token` may touch the model a request names (`name` or `name@step`)."""
    return token.models is None or model.split("@", 1)[0] in token.models


def check_models(scope: Scope, models: Sequence[str] | None) -> list[str] | None:
    """A token's model list as stored (names checked, duplicates dropped), refused where it cannot be."""
    if models is None:
        return None
    if isinstance(models, str):  # a bare string would be read as its letters
        raise InvalidFieldError("models", models, "must be a list of model names")
    names = list(dict.fromkeys(check_name("models", m) for m in models))
    if not names:
        raise InvalidFieldError("models", models, "name at least one model, or leave it out for every model")
    if scope == "admin":
        raise InvalidFieldError(
            "models", names, "an admin token manages every tenant's tokens: it cannot be scoped to models"
        )
    return names


class TokenBook:
    """The tokens a server accepts: `$JOURNEYMAN_TOKEN` (admin) and those in `path` (if given).

    `lookup` is safe from any thread and notices edits to the file by its modification time.
    """

    def __init__(self, path: Path | None = None, admin_secret: str | None = None) -> None:
        if admin_secret is not None and len(admin_secret) < MIN_SECRET_CHARS:
            raise InvalidFieldError(
                "token",
                "<hidden>",
                f"use at least {MIN_SECRET_CHARS} characters (e.g. `openssl rand -hex 24`)",
            )
        self.path = path
        self._env = (
            ApiToken(name=ENV_TOKEN_NAME, scope="admin", sha256=_digest(admin_secret), created_at=0.0)
            if admin_secret is not None
            else None
        )
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self._tokens: list[ApiToken] = []

    def lookup(self, secret: str) -> ApiToken | None:
        """The token whose secret this is, or None. Every digest is compared in constant time."""
        digest = _digest(secret)
        found = None
        for token in self.tokens():
            if hmac.compare_digest(token.sha256, digest):
                found = token
        return found

    def tokens(self) -> list[ApiToken]:
        """Every accepted token, the env token first."""
        with self._lock:
            self._refresh()
            return [*([self._env] if self._env else []), *self._tokens]

    def add(self, name: str, scope: Scope, models: Sequence[str] | None = None) -> str:
        """Add a token named `name` with `scope`, for `models` alone if given (every model if None);
        returns its secret (shown once, stored hashed)."""
        check_name("name", name)
        if scope not in SCOPES:
            raise InvalidFieldError("scope", scope, f"use one of {list(SCOPES)}")
        names = check_models(scope, models)
        if name == ENV_TOKEN_NAME:
            raise InvalidFieldError("name", name, "is the name of $JOURNEYMAN_TOKEN; pick another")
        secret = secrets.token_urlsafe(32)
        with self._lock:
            self._refresh()
            if any(t.name == name for t in self._tokens):
                raise InvalidFieldError("name", name, "a token of that name exists: revoke it first")
            self._write(
                [*self._tokens, ApiToken(name=name, scope=scope, sha256=_digest(secret), models=names)]
            )
        return secret

    def revoke(self, name: str) -> bool:
        """Remove the token named `name`; False if there was none."""
        with self._lock:
            self._refresh()
            kept = [t for t in self._tokens if t.name != name]
            if len(kept) == len(self._tokens):
                return False
            self._write(kept)
            return True

    def _file(self) -> Path:
        if self.path is None:
            raise InvalidFieldError("path", None, "this server keeps no token file (only $JOURNEYMAN_TOKEN)")
        return self.path

    def _refresh(self) -> None:
        if self.path is None:
            return
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._seen, self._tokens = None, []
            return
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return
        raw = json.loads(self.path.read_text() or "[]")
        self._tokens = [ApiToken.model_validate(t) for t in raw]
        self._seen = seen

    def _write(self, tokens: list[ApiToken]) -> None:
        path = self._file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # digests only, still private
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps([t.model_dump() for t in tokens], indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._tokens, self._seen = tokens, None  # re-read on next use: the mtime may not have moved


__all__ = ["SCOPES", "ApiToken", "Scope", "TokenBook", "allows", "check_models", "may_touch"]
