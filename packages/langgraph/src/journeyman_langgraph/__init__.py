"""Journeyman for LangGraph: train on the runs of a graph you already have, with two decorators.

    from journeyman_langgraph import chat_model, trainable, trajectory

    llm = trainable(chat_model(model))          # the trained policy (or mark a node: @trainable)
    agent = create_agent(llm, tools=[...])

    @trajectory(model)                          # one episode -> one Trajectory
    async def rollout(scenario) -> float:
        out = await agent.ainvoke({"messages": [("user", scenario.question)]})
        return reward(out)

    traj = await rollout(scenario)              # exact token records of every trained call

ART users: `wrap_rollout(model)` is `trajectory(model)` (the function may return the reward or a
Trajectory), `init_chat_model()` is `init_chat_model()`.
"""

from ._capture import TRAINABLE_TAG
from ._chat import chat_model
from ._decorators import current_trajectory, init_chat_model, trainable, trajectory

__all__ = [
    "TRAINABLE_TAG",
    "chat_model",
    "current_trajectory",
    "init_chat_model",
    "trainable",
    "trajectory",
]
