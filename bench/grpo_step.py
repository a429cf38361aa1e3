"""Seconds per GRPO step: Journeyman vs TRL's GRPOTrainer, same model, task and settings, one run.

Setting (issue 3): the embedded SmolLM2-135M-Instruct in fp32, LoRA r8 on all linear layers,
8 prompts x 4 generations per step, <= 40 new tokens, the built-in on-topic/brevity reward,
learning rate 2e-4, no KL. Each framework runs `--steps` steps; the first is reported apart
(warm-up) and the median of the rest is compared.

    uv run --group bench python bench/grpo_step.py --steps 4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import journeyman as jm
import torch
from journeyman.app import tasks
from journeyman.policy.weights import DEFAULT_BASE_MODEL, resolve_base_model

PROMPTS, GROUP, MAX_TOKENS, LR = 8, 4, 40, 2e-4


async def journeyman_steps(
    steps: int, root: Path, bf16: bool, train_seconds: list[float], dtype: str = "float32"
) -> tuple[list[float], list[float]]:
    backend = jm.LocalBackend(path=root, dtype=dtype)
    model = jm.TrainableModel(name="bench", project="bench")
    await model.register(backend)
    client = model.openai_client()
    scenarios = tasks.scenarios("train", PROMPTS * steps, seed=1)
    seconds, rewards = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        groups = await jm.gather_trajectory_groups(
            (
                jm.TrajectoryGroup(
                    tasks.rollout(model, client, s, max_tokens=MAX_TOKENS) for _ in range(GROUP)
                )
                for s in scenarios[step * PROMPTS : (step + 1) * PROMPTS]
            ),
            pbar_desc=None,
        )
        t1 = time.perf_counter()
        result = await model.train(groups, config=jm.TrainConfig(learning_rate=LR, autocast_bf16=bf16))
        seconds.append(time.perf_counter() - t0)
        train_seconds.append(time.perf_counter() - t1)
        rewards.append(result.metrics["reward"])
        m = result.metrics
        # token positions the model ran (packed: no padding, shared prefixes once) against the
        # rows' own lengths
        print(
            f"journeyman step {step}: {seconds[-1]:.1f}s (rollout {t1 - t0:.1f}s, train {train_seconds[-1]:.1f}s, "
            f"of which the optimizer step {m.get('train_seconds', float('nan')):.1f}s) "
            f"reward {rewards[-1]:.3f} engine/trainer gap {m.get('engine_trainer_logprob_gap', float('nan')):.2e} "
            f"model tokens {m.get('forward_tokens', float('nan')):.0f} (rows {m.get('row_tokens', float('nan')):.0f}, "
            f"trained {m.get('trained_tokens', 0.0):.0f})",
            flush=True,
        )
    backend.close()
    peak_memory("journeyman")
    return seconds, rewards


def peak_memory(name: str) -> None:
    """On CUDA, the peak of allocated GPU memory since the last call (engine and trainer share it)."""
    if torch.cuda.is_available():
        print(f"{name}: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
        torch.cuda.reset_peak_memory_stats()


def trl_steps(steps: int, root: Path) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    scenarios = tasks.scenarios("train", PROMPTS * steps, seed=1)
    data = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": tasks.SYSTEM},
                    {"role": "user", "content": s.prompt},
                ],
                "topic": s.topic,
            }
            for s in scenarios
        ]
    )

    def reward(
        completions: list, topic: list[str], completion_ids: list[list[int]], **_: object
    ) -> list[float]:
        out = []
        for c, t, ids in zip(completions, topic, completion_ids, strict=True):
            out.append(
                tasks.reward(tasks.Scenario(topic=t, prompt=""), c[0]["content"], len(ids), MAX_TOKENS)
            )
        return out

    seconds: list[float] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            seconds.append(time.perf_counter() - self.t0)
            print(f"trl step {len(seconds) - 1}: {seconds[-1]:.1f}s", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    config = GRPOConfig(
        output_dir=str(root / "trl"),
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        learning_rate=LR,
        beta=0.0,
        logging_steps=1,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=str(resolve_base_model(DEFAULT_BASE_MODEL)),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[Timer()],
    )
    trainer.train()
    peak_memory("trl")
    return seconds, rewards


def gain_per_step(rewards: list[float]) -> float:
    if len(rewards) < 2:
        return float("nan")
    n = len(rewards)
    xs = range(n)
    mx, my = (n - 1) / 2, statistics.mean(rewards)
    return sum((x - mx) * (y - my) for x, y in zip(xs, rewards, strict=True)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--bf16", action="store_true", help="also time Journeyman with bf16 autocast in the trainer"
    )
    ap.add_argument(
        "--bf16-weights",
        action="store_true",
        help="also time Journeyman with the model held in bf16 (engine and trainer; LoRA weights too)",
    )
    ap.add_argument("--skip-trl", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jm-bench-"))
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", flush=True)
    rows = {}
    train: dict[str, list[float]] = {
        "journeyman fp32": [],
        "journeyman bf16-autocast": [],
        "journeyman bf16 weights": [],
    }
    rows["journeyman fp32"] = asyncio.run(
        journeyman_steps(args.steps, root / "jm", bf16=False, train_seconds=train["journeyman fp32"])
    )
    if args.bf16:
        rows["journeyman bf16-autocast"] = asyncio.run(
            journeyman_steps(
                args.steps, root / "jm16", bf16=True, train_seconds=train["journeyman bf16-autocast"]
            )
        )
    if args.bf16_weights:
        rows["journeyman bf16 weights"] = asyncio.run(
            journeyman_steps(
                args.steps,
                root / "jmbf16",
                bf16=False,
                train_seconds=train["journeyman bf16 weights"],
                dtype="bfloat16",
            )
        )
    if not args.skip_trl:
        rows["trl GRPOTrainer fp32"] = trl_steps(args.steps, root)
    print(f"\n{'':26} {'first step s':>12} {'median s/step':>14} {'reward gain/step':>17}")
    medians = {}
    for name, (secs, rewards) in rows.items():
        medians[name] = statistics.median(secs[1:] or secs)
        print(f"{name:26} {secs[0]:12.1f} {medians[name]:14.1f} {gain_per_step(rewards):17.3f}")
    for name, secs in train.items():
        if secs:
            print(f"{name}: train phase median {statistics.median(secs[1:] or secs):.2f} s/step")
    if "trl GRPOTrainer fp32" in medians:
        for name in medians:
            if name.startswith("journeyman"):
                print(f"speed-up of {name} over TRL: {medians['trl GRPOTrainer fp32'] / medians[name]:.2f}x")


if __name__ == "__main__":
    main()
