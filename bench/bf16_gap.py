"""The engine/trainer logprob gap bf16 causes, on real samples, and what TIS makes of it; and the
size of the undo log that merging into a bf16 base keeps (policy/merge.py).

For each dtype (float32, then bfloat16): a LocalBackend on this device, the embedded SmolLM2-135M
with a LoRA adapter whose B matrices are drawn at `--b-std` (a fresh adapter is a no-op; the soak
run's adapter after 7 steps had B std 1.6e-4), completions of the built-in task sampled through the
endpoint (the torch engine, merged weights), then per sampled token the trainer's logprob of it
(unmerged, teacher-forced) against the one the engine recorded, and one real train step without
TIS, whose `engine_trainer_logprob_gap` and `clip_fraction` are the trainer's own (packed rows).

What the gap does to a step:
- without TIS (`tis_cap=None`) the engine's logprobs are π_old: a token whose trainer/engine ratio
  is outside [1 - eps, 1 + eps] is clipped at the first update, signal lost to precision.
- with TIS (`tis_cap=C`) π_old is the trainer's own logprob (ratio 1 at the first update, nothing
  clipped by the gap) and each token is weighted by min(π_trainer / π_engine, C): the weights'
  mean and spread and the share the cap truncates are printed.

    uv run python bench/bf16_gap.py                       # 8 prompts x 4 samples, 40 tokens
    uv run python bench/bf16_gap.py --prompts 4 --b-std 1.6e-4
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from pathlib import Path

import journeyman as jm
import torch
from journeyman.app import tasks
from journeyman.policy.lora import LoraPolicy

EPS, TIS_CAP = 0.2, 2.0


def set_adapter(policy: LoraPolicy, b_std: float) -> None:
    """B drawn at `b_std` from a fixed seed, the same values in every dtype (LoRA weights are fp32)."""
    gen = torch.Generator().manual_seed(0)
    with policy.editing(), torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
        policy.version += 1


def undo_log_sizes(policy: LoraPolicy, stds: list[float]) -> list[tuple[float, int, int]]:
    """(B std, undo-log bytes while merged, bytes of a copy of the adapted weights) per B std."""
    weights = [layer.get_base_layer().weight for layer in policy.merge.layers]
    copy = sum(w.numel() * w.element_size() for w in weights)
    out = []
    for std in stds:
        set_adapter(policy, std)
        with policy.sampling():
            out.append((std, policy.merge.undo_bytes(), copy))
    return out


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def measure(dtype: str, root: Path, args: argparse.Namespace) -> dict[str, float]:
    backend = jm.LocalBackend(path=root / dtype, dtype=dtype)
    model = jm.TrainableModel(name="gap", project="bench")
    await model.register(backend)
    policy = backend.service(model).policy
    set_adapter(policy, args.b_std)
    client = model.openai_client()
    t0 = time.perf_counter()
    scenarios = tasks.scenarios("train", args.prompts, seed=1)
    groups = await jm.gather_trajectory_groups(
        (
            jm.TrajectoryGroup(
                tasks.rollout(model, client, s, max_tokens=args.max_tokens) for _ in range(args.group)
            )
            for s in scenarios
        ),
        pbar_desc=None,
    )
    for g in groups:  # rewards that differ in every group, so the step trains every row
        for i, t in enumerate(g.trajectories):
            t.reward = float(i % 2)
    t1 = time.perf_counter()
    gaps: list[float] = []  # log π_trainer - log π_engine, per sampled token
    for g in groups:
        for t in g.trajectories:
            for r in t.records():
                trainer = policy.sampled_logprobs(r.prompt_token_ids, r.token_ids)
                gaps.extend(a - b for a, b in zip(trainer, r.logprobs, strict=True))
    t2 = time.perf_counter()
    result = await model.train(groups, config=jm.TrainConfig(learning_rate=1e-6, eps=EPS))
    t3 = time.perf_counter()
    print(
        f"{dtype}: sampling {t1 - t0:.0f} s, trainer logprobs {t2 - t1:.0f} s, step {t3 - t2:.0f} s",
        flush=True,
    )
    sizes = undo_log_sizes(policy, [1.6e-4, 1e-3, 1e-2]) if dtype == "bfloat16" else []
    backend.close()
    weights = [min(math.exp(d), TIS_CAP) for d in gaps]
    out = {
        "tokens": float(len(gaps)),
        "mean |gap|": statistics.fmean(abs(d) for d in gaps),
        "p50 |gap|": quantile([abs(d) for d in gaps], 0.5),
        "p99 |gap|": quantile([abs(d) for d in gaps], 0.99),
        "max |gap|": max(abs(d) for d in gaps),
        f"outside [1-{EPS}, 1+{EPS}]": sum(abs(math.exp(d) - 1) > EPS for d in gaps) / len(gaps),
        "trainer step gap": result.metrics["engine_trainer_logprob_gap"],
        "trainer step clip_fraction": result.metrics.get("clip_fraction", float("nan")),
        "TIS weight mean": statistics.fmean(weights),
        "TIS weight std": statistics.pstdev(weights),
        f"TIS capped at {TIS_CAP}": sum(math.exp(d) > TIS_CAP for d in gaps) / len(gaps),
    }
    for std, undo, copy in sizes:
        out[f"undo log, B std {std:g} (MB; copy {copy / 1e6:.0f})"] = undo / 1e6
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--b-std", type=float, default=1e-3, help="std of the adapter's B matrices")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B std {args.b_std:g}", flush=True)
    with tempfile.TemporaryDirectory(prefix="jm-bf16-gap-") as tmp:
        rows = {dtype: await measure(dtype, Path(tmp), args) for dtype in ("float32", "bfloat16")}
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    print(f"\n{'':44s} {'float32':>10s} {'bfloat16':>10s}")
    for k in keys:
        cells = [f"{rows[d][k]:10.3g}" if k in rows[d] else f"{'':10s}" for d in rows]
        print(f"{k:44s} {' '.join(cells)}")


if __name__ == "__main__":
    asyncio.run(main())
