"""Captured endpoint calls + the SDK's spans -> one Trajectory.

Each call the endpoint served for a run is joined to the model-call span the SDK traced for it
(see `_tracing`), which names the agent. Calls then form histories: a call continues the latest
history of the same agent whose last prompt + completion its own prompt starts with (the endpoint
splices sampled turns, so an agent's tool loop is one token sequence); otherwise it starts a new
one. After a handoff the specialist has its own system prompt, so it gets its own history.

The first trained history is the trajectory's main conversation; the others are additional
histories, `trainable` when their agent is trained.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from journeyman import History, TokenRecord, Trajectory
from journeyman.capture import CapturedCall
from journeyman.chat_format import assistant_key, openai_message
from journeyman.responses_api import response_id_of
from openai.types.chat.chat_completion import Choice

from ._tracing import SpanInfo, agent_of


def agents_of_calls(calls: list[CapturedCall], spans: list[SpanInfo]) -> list[str | None]:
    """The agent behind each call (None when the SDK traced nothing for it)."""
    model_spans = [s for s in spans if s.model_call]
    used: set[int] = set()
    agents: list[str | None] = []
    for call in calls:
        msg = call.response["choices"][0]["message"]
        keys = {response_id_of(call.response["id"]), assistant_key(msg.get("content"), msg.get("tool_calls"))}
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


@dataclass
class _Chain:
    agent: str | None
    trainable: bool
    tools: list[dict[str, Any]] | None
    items: list[dict[str, Any] | Choice] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # prompt + completion of the last call
    n_request_messages: int = 0


def build_trajectory(
    calls: list[CapturedCall],
    spans: list[SpanInfo],
    trained_agents: Collection[str] | None = None,
) -> Trajectory:
    """The run's trajectory; `trained_agents=None` trains every agent's calls."""
    agents = agents_of_calls(calls, spans)
    chains: list[_Chain] = []
    for call, agent in zip(calls, agents, strict=True):
        raw = call.response["choices"][0]
        choice = Choice.model_validate(raw)
        rec = TokenRecord.model_validate(raw["journeyman"])
        prompt = rec.prompt_token_ids
        chain = next(
            (
                c
                for c in reversed(chains)
                if c.agent == agent and len(prompt) >= len(c.ids) and prompt[: len(c.ids)] == c.ids
            ),
            None,
        )
        if chain is None:
            trainable = trained_agents is None or (agent is not None and agent in trained_agents)
            chain = _Chain(agent=agent, trainable=trainable, tools=call.tools)
            chains.append(chain)
            new = call.request_messages
        else:  # skip what the chain holds: its messages and the choice standing for the assistant turn
            new = call.request_messages[chain.n_request_messages + 1 :]
        chain.items += [openai_message(m) for m in new]
        chain.items.append(choice)
        chain.ids = [*prompt, *rec.token_ids]
        chain.n_request_messages = len(call.request_messages)

    main = next((c for c in chains if c.trainable), None)
    others = [c for c in chains if c is not main]
    trajectory = Trajectory(
        messages_and_choices=main.items if main else [],
        tools=main.tools if main else None,
        additional_histories=[
            History(messages_and_choices=c.items, tools=c.tools, trainable=c.trainable) for c in others
        ],
    )
    trajectory.metadata["agents"] = [c.agent for c in ([main] if main else []) + others]
    trajectory.metrics["llm_calls"] = len(calls)
    if calls and all(a is None for a in agents):
        trajectory.log("no model-call spans for this run (tracing disabled?): agents unknown")
    return trajectory
