"""Journeyman: on-the-job reinforcement learning for LLM agents."""

from .adapter import LoraConfig
from .backend import LocalBackend
from .capture import CapturedCall
from .errors import (
    BaseModelNotFoundError,
    EmptyGroupError,
    InvalidFieldError,
    JourneymanError,
    NoTrainableTokensError,
    TooManyExceptionsError,
    UnknownModelError,
)
from .gather import gather_trajectory_groups
from .model import TrainableModel
from .ruler import RulerJudgeError, ruler_score_group
from .train import TrainConfig, TrainResult
from .types import History, RolloutException, TokenRecord, Trajectory, TrajectoryGroup, record_of
from .weights import DEFAULT_BASE_MODEL

__all__ = [
    "DEFAULT_BASE_MODEL",
    "BaseModelNotFoundError",
    "CapturedCall",
    "EmptyGroupError",
    "History",
    "InvalidFieldError",
    "JourneymanError",
    "LocalBackend",
    "LoraConfig",
    "NoTrainableTokensError",
    "RolloutException",
    "RulerJudgeError",
    "TokenRecord",
    "TooManyExceptionsError",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "UnknownModelError",
    "gather_trajectory_groups",
    "record_of",
    "ruler_score_group",
]
