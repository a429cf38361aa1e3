"""The common start of token sequences, which the engine and the trainer each run once for all rows."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MIN_SHARED_PREFIX", "common_prefix_length"]

# A shared prefix shorter than this is run per sequence: sharing it saves less than the extra pass costs.
MIN_SHARED_PREFIX = 32


def common_prefix_length(seqs: Sequence[Sequence[int]], limit: int) -> int:
    """How many leading tokens all `seqs` have in common, at most `limit`."""
    n = min(limit, *(len(s) for s in seqs))
    first = seqs[0]
    for other in seqs[1:]:
        for i in range(n):
            if first[i] != other[i]:
                n = i
                break
    return n
