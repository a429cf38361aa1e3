"""Train with RULER instead of a hand-written reward.

Each scenario is rolled out a few times; a judge model sees the group side by side and scores each
rollout in [0, 1] against a rubric; GRPO trains on those relative scores. Nothing here knows what a
good answer is: the rubric says what the user wants.

    uv run python examples/ruler_train.py                     # offline: a second local model judges
    uv run python examples/ruler_train.py --judge openai/gpt-4o   # any LiteLLM model (journeyman[litellm])
    uv run python examples/ruler_train.py --judge http://127.0.0.1:8000/v1 --judge-model Qwen/Qwen3-8B

The offline judge is the same 135M model as the policy (kept frozen): it shows the loop working on
a laptop CPU, not a judge worth trusting. Point --judge at a strong model for real training.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
from pathlib import Path

import journeyman as jm
from openai import AsyncOpenAI

RUBRIC = """\
- The user asked a factual question: a correct, direct answer scores highest.
- A short answer that states the fact beats a long one that wanders; rambling costs points.
- A wrong or evasive answer scores lowest; a partly right one gets partial credit."""

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What gas do plants take in from the air?",
    "Which planet is closest to the sun?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the largest ocean on Earth?",
    "How many days are in a leap year?",
]


async def rollout(
    model: jm.TrainableModel, client: AsyncOpenAI, question: str, max_tokens: int
) -> jm.Trajectory:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": question},
    ]
    out = await client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=max_tokens, temperature=1.0
    )
    return jm.Trajectory(messages_and_choices=[*messages, out.choices[0]], metadata={"question": question})


async def main(args: argparse.Namespace) -> None:
    async with jm.LocalBackend(path=args.path) as backend:
        judge: str | jm.TrainableModel = args.judge
        if judge == "local":
            # A frozen copy of the base model as judge, so the policy does not grade itself.
            judge = jm.TrainableModel(name="judge", project="ruler-example")
            await judge.register(backend)
        model = jm.TrainableModel(name="agent", project="ruler-example")
        await model.register(backend)
        client = model.openai_client()
        score = functools.partial(
            jm.ruler_score_group,
            judge=judge,
            rubric=RUBRIC,
            config=jm.RulerConfig(judge_model=args.judge_model, explanation_chars=args.explanation_chars),
        )
        loop = jm.TrainLoop(
            model,
            lambda q: rollout(model, client, q, args.max_tokens),
            QUESTIONS,
            groups_per_step=args.groups,
            group_size=args.group_size,
            config=jm.TrainConfig(learning_rate=args.learning_rate),
            after_each=score,  # RULER replaces each group's rewards as soon as it is gathered
        )
        async for s in loop.steps(args.steps):
            for g in s.groups:
                best = max(g.trajectories, key=lambda t: t.reward)
                print(
                    f"  {best.metadata['question']!r}: rewards {g.rewards()} best: {best.messages()[-1]['content']!r}"
                )
            print(
                f"step {s.step} -> {s.result.step}: mean RULER reward {s.mean('reward'):.3f}, skipped={s.result.skipped}"
            )
        print(f"run directory: {model.run_dir}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--judge", default="local", help='"local", a LiteLLM model string, or an OpenAI-compatible base URL'
    )
    p.add_argument("--judge-model", default=None, help="the model to ask when --judge is a base URL")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--groups", type=int, default=2, help="scenarios per step")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per scenario")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--explanation-chars", type=int, default=40)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--path", type=Path, default=Path(".journeyman"))
    asyncio.run(main(p.parse_args()))
