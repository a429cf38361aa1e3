"""ART's client API on Journeyman: `import journeyman.art as art` runs code written for OpenPipe's ART.

The names and call shapes of ART (`art.Model`, `art.TrainableModel`, `art.Trajectory`,
`art.TrajectoryGroup`, `art.gather_trajectory_groups`, `backend.train(model, groups, learning_rate=...)`,
`model.log(groups, metrics=..., step=..., split=...)`, `model.train_sft`, `art.retry`, `art.dev`, and
the submodules `.local` (`.local.backend`), `.rewards`, `.utils` (`.utils.iterate_dataset`,
`.utils.sft`), `.langgraph`, `.gather`, `.trajectories`), with ART's defaults where ART code relies on
them (a learning rate of 5e-6, runs under `.art/`). Underneath they are Journeyman's own objects, so
everything Journeyman records and checks applies. ART's GPU settings are translated where
Journeyman has the knob and warned about, once, where it does not. What of ART's latest release
(`openpipe-art` 0.5.23) Journeyman does not have raises `ArtFeatureNotSupported`, naming the feature
and what to use instead (`journeyman.art._unsupported`). See docs/migrating-from-art.md.
"""

from __future__ import annotations

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

from journeyman import Backend, Trajectory, TrajectoryGroup
from journeyman.art import dev
from journeyman.art._model import Model, TrainableModel
from journeyman.art._types import LocalTrainResult, TrainConfig, TrainResult, TrainSFTConfig
from journeyman.art._unsupported import ArtFeatureNotSupported, install_refused_modules, module_getattr
from journeyman.art.dev import LoRAConfig
from journeyman.art.gather import gather_trajectories, gather_trajectory_groups, trajectory_group_batches
from journeyman.art.utils import retry
from journeyman.chat.messages import Message
from journeyman.data.types import MessageOrChoice, Tool

if TYPE_CHECKING:
    from journeyman.art import langgraph, local, rewards, trajectories, utils

# ART code reaches its submodules as attributes (`art.utils.iterate_dataset` after `import art`): loaded
# on first use, so `import journeyman.art` stays as light as `import journeyman` (`local` needs the backend).
_SUBMODULES = ("langgraph", "local", "rewards", "trajectories", "utils")
_refused = module_getattr("art", __name__)
install_refused_modules()  # `import journeyman.art.serverless.backend` and the like: named errors


def __getattr__(name: str) -> object:
    if name not in _SUBMODULES:
        return _refused(name)
    return _import_module(f"{__name__}.{name}")


Messages = list[Message]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[Tool]

__all__ = [
    "ArtFeatureNotSupported",
    "Backend",
    "LoRAConfig",
    "LocalTrainResult",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
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
    "trajectories",
    "trajectory_group_batches",
    "utils",
]
