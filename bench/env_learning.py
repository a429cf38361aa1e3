"""Held-out reward before and after training on an environment its own authors wrote, in one run.

The environment is any SPEC `journeyman train|eval --env` take (docs/environments.md); by default
verifiers' own `ReasoningGymEnv` (verifiers 0.3.1, in the interpreter the tests pin:
packages/core/tests/environments/verifiers-requirements.txt) on reasoning-gym's `chain_sum` task,
two one-digit terms. Steps: (for the default environment, a warm-up that teaches answer tags: see FORMAT_EXAMPLES) evaluate the model on `--tasks` held-out tasks x `--k` samples, train `--steps`
GRPO steps, evaluate the trained step on the same tasks. Printed: both rewards ± SE, the paired
difference in SE, and evaluation's wall time per 100 episodes; written: `--json`.

    uv run python bench/env_learning.py                                  # verifiers ReasoningGymEnv
    uv run python bench/env_learning.py --env gym:textarena:GuessTheNumber-v0:max_turns=2 --max-tokens 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import journeyman as jm
from journeyman.environments import Environment, Sampling, evaluate, load, train, verifiers

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "packages/core/tests/environments/verifiers-requirements.txt"
# reasoning-gym's answers go in <answer> tags; an example in the system prompt says so to a 135M model
SYSTEM = "Reply with the answer only, in answer tags, like this: <answer>7</answer>"
# The embedded 135M model almost never writes answer tags (at most 1 of 16 answers under four system prompts
# tried, 2026-11-29), so nearly every reward is 0 and GRPO has nothing to compare: `--format-warmup` first
# teaches the tags by SFT on questions unlike the task's (facts and counts, no sums), as small models
# are commonly warmed up before RL. "Before" is measured after that warm-up.
FORMAT_EXAMPLES = [
    ("How many days are in a week?", "7"),
    ("How many legs does a dog have?", "4"),
    ("How many months are in a year?", "12"),
    ("What is the capital of France?", "Paris"),
    ("What colour is a clear daytime sky?", "blue"),
    ("How many sides does a triangle have?", "3"),
    ("What is the first letter of the word 'apple'?", "a"),
    ("How many hours are in a day?", "24"),
    ("What is the opposite of 'hot'?", "cold"),
    ("How many wheels does a bicycle have?", "2"),
    ("What animal says 'moo'?", "cow"),
    ("How many fingers are on one hand?", "5"),
    ("What is frozen water called?", "ice"),
    ("How many minutes are in an hour?", "60"),
    ("What planet do we live on?", "Earth"),
    ("How many sides does a square have?", "4"),
]
# sums of two one-digit numbers: hard enough that a 135M model gets some wrong, easy enough that it gets some right
GYM = '[{"name": "chain_sum", "weight": 1, "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}]'


def default_env(gym: Any) -> Environment:
    sys.path.insert(0, str(ROOT / "tests"))
    from _support import pinned_venv  # the same pinned interpreter the tests build

    return verifiers(
        "verifiers.ReasoningGymEnv",
        python=pinned_venv(REQUIREMENTS),
        gym=gym,
        num_train_examples=2000,
        num_eval_examples=200,
        system_prompt=SYSTEM,
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    env = (
        load(args.env)
        if args.env
        else default_env(json.loads(args.gym) if args.gym.startswith("[") else args.gym)
    )
    backend = jm.LocalBackend(path=args.path or tempfile.mkdtemp(prefix="env-learning-"))
    model = jm.TrainableModel(name="learner", project="env-learning")
    await model.register(backend)
    try:
        if args.format_warmup and not args.env:
            warm = [
                jm.Trajectory(
                    messages_and_choices=[
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": f"<answer>{answer}</answer>"},
                    ]
                )
                for question, answer in FORMAT_EXAMPLES
            ]
            await model.train_sft(warm, jm.SFTConfig(epochs=args.format_warmup, learning_rate=1e-3))
            print(f"format warm-up: {args.format_warmup} SFT epochs on {len(warm)} examples", flush=True)
        evaluation = Sampling(temperature=1.0, max_tokens=args.max_tokens)
        start = await model.get_step()
        started = time.perf_counter()

        def progress(step: jm.environments.TrainStep) -> None:
            print(
                f"  step {step.step}: reward {step.reward:.3f} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )

        await train(
            model,
            env,
            steps=args.steps,
            groups_per_step=args.groups_per_step,
            group_size=args.group_size,
            config=jm.TrainConfig(learning_rate=args.learning_rate),
            sampling=Sampling(temperature=1.0, max_tokens=args.max_tokens),
            on_step=progress,
        )
        train_seconds = time.perf_counter() - started
        report = await evaluate(
            model, env, steps=[start, "latest"], tasks=args.tasks, k=args.k, sampling=evaluation
        )
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()
        backend.close()
    print("\n".join(report.lines()), flush=True)
    first, last = report.steps[0], report.steps[-1]
    per_100 = 100 * last.seconds / max(1, last.episodes)
    print(f"train: {args.steps} steps in {train_seconds:.0f} s; eval: {per_100:.1f} s per 100 episodes")
    out = {
        "env": env.name,
        "steps": args.steps,
        "before": first.model_dump(include={"step", "mean", "sem", "tasks", "k"}),
        "after": last.model_dump(include={"step", "mean", "sem", "tasks", "k"}),
        "failures": [f.error for s in report.steps for f in s.failures],
        "difference_in_se": report.differences[-1].in_sems if report.differences else None,
        "train_seconds": train_seconds,
        "eval_seconds_per_100_episodes": per_100,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", default=None, help="a SPEC; default: verifiers' ReasoningGymEnv on --gym")
    parser.add_argument(
        "--gym", default=GYM, help="reasoning-gym task (a name, or a JSON list of dataset specs)"
    )
    parser.add_argument(
        "--format-warmup", type=int, default=3, help="SFT epochs teaching answer tags (0: none)"
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tasks", type=int, default=64, help="held-out tasks evaluated")
    parser.add_argument("--k", type=int, default=2, help="samples a held-out task (temperature 1)")
    parser.add_argument("--path", default=None, help="run directory (default: a temporary one)")
    parser.add_argument("--json", default=None, help="write the results here")
    asyncio.run(main(parser.parse_args()))
    sys.exit(0)
