"""Where Journeyman keeps files on this machine."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Where converted weights and judge answers live: `$JOURNEYMAN_CACHE`, else the user's cache dir."""
    return Path(os.environ.get("JOURNEYMAN_CACHE") or user_cache_dir("journeyman"))
