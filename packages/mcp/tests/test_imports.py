"""The public names of journeyman_mcp: the API changes only on purpose."""

from __future__ import annotations

import journeyman_mcp


def test_public_names() -> None:
    assert sorted(journeyman_mcp.__all__) == [
        "COMPLETE_TASK",
        "Check",
        "DIFFICULTY",
        "EvalSummary",
        "McpRlSettings",
        "Player",
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
        "WinRate",
        "evaluate",
        "generate_scenarios",
        "rollout",
        "schema_scenarios",
        "score_group",
        "train",
        "win_rate",
    ]
    for name in journeyman_mcp.__all__:
        assert getattr(journeyman_mcp, name) is not None
