"""Where a run stops against each kind of budget (issue 57): the spend when the first refusal came,
against the limit.

One `LocalBackend` serves the embedded model under a fresh name per budget (all on one base), each
with one limit, and drives it until the named error:

- sampled_tokens: rounds of `--concurrency` completions at once; refused with a 402 before they start
  once the limit is reached, so the overshoot is at most the tokens of the requests in flight;
- trained_tokens: synchronous GRPO steps on sampled groups; a step that began under the limit commits,
  so the overshoot is at most one step's tokens;
- judge_tokens: RULER with a local judge (a frozen copy of the base beside the policy), charged to
  the policy: checked before each judge call, so the overshoot is at most one call;
- judge_usd: the same judge asked through LiteLLM as "openai/gpt-4o-mini" (served under that name, so
  no request leaves the machine) and priced by LiteLLM's own table (the `litellm` extra, which the
  workspace installs; skipped without it);
- wall_s: completions one after another until the clock passes the limit.

    uv run python bench/budget_stop.py          # ~3 min on 2 CPU cores
    uv run python bench/budget_stop.py --json stops.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import journeyman as jm
import openai
from journeyman.rewards.ruler import RulerConfig, ruler_score_group

PROMPTS = ["Name a river of Europe.", "What does a thermometer measure?", "Give one use of copper."]


def _model(name: str, **budget: Any) -> jm.TrainableModel:
    return jm.TrainableModel(name=name, project="budget-stop", max_tokens=16, budget=jm.Budget(**budget))


async def _ask(model: jm.TrainableModel, i: int) -> int:
    done = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], temperature=1.0
    )
    return done.usage.completion_tokens if done.usage else 0


async def _group(model: jm.TrainableModel, i: int, n: int = 4) -> jm.TrajectoryGroup:
    ask = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    client = model.openai_client()
    done = await client.chat.completions.create(model=model.name, messages=ask, n=n, temperature=1.0)  # pyright: ignore[reportArgumentType]
    return jm.TrajectoryGroup(
        jm.Trajectory(messages_and_choices=[*ask, c], reward=float(len(c.message.content or "") % 3))
        for c in done.choices
    )


def _named(e: BaseException) -> str:
    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}: {str(e)[:160]}"
    return f"{type(e).__name__}: {str(e)[:160]}"


async def _until_refused(step: Callable[[int], Awaitable[object]], limit_steps: int = 400) -> tuple[int, str]:
    """(calls that went through, the refusal) calling `step(i)` until it raises a budget's error."""
    for i in range(limit_steps):
        try:
            await step(i)
        except (jm.BudgetExceededError, openai.APIStatusError) as e:
            if isinstance(e, openai.APIStatusError) and e.status_code != 402:
                raise
            return i, _named(e)
    raise RuntimeError(f"no refusal after {limit_steps} calls")


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    backend = jm.LocalBackend(path=Path(tempfile.mkdtemp(prefix="budget-stop-")))
    out: list[dict[str, Any]] = []

    async def measure(
        budget: str, limit: float, model: jm.TrainableModel, step: Callable[[int], Awaitable[object]]
    ) -> None:
        await model.register(backend)
        t0 = time.perf_counter()
        calls, refusal = await _until_refused(step)
        spent = backend.service(model).meter.spent()[budget]  # pyright: ignore[reportOptionalMemberAccess]
        row = {
            "budget": budget,
            "limit": limit,
            "spent": round(spent, 6),
            "over_by": round(spent - limit, 6),
            "over_pct": round(100 * (spent - limit) / limit, 1),
            "calls": calls,
            "seconds": round(time.perf_counter() - t0, 1),
            "refusal": refusal,
        }
        print(json.dumps(row), flush=True)
        out.append(row)

    try:
        sampled = _model("sampled", sampled_tokens=args.sampled_tokens)
        await measure(
            "sampled_tokens",
            args.sampled_tokens,
            sampled,
            lambda i: asyncio.gather(
                *(_ask(sampled, i * args.concurrency + k) for k in range(args.concurrency))
            ),
        )

        trained = _model("trained", trained_tokens=args.trained_tokens)

        async def train_step(i: int) -> object:
            return await trained.train([await _group(trained, i)], config=jm.TrainConfig(learning_rate=1e-4))

        await measure("trained_tokens", args.trained_tokens, trained, train_step)

        judge = jm.TrainableModel(name="judge", project="budget-stop", max_tokens=512)
        await judge.register(backend)  # a frozen copy of the base: never trained
        by_tokens = _model("judged", judge_tokens=args.judge_tokens)
        config = RulerConfig(use_cache=False, explanation_chars=20)

        async def judged(i: int) -> object:
            group = await _group(by_tokens, i, n=2)
            return await ruler_score_group(group, judge="local:judge", config=config, charge_to=by_tokens)

        await measure("judge_tokens", args.judge_tokens, by_tokens, judged)

        if importlib.util.find_spec("litellm") is not None:
            paid_judge = jm.TrainableModel(name="gpt-4o-mini", project="budget-stop", max_tokens=512)
            await paid_judge.register(backend)
            where = backend.inference("gpt-4o-mini")
            by_usd = _model("paid", judge_usd=args.judge_usd)
            paid = config.with_options(
                judge_params={"api_base": where.base_url, "max_tokens": 200}, api_key=where.api_key
            )

            async def priced(i: int) -> object:
                group = await _group(by_usd, i, n=2)
                return await ruler_score_group(
                    group, judge="openai/gpt-4o-mini", config=paid, charge_to=by_usd
                )

            await measure("judge_usd", args.judge_usd, by_usd, priced)
        else:
            print(
                '{"budget": "judge_usd", "skipped": "no litellm: pip install journeyman[litellm]"}',
                flush=True,
            )

        clock = _model("clock", wall_s=args.wall_s)
        await measure("wall_s", args.wall_s, clock, lambda i: _ask(clock, i))
    finally:
        backend.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sampled-tokens", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4, help="completions at once (sampled_tokens)")
    p.add_argument("--trained-tokens", type=int, default=200)
    p.add_argument("--judge-tokens", type=int, default=1500)
    p.add_argument("--judge-usd", type=float, default=0.0005)
    p.add_argument("--wall-s", type=float, default=10.0)
    p.add_argument("--json", type=Path, help="write the rows here too")
    args = p.parse_args()
    rows = asyncio.run(run(args))
    print(f"{'budget':<15} {'limit':>10} {'spent':>12} {'over by':>10} {'calls':>6}")
    for r in rows:
        print(f"{r['budget']:<15} {r['limit']:>10g} {r['spent']:>12g} {r['over_pct']:>9.1f}% {r['calls']:>6}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
