"""Journeyman: on-the-job reinforcement learning for LLM agents.

`import journeyman` is light (no torch, nothing started) and works on the light install
(`pip install journeyman`: RemoteBackend, TrainableModel, RULER, the integrations). The names of the
machine that trains (`LocalBackend`, `open_backend`, `Tracker`, `VLLMConfig`) load their modules
on first use; constructing a `LocalBackend` without `pip install 'journeyman[backend]'` says so.
"""

from __future__ import annotations

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

from journeyman.client.model import Capture, TrainableModel
from journeyman.client.pipeline_trainer import PipelineConfig, PipelineResult, PipelineTrainer
from journeyman.client.protocol import (
    Backend,
    Inference,
    LiveBackend,
    MeteredBackend,
    charging,
    current_backend,
)
from journeyman.client.remote import RemoteBackend
from journeyman.client.train_loop import TrainLoop
from journeyman.data.budget import Budget, BudgetExceededError
from journeyman.data.config import (
    DEFAULT_BASE_MODEL,
    DistillConfig,
    LoraConfig,
    ModelConfig,
    SFTConfig,
    Teacher,
    TrainConfig,
    TrainerConfig,
    TrainResult,
)
from journeyman.data.failures import OnError
from journeyman.data.live_types import GateConfig, LiveConfig, LiveStatus
from journeyman.data.trajectory_file import read_trajectories, write_trajectories
from journeyman.data.types import (
    History,
    RolloutException,
    TokenRecord,
    Trajectory,
    TrajectoryGroup,
    record_of,
)
from journeyman.errors import (
    AuthenticationError,
    BackendUnavailableError,
    BaseModelNotFoundError,
    ChatTemplateError,
    CheckpointError,
    EmptyGroupError,
    EngineDownError,
    EngineTimeoutError,
    EnvironmentRolloutError,
    EnvironmentWorkerError,
    IdempotencyKeyReusedError,
    ImpossiblePlanError,
    InvalidFieldError,
    JourneymanError,
    NoLearningSignalError,
    NoTrainableTokensError,
    ProtocolMismatchError,
    RemoteError,
    RolloutDroppedError,
    TeacherError,
    TeacherLogprobsError,
    TeacherTokenizerError,
    TeacherUnreachableError,
    TooManyExceptionsError,
    TrainerRankError,
    UnknownModelError,
    WakeMemoryError,
)
from journeyman.rewards.ruler import RulerConfig, RulerJudgeError, ruler_score_group
from journeyman.rollout.capture import CAPTURE_HEADER, CapturedCall, capture_scope
from journeyman.rollout.gather import gather_trajectory_groups

if TYPE_CHECKING:
    from journeyman import environments
    from journeyman.backends.connect import open_backend
    from journeyman.backends.local import LocalBackend
    from journeyman.backends.tracking import Tracker
    from journeyman.engine.vllm_server import VLLMConfig

# The backend's names, imported on first access (module `__getattr__`, PEP 562).
_LAZY = {
    "LocalBackend": "journeyman.backends.local",
    "Tracker": "journeyman.backends.tracking",
    "VLLMConfig": "journeyman.engine.vllm_server",
    "open_backend": "journeyman.backends.connect",
}


# Subpackages imported on first access: `jm.environments` (light, but not needed by every agent).
_LAZY_PACKAGES = ("environments",)


def __getattr__(name: str) -> object:
    if name in _LAZY_PACKAGES:
        value = _import_module(f"{__name__}.{name}")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CAPTURE_HEADER",
    "DEFAULT_BASE_MODEL",
    "AuthenticationError",
    "Backend",
    "BackendUnavailableError",
    "BaseModelNotFoundError",
    "Budget",
    "BudgetExceededError",
    "Capture",
    "CapturedCall",
    "ChatTemplateError",
    "CheckpointError",
    "DistillConfig",
    "EmptyGroupError",
    "EngineDownError",
    "EngineTimeoutError",
    "EnvironmentRolloutError",
    "EnvironmentWorkerError",
    "GateConfig",
    "History",
    "IdempotencyKeyReusedError",
    "ImpossiblePlanError",
    "Inference",
    "InvalidFieldError",
    "JourneymanError",
    "LiveBackend",
    "LiveConfig",
    "LiveStatus",
    "LocalBackend",
    "LoraConfig",
    "MeteredBackend",
    "ModelConfig",
    "NoLearningSignalError",
    "NoTrainableTokensError",
    "OnError",
    "PipelineConfig",
    "PipelineResult",
    "PipelineTrainer",
    "ProtocolMismatchError",
    "RemoteBackend",
    "RemoteError",
    "RolloutDroppedError",
    "RolloutException",
    "RulerConfig",
    "RulerJudgeError",
    "SFTConfig",
    "Teacher",
    "TeacherError",
    "TeacherLogprobsError",
    "TeacherTokenizerError",
    "TeacherUnreachableError",
    "TokenRecord",
    "TooManyExceptionsError",
    "Tracker",
    "TrainConfig",
    "TrainLoop",
    "TrainResult",
    "TrainableModel",
    "TrainerConfig",
    "TrainerRankError",
    "Trajectory",
    "TrajectoryGroup",
    "UnknownModelError",
    "VLLMConfig",
    "WakeMemoryError",
    "capture_scope",
    "charging",
    "current_backend",
    "environments",
    "gather_trajectory_groups",
    "open_backend",
    "read_trajectories",
    "record_of",
    "ruler_score_group",
    "write_trajectories",
]
