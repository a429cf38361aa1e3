"""The real Agents SDK on the real model: runs become trajectories with the engine's exact tokens.

"Exact" is checked against the engine itself: each record's completion ids, fed back with its
prompt ids through the served policy, give back the logprobs the engine recorded while sampling,
and decode to what the SDK saw (tool name and arguments, or text).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from agents import Agent, ModelSettings, RunConfig, function_tool, handoff
from agents.items import ToolCallItem
from agents.tracing import Span, Trace, TracingProcessor, add_trace_processor
from journeyman import History, TokenRecord, Trajectory
from journeyman.responses_api import chat_messages
from journeyman_agents import TrainableRunner
from journeyman_agents._tracing import _key_from_output

pytestmark = pytest.mark.integration
APIS = ["responses", "chat_completions"]


@function_tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"It is sunny and 21 C in {city}."


def _weather_agent(**settings: Any) -> Agent[Any]:
    return Agent(
        name="Weather",
        instructions="You answer weather questions. Use the get_weather tool, then answer in one sentence.",
        tools=[get_weather],
        # the 135M model rarely calls tools on its own: force the first call (grammar-constrained);
        # reset_tool_choice (the SDK default) lets the next turn answer freely.
        # 64, not 40: the forced call's free-text argument can run long at temperature 1, and a streamed
        # Responses run that hits max_tokens ends `response.incomplete`, which the SDK raises on.
        model_settings=ModelSettings(tool_choice="required", max_tokens=64, **settings),
    )


def _check_exact(backend: Any, model: Any, history: History) -> list[TokenRecord]:
    """Every record's ids are what the engine sampled: a teacher-forced pass gives its logprobs."""
    service = backend.service(model)
    records = history.records()
    assert records and len(records) == len(
        [x for x in history.messages_and_choices if not isinstance(x, dict)]
    )
    for rec in records:
        ids = torch.tensor([rec.prompt_token_ids + rec.token_ids])
        with service.policy.lock, torch.inference_mode():
            logits = service.policy.model(input_ids=ids).logits[0].float()
        start = len(rec.prompt_token_ids)
        logp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
        mine = logp.gather(1, torch.tensor(rec.token_ids)[:, None]).squeeze(1)
        assert len(rec.logprobs) == len(rec.token_ids)
        assert torch.allclose(mine, torch.tensor(rec.logprobs), atol=2e-3), (mine, rec.logprobs)
    return records


def _decoded_call(backend: Any, model: Any, rec: TokenRecord) -> tuple[str, dict[str, Any]]:
    fmt = backend.service(model).chat_format
    text = fmt.completion_text(rec.token_ids)
    calls = fmt.parse(text).tool_calls
    assert len(calls) == 1, text
    return calls[0]["name"], json.loads(calls[0]["arguments"])


def _decoded_text(backend: Any, model: Any, rec: TokenRecord) -> str:
    return backend.service(model).chat_format.tokenizer.decode(rec.token_ids, skip_special_tokens=True)


def _sdk_calls(items: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for item in items:
        if isinstance(item, ToolCallItem):
            raw = item.raw_item
            name = raw.name if hasattr(raw, "name") else raw["name"]
            args = raw.arguments if hasattr(raw, "arguments") else raw["arguments"]
            out.append((name, json.loads(args)))
    return out


def test_responses_input_items_become_chat_messages() -> None:
    """A sampled turn (text + calls) sent back as Responses items is one assistant message again."""
    messages = chat_messages(
        "be brief",
        [
            {"role": "user", "content": "weather in Oslo?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    )
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    # a generation span holds a chat message, or (streamed) a Responses dump: same key either way
    chat = [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    ]
    dump = [{"output": [{"type": "function_call", "name": "f", "arguments": "{}", "call_id": "x"}]}]
    assert _key_from_output(chat) == _key_from_output(dump)


@pytest.mark.parametrize("api", APIS)
async def test_function_tool_runs_concurrently(served: tuple[Any, Any], api: str) -> None:
    model, backend = served
    runner = TrainableRunner(model, api=api)
    agent = _weather_agent()
    # concurrent runs on one API (they must not share calls); one run on the other, to save CPU time
    cities = ["Paris", "Tokyo"] if api == "responses" else ["Paris"]
    runs = await asyncio.gather(*(runner.run(agent, f"What is the weather in {c}?") for c in cities))
    for city, (result, traj) in zip(cities, runs, strict=True):
        assert isinstance(traj, Trajectory) and not traj.additional_histories
        # only this run's calls: its own question, a tool call, the tool result, the answer
        assert traj.messages()[1] == {"role": "user", "content": f"What is the weather in {city}?"}
        assert traj.metadata["agents"] == ["Weather"] and traj.metrics["llm_calls"] == 2
        first, second = _check_exact(backend, model, traj)
        # the tool call the SDK executed is the one decoded from the sampled ids
        assert [_decoded_call(backend, model, first)] == _sdk_calls(result.new_items)
        tool_msg = next(m for m in traj.messages() if m["role"] == "tool")
        assert "sunny" in tool_msg["content"]
        # one token sequence: turn 2's prompt holds turn 1's sampled ids verbatim
        assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.token_ids)] == (
            first.prompt_token_ids + first.token_ids
        )
        assert second.spliced_turns == 1
        assert traj.metadata["final_output"] == result.final_output == _decoded_text(backend, model, second)


class _UserProcessor(TracingProcessor):
    """Stands for a user's own trace processor: it must keep receiving spans."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def on_trace_start(self, trace: Trace) -> None:
        pass

    def on_trace_end(self, trace: Trace) -> None:
        pass

    def on_span_start(self, span: Span[Any]) -> None:
        pass

    def on_span_end(self, span: Span[Any]) -> None:
        self.kinds.append(span.span_data.type)

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


async def test_triage_hands_off_to_specialist(served: tuple[Any, Any]) -> None:
    model, backend = served
    user_processor = _UserProcessor()
    add_trace_processor(user_processor)
    specialist = Agent(
        name="Billing",
        instructions="You are a billing specialist. Reply in one short sentence.",
        model_settings=ModelSettings(max_tokens=16),
    )
    triage = Agent(
        name="Triage",
        instructions="Route the customer to the right specialist.",
        handoffs=[handoff(specialist)],
        model_settings=ModelSettings(tool_choice="required", max_tokens=40),
    )
    # only the specialist is trained; the triage turn is kept, untrainable
    runner = TrainableRunner(model, api="responses", trained_agents={"Billing"})
    result, traj = await runner.run(triage, "I was charged twice this month.")
    assert result.last_agent.name == "Billing"
    assert traj.metadata["agents"] == ["Billing", "Triage"] and traj.metadata["last_agent"] == "Billing"
    (triage_history,) = traj.additional_histories
    assert not triage_history.trainable
    (transfer,) = _check_exact(backend, model, triage_history)
    assert _decoded_call(backend, model, transfer)[0] == "transfer_to_billing"
    (answer,) = _check_exact(backend, model, traj)
    assert _decoded_text(backend, model, answer) == result.final_output
    assert traj.messages()[0]["content"].startswith("You are a billing specialist")
    assert traj.messages()[-1]["content"] == result.final_output
    assert "generation" not in user_processor.kinds and "response" in user_processor.kinds


@pytest.mark.parametrize("api", APIS)
async def test_streamed_run(served: tuple[Any, Any], api: str) -> None:
    model, backend = served
    runner = TrainableRunner(model, api=api)
    agent = _weather_agent().clone(tool_use_behavior="stop_on_first_tool")
    streamed = runner.run_streamed(agent, "Weather in Lima?")
    kinds = [event.type async for event in streamed.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    traj = await streamed.trajectory()
    (record,) = _check_exact(backend, model, traj)
    assert [_decoded_call(backend, model, record)] == _sdk_calls(streamed.result.new_items)
    assert streamed.result.final_output == "It is sunny and 21 C in {}.".format(
        _sdk_calls(streamed.result.new_items)[0][1]["city"]
    )
    assert traj.metadata["agents"] == ["Weather"]


async def test_tracing_disabled_still_gives_records(served: tuple[Any, Any]) -> None:
    model, backend = served
    runner = TrainableRunner(model, api="chat_completions")
    agent = _weather_agent().clone(tool_use_behavior="stop_on_first_tool")
    _, traj = await runner.run(agent, "Weather in Rome?", run_config=RunConfig(tracing_disabled=True))
    _check_exact(backend, model, traj)
    assert traj.metadata["agents"] == [None] and "tracing disabled" in traj.logs[0]
