"""Token ids to the text of each token, for the token view: the run's base-model tokenizer, if this
machine has its `tokenizer.json` (the embedded model's once converted, or a local model directory).

The viewer never converts or downloads a model: without a tokenizer the token view shows ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from journeyman.data.config import DEFAULT_BASE_MODEL
from journeyman.data.paths import cache_dir

Decode = Callable[[list[int]], list[str]]


def _tokenizer_file(base_model: str) -> Path | None:
    """`base_model` comes from a run's state.json: any text. One that names no readable directory
    (a NUL byte, an unknown `~user`, a name too long for the file system) has no tokenizer here."""
    try:
        candidates = [Path(base_model).expanduser() / "tokenizer.json"]
        if base_model == DEFAULT_BASE_MODEL:
            candidates.insert(0, cache_dir() / "models" / base_model / "tokenizer.json")
        return next((p for p in candidates if p.is_file()), None)
    except (OSError, ValueError, RuntimeError):
        return None


@functools.lru_cache(maxsize=8)
def token_decoder(base_model: str) -> Decode | None:
    """A function from ids to one string per id, or None when no tokenizer is at hand."""
    path = _tokenizer_file(base_model)
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # the light client: ids only
        return None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # a file that is not a tokenizer (the library raises a bare Exception): ids only
        return None

    def decode(ids: list[int]) -> list[str]:
        return tok.decode_batch([[i] for i in ids], skip_special_tokens=False)

    return decode


__all__ = ["Decode", "token_decoder"]
