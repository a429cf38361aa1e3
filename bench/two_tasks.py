"""Two models on one base, trained at once on different tasks, each learns its own.

Both are registered on one `LocalBackend` (one copy of the embedded base, one engine: their rollouts
share its batches, each row through its own model's adapter). Same prompts, different rewards:

- `brief`: the built-in task (`journeyman.app.tasks`): on topic x brevity, 1 - tokens / max_tokens.
- `topical`: how often the answer names its topic (up to 3 times), whatever its length.

Their training loops run concurrently (`asyncio.gather`), each step's rollouts and update on its own.
Printed per model: held-out reward on its own task before and after with its standard error
(greedy by default; `--eval-samples 4 --eval-temperature 1` scores the sampling policy GRPO trains,
4 seeded answers a prompt, the standard error over prompts), the gain in standard errors and the
completion length; then the isolation check: `brief`'s greedy
answers (token ids and logprobs) on held-out prompts, before and after one more step of `topical`
alone, must be identical, and the other way round.

    uv run python bench/two_tasks.py                    # 10 steps each, ~20 min on 2 cores
    uv run python bench/two_tasks.py --steps 4 --json two.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import journeyman as jm
from journeyman.app import tasks
from pydantic import BaseModel

Reward = Callable[[tasks.Scenario, str, int, int], float]


def topical(scenario: tasks.Scenario, text: str, completion_tokens: int, max_tokens: int) -> float:
    """How often the answer names its topic, up to 3 times (length is not rewarded nor punished)."""
    del completion_tokens, max_tokens
    return min(text.lower().count(scenario.topic.lower()), 3) / 3


REWARDS: dict[str, Reward] = {"brief": tasks.reward, "topical": topical}


class Eval(BaseModel):
    mean: float
    sem: float
    completion_tokens: float


class ModelResult(BaseModel):
    name: str
    before: Eval
    after: Eval
    steps: int
    train_seconds: float

    @property
    def gain_in_sems(self) -> float:
        se = math.hypot(self.before.sem, self.after.sem)
        return (self.after.mean - self.before.mean) / se if se > 0 else math.inf


async def _answer(
    model: jm.TrainableModel, scenario: tasks.Scenario, max_tokens: int, temperature: float, seed: int | None
) -> jm.Trajectory:
    """One rollout of `scenario`, rewarded by the model's own task."""
    client = model.openai_client()
    messages: list[dict[str, str]] = [
        {"role": "system", "content": tasks.SYSTEM},
        {"role": "user", "content": scenario.prompt},
    ]
    done = await client.chat.completions.create(
        model=model.name,
        messages=messages,  # pyright: ignore[reportArgumentType]
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
    )
    choice = done.choices[0]
    record = jm.record_of(choice)
    n = len(record.token_ids) if record else max_tokens
    reward = REWARDS[model.name](scenario, choice.message.content or "", n, max_tokens)
    return jm.Trajectory(
        messages_and_choices=[*messages, choice], reward=reward, metrics={"completion_tokens": n}
    )


async def _evaluate(
    model: jm.TrainableModel, n: int, max_tokens: int, samples: int, temperature: float
) -> Eval:
    """Held-out reward: each of `n` prompts answered `samples` times (seeded, so before and after
    see the same draws of randomness); the standard error is over the prompts' means."""
    val = tasks.scenarios("val", n)
    done = await asyncio.gather(
        *(_answer(model, s, max_tokens, temperature, k) for s in val for k in range(samples))
    )
    means = [statistics.mean(t.reward for t in done[i : i + samples]) for i in range(0, len(done), samples)]
    return Eval(
        mean=statistics.mean(means),
        sem=statistics.stdev(means) / math.sqrt(len(means)),
        completion_tokens=statistics.mean(float(t.metrics["completion_tokens"]) for t in done),
    )


async def _train(
    model: jm.TrainableModel, steps: int, prompts: int, group: int, lr: float, max_tokens: int, seed: int
) -> float:
    """`steps` GRPO steps on the model's own task; the seconds they took."""
    t0 = time.monotonic()
    train = tasks.scenarios("train", prompts * steps, seed=seed)
    for step in range(steps):
        batch = train[step * prompts : (step + 1) * prompts]
        rollouts = await asyncio.gather(
            *(_answer(model, s, max_tokens, 1.0, None) for s in batch for _ in range(group))
        )
        groups = [jm.TrajectoryGroup(rollouts[i : i + group]) for i in range(0, len(rollouts), group)]
        result = await model.train(groups, config=jm.TrainConfig(learning_rate=lr))
        mean = statistics.mean(t.reward for t in rollouts)
        print(f"  {model.name} step {result.step}: rollout reward {mean:.3f}", flush=True)
    return time.monotonic() - t0


async def _greedy(model: jm.TrainableModel, n: int, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    out = []
    for s in tasks.scenarios("val", n, seed=5):
        t = await _answer(model, s, max_tokens, 0.0, None)
        record = t.records()[0]
        out.append((list(record.token_ids), list(record.logprobs)))
    return out


async def run(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        backend = jm.LocalBackend(path=Path(tmp))
        try:
            models = [
                jm.TrainableModel(name=n, project="two-tasks", max_tokens=args.max_tokens) for n in REWARDS
            ]
            for m in models:
                await m.register(backend)
            ev = (args.eval_prompts, args.max_tokens, args.eval_samples, args.eval_temperature)
            before = await asyncio.gather(*(_evaluate(m, *ev) for m in models))
            seconds = await asyncio.gather(
                *(
                    _train(m, args.steps, args.prompts, args.group, args.lr, args.max_tokens, seed=i + 1)
                    for i, m in enumerate(models)
                )
            )
            after = await asyncio.gather(*(_evaluate(m, *ev) for m in models))
            results = [
                ModelResult(name=m.name, before=b, after=a, steps=args.steps, train_seconds=s)
                for m, b, a, s in zip(models, before, after, seconds, strict=True)
            ]
            # isolation: one more step of one model leaves the other's greedy answers bit for bit
            isolation = {}
            for trained, other in (models, models[::-1]):
                kept = await _greedy(other, args.check_prompts, args.max_tokens)
                await _train(trained, 1, args.prompts, args.group, args.lr, args.max_tokens, seed=99)
                isolation[f"{other.name} while {trained.name} trains"] = (
                    await _greedy(other, args.check_prompts, args.max_tokens) == kept
                )
            engine = backend.service(models[0]).engine
            mixed = engine.counters().get("decode_mixed_steps", 0)
        finally:
            backend.close()
    return {"models": results, "isolation": isolation, "mixed_decode_steps": mixed}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8, help="scenarios a step")
    parser.add_argument("--group", type=int, default=4, help="rollouts a scenario")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--eval-samples", type=int, default=1, help="answers a held-out prompt")
    parser.add_argument("--eval-temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--check-prompts", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    out = asyncio.run(run(args))
    print("| model | before | after | gain (SE) | tokens before -> after | train s |")
    print("|---|---|---|---|---|---|")
    for r in out["models"]:  # pyright: ignore[reportGeneralTypeIssues]
        assert isinstance(r, ModelResult)
        print(
            f"| {r.name} | {r.before.mean:.3f} ± {r.before.sem:.3f} | {r.after.mean:.3f} ± {r.after.sem:.3f} | "
            f"{r.gain_in_sems:+.1f} | {r.before.completion_tokens:.1f} -> {r.after.completion_tokens:.1f} | "
            f"{r.train_seconds:.0f} |"
        )
    print("isolation (greedy answers identical):", out["isolation"])
    print("decode steps with rows of both models:", out["mixed_decode_steps"])
    if args.json is not None:
        models = [{**r.model_dump(), "gain_in_sems": r.gain_in_sems} for r in out["models"]]  # pyright: ignore[reportGeneralTypeIssues]
        args.json.write_text(json.dumps({**out, "models": models}, indent=2))


if __name__ == "__main__":
    main()
