"""Trajectories in a `.jsonl` file: one Trajectory or TrajectoryGroup JSON object per line.

The format the run directory's `trajectories/<split>/<step>.jsonl` and `journeyman langfuse pull`
write (groups), and the one `journeyman sft` and `mcp-rl train --sft-warmup` read (either).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError


def read_trajectories(path: str | Path, *, min_reward: float | None = None) -> list[Trajectory]:
    """Every trajectory in the file (a group's in order), keeping those with reward >= `min_reward`.

    A bad line raises InvalidFieldError naming the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise InvalidFieldError("path", str(path), "no such file")
    out: list[Trajectory] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path.name}:{n}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidFieldError(where, line[:80], f"is not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(raw, dict):
            raise InvalidFieldError(where, raw, "expected a Trajectory or TrajectoryGroup JSON object")
        try:
            if "trajectories" in raw:
                out += TrajectoryGroup.model_validate(raw).trajectories
            else:
                out.append(Trajectory.model_validate(raw))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise InvalidFieldError(f"{where} {loc}".strip(), err.get("input"), err["msg"]) from None
        except InvalidFieldError as e:  # our own validators (a non-finite reward, ...) name the field
            raise InvalidFieldError(f"{where} {e.field}", e.value, e.reason) from None
    if min_reward is not None:
        out = [t for t in out if t.reward >= min_reward]
    if not out:
        kept = f" with reward >= {min_reward}" if min_reward is not None else ""
        raise InvalidFieldError("path", str(path), f"holds no trajectories{kept}")
    return out


def check_trajectories(
    items: Iterable[Trajectory | TrajectoryGroup],
) -> tuple[list[Trajectory | TrajectoryGroup], list[Trajectory]]:
    """(the items as given, every trajectory in them): loose trajectories and finished groups, as
    `train_sft` takes them; anything else raises InvalidFieldError naming `trajectories[i]`."""
    # a pydantic model iterates over its fields: one Trajectory is refused, not read as its fields
    if isinstance(items, Trajectory | TrajectoryGroup | str | bytes | dict) or not isinstance(
        items, Iterable
    ):
        raise InvalidFieldError("trajectories", items, "expected a list of Trajectory or TrajectoryGroup")
    given = list(items)
    flat: list[Trajectory] = []
    for i, item in enumerate(given):
        if isinstance(item, Trajectory):
            flat.append(item)
        elif isinstance(item, TrajectoryGroup) and not item.pending:
            flat += item.trajectories
        else:
            raise InvalidFieldError(
                f"trajectories[{i}]", item, "expected a Trajectory or a finished TrajectoryGroup"
            )
    if not flat:
        raise InvalidFieldError("trajectories", given, "need at least one trajectory")
    return given, flat


def write_trajectories(path: str | Path, items: Iterable[Trajectory | TrajectoryGroup]) -> Path:
    """One JSON object per line, readable by `read_trajectories`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for item in items:
            f.write(item.model_dump_json() + "\n")
    return path


__all__ = ["check_trajectories", "read_trajectories", "write_trajectories"]
