"""Both agent integrations, unchanged, against `journeyman serve` in another process (`jm.RemoteBackend`).

"Token-exact" is checked against the engine itself: the server serves step 0 (LoRA B = 0, i.e. the
base model), so a local copy of the base model, teacher-forced on each record's prompt + sampled
ids, must give back the logprobs the server's engine recorded while sampling; the ids must decode
to what the framework saw; and each later call's prompt must hold the earlier sampled ids verbatim.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import journeyman as jm
import pytest
from journeyman.backends.server import ServerProcess

pytestmark = pytest.mark.integration


# Enums, not any string, for the tools' argument: at temperature 1 the 135M model's free-text
# argument could run past max_tokens, cutting the forced call off, and the run then ended after one
# LLM call.
City = Literal["Paris", "Tokyo", "Lima", "Oslo"]


@pytest.fixture(scope="module")
def remote(remote_server: ServerProcess) -> jm.RemoteBackend:
    return jm.RemoteBackend(remote_server.url, token=remote_server.token, progress=False)


async def _registered(backend: jm.RemoteBackend, name: str) -> jm.TrainableModel:
    model = jm.TrainableModel(name=name, project="p")
    await model.register(backend)
    return model


@pytest.fixture(scope="module")
def base() -> tuple[Any, Any]:
    """The base model and tokenizer, loaded here: what the server samples from at step 0."""
    from journeyman.policy.weights import resolve_base_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path: Path = resolve_base_model(jm.DEFAULT_BASE_MODEL)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def check_exact(base: tuple[Any, Any], history: jm.History) -> list[jm.TokenRecord]:
    import torch

    model, _ = base
    records = history.records()
    assert len(records) >= 2
    for rec in records:
        ids = torch.tensor([rec.prompt_token_ids + rec.token_ids])
        with torch.inference_mode():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        n = len(rec.prompt_token_ids)
        mine = logp[n - 1 : -1].gather(1, torch.tensor(rec.token_ids)[:, None]).squeeze(1)
        assert (mine - torch.tensor(rec.logprobs)).abs().max() < 1e-3  # fp32: the engine's own numbers
    for earlier, later in itertools.pairwise(records):  # one token sequence across turns
        assert later.prompt_token_ids[: len(earlier.prompt_token_ids) + len(earlier.token_ids)] == (
            earlier.prompt_token_ids + earlier.token_ids
        )
    return records


@pytest.mark.slow
async def test_agents_sdk_runner_on_a_remote_backend(remote: jm.RemoteBackend, base: tuple[Any, Any]) -> None:
    from agents import Agent, ModelSettings, function_tool
    from journeyman_agents import TrainableRunner

    @function_tool
    def get_weather(city: City) -> str:
        """Current weather for a city."""
        return f"It is sunny and 21 C in {city}."

    model = await _registered(remote, "agents-remote")
    agent = Agent(
        name="Weather",
        instructions="You answer weather questions. Use the get_weather tool, then answer in one sentence.",
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=40),
    )
    result, traj = await TrainableRunner(model).run(agent, "What is the weather in Paris?")
    assert traj.metadata["agents"] == ["Weather"] and traj.metrics["llm_calls"] == 2
    first, second = check_exact(base, traj)
    _, tokenizer = base
    assert "get_weather" in tokenizer.decode(first.token_ids)
    assert tokenizer.decode(second.token_ids, skip_special_tokens=True) == result.final_output


async def test_langgraph_decorators_on_a_remote_backend(
    remote: jm.RemoteBackend, base: tuple[Any, Any]
) -> None:
    from journeyman_langgraph import chat_model, trainable, trajectory
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_time(city: City) -> str:
        """The local time in a city."""
        return f"TIME {city}: 09:30"

    class ToolThenAnswer(AgentMiddleware):  # the 135M model needs its first call forced
        async def awrap_model_call(
            self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
        ) -> Any:
            if any(isinstance(m, ToolMessage) for m in request.messages):
                return await handler(request.override(model_settings={"max_tokens": 6}))
            return await handler(request.override(tool_choice="required"))

    model = await _registered(remote, "langgraph-remote")
    agent = create_agent(trainable(chat_model(model)), tools=[get_time], middleware=[ToolThenAnswer()])

    @trajectory(model)
    async def rollout(city: str) -> float:
        out = await agent.ainvoke({"messages": [("user", f"What time is it in {city}?")]})
        return float("09:30" in str(out["messages"][-1].content))

    traj = await rollout("Oslo")
    records = check_exact(base, traj)
    assert len(records) == 2 and "get_time" in base[1].decode(records[0].token_ids)
    tool_msg = next(m for m in traj.messages() if m["role"] == "tool")
    assert "TIME" in tool_msg["content"]
