"""The packed attention on any device: its logprobs and LoRA gradients against the references, its
time and peak memory, on agent-shaped packs of a random-weight model (torch, transformers, peft only).

Ways (`journeyman.training.packing`): "dense" (the reference: a (1, 1, L, L) mask, row by row;
skipped past `--dense-max` tokens), "rows" (each row against its own keys), "flex" (FlexAttention,
one call per layer; with a backward on CUDA only), and "tree" (`pack_tree`: the shared prompt
prefixes run once, then the packs, with the device's default attention). Each way runs the same rows
(a shared system prompt, groups under it, one long row) with and without grad; gaps are relative to
"rows". For `bench/gpu_check.py`: `check(...)` returns the rows of the table.

    uv run python bench/packed_attention_check.py --dry-run            # toy size on the CPU
    python bench/packed_attention_check.py --tokens 4096 16384 --width 7b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
from journeyman.training.packing import PackAttention, pack_rows, pack_tree, packed_logprobs, pad_rows
from journeyman.training.rows import Row
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

# (hidden, intermediate, heads, kv heads, layers): the embedded SmolLM2-135M's shape, a Qwen2.5-7B-wide
# one of a few layers, and a toy for --dry-run
WIDTHS = {
    "toy": (64, 128, 4, 2, 2),
    "135m": (576, 1536, 9, 3, 30),
    "7b": (3584, 18944, 28, 4, 4),
}


def model(width: str, device: torch.device, dtype: torch.dtype) -> Any:
    hidden, inter, heads, kv, layers = WIDTHS[width]
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        max_position_embeddings=65536,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    peft = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-2)
    return peft.train()


@dataclass(frozen=True)
class RowShape:
    """The agent-shaped rows of a pack: one system prompt, groups of rollouts under a task each."""

    system: int  # tokens of the shared system prompt
    task: int  # tokens of each group's task
    group: int  # rollouts per group
    completion: tuple[int, int]  # the fewest and most tokens of a rollout


AGENT = RowShape(system=600, task=40, group=8, completion=(100, 200))
TOY = RowShape(system=24, task=4, group=4, completion=(8, 16))  # bench/gpu_check.py --dry-run


def agent_rows(tokens: int, seed: int = 0, shape: RowShape = AGENT) -> list[Row]:
    """About `tokens` tokens of `shape`'s rows (by default a 600-token system prompt, groups of 8
    rollouts of 100-200 tokens under a 40-token task), and one row of half the budget."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 32000, (n,), generator=gen).tolist()

    system = ids(shape.system)
    long = Row(advantage=1.0)
    long.extend(system + ids(shape.task), trained=False)
    trained = max(16, tokens // 2 - shape.system - shape.task)
    long.extend(ids(trained), trained=True, logprobs=[-1.0] * trained)
    rows, used = [long], len(long.input_ids)
    lo, hi = shape.completion
    while used < tokens:
        task = ids(shape.task)
        for i in range(shape.group):
            n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            r = Row(advantage=1.0 if i % 2 else -1.0)
            r.extend(system + task, trained=False)
            r.extend(ids(n), trained=True, logprobs=[-1.0] * n)
            rows.append(r)
            used += n
        used += shape.task
    return rows


def run(
    peft: Any, rows: list[Row], way: str, device: torch.device, grad: bool
) -> tuple[torch.Tensor, list[torch.Tensor], float, float]:
    """(logprobs in row order, LoRA gradients, seconds, peak GiB on CUDA) of one way."""
    budget = sum(len(r.input_ids) for r in rows)  # one pack: the whole budget in one sequence
    tree = pack_tree(rows, budget) if way == "tree" else None
    attention: PackAttention = "auto" if way == "tree" else way  # pyright: ignore[reportAssignmentType]
    packs = tree.packs if tree is not None else pack_rows(rows, budget, attention)
    params = [p for p in peft.parameters() if p.requires_grad]
    peft.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out: dict[int, torch.Tensor] = {}
    # per-token weights fixed per row: a logprob landing on another row or token changes the sum
    weights = {
        id(r): torch.linspace(-1, 1, sum(r.trained[1:]), device=device) * (i + 1) for i, r in enumerate(rows)
    }
    with torch.set_grad_enabled(grad):
        for pack in packs:
            rows_idx, pos_idx = pad_rows(pack.rows)[2][:, 1:].to(device).nonzero(as_tuple=True)
            logp = packed_logprobs(peft, pack.inputs(device), rows_idx, pos_idx).float()
            parts = logp.split([sum(r.trained[1:]) for r in pack.rows])
            if grad:
                torch.stack(
                    [(weights[id(r)] * lp).sum() for r, lp in zip(pack.rows, parts, strict=True)]
                ).sum().backward()
            out |= {id(r): lp.detach() for r, lp in zip(pack.rows, parts, strict=True)}
        if tree is not None and grad:
            tree.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    grads = [p.grad.float().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    peft.zero_grad(set_to_none=True)
    return torch.cat([out[id(r)] for r in rows]), grads, seconds, peak


def check(
    tokens: list[int],
    width: str,
    device: torch.device,
    dtype: torch.dtype,
    dense_max: int,
    shape: RowShape = AGENT,
) -> list[dict[str, Any]]:
    """One result per (tokens, way, grad): seconds, peak memory, gaps to "rows"."""
    peft = model(width, device, dtype)
    results = []
    for n in tokens:
        rows = agent_rows(n, shape=shape)
        for grad in (False, True):
            ways = ["rows", "tree"] + (["dense"] if n <= dense_max else [])
            if not grad or device.type == "cuda":  # torch's FlexAttention has no CPU backward
                ways.append("flex")
            run(peft, rows, "rows", device, grad)  # warm-up (and, for flex, compilation)
            ref = None
            for way in ways:
                if way in ("flex", "tree"):
                    run(peft, rows, way, device, grad)  # compile outside the timing
                logp, grads, seconds, peak = run(peft, rows, way, device, grad)
                if ref is None:
                    ref = (logp, grads)
                lp_gap = float((logp - ref[0]).abs().max())
                num = sum(float((a - b).norm() ** 2) for a, b in zip(ref[1], grads, strict=True)) ** 0.5
                den = sum(float(a.norm() ** 2) for a in ref[1]) ** 0.5
                results.append(
                    {
                        "tokens": n,
                        "way": way,
                        "grad": grad,
                        "seconds": seconds,
                        "peak_gib": peak,
                        "logprob_gap": lp_gap,
                        "grad_gap": num / den if grad and den > 0 else float("nan"),
                    }
                )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--width", choices=sorted(WIDTHS), default="135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dense-max", type=int, default=8192, help="longest pack the dense reference runs")
    ap.add_argument("--dry-run", action="store_true", help="toy width, 1024 tokens")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dry_run:
        args.width, args.tokens = "toy", [1024]
    results = check(args.tokens, args.width, device, getattr(torch, args.dtype), args.dense_max)
    print(f"{device}, width {args.width}, {args.dtype}")
    print(
        f"{'tokens':>7s} {'way':6s} {'grad':5s} {'seconds':>8s} {'peak GiB':>9s} {'logp gap':>9s} {'grad gap':>9s}"
    )
    for r in results:
        print(
            f"{r['tokens']:7d} {r['way']:6s} {r['grad']!s:5s} {r['seconds']:8.3f} {r['peak_gib']:9.2f} "
            f"{r['logprob_gap']:9.1e} {r['grad_gap']:9.1e}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
