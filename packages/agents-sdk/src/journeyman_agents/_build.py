"""Captured endpoint calls + the SDK's spans -> one Trajectory.

Each call the endpoint served for a run is joined to the model-call span the SDK traced for it
(see `_tracing`), which names the agent. The calls then form histories by core's one rule
(`journeyman.integrations.Episode.join`), partitioned by agent: an agent's tool loop is one token sequence, and
after a handoff the specialist has its own system prompt, so it gets its own history.

The first trained history is the trajectory's main conversation; the others are additional
histories, `trainable` when their agent is trained.
"""

from __future__ import annotations

from collections.abc import Collection

from journeyman import CapturedCall, Trajectory
from journeyman.integrations import Episode, assistant_key

from ._tracing import SpanInfo, agent_of


def agents_of_calls(calls: list[CapturedCall], spans: list[SpanInfo]) -> list[str | None]:
    """The agent behind each call (None when the SDK traced nothing for it)."""
    model_spans = [s for s in spans if s.model_call]
    used: set[int] = set()
    agents: list[str | None] = []
    for call in calls:
        msg = call.response["choices"][0]["message"]
        keys = {
            call.response_id or call.response["id"],
            assistant_key(msg.get("content"), msg.get("tool_calls")),
        }
        free = [j for j in range(len(model_spans)) if j not in used]
        # exact key first; spans without data (sensitive data off) in call order
        j = next((j for j in free if model_spans[j].key in keys), None)
        if j is None:
            j = next((j for j in free if model_spans[j].key is None), None)
        if j is None:
            agents.append(None)
            continue
        used.add(j)
        agents.append(agent_of(model_spans[j], spans))
    return agents


def build_trajectory(
    calls: list[CapturedCall],
    spans: list[SpanInfo],
    trained_agents: Collection[str] | None = None,
) -> Trajectory:
    """The run's trajectory; `trained_agents=None` trains every agent's calls."""
    return fill_trajectory(Episode(), calls, spans, trained_agents)


def fill_trajectory(
    episode: Episode,
    calls: list[CapturedCall],
    spans: list[SpanInfo],
    trained_agents: Collection[str] | None = None,
) -> Trajectory:
    """Join `calls` (partitioned by the agent behind each) onto `episode`'s trajectory."""
    agents = agents_of_calls(calls, spans)
    histories = episode.join(calls, agents, trained=trained_agents)
    trajectory = episode.trajectory
    trajectory.metadata["agents"] = [h.partition for h in histories]
    trajectory.metrics["llm_calls"] = len(calls)
    if calls and all(a is None for a in agents):
        trajectory.log("no model-call spans for this run (tracing disabled?): agents unknown")
    return trajectory
