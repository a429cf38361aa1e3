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

from journeyman import Backend, Trajectory, TrajectoryGroup
from journeyman.art import dev
from journeyman.art._gather import gather_trajectories, gather_trajectory_groups, trajectory_group_batches
from journeyman.art._model import Model, TrainableModel
from journeyman.art._types import LocalTrainResult, TrainConfig, TrainResult
from journeyman.art.utils import retry
from journeyman.chat.messages import Message
from journeyman.data.types import MessageOrChoice, Tool

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
    "retry",
    "trajectory_group_batches",
]
