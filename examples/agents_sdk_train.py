"""Train an OpenAI Agents SDK agent with GRPO, through `journeyman_agents.TrainableRunner`.

The agent is ordinary Agents SDK code: an `Agent` with a function tool. The runner serves it from the
trainable model (Responses API by default, `--api chat_completions` for the other one), and every
run comes back as the SDK's `RunResult` plus a `Trajectory` holding the exact sampled tokens of
both turns (the tool call, then the answer). Reward: the tool was called for the city asked about,
and the answer passes on what the tool said.

    uv run python examples/agents_sdk_train.py                 # 3 steps, ~1-2 min per step on 2 CPU cores
    uv run python examples/agents_sdk_train.py --api chat_completions --steps 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path
from typing import Any

import journeyman as jm
from agents import Agent, ModelSettings, function_tool
from agents.items import ToolCallItem
from journeyman_agents import TrainableRunner

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Madrid"]
WEATHER = {
    c: f"{w}, {t} C"
    for c, w, t in zip(CITIES, ["sunny", "rainy", "foggy", "snowy"] * 2, range(14, 30, 2), strict=True)
}


@function_tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return WEATHER.get(city.strip().title(), "unknown city")


agent = Agent(
    name="Weather",
    instructions="You answer weather questions. Call get_weather, then answer in one short sentence.",
    tools=[get_weather],
    # Force the first turn's tool call (grammar-constrained on the endpoint); the SDK resets
    # tool_choice after it (reset_tool_choice), so the second turn answers in text.
    model_settings=ModelSettings(tool_choice="required", max_tokens=40),
)


def reward(city: str, result: Any) -> float:
    called = [json.loads(i.raw_item.arguments) for i in result.new_items if isinstance(i, ToolCallItem)]
    right_city = any(str(a.get("city", "")).strip().lower() == city.lower() for a in called)
    answer = str(result.final_output or "").lower()
    said_weather = WEATHER[city].split(",")[0] in answer
    return 0.5 * right_city + 0.5 * said_weather


async def rollout(runner: TrainableRunner, city: str) -> jm.Trajectory:
    result, trajectory = await runner.run(agent, f"What's the weather like in {city} today?")
    trajectory.reward = reward(city, result)
    trajectory.metadata["city"] = city
    return trajectory


async def main(args: argparse.Namespace) -> None:
    async with jm.LocalBackend(path=args.path) as backend:
        model = jm.TrainableModel(name="weather-agent", project="agents-sdk-example")
        await model.register(backend)
        runner = TrainableRunner(model, api=args.api)
        config = jm.TrainConfig(learning_rate=args.learning_rate)
        rng = random.Random(0)
        for _ in range(args.steps):
            step = await model.get_step()
            groups = await jm.gather_trajectory_groups(
                (
                    jm.TrajectoryGroup(rollout(runner, city) for _ in range(args.group_size))
                    for city in rng.sample(CITIES, args.groups)
                ),
                pbar_desc=f"step {step}",
            )
            rewards = [r for g in groups for r in g.rewards()]
            result = await model.train(groups, config=config)
            best = max((t for g in groups for t in g.trajectories), key=lambda t: t.reward)
            print(
                f"step {step} -> {result.step}: mean reward {sum(rewards) / len(rewards):.3f} "
                f"(n={len(rewards)}), skipped={result.skipped}; best answer: "
                f"{best.metadata.get('final_output', '')!r}"
            )
        print(f"run directory: {model.run_dir}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", choices=["responses", "chat_completions"], default="responses")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--groups", type=int, default=2, help="cities per step")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per city")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--path", type=Path, default=Path(".journeyman"))
    asyncio.run(main(p.parse_args()))
