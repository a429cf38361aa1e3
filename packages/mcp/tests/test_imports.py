"""The public names of journeyman_mcp: the API changes only on purpose."""

from __future__ import annotations

import journeyman_mcp


def test_public_names() -> None:
    assert sorted(journeyman_mcp.__all__) == [
        "COMPLETE_TASK",
        "Check",
        "EvalSummary",
        "McpRlSettings",
        "RUBRIC",
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
    for name in journeyman_mcp.__all__:
        assert getattr(journeyman_mcp, name) is not None
