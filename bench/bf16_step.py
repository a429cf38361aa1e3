"""Is bf16 faster than fp32 on this CPU? Matmul rates at the shapes a step runs, then one LoRA
forward + backward of a packed sequence in three precisions, with a per-op profile on request.

The answer depends on the CPU, not on our code: bf16 GEMMs are fast where the CPU has AMX (Intel
Sapphire Rapids and later) or a fast AVX-512 BF16 path (the AMD EPYC this project was first measured
on: 737 GFLOP/s bf16 vs 173 fp32 at 2048^3), and slower than fp32 elsewhere. Run this on the
machine that trains before setting `TrainConfig(autocast_bf16=True)`.

Precisions of the step (the embedded SmolLM2-135M, LoRA r8 on every linear layer, fp32 LoRA
weights and optimizer in all three):
- fp32: everything fp32 (the default).
- autocast: fp32 weights, matmuls under `torch.autocast(bfloat16)` (`autocast_bf16=True`); the
  frozen base weights are cast on every call, as autocast caches only casts of leaves that need grad.
- bf16-base: the frozen base weights stored in bf16 once, matmuls under autocast: no casts of them.

    uv run python bench/bf16_step.py                  # 768 tokens, rates and step times
    uv run python bench/bf16_step.py --tokens 1536 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from journeyman.policy.lora import LoraPolicy
from journeyman.policy.weights import DEFAULT_BASE_MODEL, resolve_base_model

PRECISIONS = ("fp32", "autocast", "bf16-base")


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_rates(tokens: int, hidden: int, inter: int, vocab: int) -> list[tuple[str, float, float]]:
    """(shape, fp32 GFLOP/s, bf16 GFLOP/s) of `linear` at the step's shapes and at 2048^3."""
    shapes = [(tokens, hidden, inter), (tokens, inter, hidden), (tokens, hidden, vocab), (2048, 2048, 2048)]
    out = []
    for m, k, n in shapes:
        rates = []
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            s = best_seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w), 5)
            rates.append(2 * m * k * n / s / 1e9)
        out.append((f"{m}x{k} @ {k}x{n}", rates[0], rates[1]))
    return out


def step_seconds(policy: LoraPolicy, ids: torch.Tensor, precision: str) -> Callable[[], None]:
    model = policy.model
    frozen = [p for p in model.parameters() if not p.requires_grad]
    dtype = torch.bfloat16 if precision == "bf16-base" else torch.float32
    for p in frozen:
        p.data = p.data.to(dtype)

    def step() -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision != "fp32" else contextlib.nullcontext()
        with ctx:
            logits = model(input_ids=ids).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
        logp.mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=768, help="tokens in the packed sequence")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print the top ops of one step per precision")
    args = ap.parse_args()
    torch.manual_seed(0)
    policy = LoraPolicy(resolve_base_model(DEFAULT_BASE_MODEL))
    cfg = policy.model.config
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'linear':28s} {'fp32 GF/s':>10s} {'bf16 GF/s':>10s} {'bf16/fp32':>10s}")
    rates = matmul_rates(args.tokens, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)
    for shape, f32, b16 in rates:
        print(f"{shape:28s} {f32:10.0f} {b16:10.0f} {b16 / f32:10.2f}")

    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    seconds: dict[str, float] = {}
    for precision in PRECISIONS:
        step = step_seconds(policy, ids, precision)
        seconds[precision] = best_seconds(step, args.repeats)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                step()
            print(f"--- {precision}")
            print(
                prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40
                )
            )
    step_seconds(policy, ids, "fp32")  # leave the policy as it was loaded
    base = seconds["fp32"]
    print(f"\nLoRA forward + backward, {args.tokens} tokens (best of {args.repeats}):")
    for precision, s in seconds.items():
        print(f"  {precision:10s} {s:6.2f} s   speed-up over fp32 {base / s:.2f}x")
    mlp = statistics.fmean(b16 / f32 for _, f32, b16 in rates[:2])  # the MLP's two shapes: most FLOPs
    verdict = "faster" if mlp > 1 else "slower"
    print(f"bf16 matmuls are {verdict} than fp32 on this CPU at the step's shapes.")


if __name__ == "__main__":
    main()
