"""Train an OpenAI Agents SDK agent with GRPO, through `journeyman_agents.TrainableRunner`.

Ordinary Agents SDK code: a triage agent hands every request off to a to-do agent with four
function tools (add, list, mark done, remove). Each task ("Take 'pay rent' off my list") starts
from a known list and succeeds when the list ends in the state asked for (`todo_task.py`: the same
tasks and checks as the MCP and LangGraph examples, 72 for training, 24 held out on titles never
seen in training). The runner serves both agents from the trainable model (Responses API by
default, `--api chat_completions` for the other one), and every run comes back as the SDK's
`RunResult` plus a `Trajectory` with the exact sampled tokens of all three turns (the handoff, the
tool call, the answer). Held-out success (greedy, each held-out task in
its 3 phrasings: 72) is measured before and after, with the paired count of tasks fixed and broken.

    uv run python examples/agents_sdk_train.py                 # 10 steps, about 20 minutes on 2 CPU cores
    uv run python examples/agents_sdk_train.py --api chat_completions --steps 4
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import journeyman as jm
from agents import Agent, ModelSettings, function_tool, handoff
from agents.extensions import handoff_filters
from journeyman_agents import TrainableRunner
from todo_task import (
    EPISODE,
    INSTRUCTIONS,
    TOOL_FUNCTIONS,
    Scenario,
    load_scenarios,
    train_and_report,
)

TOOLS = [function_tool(f) for f in TOOL_FUNCTIONS]  # the to-do tools of the episode set in EPISODE


def triage_agent(temperature: float) -> Agent:
    """The entry agent and the one it hands off to. Both force their first call (grammar-constrained
    on the endpoint); the SDK resets tool_choice after a tool call (reset_tool_choice), so the to-do
    agent then answers in text."""
    keeper = Agent(
        name="todo_keeper",
        instructions=INSTRUCTIONS,
        tools=TOOLS,
        model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=temperature),
    )
    return Agent(
        name="triage",
        instructions="Hand every request about the user's to-do list to the todo_keeper agent.",
        # the to-do agent sees the user's request, not the handoff call and its output (which
        # confused the 135M model: held-out success 0.00 with them, 24 tasks)
        handoffs=[handoff(keeper, input_filter=handoff_filters.remove_all_tools)],
        model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=temperature),
    )


async def rollout(runner: TrainableRunner, agent: Agent, s: Scenario) -> jm.Trajectory:
    todo = s.fresh_list()
    EPISODE.set(todo)
    _, trajectory = await runner.run(agent, s.task, max_turns=4)
    success = s.passed(todo)
    # success, and a little for a call the list accepted (the shaping mcp-rl uses too); a run that
    # raised (max_turns) keeps its calls and is scored the same way
    trajectory.reward = float(success) + 0.1 * (todo.calls > todo.refused)
    trajectory.metrics.update(success=success, refused=todo.refused)
    return trajectory


async def main(args: argparse.Namespace) -> None:
    async with jm.LocalBackend(path=args.path) as backend:
        model = jm.TrainableModel(name=args.name, project="agents-sdk-example")
        await model.register(backend)
        runner = TrainableRunner(model, api=args.api)
        sampled, greedy = triage_agent(0.7), triage_agent(0.0)
        loop = jm.TrainLoop(
            model,
            lambda s: rollout(runner, sampled, s),
            load_scenarios("train"),
            groups_per_step=args.groups,
            group_size=args.group_size,
            config=jm.TrainConfig(learning_rate=args.learning_rate),
        )
        await train_and_report(loop, lambda s: rollout(runner, greedy, s), args.eval_scenarios, args.steps)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", choices=["responses", "chat_completions"], default="responses")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--groups", type=int, default=3, help="training tasks per step")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per task")
    p.add_argument(
        "--eval-scenarios",
        type=int,
        default=72,
        help="held-out tasks to evaluate on (at most 72: the 24 held-out tasks, each in 3 phrasings)",
    )
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--name", default="todo-agent")
    p.add_argument("--path", type=Path, default=Path(".journeyman"))
    asyncio.run(main(p.parse_args()))
