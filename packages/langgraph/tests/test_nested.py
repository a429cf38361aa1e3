"""Graphs and chat models run inside a marked node are served by the trained model (issue 36, item 2).

A scripted model answers through the real endpoint (no weights). The nested graph's chat model is
built as LangGraph's examples build theirs, for OpenAI's API with a placeholder key: this machine
cannot reach OpenAI, so a call that went there would fail the test.
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

import pytest
from journeyman_langgraph import chat_model, trainable, trajectory
from langchain_core.messages import AnyMessage, HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from pydantic import SecretStr

pytestmark = pytest.mark.integration


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def _one_node_graph(llm: Any) -> Any:
    async def agent(state: State) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    g = StateGraph(State)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    return g.compile()


async def test_a_nested_graph_in_a_marked_node_is_served_and_becomes_its_own_history(scripted: Any) -> None:
    model, backend = scripted
    backend.engine(model).script = ["Paris is sunny.", "Checked: correct."]
    policy = chat_model(model)
    # a sub-agent as LangGraph's examples write it: OpenAI's model name, a key that is never used
    critic = ChatOpenAI(model="gpt-4.1-mini", api_key=SecretStr("sk-placeholder"), max_retries=0, timeout=10)
    reviewer = _one_node_graph(critic)

    @trainable
    async def lead(state: State) -> dict[str, Any]:
        answer = await policy.ainvoke(state["messages"])
        review = await reviewer.ainvoke({"messages": [HumanMessage(f"Check this answer: {answer.content}")]})
        return {"messages": [answer, review["messages"][-1]]}

    g = StateGraph(State)
    g.add_node("lead", lead)
    g.add_edge(START, "lead")
    graph = g.compile()

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
