"""What Agents SDK users do every day, through `TrainableRunner` on the real model (issue 36): an
`output_type` agent with a tool (the call forced, then an answer that must fit the schema, with tools
still offered), and `run_streamed` receiving the answer in many deltas on both APIs."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from agents import Agent, ModelSettings, function_tool
from journeyman_agents import TrainableRunner
from openai.types.responses import ResponseTextDeltaEvent
from pydantic import BaseModel

pytestmark = pytest.mark.integration


@function_tool
def get_weather(city: Literal["Paris", "Lima"]) -> str:
    """Current weather for a city."""
    return f"It is sunny and 21 C in {city}."


class Report(BaseModel):
    city: Literal["Paris", "Lima"]
    sunny: bool


async def test_an_output_type_agent_may_call_its_tool_and_answers_only_in_the_schema(
    served: tuple[Any, Any],
) -> None:
    """The forced first turn calls the tool (a response schema no longer refuses it); every later,
    unforced turn, the tool still offered, is either a call of it or an answer in the schema, never
    free text (before, the schema's grammar left the model no way to call a tool at all)."""
    model, _ = served
    agent = Agent(
        name="Weather",
        instructions="Use get_weather, then report the weather.",
        tools=[get_weather],
        output_type=Report,
        model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=1.0),
    )
    # the SDK's default API; any draw: what is checked is what the grammar allows
    runner = TrainableRunner(model, api="responses")
    result, traj = await runner.run(agent, "Weather in Lima?", max_turns=3)
    turns = [m for m in traj.messages() if m["role"] == "assistant"]
    assert turns and turns[0].get("tool_calls"), turns  # the forced call
    for turn in turns[1:]:
        calls = turn.get("tool_calls") or []
        if calls:
            assert all(c["function"]["name"] == "get_weather" for c in calls)
        else:
            Report.model_validate_json(turn["content"])
    if result is not None:
        assert isinstance(result.final_output, Report)


async def test_run_streamed_gets_the_answer_in_many_deltas(served: tuple[Any, Any]) -> None:
    """On the SDK's default API (the chat route's streaming is tested in core and LangGraph)."""
    model, _ = served
    agent = Agent(
        name="Teller",
        instructions="Answer in one sentence.",
        model_settings=ModelSettings(max_tokens=128, temperature=0.0),
    )
    streamed = TrainableRunner(model).run_streamed(agent, "What is a dog?")
    deltas = [
        e.data.delta
        async for e in streamed.stream_events()
        if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)
    ]
    traj = await streamed.trajectory()
    assert len(deltas) > 1, deltas
    assert "".join(deltas) == streamed.result.final_output == traj.messages()[-1]["content"]
