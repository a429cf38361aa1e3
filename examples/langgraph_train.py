"""Train a LangGraph agent with GRPO: an existing `create_agent` graph plus two decorators.

The agent keeps a to-do list with four tools (add, list, mark done, remove). Each task ("Take
'pay rent' off my list") starts from a known list, and succeeds when the list ends in the state
asked for (`todo_task.py`: the same tasks and checks as the MCP example, 72 for training, 24 held
out on titles never seen in training). The embedded 135M model starts weak at it; each step rolls
three training tasks out eight times, GRPO compares the rollouts of a task, and the endpoint serves
the updated adapter for the next step. Held-out success (greedy, each held-out task in
its 3 phrasings: 72) is measured before and after, with the paired count of tasks fixed and broken.

    uv run python examples/langgraph_train.py                 # 10 steps, about 12 minutes on 2 CPU cores
    uv run python examples/langgraph_train.py --steps 4 --eval-scenarios 12

The first model turn is a forced tool call (`tool_choice="required"`: the endpoint constrains
decoding to one well-formed call of a listed tool); which tool and which title stay the model's
choice, and that is what it learns. After the tool's result it answers in a few words.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import journeyman as jm
from journeyman_langgraph import chat_model, trainable, trajectory
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from todo_task import (
    EPISODE,
    INSTRUCTIONS,
    TOOL_FUNCTIONS,
    Scenario,
    load_scenarios,
    train_and_report,
)

TOOLS = [tool(f) for f in TOOL_FUNCTIONS]  # the to-do tools of the episode set in EPISODE


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


async def main(args: argparse.Namespace) -> None:
    async with jm.LocalBackend(path=args.path) as backend:
        model = jm.TrainableModel(name=args.name, project="langgraph-example")
        await model.register(backend)

        # The user's graph. The two Journeyman lines: `trainable(chat_model(model))` and `@trajectory(model)`.
        def agent(temperature: float) -> Any:
            llm = trainable(chat_model(model, max_tokens=64, temperature=temperature))
            return create_agent(
                llm, tools=TOOLS, system_prompt=INSTRUCTIONS, middleware=[ToolThenAnswer(args.answer_tokens)]
            )

        sampled, greedy = agent(0.7), agent(0.0)

        @trajectory(model)
        async def rollout(s: Scenario, graph: Any) -> tuple[float, dict[str, Any]]:
            todo = s.fresh_list()
            EPISODE.set(todo)
            await graph.ainvoke({"messages": [("user", s.task)]}, {"recursion_limit": 6})
            success = s.passed(todo)
            # success, and a little for a call the list accepted (the shaping mcp-rl uses too)
            return float(success) + 0.1 * (todo.calls > todo.refused), {
                "success": success,
                "refused": todo.refused,
            }

        loop = jm.TrainLoop(
            model,
            lambda s: rollout(s, sampled),
            load_scenarios("train"),
            groups_per_step=args.groups,
            group_size=args.group_size,
            config=jm.TrainConfig(learning_rate=args.learning_rate),
        )
        await train_and_report(loop, lambda s: rollout(s, greedy), args.eval_scenarios, args.steps)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--groups", type=int, default=3, help="training tasks per step")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per task")
    p.add_argument(
        "--eval-scenarios",
        type=int,
        default=72,
        help="held-out tasks to evaluate on (at most 72: the 24 held-out tasks, each in 3 phrasings)",
    )
    p.add_argument("--answer-tokens", type=int, default=8, help="max tokens of the answer after the tool")
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--name", default="todo-agent")
    p.add_argument("--path", type=Path, default=Path(".journeyman"))
    asyncio.run(main(p.parse_args()))
