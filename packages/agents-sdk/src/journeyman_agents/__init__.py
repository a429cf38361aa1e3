"""Journeyman integration for the OpenAI Agents SDK: run agents on a trainable model, get trajectories.

runner = TrainableRunner(model)                     # or api="chat_completions"
result, trajectory = await runner.run(agent, "hi")  # RunResult + Trajectory (exact token ids)
"""

from __future__ import annotations

from ._build import build_trajectory
from ._provider import JourneymanModelProvider, ModelAPI
from ._runner import AgentRun, StreamedAgentRun, TrainableRunner
from ._tracing import SpanCollector

__all__ = [
    "AgentRun",
    "JourneymanModelProvider",
    "ModelAPI",
    "SpanCollector",
    "StreamedAgentRun",
    "TrainableRunner",
    "build_trajectory",
]
