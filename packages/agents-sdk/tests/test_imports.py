"""The public names of journeyman_agents: the API changes only on purpose."""

from __future__ import annotations

import journeyman_agents


def test_public_names() -> None:
    assert sorted(journeyman_agents.__all__) == [
        "AgentRun",
        "JourneymanModelProvider",
        "ModelAPI",
        "SpanCollector",
        "StreamedAgentRun",
        "TrainableRunner",
        "build_trajectory",
    ]
    for name in journeyman_agents.__all__:
        assert getattr(journeyman_agents, name) is not None
