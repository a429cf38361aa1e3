"""Journeyman MCP·RL: train a model to use any MCP server's tools.

server (connect, list tools, session pool) → scenarios (generate, dedupe, split) → rollout (multi-turn
episodes against the real server) → reward (RULER + end-state checks) → train (GRPO via the core).
"""

from .reward import RUBRIC, score_group
from .rollout import COMPLETE_TASK, RolloutConfig, rollout
from .scenarios import Check, Scenario, ScenarioSet, ToolCallSpec, generate_scenarios, schema_scenarios
from .server import ServerInfo, ServerSpec, ServerUnavailableError, SessionPool
from .train import EvalSummary, McpRlSettings, TrainReport, evaluate, train

__all__ = [
    "COMPLETE_TASK",
    "RUBRIC",
    "Check",
    "EvalSummary",
    "McpRlSettings",
    "RolloutConfig",
    "Scenario",
    "ScenarioSet",
    "ServerInfo",
    "ServerSpec",
    "ServerUnavailableError",
    "SessionPool",
    "ToolCallSpec",
    "TrainReport",
    "evaluate",
    "generate_scenarios",
    "rollout",
    "schema_scenarios",
    "score_group",
    "train",
]
