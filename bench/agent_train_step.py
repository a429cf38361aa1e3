"""The train half of a GRPO step on agent-shaped rows: before and after the shared prompt prefix is
run once per step, and the attention over packed rows builds no (L, L) mask.

Rows (issue 34): a system prompt with five tool definitions rendered by the embedded model's chat
template (~630 tokens), then `--groups` user tasks with `--rollouts` rollouts each: an assistant
turn that calls a tool, the tool's result (not trained), a final answer; 100-200 tokens a rollout.
The model is the embedded SmolLM2-135M with LoRA r8 on every linear layer, in fp32 on the CPU.

Three ways of running the same rows, each through the trainer's own micro-step (loss, backward):
- before: `pack_rows` and the dense reference attention (a (1, 1, L, L) mask, then row by row):
  the shared prefix runs in every micro-batch;
- attention: `pack_rows` and the packed attention (`packed_attention`, no (L, L) mask);
- after: `pack_tree`: each shared prompt prefix once per step, the packs hold the rest.
Timed: the micro-batches' forward and backward (and the prefixes' backward), median and best of
`--repeats` runs in turn after one warm-up; the LoRA gradients of each way are compared with before's.

    uv run python bench/agent_train_step.py
    uv run python bench/agent_train_step.py --groups 4 --micro-batch-tokens 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from journeyman.chat.formats import ChatFormat
from journeyman.data.config import DEFAULT_BASE_MODEL, TrainConfig, micro_batch_tokens
from journeyman.policy.lora import LoraPolicy
from journeyman.policy.weights import resolve_base_model
from journeyman.training.packing import Pack, PrefixTree, pack_rows, pack_tree
from journeyman.training.rows import Row
from journeyman.training.trainer import GRPOTrainer

SYSTEM = (
    "You are an operations agent for a small company. You can read and change the shared task list, "
    "the calendar and the customer database through the tools below. Always check the current state "
    "with a read tool before you change anything, never invent identifiers, and answer the user in "
    "one short paragraph once the work is done."
)


def _tool(name: str, description: str, fields: dict[str, str]) -> dict[str, object]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": v} for k, v in fields.items()},
                "required": list(fields),
            },
        },
    }


TOOLS = [
    _tool("list_tasks", "List the open tasks of a project, newest first.", {"project": "project name"}),
    _tool(
        "add_task",
        "Add a task to a project and assign it.",
        {"project": "project name", "title": "short title", "assignee": "user name", "due": "ISO date"},
    ),
    _tool("close_task", "Mark a task as done.", {"task_id": "the id list_tasks gave"}),
    _tool(
        "find_customer",
        "Search the customer database by name, email or phone number.",
        {"query": "any part of the name, email or phone"},
    ),
    _tool(
        "update_customer",
        "Change one field of a customer record.",
        {"customer_id": "the id find_customer gave", "field": "field name", "value": "new value"},
    ),
]

TASKS = [
    "Move every open task of the website project that is due this week to Dana.",
    "The customer Ortega changed her email to m.ortega@example.org, please update it.",
    "Set up a one-hour review with Sam and Lee next Tuesday afternoon.",
    "Close the tasks of the billing project that mention the old invoice template.",
]


def agent_rows(chat_format: ChatFormat, groups: int, rollouts: int, seed: int = 0) -> list[Row]:
    """`groups` x `rollouts` rows: the rendered prompt (system, tools, task), then per rollout a
    tool call (trained), its result (not), an answer (trained), 100-200 tokens in all."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(chat_format.tokenizer)
    rows = []
    for g in range(groups):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[g % len(TASKS)]}]
        prompt, _ = chat_format.prompt_ids(messages, TOOLS)  # pyright: ignore[reportArgumentType]
        for i in range(rollouts):
            total = int(torch.randint(100, 201, (1,), generator=gen))
            call, result = total // 4, total // 3
            r = Row(advantage=1.0 if i % 2 else -1.0)
            r.extend(prompt, trained=False)
            for n, trained in ((call, True), (result, False), (total - call - result, True)):
                ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
                r.extend(ids, trained=trained, logprobs=[-1.0] * n if trained else None)
            rows.append(r)
    return rows


def train_half(
    trainer: GRPOTrainer, rows: list[Row], config: TrainConfig, how: str
) -> tuple[float, list[torch.Tensor], int, int]:
    """(seconds, LoRA gradients, micro-batches, token positions run) of one way of running `rows`."""
    policy = trainer.policy
    num_tokens = sum(r.num_trained for r in rows)
    tree: PrefixTree | None = None
    budget = micro_batch_tokens(config.micro_batch_tokens, config.max_seq_len, policy.device.type)
    with policy.editing():
        policy.model.train()
        policy.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        packs: list[Pack]
        if how == "after":
            tree = pack_tree(rows, budget)
            packs = tree.packs
        else:
            packs = pack_rows(rows, budget, attention="dense" if how == "before" else "auto")
        for pack in packs:
            trainer._micro_step(pack, num_tokens, config)  # pyright: ignore[reportPrivateUsage]
        if tree is not None:
            tree.backward()
        seconds = time.perf_counter() - t0
        grads = [p.grad.clone() for p in policy.trainable_parameters() if p.grad is not None]
        policy.model.zero_grad(set_to_none=True)
        policy.model.eval()
    tokens = tree.forward_tokens if tree is not None else sum(p.length for p in packs)
    return seconds, grads, len(packs), tokens


def relative_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).norm() ** 2) for x, y in zip(a, b, strict=True)) ** 0.5
    return num / sum(float(x.norm() ** 2) for x in a) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)  # TrainConfig's on a CPU
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.manual_seed(0)
    policy = LoraPolicy(resolve_base_model(DEFAULT_BASE_MODEL))
    chat_format = ChatFormat(policy.tokenizer)
    trainer = GRPOTrainer(policy, chat_format)
    with policy.editing(), torch.no_grad():  # a fresh LoRA's B is 0, which leaves A without gradient
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-3)
    rows = agent_rows(chat_format, args.groups, args.rollouts)
    config = TrainConfig(micro_batch_tokens=args.micro_batch_tokens)
    prompt = rows[0].trained.index(True)
    print(
        f"{len(rows)} rows ({args.groups} group(s) x {args.rollouts}), prompt {prompt} tokens, "
        f"rollouts {min(len(r.input_ids) for r in rows) - prompt}-{max(len(r.input_ids) for r in rows) - prompt} "
        f"tokens, micro_batch_tokens {config.micro_batch_tokens}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {policy.device}",
        flush=True,
    )
    ways = ("before", "attention", "after")
    runs: dict[str, Callable[[], tuple[float, list[torch.Tensor], int, int]]] = {
        w: (lambda w=w: train_half(trainer, rows, config, w)) for w in ways
    }
    runs["after"]()  # warm-up: first-call allocations and kernel selection
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    shape: dict[str, tuple[int, int]] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.repeats):
        for w in ways:
            s, g, packs, tokens = runs[w]()
            seconds[w].append(s)
            shape[w], grads[w] = (packs, tokens), g
            print(f"  {w}: {s:.2f} s ({packs} micro-batches, {tokens} tokens)", flush=True)
    base, best = statistics.median(seconds["before"]), min(seconds["before"])
    results = {}
    print(
        f"\n{'way':10s} {'micro-batches':>13s} {'tokens run':>10s} {'median s':>9s} {'best s':>7s} "
        f"{'speed-up (median, best)':>24s} {'grad gap':>9s}"
    )
    for w in ways:
        med, low = statistics.median(seconds[w]), min(seconds[w])
        gap = relative_gap(grads["before"], grads[w])
        packs, tokens = shape[w]
        results[w] = {
            "micro_batches": packs,
            "tokens": tokens,
            "seconds": seconds[w],
            "speedup_median": base / med,
            "speedup_best": best / low,
            "grad_gap": gap,
        }
        print(
            f"{w:10s} {packs:13d} {tokens:10d} {med:9.2f} {low:7.2f} {base / med:13.2f}x {best / low:9.2f}x {gap:9.1e}"
        )
    after = seconds["after"]
    print(
        f"\nrow tokens {sum(len(r.input_ids) for r in rows)}; before / after: "
        f"{base / statistics.median(after):.2f}x (median), {best / min(after):.2f}x (best)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
