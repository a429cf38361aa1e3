"""ART's client API on Journeyman: `import journeyman.art as art` runs code written for OpenPipe's ART.

The names and call shapes of ART (`art.Model`, `art.TrainableModel`, `art.Trajectory`,
`art.TrajectoryGroup`, `art.gather_trajectory_groups`, `backend.train(model, groups, learning_rate=...)`,
`model.log(groups, metrics=..., step=..., split=...)`, `art.retry`, `art.dev`, and the submodules
`.local`, `.rewards`, `.utils`, `.langgraph`), with ART's defaults where ART code relies on them
(a learning rate of 5e-6, runs under `.art/`). Underneath they are Journeyman's own objects, so
everything Journeyman records and checks applies. ART's GPU settings are translated where
Journeyman has the knob and warned about, once, where it does not. See docs/migrating-from-art.md.
"""

from __future__ import annotations

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

from journeyman import Backend, Trajectory, TrajectoryGroup
from journeyman.art import dev
from journeyman.art._gather import gather_trajectories, gather_trajectory_groups, trajectory_group_batches
from journeyman.art._model import Model, TrainableModel
from journeyman.art._types import LocalTrainResult, TrainConfig, TrainResult
from journeyman.art.utils import retry
from journeyman.chat.messages import Message
from journeyman.data.types import MessageOrChoice, Tool

if TYPE_CHECKING:
    from journeyman.art import langgraph, local, rewards, utils

# ART code reaches its submodules as attributes (`art.utils.iterate_dataset` after `import art`): loaded
# on first use, so `import journeyman.art` stays as light as `import journeyman` (`local` needs the backend).
_SUBMODULES = ("langgraph", "local", "rewards", "utils")


def __getattr__(name: str) -> object:
    if name not in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _import_module(f"{__name__}.{name}")


Messages = list[Message]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[Tool]

__all__ = [
    "Backend",
    "LocalTrainResult",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "dev",
    "gather_trajectories",
    "gather_trajectory_groups",
    "langgraph",
    "local",
    "retry",
    "rewards",
    "trajectory_group_batches",
    "utils",
]
