"""Peak memory and time of one training micro-step on one long row, with and without gradient
checkpointing (and, on CUDA, with activations offloaded to host memory).

The row is an agent row of `--tokens` tokens, a quarter of them sampled (trained) in turns between
untrained tool results. It runs through the trainer's own micro-step (`GRPOTrainer._micro_step`:
packed forward, loss, backward) on the embedded SmolLM2-135M's architecture with random weights,
cut to `--layers` decoder layers (activation memory grows with layers x tokens; all 30 layers at 16k
tokens without checkpointing need about 26 GB), LoRA r8 on every linear layer, fp32 on CPU.

Each case runs in a fresh process, so one case's peak is not another's: on CPU the peak host memory
is the process's peak resident set (`getrusage(RUSAGE_SELF).ru_maxrss`) less its resident set just
before the step (the model, the allocator's pools); on CUDA it is `torch.cuda.max_memory_allocated`
less the allocation before the step.

    uv run python bench/long_rows.py --tokens 16384 --layers 4
    uv run python bench/long_rows.py --tokens 4096 16384 32768 --layers 28 --device cuda   # a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def model_dir(out: Path, layers: int) -> Path:
    """The embedded model's config cut to `layers` decoder layers, random weights, its tokenizer."""
    from journeyman.data.config import DEFAULT_BASE_MODEL
    from journeyman.policy.weights import resolve_base_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = resolve_base_model(DEFAULT_BASE_MODEL)
    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers = layers
    config.max_position_embeddings = max(config.max_position_embeddings, 131072)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(path: Path, tokens: int, checkpointing: bool, offload: bool, device: str) -> dict[str, object]:
    """One micro-step on one `tokens`-long row: the peak memory it added and its seconds."""
    import journeyman as jm
    from journeyman.chat.formats import ChatFormat
    from journeyman.policy.lora import LoraPolicy
    from journeyman.training.packing import pack_rows
    from journeyman.training.rows import Row
    from journeyman.training.trainer import GRPOTrainer, gradient_checkpointing

    policy = LoraPolicy(path, device=device, dtype="float32" if device == "cpu" else None)
    trainer = GRPOTrainer(policy, ChatFormat(policy.tokenizer))
    gen = torch.Generator().manual_seed(0)
    row = Row(advantage=1.0)
    turn = 256
    while len(row.input_ids) < tokens:  # tool result, then a sampled turn, a quarter of each 4 x turn
        n = min(4 * turn, tokens - len(row.input_ids))
        ids = torch.randint(100, 40000, (n,), generator=gen).tolist()
        row.extend(ids[: n - turn], trained=False)
        row.extend(ids[n - turn :], trained=True, logprobs=[-1.0] * len(ids[n - turn :]))
    (pack,) = pack_rows([row], tokens)
    config = jm.TrainConfig(offload_activations=offload)
    cuda = policy.device.type == "cuda"
    with policy.editing(), gradient_checkpointing(policy, checkpointing):
        policy.model.train()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else _rss_bytes()
        t0 = time.perf_counter()
        trainer._micro_step(pack, row.num_trained, config)  # pyright: ignore[reportPrivateUsage]
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = (
            torch.cuda.max_memory_allocated()
            if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        policy.model.eval()
    return {
        "tokens": tokens,
        "checkpointing": checkpointing,
        "offload": offload,
        "device": policy.device.type,
        "peak_step_gb": (peak - before) / 1e9,
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--cases", choices=["both", "on", "off"], default="both", help="checkpointing on, off or both"
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--case", help=argparse.SUPPRESS)  # a child process: path,tokens,checkpointing,offload
    args = p.parse_args()
    if args.case:
        path, tokens, ckpt, offload = args.case.split(",")
        print(json.dumps(measure(Path(path), int(tokens), ckpt == "1", offload == "1", args.device)))
        return
    cases = [(False, False), (True, False)] + ([(True, True)] if args.device != "cpu" else [])
    cases = [c for c in cases if args.cases == "both" or c[0] == (args.cases == "on")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp), args.layers)
        for tokens in args.tokens:
            for ckpt, offload in cases:
                case = f"{path},{tokens},{int(ckpt)},{int(offload)}"
                cmd = [sys.executable, __file__, "--case", case, "--device", args.device]
                out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    print(
                        f"{tokens} tokens, checkpointing={ckpt}: exit {out.returncode}\n{out.stderr[-2000:]}",
                        file=sys.stderr,
                    )
                    continue
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = results[-1]
                print(
                    f"{tokens:>6} tokens  checkpointing {'on ' if ckpt else 'off'}  offload {'on ' if offload else 'off'}"
                    f"  peak {r['peak_step_gb']:6.2f} GB  {r['seconds']:6.1f} s",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "results": results}, indent=2))


if __name__ == "__main__":
    main()
