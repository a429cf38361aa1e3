"""verifiers environments (stage 3: not yet bridged)."""

from __future__ import annotations

from typing import Any

from journeyman.environments._protocol import Environment
from journeyman.errors import InvalidFieldError


def load_verifiers(target: str, args: dict[str, Any], *, spec: str) -> Environment:
    raise InvalidFieldError("spec", spec, "the verifiers bridge is not built yet")
