"""Judge answers on disk, so scoring the same group again makes no request.

One JSON file per key; the key names everything that could change the answer (prompt version,
judge identity with its served step, rubric, the set of distinct trajectory contents in any order,
explanation length, sampling parameters), and nothing that could not.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from journeyman.rewards.ruler._prompt import PROMPT_VERSION, RulerScore


def default_cache_dir() -> Path:
    """`$JOURNEYMAN_CACHE/ruler` (the machine's journeyman cache when unset)."""
    from journeyman.data.paths import cache_dir

    return cache_dir() / "ruler"


def cache_key(
    identity: str, rubric: str, digests: Sequence[str], explanation_chars: int, params: dict[str, Any]
) -> str:
    blob = json.dumps(
        {
            "v": PROMPT_VERSION,
            "judge": identity,
            "rubric": rubric,
            "group": sorted(digests),  # the same set of trajectories in any order
            "explanation_chars": explanation_chars,
            "params": params,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_read(path: Path) -> tuple[dict[str, RulerScore], str] | None:
    """(scores by trajectory digest, the judge's raw answer), or None when there is nothing usable."""
    try:
        data = json.loads(path.read_text())
        return {d: RulerScore.model_validate(s) for d, s in data["scores"].items()}, str(data["answer"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: ask again


def cache_write(path: Path, identity: str, scores: dict[str, RulerScore], answer: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    record = {
        "judge": identity,
        "scores": {d: s.model_dump() for d, s in scores.items()},
        "answer": answer,
    }
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # atomic: concurrent scorers never read half a file
