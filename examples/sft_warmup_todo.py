"""SFT warm-up, then RL, on the to-do MCP server: does fine-tuning on successful runs lift held-out
success before any RL step, and does RL keep going from there?

    uv run python examples/sft_warmup_todo.py --successes 64 --rl-steps 4

1. Collect: the base model runs the training scenarios (sampled, temperature 0.7, each run seeded
   from `--seed`: the same runs every time) until `--successes` runs reached the checked end state; those are written to
   `<run>/sft_successes.jsonl` (exact token records: the model's own successes, i.e. rejection
   sampling; a stronger model's or reviewed runs would do the same job).
2. `mcp-rl train --sft-warmup <that file>`: held-out eval at step 0 (greedy, 24 scenarios), SFT
   (one step of the run), eval, then `--rl-steps` GRPO steps, eval. The table it prints is the result.

The run lives in .journeyman/sft-warmup/models/todo-sft (delete it to start over).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import journeyman as jm
from journeyman_mcp.rollout import RolloutConfig, rollout
from journeyman_mcp.scenarios import ScenarioSet
from journeyman_mcp.server import ServerSpec
from journeyman_mcp.train import McpRlSettings, connect, train

HERE = Path(__file__).parent


async def collect(settings: McpRlSettings, want: int, out: Path, max_rounds: int = 40) -> list[jm.Trajectory]:
    """Sampled runs of the base model on the training scenarios, kept when they succeed."""
    pool, info = await connect(settings, print)
    backend = jm.LocalBackend(path=settings.path)
    try:
        model = jm.TrainableModel(name="todo-collector", project=settings.project)
        await model.register(backend)
        client = model.openai_client()
        sset = ScenarioSet.load(settings.scenarios_file or HERE / "mcp_todo_scenarios.json")
        rng = random.Random(settings.seed)
        kept: list[jm.Trajectory] = []
        tried, t0 = 0, time.perf_counter()

        async def one(s: object, seed: int) -> jm.Trajectory:
            async with pool.lease() as conn:
                return await rollout(model, client, conn, info, s, settings.rollout, seed=seed)  # type: ignore[arg-type]

        # about four runs per success wanted (base success is ~0.25), in engine-sized batches of 8 to 16
        per_round = min(16, max(8, 4 * want), len(sset.train))
        for _ in range(max_rounds):
            batch = rng.sample(sset.train, per_round)
            seeds = [rng.randrange(1 << 31) for _ in batch]
            runs = await asyncio.gather(*map(one, batch, seeds), return_exceptions=True)
            tried += len(batch)
            kept += [t for t in runs if isinstance(t, jm.Trajectory) and t.metrics.get("success")]
            print(f"collect: {len(kept)} successes of {tried} runs ({time.perf_counter() - t0:.0f}s)")
            if len(kept) >= want:
                break
        kept = kept[:want]
        jm.write_trajectories(out, kept)
        return kept
    finally:
        backend.close()
        await pool.__aexit__(None, None, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--successes", type=int, default=64)
    p.add_argument("--rl-steps", type=int, default=4)
    p.add_argument("--sft-epochs", type=int, default=2)
    p.add_argument("--sft-learning-rate", type=float, default=2e-4)
    p.add_argument("--groups", type=int, default=3, help="groups per RL step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument(
        "--eval-scenarios", type=int, default=0, help="evaluate on the first N held-out tasks (0: all 24)"
    )
    p.add_argument(
        "--eval-samples",
        type=int,
        default=1,
        help="sampled held-out episodes per scenario beside the greedy one (0: greedy only)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the collection's scenarios and samples (reproducible)"
    )
    p.add_argument("--path", type=Path, default=Path(".journeyman"))
    args = p.parse_args()
    scenarios = HERE / "mcp_todo_scenarios.json"
    if args.eval_scenarios:  # a smaller held-out set, written beside the run
        sset = ScenarioSet.load(scenarios)
        sset.eval = sset.eval[: args.eval_scenarios]
        scenarios = sset.save(args.path / "sft-warmup" / f"scenarios-eval{args.eval_scenarios}.json")
    rollout_cfg = RolloutConfig(max_turns=1, max_tokens=48, temperature=0.7)
    settings = McpRlSettings(
        server=ServerSpec.parse(["python", str(HERE / "mcp_todo_server.py")]),
        path=args.path,
        project="sft-warmup",
        model="todo-sft",
        scenarios_file=scenarios,
        judge="none",
        generator="none",
        max_arg_chars=32,
        group_size=args.group_size,
        groups_per_step=args.groups,
        learning_rate=5e-4,
        steps=args.rl_steps,
        eval_samples=args.eval_samples,
        rollout=rollout_cfg,
        seed=args.seed,
        sft=jm.SFTConfig(epochs=args.sft_epochs, learning_rate=args.sft_learning_rate, batch_size=8),
    )
    data = settings.out_dir / "sft_successes.jsonl"
    if not data.exists():
        asyncio.run(collect(settings, args.successes, data))
    report = asyncio.run(train(settings.model_copy(update={"sft_warmup": data})))
    print(report.table())


if __name__ == "__main__":
    main()
