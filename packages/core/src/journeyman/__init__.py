"""Journeyman: on-the-job reinforcement learning for LLM agents.

`import journeyman` is light (no torch, nothing started): the engine, the trainer and their
libraries load when a backend first serves a model.
"""

from .backend import Backend, Inference, current_backend
from .capture import CAPTURE_HEADER, CapturedCall, capture_scope
from .config import (
    DEFAULT_BASE_MODEL,
    LoraConfig,
    ModelConfig,
    SFTConfig,
    TrainConfig,
    TrainerConfig,
    TrainResult,
)
from .connect import open_backend
from .engine.vllm_server import VLLMConfig
from .errors import (
    AuthenticationError,
    BackendUnavailableError,
    BaseModelNotFoundError,
    ChatTemplateError,
    CheckpointError,
    EmptyGroupError,
    EngineDownError,
    EngineTimeoutError,
    InvalidFieldError,
    JourneymanError,
    NoTrainableTokensError,
    ProtocolMismatchError,
    RemoteError,
    RolloutDroppedError,
    TooManyExceptionsError,
    TrainerRankError,
    UnknownModelError,
)
from .failures import OnError
from .gather import gather_trajectory_groups
from .local_backend import LocalBackend
from .model import Capture, TrainableModel
from .remote_backend import RemoteBackend
from .ruler import RulerConfig, RulerJudgeError, ruler_score_group
from .tracking import Tracker
from .trajectory_file import read_trajectories, write_trajectories
from .types import History, RolloutException, TokenRecord, Trajectory, TrajectoryGroup, record_of

__all__ = [
    "CAPTURE_HEADER",
    "DEFAULT_BASE_MODEL",
    "AuthenticationError",
    "Backend",
    "BackendUnavailableError",
    "BaseModelNotFoundError",
    "Capture",
    "CapturedCall",
    "ChatTemplateError",
    "CheckpointError",
    "EmptyGroupError",
    "EngineDownError",
    "EngineTimeoutError",
    "History",
    "Inference",
    "InvalidFieldError",
    "JourneymanError",
    "LocalBackend",
    "LoraConfig",
    "ModelConfig",
    "NoTrainableTokensError",
    "OnError",
    "ProtocolMismatchError",
    "RemoteBackend",
    "RemoteError",
    "RolloutDroppedError",
    "RolloutException",
    "RulerConfig",
    "RulerJudgeError",
    "SFTConfig",
    "TokenRecord",
    "TooManyExceptionsError",
    "Tracker",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "TrainerConfig",
    "TrainerRankError",
    "Trajectory",
    "TrajectoryGroup",
    "UnknownModelError",
    "VLLMConfig",
    "capture_scope",
    "current_backend",
    "gather_trajectory_groups",
    "open_backend",
    "read_trajectories",
    "record_of",
    "ruler_score_group",
    "write_trajectories",
]
