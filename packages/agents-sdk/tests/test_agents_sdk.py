"""The real Agents SDK on the real model: runs become trajectories with the engine's exact tokens.

"Exact" is checked against the engine itself: each record's completion ids, fed back with its
prompt ids through the served policy, give back the logprobs the engine recorded while sampling,
and decode to what the SDK saw (tool name and arguments, or text).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Literal

import journeyman as jm
import pytest
import torch
from agents import (
    Agent,
    GuardrailFunctionOutput,
    InputGuardrailTripwireTriggered,
    ModelSettings,
    OutputGuardrailTripwireTriggered,
    RunConfig,
    RunHooks,
    Runner,
    function_tool,
    handoff,
    input_guardrail,
    output_guardrail,
)
from agents.items import ToolCallItem
from agents.run import get_default_agent_runner
from agents.tracing import Span, Trace, TracingProcessor, add_trace_processor, flush_traces, trace
from agents.tracing.processors import default_exporter
from journeyman import History, TokenRecord, Trajectory
from journeyman.serving.responses_api import chat_messages
from journeyman_agents import TrainableRunner
from journeyman_agents._nested import ServingRunner
from journeyman_agents._tracing import EXPORT_NOTICE, _key_from_output
from openai import OpenAIError
from pydantic import BaseModel

pytestmark = pytest.mark.integration
APIS = ["responses", "chat_completions"]


@function_tool
def get_weather(city: Literal["Paris", "Tokyo", "Lima", "Oslo"]) -> str:
    """Current weather for a city."""
    # An enum, not any string: at temperature 1 the 135M model's free-text argument could run past
    # max_tokens, cutting the forced call off, and the run then ended after one LLM call.
    return f"It is sunny and 21 C in {city}."


def _weather_agent(**settings: Any) -> Agent[Any]:
    return Agent(
        name="Weather",
        instructions="You answer weather questions. Use the get_weather tool, then answer in one sentence.",
        tools=[get_weather],
        # the 135M model rarely calls tools on its own: force the first call (grammar-constrained);
        # reset_tool_choice (the SDK default) lets the next turn answer freely.
        # 64, not 40: a streamed Responses run whose answer hits max_tokens ends `response.incomplete`,
        # which the SDK raises on.
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


@input_guardrail(run_in_parallel=False)  # trips before any model call: the run leaves nothing
def _refuse_all(ctx: Any, agent: Agent[Any], input: Any) -> GuardrailFunctionOutput:
    return GuardrailFunctionOutput(output_info="refused", tripwire_triggered=True)


async def test_run_stopped_by_max_turns_is_a_trajectory_and_trains(served: tuple[Any, Any]) -> None:
    _, backend = served
    # a model of its own on the shared backend (one more LoRA policy, ~1 s): this test trains it
    model = jm.TrainableModel(name="agents-failed-runs", project="tests")
    await model.register(backend)
    # greedy forced tool calls that never end in an answer: max_turns=2 stops the run after two calls
    looping = _weather_agent(temperature=0.0).clone(reset_tool_choice=False)
    answering = Agent(name="Weather", model_settings=ModelSettings(max_tokens=4))  # a 4-token answer
    refused = looping.clone(input_guardrails=[_refuse_all])
    scoring = TrainableRunner(model, error_reward=-1.0)  # on_error="score", the default
    runs: dict[str, Any] = {}

    async def rollout(name: str, runner: TrainableRunner, agent: Agent[Any], **kw: Any) -> jm.Trajectory:
        runs[name] = await runner.run(agent, "What is the weather in Paris?", **kw)
        return runs[name].trajectory

    async def streamed() -> jm.Trajectory:  # stopped the same way after one call: the stream ends quietly
        runs["streamed"] = scoring.run_streamed(looping, "What is the weather in Lima?", max_turns=1)
        async for _ in runs["streamed"].stream_events():
            pass
        return await runs["streamed"].trajectory()

    [group] = await jm.gather_trajectory_groups(
        [
            jm.TrajectoryGroup(
                [
                    rollout("failed", scoring, looping, max_turns=2),
                    streamed(),
                    rollout("done", TrainableRunner(model, api="chat_completions"), answering),
                    rollout("nothing", scoring, refused),  # no call to keep: an exception even so
                    rollout("dropped", TrainableRunner(model, on_error="drop"), refused),
                ]
            )
        ],
        max_exceptions=1,
    )
    # counted apart: a kept failure is a trajectory; a run that left nothing is an exception
    assert [x.type for x in group.exceptions] == ["InputGuardrailTripwireTriggered"]
    assert [x.type for x in group.dropped] == ["InputGuardrailTripwireTriggered"]
    assert len(group.trajectories) == 3 and len(group.errored()) == 2 and runs["failed"].result is None
    failed = runs["failed"].trajectory
    assert failed.error is not None and failed.error.type == "MaxTurnsExceeded"
    assert runs["failed"].error == failed.error and "(2)" in failed.error.message
    assert failed.reward == -1.0 and failed.metrics == {"llm_calls": 2, "errored": True}
    assert failed.metadata["last_agent"] == "Weather" and failed.metadata["agents"] == ["Weather"]
    # the two calls made before the error, each with the ids and logprobs the engine sampled
    first, second = _check_exact(backend, model, failed)
    assert [m["role"] for m in failed.messages()] == ["system", "user", "assistant", "tool", "assistant"]
    assert (
        _decoded_call(backend, model, first)[0] == _decoded_call(backend, model, second)[0] == "get_weather"
    )
    assert second.spliced_turns == 1 and "sunny" in failed.messages()[3]["content"]
    stream_failed = await runs["streamed"].trajectory()
    assert stream_failed.error is not None and stream_failed.error.type == "MaxTurnsExceeded"
    (call,) = _check_exact(backend, model, stream_failed)
    assert _decoded_call(backend, model, call)[0] == "get_weather" and stream_failed.reward == -1.0
    # a group mixing them with a normal run trains: the failed runs' records are used as any other's
    done = runs["done"].trajectory
    assert done.error is None and done.metrics["errored"] is False
    (answer,) = _check_exact(backend, model, done)
    assert _decoded_text(backend, model, answer) == runs["done"].result.final_output
    done.reward = 1.0
    result = await model.train([group], config=jm.TrainConfig(learning_rate=1e-4))
    assert result.step == 1 and not result.skipped


@output_guardrail
def _no_math(ctx: Any, agent: Agent[Any], output: Any) -> GuardrailFunctionOutput:
    return GuardrailFunctionOutput(output_info={"is_math": True}, tripwire_triggered=True)


class _CallDone(RunHooks[Any]):
    """Lets a parallel guardrail wait until the first model call is back (and filed)."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def on_llm_end(self, context: Any, agent: Agent[Any], response: Any) -> None:
        self.done.set()


async def test_tripwire_exception_is_kept_and_input_tripwires_raise_whatever_the_timing(
    scripted: tuple[Any, Any],
) -> None:
    model, backend = scripted
    runner = TrainableRunner(model)
    agent = Agent(name="Tutor", instructions="Help with homework.")
    # the SDK's output guardrail example, on the returned run instead of in an `except` clause
    run = await runner.run(agent.clone(output_guardrails=[_no_math]), "Solve 2x + 3 = 11.")
    assert run.result is None and isinstance(run.exception, OutputGuardrailTripwireTriggered)
    assert run.exception.guardrail_result.output.output_info == {"is_math": True}
    assert run.trajectory.error is not None and run.trajectory.error.exception is run.exception
    assert len(run.trajectory.records()) == 1  # the answer the guardrail refused, kept to train
    streamed = runner.run_streamed(agent.clone(output_guardrails=[_no_math]), "Solve 2x + 3 = 11.")
    kept = await streamed.trajectory()
    assert kept.error is not None and isinstance(kept.error.exception, OutputGuardrailTripwireTriggered)

    # input tripwires: before the call, while it is in flight, after it came back: all raise alike
    hooks = _CallDone()

    @input_guardrail(run_in_parallel=False)
    def before(ctx: Any, agent: Agent[Any], input: Any) -> GuardrailFunctionOutput:
        return GuardrailFunctionOutput(output_info="before", tripwire_triggered=True)

    engine = backend.engine(model)
    served = len(engine.requests)

    @input_guardrail  # parallel (the SDK's default), tripping while the engine holds the call
    async def during(ctx: Any, agent: Agent[Any], input: Any) -> GuardrailFunctionOutput:
        async with asyncio.timeout(10):
            while len(engine.requests) == served:
                await asyncio.sleep(0.01)
        return GuardrailFunctionOutput(output_info="during", tripwire_triggered=True)

    @input_guardrail  # parallel, tripping once the call was answered and filed
    async def after(ctx: Any, agent: Agent[Any], input: Any) -> GuardrailFunctionOutput:
        await asyncio.wait_for(hooks.done.wait(), 10)
        return GuardrailFunctionOutput(output_info="after", tripwire_triggered=True)

    for guardrail, delay_s in [(before, 0.0), (during, 0.3), (after, 0.0)]:
        engine.delay_s = delay_s
        served = len(engine.requests)
        refusing = agent.clone(input_guardrails=[guardrail])
        with pytest.raises(InputGuardrailTripwireTriggered) as raised:
            await runner.run(refusing, "Solve 2x + 3 = 11.", hooks=hooks)
        assert raised.value.guardrail_result.output.output_info == guardrail.get_name()
        assert len(engine.requests) - served == (0 if guardrail is before else 1)
    assert hooks.done.is_set()
    hooks.done.clear()
    streamed = runner.run_streamed(agent.clone(input_guardrails=[after]), "Solve 2x + 3 = 11.", hooks=hooks)
    with pytest.raises(InputGuardrailTripwireTriggered):
        await streamed.trajectory()


async def test_no_trace_export_notice_for_served_runs(
    scripted: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With no OpenAI key, the SDK's exporter notice is ours to drop only while our traces alone are skipped."""
    model, _ = scripted
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delitem(default_exporter().__dict__, "api_key", raising=False)  # a key cached earlier
    runner = TrainableRunner(model)
    flush_traces()  # what earlier tests left goes first
    with caplog.at_level(logging.WARNING, logger="openai.agents"):
        caplog.clear()
        await runner.run(Agent(name="Echo"), "Say OK.")
        flush_traces()
        assert EXPORT_NOTICE not in caplog.messages
        with trace("the user's own workflow"):  # a trace of theirs, skipped too: they hear of it
            pass
        flush_traces()
        assert caplog.messages.count(EXPORT_NOTICE) == 1


class _MathHomework(BaseModel):
    is_math_homework: bool
    reasoning: str


# The SDK's agent-based input guardrail (docs/guardrails.md), as written there: it runs an agent of
# its own with `Runner.run`, given no run_config and so no model provider.
_guardrail_agent = Agent(
    name="Guardrail check",
    instructions="Check if the user is asking you to do their math homework.",
    output_type=_MathHomework,
)


@input_guardrail
async def _math_guardrail(ctx: Any, agent: Agent[Any], input: Any) -> GuardrailFunctionOutput:
    result = await Runner.run(_guardrail_agent, input, context=ctx.context)
    return GuardrailFunctionOutput(
        output_info=result.final_output, tripwire_triggered=result.final_output.is_math_homework
    )


@input_guardrail
async def _math_guardrail_streamed(ctx: Any, agent: Agent[Any], input: Any) -> GuardrailFunctionOutput:
    result = Runner.run_streamed(_guardrail_agent, input, context=ctx.context)
    async for _ in result.stream_events():
        pass
    return GuardrailFunctionOutput(
        output_info=result.final_output, tripwire_triggered=result.final_output.is_math_homework
    )


@pytest.mark.parametrize("streamed", [False, True])
async def test_runs_nested_in_a_guardrail_are_served_and_recorded(
    scripted: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    model, backend = scripted
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # served by the trained model, or not at all
    verdict = '{"is_math_homework": false, "reasoning": "geography"}'
    backend.engine(model).script = lambda call: verdict if call.params.json_schema else "Paris."
    guardrail = _math_guardrail_streamed if streamed else _math_guardrail
    agent = Agent(name="Tutor", instructions="Help with homework.", input_guardrails=[guardrail])
    runner = TrainableRunner(model)
    question = "What is the capital of France?"

    async def trained() -> Trajectory:
        if not streamed:
            result, trajectory = await runner.run(agent, question)
            assert result is not None and result.final_output == "Paris."
            return trajectory
        run = runner.run_streamed(agent, question)
        async for _ in run.stream_events():
            pass
        assert run.result.final_output == "Paris."
        return await run.trajectory()

    # a plain run beside it, in a task of its own started once the trained run wrapped the SDK's
    # default runner: it goes through the wrapper but is not inside the trained run, so it keeps the
    # SDK's default provider (OpenAI, with no key here: "Missing credentials"), as before. Untraced:
    # its trace would be the user's own, and the SDK's exporter would say at exit it had no key.
    plain_run = Runner.run(_guardrail_agent, question, run_config=RunConfig(tracing_disabled=True))
    traj, plain = await asyncio.gather(trained(), plain_run, return_exceptions=True)
    assert isinstance(get_default_agent_runner(), ServingRunner)
    assert isinstance(plain, OpenAIError) and "api_key" in str(plain)
    assert isinstance(traj, Trajectory) and traj.error is None
    # the guardrail agent's call is the run's too, as a history of its own beside the tutor's
    assert sorted(traj.metadata["agents"]) == ["Guardrail check", "Tutor"]
    histories = dict(zip(traj.metadata["agents"], [traj, *traj.additional_histories], strict=True))
    for name, text in [("Guardrail check", verdict), ("Tutor", "Paris.")]:
        (record,) = histories[name].records()  # the ids the engine sampled, read back as the SDK's answer
        assert backend.chat_format.tokenizer.decode(record.token_ids, skip_special_tokens=True) == text
        assert histories[name].messages()[-1]["content"] == text and histories[name].trainable
    assert histories["Guardrail check"].messages()[0]["content"].startswith("Check if the user")
    assert traj.metrics["llm_calls"] == 2
