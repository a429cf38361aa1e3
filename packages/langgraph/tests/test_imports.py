"""The public names of journeyman_langgraph: the API changes only on purpose."""

from __future__ import annotations

import journeyman_langgraph


def test_public_names() -> None:
    assert sorted(journeyman_langgraph.__all__) == [
        "TRAINABLE_TAG",
        "chat_model",
        "current_trajectory",
        "init_chat_model",
        "trainable",
        "trajectory",
    ]
    for name in journeyman_langgraph.__all__:
        assert getattr(journeyman_langgraph, name) is not None
