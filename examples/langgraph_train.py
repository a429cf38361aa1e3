"""Train a LangGraph agent with GRPO: an existing `create_agent` graph plus two decorators.

The agent answers "what is the weather / the time in <country>?" with two tools that take the
capital city. The reward checks the tool call it made: the right tool (0.5) and the capital of that
country (0.5). Each step rolls every scenario
out a few times (a group), GRPO compares the rollouts within each group, and the endpoint serves
the updated adapter for the next step.

    uv run python examples/langgraph_train.py                 # 3 steps on the embedded 135M model (CPU)
    uv run python examples/langgraph_train.py --steps 10 --groups 8

The 135M model rarely calls a tool on its own, so the first turn forces a call
(`tool_choice="required"`: the endpoint constrains decoding to one well-formed call of a listed
tool); which tool and which city stay the model's choice, and that is what it learns.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import journeyman as jm
from journeyman_langgraph import chat_model, trainable, trajectory
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool

City = Literal["Paris", "Rome", "Oslo", "Lima", "Tokyo", "Cairo", "Madrid", "Berlin"]
CAPITALS = {"Norway": "Oslo", "Peru": "Lima", "Japan": "Tokyo", "Egypt": "Cairo"}


@tool
def get_weather(city: City) -> str:
    """The current weather in a capital city."""
    return f"{city}: sunny, 21 C"


@tool
def get_time(city: City) -> str:
    """The local time in a capital city."""
    return f"{city}: 09:30"


SCENARIOS = [(f"What is the weather in {k} right now?", "get_weather", c) for k, c in CAPITALS.items()] + [
    (f"What time is it in {k}?", "get_time", c) for k, c in CAPITALS.items()
]


class ToolThenAnswer(AgentMiddleware):
    """First turn: a forced tool call. After the tool result: a short answer."""

    def __init__(self, answer_tokens: int) -> None:
        super().__init__()
        self.answer_tokens = answer_tokens

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        if any(isinstance(m, ToolMessage) for m in request.messages):
            return await handler(request.override(model_settings={"max_tokens": self.answer_tokens}))
        return await handler(request.override(tool_choice="required"))


def score(messages: list[Any], want_tool: str, want_city: str) -> tuple[float, dict[str, float | bool]]:
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    if not calls:
        return 0.0, {"right_tool": False, "right_city": False}
    first = calls[0]
    right_tool = first["name"] == want_tool
    right_city = first["args"].get("city") == want_city
    return 0.5 * right_tool + 0.5 * right_city, {"right_tool": right_tool, "right_city": right_city}


async def main(args: argparse.Namespace) -> None:
    async with jm.LocalBackend(path=args.path) as backend:
        model = jm.TrainableModel(name=args.name, project="langgraph-example")
        await model.register(backend)

        # The user's graph. The two Journeyman lines: `trainable(chat_model(model))` and `@trajectory(model)`.
        llm = trainable(chat_model(model, max_tokens=48))
        agent = create_agent(
            llm,
            tools=[get_weather, get_time],
            middleware=[ToolThenAnswer(args.answer_tokens)],
        )

        @trajectory(model)
        async def rollout(question: str, want_tool: str, want_city: str) -> tuple[float, dict[str, Any]]:
            out = await agent.ainvoke({"messages": [("user", question)]}, {"recursion_limit": 6})
            return score(out["messages"], want_tool, want_city)

        async def evaluate() -> None:
            step = await model.get_step()
            groups = await jm.gather_trajectory_groups(
                (
                    jm.TrajectoryGroup(rollout(*s) for _ in range(args.eval_size))
                    for s in SCENARIOS[: args.eval_scenarios]
                ),
                pbar_desc=f"eval {step}",
            )
            m = await model.log(groups, split="val")
            print(
                f"step {step}: val reward {m['reward']:.3f} "
                f"(right tool {m['right_tool']:.2f}, right city {m['right_city']:.2f})"
            )

        await evaluate()
        rng = random.Random(0)
        config = jm.TrainConfig(learning_rate=args.learning_rate)
        for _ in range(args.steps):
            step = await model.get_step()
            t0 = time.perf_counter()
            batch = rng.sample(SCENARIOS, args.groups)
            groups = await jm.gather_trajectory_groups(
                (jm.TrajectoryGroup(rollout(*s) for _ in range(args.group_size)) for s in batch),
                pbar_desc=f"step {step}",
            )
            rollout_s = time.perf_counter() - t0
            rewards = [r for g in groups for r in g.rewards()]
            mean = sum(rewards) / len(rewards)
            t0 = time.perf_counter()
            result = await model.train(groups, config=config)
            print(
                f"step {step}: mean reward {mean:.3f} over {len(rewards)} rollouts "
                f"(rollouts {rollout_s:.0f} s, train {time.perf_counter() - t0:.0f} s, skipped={result.skipped})"
            )
        await evaluate()
        print(f"run directory: {model.run_dir}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups", type=int, default=4, help="scenarios per step")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per scenario")
    p.add_argument("--eval-size", type=int, default=2, help="rollouts per scenario when evaluating")
    p.add_argument(
        "--eval-scenarios", type=int, default=len(SCENARIOS), help="how many scenarios to evaluate on"
    )
    p.add_argument("--answer-tokens", type=int, default=8, help="max tokens of the answer after the tool")
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--name", default="weather-agent")
    p.add_argument("--path", type=Path, default=Path(".journeyman"))
    asyncio.run(main(p.parse_args()))
