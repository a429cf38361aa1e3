"""Long agent rows: the long-row policy on chat-formatted rows, and gradient checkpointing through
the trainer's own micro-step on a tiny random-weight Llama (fp32, CPU, LoRA on every linear layer)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import journeyman as jm
import pytest
import torch
from _support import function_tool, recorded_choice, tiny_llama_config
from journeyman.chat.formats import ChatFormat
from journeyman.policy.lora import LoraPolicy
from journeyman.training.packing import pack_rows, pack_tree
from journeyman.training.rows import LONG_ROW_METRICS, Row, fit_rows, trajectory_rows
from journeyman.training.trainer import (
    LONG_ROW_TOKENS,
    GRPOTrainer,
    build_rows,
    gradient_checkpointing,
    uses_checkpointing,
)

SYSTEM = "You are a filing agent. Use the tools, then state the outcome in one sentence."
TOOLS = [function_tool("read_page", "Read one page of the ledger.", {"page": {"type": "integer"}})]
OUTCOME = "All 9 pages are filed: the total is 4,512 dollars."


def agent_run(calls: int, reward: float = 0.0) -> jm.Trajectory:
    """A tool-calling run: system, tools, a user request, `calls` tool calls each with its result,
    then the final answer where the run reaches its outcome."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "File the ledger and tell me the total."},
    ]
    for i in range(calls):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "read_page", "arguments": json.dumps({"page": i})},
        }
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append(
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"page {i}: " + "entry " * 20}
        )
    messages.append({"role": "assistant", "content": OUTCOME})
    return jm.Trajectory(messages_and_choices=messages, tools=TOOLS, reward=reward)  # pyright: ignore[reportArgumentType]


def trained_runs(row: Row) -> list[tuple[int, ...]]:
    """The row's sampled turns: each maximal run of trained tokens."""
    runs, run = [], []
    for tok, t in zip(row.input_ids, row.trained, strict=True):
        if t:
            run.append(tok)
        elif run:
            runs.append(tuple(run))
            run = []
    return [*runs, tuple(run)] if run else runs


def longest_turn(row: Row) -> int:
    """Tokens of the longest turn: a sampled run and the untrained tokens since the run before it."""
    t = row.trained
    ends = [i + 1 for i in range(len(t)) if t[i] and (i + 1 == len(t) or not t[i + 1])]
    return max(b - a for a, b in zip([t.index(True), *ends], ends, strict=False))


def test_split_trains_every_turn_once_ends_on_the_outcome_and_keeps_the_prefix(
    chat_format: ChatFormat,
) -> None:
    (row,) = trajectory_rows(agent_run(9), chat_format, advantage=1.0)
    prefix = row.trained.index(True)
    turns = trained_runs(row)
    assert len(turns) == 10 and OUTCOME in chat_format.decode(turns[-1])
    limit = prefix + 4 * longest_turn(row)  # four turns of the ten fit
    assert len(row.input_ids) > limit

    rows, counts = fit_rows([row], limit, "split")
    assert len(rows) >= 3 and all(len(r.input_ids) <= limit for r in rows)
    # every fitted row starts with the prompt prefix (system, tools, first user message) and ends on a sampled token
    assert all(r.input_ids[:prefix] == row.input_ids[:prefix] and not any(r.trained[:prefix]) for r in rows)
    assert all(r.trained[-1] for r in rows)
    # each sampled turn trained exactly once, in order; the last row trains the outcome
    assert [t for r in rows for t in trained_runs(r)] == turns
    assert OUTCOME in chat_format.decode(trained_runs(rows[-1])[-1])
    # the first row is the run's exact start; later rows see the latest earlier turns as context
    assert rows[0].input_ids == row.input_ids[: len(rows[0].input_ids)]
    context = [
        chat_format.decode(
            [t for t, tr in zip(r.input_ids[prefix:], r.trained[prefix:], strict=True) if not tr]
        )
        for r in rows[1:]
    ]
    assert all("read_page" in c for c in context)  # earlier calls, untrained (the tool list is in the prefix)
    assert counts["rows_over_limit"] == 1 and counts["rows_from_long"] == len(rows)
    assert counts["trained_tokens_dropped"] == 0 and counts["rows_truncated"] == 0
    assert counts["context_tokens_dropped"] > 0
    assert set(counts) == set(LONG_ROW_METRICS)


def test_keep_end_trains_the_last_turns_and_cut_end_loses_the_outcome(chat_format: ChatFormat) -> None:
    (row,) = trajectory_rows(agent_run(9), chat_format, advantage=1.0)
    prefix = row.trained.index(True)
    turns = trained_runs(row)
    limit = prefix + 4 * longest_turn(row)

    (kept,), counts = fit_rows([row], limit, "keep_end")
    assert len(kept.input_ids) <= limit and kept.input_ids[:prefix] == row.input_ids[:prefix]
    kept_turns = trained_runs(kept)
    assert 1 <= len(kept_turns) < len(turns) and kept_turns == turns[-len(kept_turns) :]  # the final ones
    assert kept.input_ids[-len(kept_turns[-1]) :] == list(turns[-1])
    assert counts["trained_tokens_dropped"] == sum(map(len, turns[: -len(kept_turns)])) > 0

    (cut,), counts = fit_rows([row], limit, "cut_end")
    assert cut.input_ids == row.input_ids[:limit] and OUTCOME not in chat_format.decode(cut.input_ids)
    assert counts["rows_truncated"] == 1 and counts["trained_tokens_dropped"] > 0

    # rows within the limit pass through as they are, whatever the policy
    short = trajectory_rows(agent_run(1), chat_format, advantage=1.0)
    assert fit_rows(short, limit, "split")[0] == short


def test_rows_whose_context_was_dropped_train_without_rollout_logprobs(chat_format: ChatFormat) -> None:
    """Recorded calls: the first fitted row keeps the engine's logprobs (its context is the one
    sampled from); a later row's turns were sampled after turns it no longer holds."""
    system = list(range(100, 140))
    items: list[Any] = [{"role": "user", "content": "q"}]
    prompt = system
    for i in range(6):
        sampled = [200 + 10 * i + k for k in range(8)]
        items.append(recorded_choice(prompt_token_ids=prompt, token_ids=sampled))
        prompt = [*prompt, *sampled, *range(300 + 10 * i, 306 + 10 * i)]  # + the tool's result
    (row,) = trajectory_rows(jm.Trajectory(messages_and_choices=items), chat_format, advantage=1.0)
    rows, _ = fit_rows([row], 40 + 3 * 14, "split")
    assert len(rows) > 1
    first, *later = rows
    assert all(lp == -0.5 for lp, t in zip(first.rollout_logprobs, first.trained, strict=True) if t)
    assert all(math.isnan(lp) for r in later for lp in r.rollout_logprobs)


def test_a_turn_too_long_for_the_limit_falls_back_to_a_counted_cut(chat_format: ChatFormat) -> None:
    (row,) = trajectory_rows(agent_run(2), chat_format, advantage=1.0)
    prefix = row.trained.index(True)
    rows, counts = fit_rows([row], prefix + 2, "split")  # no sampled turn fits after the prefix
    assert [len(r.input_ids) for r in rows] == [prefix + 2]
    assert counts["rows_truncated"] == 1 and counts["trained_tokens_dropped"] == row.num_trained - 2


def test_build_rows_counts_long_rows(chat_format: ChatFormat) -> None:
    group = jm.TrajectoryGroup([agent_run(9, reward=1.0), agent_run(9, reward=0.0)])
    rows, m = build_rows([group], chat_format, jm.TrainConfig(max_seq_len=400))
    assert (
        m["rows_over_limit"] == 2
        and m["rows_from_long"] == len(rows) > 2
        and m["trained_tokens_dropped"] == 0
    )
    assert all(len(r.input_ids) <= 400 for r in rows)


# -- gradient checkpointing --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory, chat_format: ChatFormat) -> Iterator[LoraPolicy]:
    """A random 2-layer Llama beside the embedded tokenizer, LoRA r8 on every linear layer, its B
    matrices random too (at zero, lora_A would get no gradient to compare)."""
    from transformers import LlamaForCausalLM

    out: Path = tmp_path_factory.mktemp("tiny-llama")
    tok = chat_format.tokenizer
    config = tiny_llama_config(
        len(tok),
        4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    policy = LoraPolicy(out, device="cpu", dtype="float32")
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    yield policy


def _grads(
    policy: LoraPolicy,
    chat_format: ChatFormat,
    checkpointing: bool,
    offload: bool = False,
    tree: bool = False,
) -> list[torch.Tensor]:
    """LoRA gradients of two groups' rows, split rows among them, through `GRPOTrainer._micro_step`
    (KL term on, so the reference forward runs under the switch too). `offload`: what autograd
    saves goes through torch's save_on_cpu, as `offload_activations` does on CUDA (here unpinned:
    a CPU has no pinned memory to give). `tree`: the prompt prefixes the rows share run once
    (`pack_tree`, as `GRPOTrainer.step` runs them), their gradient sent back after the packs'."""
    trainer = GRPOTrainer(policy, chat_format)
    config = jm.TrainConfig(max_seq_len=320, kl_coef=0.05)
    groups = [
        jm.TrajectoryGroup([agent_run(3, reward=1.0), agent_run(1, reward=0.0)]),
        jm.TrajectoryGroup([agent_run(2, reward=0.0), agent_run(1, reward=1.0)]),
    ]
    rows, m = build_rows(groups, chat_format, config)
    shared = pack_tree(rows, 96) if tree else None  # what follows the prefixes, in several packs
    packs = shared.packs if shared is not None else pack_rows(rows, 300)
    assert len(packs) >= 2 and m["rows_over_limit"] > 0
    assert shared is None or shared.prefixes  # the system prompt and tools, at least
    num_tokens = sum(r.num_trained for r in rows)
    params = policy.trainable_parameters()
    with policy.editing(), gradient_checkpointing(policy, checkpointing):
        policy.model.train()
        for p in params:
            p.grad = None
        for pack in packs:
            with torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext():
                trainer._micro_step(pack, num_tokens, config)  # pyright: ignore[reportPrivateUsage]
        if shared is not None:
            shared.backward()
        policy.model.eval()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def test_checkpointed_gradients_equal_the_plain_ones(
    tiny_policy: LoraPolicy, chat_format: ChatFormat
) -> None:
    """Checkpointed, each layer runs again in the backward pass, under the packed attention it ran
    with in the forward (that it is checkpointed: test_checkpointing_keeps_each_layers_input_only)."""
    plain = _grads(tiny_policy, chat_format, checkpointing=False)
    ckpt = _grads(tiny_policy, chat_format, checkpointing=True)
    offloaded = _grads(tiny_policy, chat_format, checkpointing=True, offload=True)
    # the trainer's way: shared prefixes once a step, checkpointed, with the KL reference's own run
    tree = _grads(tiny_policy, chat_format, checkpointing=True, tree=True)
    den = sum(float(a.norm() ** 2) for a in plain) ** 0.5
    assert den > 0 and all(float(g.norm()) > 0 for g in plain)  # lora_A and lora_B of every layer
    for other in (ckpt, offloaded, tree):
        num = sum(float((a - b).norm() ** 2) for a, b in zip(plain, other, strict=True)) ** 0.5
        assert num / den < 1e-5, num / den

    # the switch is off again: the engine's eval forward recomputes nothing and meets no hook
    causal_lm = tiny_policy.model.get_base_model()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in causal_lm.modules())
    assert not causal_lm.get_input_embeddings()._forward_hooks


def test_checkpointing_keeps_each_layers_input_only(tiny_policy: LoraPolicy, chat_format: ChatFormat) -> None:
    """The mechanism behind the memory figures (bench/long_rows.py, docs/scale.md): bytes autograd
    saves for the backward of one 1k-token row, counted as they are saved."""
    tokens = 1024
    row = Row(advantage=1.0)
    row.extend(list(range(1000, 1000 + tokens - 64)), trained=False)
    row.extend(list(range(3000, 3064)), trained=True)
    (pack,) = pack_rows([row], tokens)
    trainer = GRPOTrainer(tiny_policy, chat_format)
    saved = {}
    for checkpointing in (False, True):
        total = 0

        def pack_hook(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with tiny_policy.editing(), gradient_checkpointing(tiny_policy, checkpointing):
            tiny_policy.model.train()
            with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
                trainer._micro_step(pack, row.num_trained, jm.TrainConfig())  # pyright: ignore[reportPrivateUsage]
            tiny_policy.model.eval()
        saved[checkpointing] = total
    hidden = 64 * 4 * tokens  # one hidden state per token, fp32
    # checkpointed: each layer's input (2), the final norm's, a few more hidden-sized tensors at most;
    # not checkpointed: every layer's projections, MLP and attention activations on top
    assert saved[True] < 6 * hidden and saved[False] > 4 * saved[True], saved


def test_checkpointing_defaults_on_for_cuda_and_for_long_rows_on_a_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert uses_checkpointing(None, cuda) and not uses_checkpointing(None, cpu, 4096)
    assert uses_checkpointing(None, cpu, LONG_ROW_TOKENS)
    assert uses_checkpointing(True, cpu) and not uses_checkpointing(False, cuda)
    assert jm.TrainConfig().long_rows == "split" and jm.SFTConfig().gradient_checkpointing is None
