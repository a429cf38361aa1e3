"""The frozen base sharded across trainer ranks (training/sharding.py), on gloo ranks of this CPU:
two threads of this process for the mechanism, a spawned worker process for a whole step."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import journeyman as jm
import pytest
import torch
from _support import recorded_choice, tiny_llama_config
from journeyman.data.config import LoraConfig, TrainerConfig
from journeyman.policy.lora import with_adapter
from journeyman.training.collective import Collective, balanced_share
from journeyman.training.sharding import ShardedBase

T = TypeVar("T")


def tiny_base(vocab: int = 128, seed: int = 0) -> Any:
    """A 2-layer random-weight Llama."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab))


def tiny_llama(seed: int = 0) -> Any:
    """`tiny_base` with LoRA, B drawn small so that every LoRA matrix gets a gradient."""
    model = with_adapter(tiny_base(seed=seed), LoraConfig(r=4, alpha=8))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def checkpointed(model: Any) -> None:
    """Activation checkpointing on, as the trainer switches it on (non-reentrant)."""
    causal_lm = model.get_base_model()
    enable = (
        getattr(causal_lm, "activation_checkpointing_enable", None) or causal_lm.gradient_checkpointing_enable
    )
    enable({"use_reentrant": False})


def on_ranks(world: int, fn: Callable[[Collective], T]) -> list[T]:
    """`fn` on `world` gloo ranks, one thread each, over one in-memory store (models are built
    before, in this thread: building one draws from torch's global generator)."""
    import torch.distributed as dist

    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    config = TrainerConfig(world_size=world, shard_base=True, timeout_s=60)
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(Collective(store, rank, world, torch.device("cpu"), config))
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return out


def lora_grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def train_pass(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A trainer's micro-step in small: a reference forward without grad (KL's), then forward and
    backward; returns the logits and the LoRA gradients."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad(), model.disable_adapter():
        ref = model(input_ids=ids).logits
    logits = model(input_ids=ids).logits
    (logits.float().log_softmax(-1)[..., 0].mean() + (logits - ref).square().mean()).backward()
    return logits.detach(), lora_grads(model)


INPUTS = [  # another shape on each rank: a gather does not depend on the rows
    torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2)),
    torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3)),
]


def test_balanced_share_caps_micro_batches_per_rank() -> None:
    sizes = [900, 100, 100, 100]
    assert [balanced_share(sizes, r, 2) for r in range(2)] == [[0], [1, 2, 3]]  # by tokens alone
    capped = [balanced_share(sizes, r, 2, most=2) for r in range(2)]
    assert capped == [[0, 3], [1, 2]]  # as many passes each: none idle in lockstep


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_sharded_ranks_compute_what_the_whole_base_computes(checkpointing: bool) -> None:
    """Each rank holds half of every layer, gathers one layer at a time, and its logits and LoRA
    gradients are the whole model's on its own rows (with or without activation checkpointing);
    between passes no layer is left whole."""
    whole, *models = (tiny_llama() for _ in range(3))
    for model in (whole, *models):
        if checkpointing:
            checkpointed(model)
        model.train()
    expected = [train_pass(whole, ids) for ids in INPUTS]

    def rank(collective: Collective) -> dict[str, Any]:
        model = models[collective.rank]
        sharded = ShardedBase(model, collective)
        held = (sharded.resident_bytes(), sharded.full_bytes(), sharded.gathered())
        first = train_pass(model, INPUTS[collective.rank])
        left_whole = sharded.gathered()
        again = train_pass(model, INPUTS[collective.rank])  # gathered and freed once more
        return {
            "held": held,
            "passes": [first, again],
            "left_whole": left_whole + sharded.gathered(),
            "share": collective.share([900, 100, 100]),
        }

    results = on_ranks(2, rank)
    for r, got in enumerate(results):
        resident, full, gathered = got["held"]
        assert resident * 2 == full and gathered == 0, got["held"]
        assert got["left_whole"] == 0
        want_logits, want_grads = expected[r]
        for logits, grads in got["passes"]:
            assert torch.allclose(logits, want_logits, rtol=0, atol=1e-6)
            assert (
                grads.keys() == want_grads.keys() and len(grads) == 2 * 7 * 2
            )  # A and B of 7 linears, 2 layers
            for name, g in grads.items():
                assert torch.allclose(g, want_grads[name], rtol=1e-5, atol=1e-8), name
    # in lockstep the rank with fewer micro-batches runs one idle pass
    assert [got["share"] for got in results] == [([0], 1), ([1, 2], 0)]


# -- a whole step: rank 0 here, rank 1 a spawned worker process, against one rank ---------------------


def tiny_model_dir(path: Path) -> Path:
    """A random-weight 2-layer Llama on disk with the embedded model's tokenizer, for LoraPolicy."""
    from journeyman.data.config import DEFAULT_BASE_MODEL
    from journeyman.policy.weights import resolve_base_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(DEFAULT_BASE_MODEL))
    tiny_base(vocab=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def groups() -> list[jm.TrajectoryGroup]:
    """Three groups of two rollouts; each group's rows share a 40-token prompt."""
    gen = torch.Generator().manual_seed(4)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 5000, (n,), generator=gen).tolist()

    out = []
    for _ in range(3):
        prompt = ids(40)
        out.append(
            jm.TrajectoryGroup(
                jm.Trajectory(
                    messages_and_choices=[
                        {"role": "user", "content": "q"},
                        recorded_choice(prompt_token_ids=prompt, token_ids=ids(8)),
                    ],
                    reward=float(i),
                )
                for i in range(2)
            )
        )
    return out


def step_on_one_rank(base: Path, steps: list[jm.TrajectoryGroup], config: jm.TrainConfig) -> Any:
    """(LoRA weights before, after, metrics) of one GRPO step on one rank with the whole base."""
    from journeyman.chat.formats import ChatFormat
    from journeyman.policy.lora import LoraPolicy
    from journeyman.training.packing import pack_rows
    from journeyman.training.trainer import GRPOTrainer, build_rows

    one = LoraPolicy(base, LORA, device="cpu", dtype="float32")
    rows, _ = build_rows(steps, ChatFormat(one.tokenizer), config)
    # one rank runs two micro-batches, the other one and a pass at zero weight
    assert len(pack_rows(rows, config.micro_batch_tokens)) == 3
    start = [p.detach().clone() for p in one.trainable_parameters()]
    updated, metrics = GRPOTrainer(one, ChatFormat(one.tokenizer)).step(steps, config)
    assert updated
    return start, [p.detach().clone() for p in one.trainable_parameters()], metrics


def assert_same_step(one: Any, got: list[torch.Tensor], metrics: dict[str, float]) -> None:
    start, want, single = one
    worst = max(float((a - b).abs().max()) for a, b in zip(want, got, strict=True))
    moved = max(float((a - b).abs().max()) for a, b in zip(want, start, strict=True))
    assert worst < 1e-5 and moved > 5e-4, (worst, moved)
    for key in ("policy_loss", "kl", "trained_tokens", "grad_norm"):
        assert metrics[key] == pytest.approx(single[key], rel=1e-5, abs=1e-8), key


LORA = LoraConfig(r=4, alpha=8)
# KL on: each micro-batch also runs a reference forward without grad, gathered like the others
STEP = jm.TrainConfig(learning_rate=1e-3, micro_batch_tokens=64, kl_coef=0.05)


@pytest.mark.integration
def test_sharded_gloo_ranks_step_like_one_rank(tmp_path: Path) -> None:
    """A GRPO step on 2 gloo ranks (threads), each holding half of every decoder layer, one of them
    with an idle pass to keep in step with the other, gives the LoRA weights, loss and gradient
    norm of the step on one rank with the whole base."""
    from journeyman.chat.formats import ChatFormat
    from journeyman.policy.lora import LoraPolicy
    from journeyman.training.trainer import GRPOTrainer

    base = tiny_model_dir(tmp_path / "tiny")
    steps = groups()
    one = step_on_one_rank(base, steps, STEP)
    policies = [LoraPolicy(base, LORA, device="cpu", dtype="float32") for _ in range(2)]

    def rank(collective: Collective) -> tuple[list[torch.Tensor], dict[str, float], int]:
        policy = policies[collective.rank]
        sharded = ShardedBase(policy.model, collective)
        trainer = GRPOTrainer(policy, ChatFormat(policy.tokenizer))
        _, metrics = trainer.step(steps, STEP, collective=collective)
        return [p.detach().clone() for p in policy.trainable_parameters()], metrics, sharded.gathered()

    results = on_ranks(2, rank)
    for weights, metrics, gathered in results:
        assert_same_step(one, weights, metrics)
        assert gathered == 0


@pytest.mark.integration
@pytest.mark.slow
def test_sharded_worker_process_steps_like_one_rank(tmp_path: Path) -> None:
    """The same step through the backend's path: rank 0 here, rank 1 a spawned worker process that
    learns `shard_base` from rank 0 through the store and shards its own copy; the step's groups
    went through the process group, the store held their kind and size."""
    from journeyman.chat.formats import ChatFormat
    from journeyman.policy.lora import LoraPolicy
    from journeyman.training.distributed import RankGroup
    from journeyman.training.trainer import GRPOTrainer

    base = tiny_model_dir(tmp_path / "tiny")
    steps = groups()
    one = step_on_one_rank(base, steps, STEP)
    policy = LoraPolicy(base, LORA, device="cpu", dtype="float32")
    trainer = GRPOTrainer(policy, ChatFormat(policy.tokenizer))
    ranks = RankGroup(TrainerConfig(world_size=2, shard_base=True), base, LORA, policy, trainer, "float32")
    try:
        assert ranks.sharded is not None
        assert ranks.sharded.resident_bytes() * 2 == ranks.sharded.full_bytes()
        updated, metrics = ranks.step(steps, STEP)
        assert updated and ranks.alive() and ranks.sharded.gathered() == 0
        assert_same_step(one, [p.detach().clone() for p in policy.trainable_parameters()], metrics)
        policy.save(tmp_path / "ckpt")  # the adapter saves from a sharded base
        assert (tmp_path / "ckpt" / "adapter_model.safetensors").exists()
        # job 1 was the start's state, job 2 the step
        header = json.loads(ranks.collective.store.get("job/2"))
        assert header.keys() == {"kind", "body_bytes"} and header["kind"] == "step"
        assert header["body_bytes"] > len(json.dumps([g.model_dump(mode="json") for g in steps]))
    finally:
        ranks.close()
