"""Journeyman MCP·RL: train a model to use any MCP server's tools.

server (connect, list tools, session pool) → scenarios (generate, dedupe, split) → rollout (multi-turn
episodes against the real server) → reward (RULER + end-state checks) → train (GRPO via the core) →
winrate (the judge compares the trained runs with a baseline's on held-out scenarios).
"""

from .players import Player
from .reward import RUBRIC, score_group
from .rollout import COMPLETE_TASK, RolloutConfig, rollout
from .scenarios import (
    DIFFICULTY,
    Check,
    Scenario,
    ScenarioSet,
    ToolCallSpec,
    generate_scenarios,
    schema_scenarios,
)
from .server import ServerInfo, ServerSpec, ServerUnavailableError, SessionPool
from .train import EvalSummary, McpRlSettings, TrainReport, evaluate, train
from .winrate import WinRate, win_rate

__all__ = [
    "COMPLETE_TASK",
    "DIFFICULTY",
    "RUBRIC",
    "Check",
    "EvalSummary",
    "McpRlSettings",
    "Player",
    "RolloutConfig",
    "Scenario",
    "ScenarioSet",
    "ServerInfo",
    "ServerSpec",
    "ServerUnavailableError",
    "SessionPool",
    "ToolCallSpec",
    "TrainReport",
    "WinRate",
    "evaluate",
    "generate_scenarios",
    "rollout",
    "schema_scenarios",
    "score_group",
    "train",
    "win_rate",
]
