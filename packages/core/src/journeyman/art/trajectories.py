"""`art.trajectories`: ART's Trajectory and TrajectoryGroup (Journeyman's own); ART's capture and
tokenization helpers of this module raise ArtFeatureNotSupported naming what to use instead."""

from __future__ import annotations

from journeyman import Trajectory, TrajectoryGroup
from journeyman.art._unsupported import NOT_SUPPORTED, refuse


def __getattr__(name: str) -> object:
    # ART re-exports these from here as `art.<name>`: the same refusal under either path
    if f"art.{name}" in NOT_SUPPORTED:
        refuse(f"art.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Trajectory", "TrajectoryGroup"]
