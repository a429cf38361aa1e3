"""The decorators on real LangGraph graphs, against the real model served on 127.0.0.1.

The 135M model almost never calls a tool unprompted, so the graphs force the first call of a turn
(`tool_choice="required"`, grammar-constrained by the endpoint) and cap the answer's length.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any, Literal, TypedDict

import journeyman as jm
import pytest
from _support import one_node_graph
from journeyman.chat.formats import ChatFormat
from journeyman.training.rows import trajectory_rows
from journeyman_langgraph import chat_model, current_trajectory, init_chat_model, trainable, trajectory
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, SecretStr

pytestmark = pytest.mark.integration

City = Literal["Paris", "Rome", "Oslo", "Lima"]


@tool
def get_weather(city: City) -> str:
    """The current weather in a city."""
    return f"WEATHER {city}: sunny, 21 C"


@tool
def get_time(city: City) -> str:
    """The local time in a city."""
    return f"TIME {city}: 09:30"


TOOLS = [get_weather, get_time]
TOOL_MAX_TOKENS = 40  # a forced call of these tools is ~25 tokens
ANSWER_MAX_TOKENS = 6


class ToolThenAnswer(AgentMiddleware):
    """Force a tool call on the first turn, then a short answer (sync and async graphs)."""

    def _adjust(self, request: ModelRequest) -> ModelRequest:
        if any(isinstance(m, ToolMessage) for m in request.messages):
            return request.override(model_settings={"max_tokens": ANSWER_MAX_TOKENS})
        return request.override(tool_choice="required")

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        return handler(self._adjust(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        return await handler(self._adjust(request))


Sampled = tuple[list[int], list[int], list[float]]


@contextlib.contextmanager
def _recording(engine: Any) -> Iterator[list[Sampled]]:
    """(prompt ids, sampled ids, their logprobs) of every sample `engine` generates meanwhile,
    streamed ones (`on_token`) included."""
    generate = engine.generate
    log: list[Sampled] = []

    async def recording(prompt_ids: list[int], params: Any, on_token: Any = None) -> Any:
        samples = await generate(prompt_ids, params, on_token)
        log.extend((list(prompt_ids), list(s.token_ids), list(s.logprobs)) for s in samples)
        return samples

    engine.generate = recording
    try:
        yield log
    finally:
        del engine.generate


@pytest.fixture
def engine_log(served: Any) -> Iterator[list[Sampled]]:
    """What the real engine samples during the test."""
    model, backend = served
    with _recording(backend.service(model).engine) as log:
        yield log


@pytest.fixture(scope="module")  # module-wide: the `scripted` fixture's backend renders with it too
def chat_format(served: Any) -> ChatFormat:
    model, backend = served
    return backend.service(model).chat_format


def _records(t: jm.Trajectory) -> list[jm.TokenRecord]:
    return [*t.records(), *(r for h in t.additional_histories for r in h.records())]


def _assert_exact(t: jm.Trajectory, log: list[Sampled]) -> None:
    for rec in _records(t):
        assert (rec.prompt_token_ids, rec.token_ids, rec.logprobs) in log


def _assert_tool_results_masked(t: jm.Trajectory, chat_format: ChatFormat) -> None:
    """The main history is one row: trained tokens are exactly the sampled ids, tool results are prompt."""
    rows = trajectory_rows(t, chat_format, advantage=1.0)
    assert len(rows) == 1 + len(t.additional_histories)
    row = rows[0]
    trained = [i for i, m in zip(row.input_ids, row.trained, strict=True) if m]
    assert trained == [i for rec in t.records() for i in rec.token_ids]
    masked = chat_format.decode([i for i, m in zip(row.input_ids, row.trained, strict=True) if not m])
    tool_msgs = [m for m in t.messages_and_choices if isinstance(m, dict) and m["role"] == "tool"]
    assert tool_msgs and all(m["content"] in masked for m in tool_msgs)
    assert "WEATHER" not in chat_format.decode(trained) and "TIME " not in chat_format.decode(trained)


def _roles(t: jm.Trajectory) -> list[str]:
    return ["choice" if isinstance(m, Choice) else m["role"] for m in t.messages_and_choices]


async def test_create_agent_with_two_tools(served: Any, engine_log: list, chat_format: ChatFormat) -> None:
    model, _ = served
    llm = trainable(chat_model(model, max_tokens=TOOL_MAX_TOKENS))
    judge = chat_model(model, max_tokens=4)  # same endpoint, unmarked: never trained
    agent = create_agent(
        llm, tools=TOOLS, system_prompt="Answer with the tools.", middleware=[ToolThenAnswer()]
    )

    class Pick(BaseModel):
        city: City

    @trajectory(model)
    async def rollout(question: str) -> tuple[float, dict[str, float | bool]]:
        out = await agent.ainvoke({"messages": [("user", question)]}, {"recursion_limit": 6})
        # the policy on a fresh prompt (structured output): a side conversation of its own
        pick = await llm.with_structured_output(Pick).ainvoke(f"Which city is named here? {question}")
        verdict = await judge.ainvoke(f"Is this a good answer? {out['messages'][-1].content}")
        current_trajectory().metadata["verdict"] = verdict.content
        n_tools = sum(isinstance(m, ToolMessage) for m in out["messages"])
        return 0.5, {"tool_messages": n_tools, "picked_rome": pick.city == "Rome"}

    t = await rollout("What is the weather in Rome?")
    assert isinstance(t, jm.Trajectory)
    assert _roles(t) == ["system", "user", "choice", "tool", "choice"]
    first, second = t.messages_and_choices[2], t.messages_and_choices[4]
    assert first.message.tool_calls and first.message.tool_calls[0].function.name in {
        "get_weather",
        "get_time",
    }
    assert jm.record_of(second).spliced_turns == 1  # the tool call went back as its sampled ids
    assert {x["function"]["name"] for x in t.tools} == {"get_weather", "get_time"}
    assert t.reward == 0.5 and t.metrics["tool_messages"] == 1 and "picked_rome" in t.metrics
    assert t.metadata["langgraph_nodes"] == ["model", "model", None]
    assert t.metadata["untrained_calls"] == 1 and "verdict" in t.metadata
    # the structured call has its own prefix: an additional (trained) history, never merged
    (side,) = t.additional_histories
    assert [m["role"] for m in side.messages()] == ["user", "assistant"]
    assert Pick.model_validate_json(side.messages()[1]["content"])
    # exactly the three policy calls, each with the ids the engine sampled; the judge's is left out
    assert len(engine_log) == 4 and len(_records(t)) == 3
    _assert_exact(t, engine_log)
    _assert_tool_results_masked(t, chat_format)


class PlanState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    plan: str


def planner_executor(model: jm.TrainableModel) -> Any:
    """Two LLM nodes sharing one unmarked chat model; only the executor is marked trainable."""
    llm = chat_model(model, max_tokens=TOOL_MAX_TOKENS)

    def planner(state: PlanState) -> dict[str, Any]:
        out = llm.invoke([SystemMessage("Write a one-line plan."), *state["messages"]], max_tokens=8)
        return {"plan": out.content}

    @trainable
    def executor(state: PlanState) -> dict[str, Any]:
        messages = [SystemMessage(f"Plan: {state['plan']}"), *state["messages"]]
        if any(isinstance(m, ToolMessage) for m in state["messages"]):
            return {"messages": [llm.bind_tools(TOOLS).invoke(messages, max_tokens=ANSWER_MAX_TOKENS)]}
        return {"messages": [llm.bind_tools(TOOLS, tool_choice="required").invoke(messages)]}

    g = StateGraph(PlanState)
    g.add_node("planner", planner)
    g.add_node("executor", executor)
    g.add_node("tools", ToolNode(TOOLS))
    g.add_edge(START, "planner")
    g.add_edge("planner", "executor")
    g.add_conditional_edges("executor", tools_condition, {"tools": "tools", END: END})
    g.add_edge("tools", "executor")
    return g.compile()


async def test_planner_executor_only_marked_node_is_trained(
    served: Any, engine_log: list, chat_format: ChatFormat
) -> None:
    model, _ = served
    graph = planner_executor(model)

    @trajectory(model)
    def rollout(question: str) -> float:  # sync: graph.invoke, nodes run in LangGraph's threads
        out = graph.invoke({"messages": [("user", question)], "plan": ""}, {"recursion_limit": 8})
        return float("Oslo" in out["messages"][-1].content)

    t = await asyncio.to_thread(rollout, "What time is it in Oslo?")
    assert _roles(t) == ["system", "user", "choice", "tool", "choice"]
    assert t.messages_and_choices[0]["content"].startswith("Plan: ")
    assert t.metadata["langgraph_nodes"] == ["executor", "executor"]
    assert t.metadata["untrained_calls"] == 1 and not t.additional_histories
    # the engine sampled three times; the planner's sample is not in the trajectory
    assert len(engine_log) == 3 and len(_records(t)) == 2
    planner_ids = engine_log[0][1]
    assert all(rec.token_ids != planner_ids for rec in t.records())
    _assert_exact(t, engine_log)
    _assert_tool_results_masked(t, chat_format)


class WeatherState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


class ToolBudgetError(RuntimeError):
    """A node's own failure: the agent looked the weather up twice and still gave no answer."""


def weather_graph(llm: Any, *, loop: bool = False) -> Any:
    """One policy call (a forced call of one tool, short prompt), then the tool: cheap enough for 16.
    `loop`: back to the policy after the tool, every visit another call; the third visit raises."""

    def agent(state: WeatherState) -> dict[str, Any]:
        if loop and sum(isinstance(m, ToolMessage) for m in state["messages"]) >= 2:
            raise ToolBudgetError("two weather lookups and still no answer")
        return {
            "messages": [llm.bind_tools([get_weather], tool_choice="get_weather").invoke(state["messages"])]
        }

    g = StateGraph(WeatherState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode([get_weather]))
    g.add_edge(START, "agent")
    g.add_edge("agent", "tools")
    g.add_edge("tools", "agent" if loop else END)
    return g.compile()


async def test_sixteen_concurrent_episodes_keep_their_own_calls(
    served: Any, engine_log: list, chat_format: ChatFormat
) -> None:
    model, _ = served
    graph = weather_graph(trainable(chat_model(model, max_tokens=TOOL_MAX_TOKENS)))
    cities = ["Paris", "Rome", "Oslo", "Lima"]

    def question(i: int) -> str:
        return f"Case {i}: the weather in {cities[i % 4]}?"

    @trajectory(model)
    async def rollout(i: int) -> float:
        inputs = {"messages": [("user", question(i))]}
        if i % 2:  # streamed: token chunks through LangGraph's messages mode
            async for _ in graph.astream(inputs, stream_mode="messages"):
                pass
        else:
            await graph.ainvoke(inputs)
        return float(i)

    @trajectory(model)
    def art_style(i: int) -> jm.Trajectory:  # ART's pattern, sync: the policy built inside the rollout
        for _ in weather_graph(init_chat_model(max_tokens=TOOL_MAX_TOKENS)).stream(
            {"messages": [("user", question(i))]}
        ):
            pass
        return jm.Trajectory(reward=float(i), metadata={"i": i})

    runs = [rollout(i) for i in range(12)] + [asyncio.to_thread(art_style, i) for i in range(12, 16)]
    trajectories = await asyncio.gather(*runs)
    assert len(engine_log) == 16
    for i, t in enumerate(trajectories):
        assert t.reward == float(i) and _roles(t) == ["user", "choice"]
        assert t.messages_and_choices[0]["content"] == question(i)
        (rec,) = t.records()  # the episode's own call: its question, the ids the engine sampled for it
        prompt = chat_format.decode(rec.prompt_token_ids)
        assert f"Case {i}:" in prompt and prompt.count("Case ") == 1
        _assert_exact(t, engine_log)
        assert t.metadata["langgraph_nodes"] == ["agent"]
    assert trajectories[12].metadata["i"] == 12


async def test_return_value_and_scope_errors(served: Any) -> None:
    model, _ = served

    @trajectory(model)
    async def no_reward() -> str:
        return "done"

    with pytest.raises(jm.InvalidFieldError, match="return value"):
        await no_reward()
    with pytest.raises(jm.InvalidFieldError, match="outside a @trajectory"):
        current_trajectory()
    with pytest.raises(jm.InvalidFieldError, match="model"):
        init_chat_model()

    @trajectory(model)
    async def no_call() -> float:
        return 1.0

    t = await no_call()
    assert t.reward == 1.0 and not t.messages_and_choices and "made no LLM call" in t.logs[0]


async def test_mark_the_policy_advice_only_when_nothing_was_marked(scripted: Any) -> None:
    model, _ = scripted
    policy = trainable(chat_model(model))
    unmarked = chat_model(model)

    @trajectory(model)
    async def episode(call: Any | None) -> float:
        if call is not None:
            await call.ainvoke("Say OK.")
        return 1.0

    marked_but_quiet = await episode(None)  # the policy is marked; this episode had no use for it
    assert marked_but_quiet.logs == ["the episode made no LLM call: nothing to train"]
    (advice,) = (await episode(unmarked)).logs  # a call was made, and nothing was marked
    assert "mark the policy with `trainable`" in advice
    trained = await episode(policy)
    assert not trained.logs and len(trained.records()) == 1


def _subgraph(llm: Any) -> Any:
    return one_node_graph(lambda state: {"messages": [llm.invoke(state["messages"])]})


async def test_subgraph_calls_are_named_by_their_path(scripted: Any) -> None:
    """Two subgraphs with an "agent" node each (LangGraph's multi-agent shape) are told apart."""
    model, _ = scripted
    llm = trainable(chat_model(model))
    g = StateGraph(WeatherState)
    g.add_node("researcher", _subgraph(llm))
    g.add_node("writer", _subgraph(llm))
    g.add_node("agent", lambda state: {"messages": [llm.invoke(state["messages"])]})
    g.add_edge(START, "researcher")
    g.add_edge("researcher", "writer")
    g.add_edge("writer", "agent")
    graph = g.compile()

    @trajectory(model)
    async def rollout() -> float:
        await graph.ainvoke({"messages": [("user", "Plan a trip.")]})
        return 1.0

    t = await rollout()
    assert t.metadata["langgraph_nodes"] == ["researcher/agent", "writer/agent", "agent"]
    assert len(t.records()) == 3


async def test_episode_whose_node_raises_is_a_trajectory_and_trains(
    served: Any, chat_format: ChatFormat
) -> None:
    _, backend = served
    # a model of its own on the shared backend (one more LoRA policy, ~1 s): this test trains it
    model = jm.TrainableModel(name="langgraph-failed-runs", project="tests")
    await model.register(backend)
    graph = weather_graph(
        trainable(chat_model(model, max_tokens=TOOL_MAX_TOKENS, temperature=0.0)), loop=True
    )
    answer = trainable(chat_model(model, max_tokens=4))

    @trajectory(model, error_reward=lambda t: -float(len(t.records())))  # on_error="score", the default
    async def failing(question: str) -> float:
        current_trajectory().metadata["question"] = question  # kept on the failed trajectory
        await graph.ainvoke({"messages": [("user", question)]})
        return 1.0

    @trajectory(model)
    async def answering(question: str) -> float:
        await answer.ainvoke(question)
        return 1.0

    @trajectory(model)
    def broken(question: str) -> float:  # sync, raises before any call: nothing to keep
        raise ToolBudgetError(question)

    dropping = trajectory(model, on_error="drop")(broken.__wrapped__)
    q = "What is the weather in Oslo?"
    with _recording(backend.service(model).engine) as log:
        [group] = await jm.gather_trajectory_groups(
            [
                jm.TrajectoryGroup(
                    [failing(q), answering(q), asyncio.to_thread(broken, q), asyncio.to_thread(dropping, q)]
                )
            ],
            max_exceptions=1,
        )
    # counted apart: a kept failure is a trajectory; a run that left nothing is an exception
    assert [x.type for x in group.exceptions] == [x.type for x in group.dropped] == ["ToolBudgetError"]
    (failed,) = group.errored()
    assert len(group.trajectories) == 2 and len(log) == 3
    assert failed.error is not None and failed.error.type == "ToolBudgetError"
    assert isinstance(failed.error.exception, ToolBudgetError)  # the object itself, as raised
    assert failed.error.message == "two weather lookups and still no answer"
    assert "in agent" in failed.error.traceback  # the node that raised
    assert failed.reward == -2.0 and failed.metrics == {"errored": True}
    assert failed.metadata["question"] == q and failed.metadata["langgraph_nodes"] == ["agent", "agent"]
    # the two calls made before the error, with the ids and logprobs the engine sampled
    assert _roles(failed) == ["user", "choice", "tool", "choice"]  # the last tool result reached no call
    assert [rec.spliced_turns for rec in failed.records()] == [0, 1]
    _assert_exact(failed, log)
    _assert_tool_results_masked(failed, chat_format)
    # a group mixing it with a normal episode trains: the failed run's records are used as any other's
    (done,) = [t for t in group.trajectories if t.error is None]
    assert done.reward == 1.0 and done.metrics == {"errored": False}
    _assert_exact(done, log)
    result = await model.train([group], config=jm.TrainConfig(learning_rate=1e-4))
    assert result.step == 1 and not result.skipped

    @trajectory(model, on_error="raise")
    async def raising() -> float:
        raise ToolBudgetError("as it was")

    with pytest.raises(ToolBudgetError, match="as it was"):
        await raising()
    with pytest.raises(jm.InvalidFieldError, match="on_error"):
        trajectory(model, on_error="ignore")  # type: ignore[arg-type]


async def test_messages_mode_streams_tokens_as_they_are_sampled(served: Any, chat_format: ChatFormat) -> None:
    """`stream_mode="messages"` gets the answer in many chunks as the engine samples it (issue 36),
    and the episode still records the exact ids whose text the chunks add up to."""
    model, _ = served
    llm = trainable(chat_model(model, max_tokens=40, temperature=0.0))

    async def agent(state: WeatherState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = one_node_graph(agent)
    chunks: list[str] = []

    @trajectory(model)
    async def rollout() -> float:
        inputs = {"messages": [("user", "Tell me a story about a dog.")]}
        async for message, _ in graph.astream(inputs, stream_mode="messages"):
            if isinstance(message.content, str) and message.content:
                chunks.append(message.content)
        return 1.0

    t = await rollout()
    (rec,) = t.records()
    assert len(chunks) > 1, chunks
    assert (
        "".join(chunks) == chat_format.parse(chat_format.completion_text(rec.token_ids), tools=False).content
    )


# -- a graph or chat model run inside a marked node is served by the trained model (issue 36, item 2)
# The nested chat model is built as LangGraph's examples build theirs, for OpenAI's API with a
# placeholder key: this machine cannot reach OpenAI, so a call that went there would fail the test.


async def test_a_nested_graph_in_a_marked_node_is_served_and_becomes_its_own_history(scripted: Any) -> None:
    model, backend = scripted
    engine = backend.engine(model)
    engine.script = lambda call: (
        "Checked: correct."
        if "Check this answer" in engine.chat_format.decode(call.prompt_ids)
        else "Paris is sunny."
    )
    policy = chat_model(model)
    # a sub-agent as LangGraph's examples write it: OpenAI's model name, a key that is never used
    critic = ChatOpenAI(model="gpt-4.1-mini", api_key=SecretStr("sk-placeholder"), max_retries=0, timeout=10)

    async def review_node(state: WeatherState) -> dict[str, Any]:
        return {"messages": [await critic.ainvoke(state["messages"])]}

    reviewer = one_node_graph(review_node)

    @trainable
    async def lead(state: WeatherState) -> dict[str, Any]:
        answer = await policy.ainvoke(state["messages"])
        review = await reviewer.ainvoke({"messages": [HumanMessage(f"Check this answer: {answer.content}")]})
        return {"messages": [answer, review["messages"][-1]]}

    graph = one_node_graph(lead, "lead")

    @trajectory(model)
    async def rollout() -> float:
        out = await graph.ainvoke({"messages": [HumanMessage("Weather in Paris?")]})
        assert [m.content for m in out["messages"][1:]] == ["Paris is sunny.", "Checked: correct."]
        return 1.0

    t = await rollout()
    assert t.error is None and not t.logs
    # the lead's call is the main history; the nested graph's fresh conversation is one of its own
    assert [r.token_ids for r in t.records()] and len(t.additional_histories) == 1
    [nested] = t.additional_histories
    [record] = nested.records()
    assert record.model.startswith(model.name)  # sampled by the trained model, not gpt-4.1-mini
    assert "Check this answer: Paris is sunny." in str(nested.messages())
    assert t.metadata["langgraph_nodes"] == ["lead", "lead/agent"]
    # the call went through a served copy: the user's chat model is as it was built
    assert critic.openai_api_base is None and critic.model_name == "gpt-4.1-mini"
