"""The memory plan (`journeyman.backends.memory_plan`) on the real shapes of the models users train: weights
equal to their checkpoints' sizes, the layouts that fit one 80 GiB GPU or a node of eight accepted,
the ones that cannot refused with the change that would fit, and the activation formula against the
bytes autograd really keeps on a small model. No model is loaded; no GPU is needed."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
from journeyman.app.cli import app
from journeyman.backends.memory_plan import (
    PRESETS,
    Layout,
    MemoryPlan,
    ModelShape,
    TrainingSetup,
    plan_for_backend,
    plan_memory,
)
from journeyman.data.config import DEFAULT_BASE_MODEL, LoraConfig, ModelConfig, TrainConfig, TrainerConfig
from journeyman.errors import ImpossiblePlanError, InvalidFieldError
from typer.testing import CliRunner

GiB = 1 << 30
FIXTURE = json.loads((Path(__file__).parent / "model_configs.json").read_text())
MODELS = [k for k in FIXTURE if not k.startswith("_")]
R16 = LoraConfig(r=16)
BF16_4K = TrainingSetup(dtype="bfloat16", lora=R16, max_seq_len=4096, gradient_checkpointing=True)


def config(name: str) -> dict[str, Any]:
    return FIXTURE[name]["config"]


def plan(name: str, setup: TrainingSetup = BF16_4K, /, **layout: Any) -> MemoryPlan:
    return plan_memory(config(name), setup, Layout(**layout), model=name)


@pytest.mark.parametrize("name", MODELS)
def test_weights_equal_the_checkpoint_size(name: str) -> None:
    """Parameters x 2 bytes is, to the byte, the bf16 size each repo's safetensors index declares."""
    p = plan(name)
    assert p.parameters * 2 == FIXTURE[name]["safetensors_total_size"]
    assert p.weights == FIXTURE[name]["safetensors_total_size"]  # bf16, one GPU: the whole base


@pytest.mark.parametrize("name", MODELS)
def test_presets_are_the_published_configs(name: str) -> None:
    preset = PRESETS[name.lower()]
    assert {k: v for k, v in preset.items() if k != "_name_or_path"} == {
        k: config(name)[k] for k in preset if k != "_name_or_path"
    }
    assert ModelShape.from_config(preset) == ModelShape.from_config(config(name))


def test_lora_parameters_and_their_state() -> None:
    """r=16 on every linear layer of Qwen2.5-7B: r x (in + out) per projection; fp32 weights and
    gradients, AdamW's two fp32 moments."""
    p = plan("Qwen2.5-7B-Instruct")
    h, kv, i = 3584, 512, 18944
    per_layer = 16 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    assert p.lora_parameters == 28 * per_layer == 40_370_176
    assert (p.adapter, p.gradients, p.optimizer) == (4 * 40_370_176, 4 * 40_370_176, 8 * 40_370_176)
    only_qv = ModelShape.from_config(config("Qwen2.5-7B-Instruct")).lora_parameters(16, ["q_proj", "v_proj"])
    assert only_qv == 28 * 16 * ((h + h) + (h + kv))
    with pytest.raises(InvalidFieldError, match="target_modules"):
        ModelShape.from_config(config("Qwen2.5-7B-Instruct")).lora_parameters(16, ["c_attn"])


@pytest.mark.parametrize("name", ["Qwen2.5-7B-Instruct", "Qwen3-8B", "Llama-3.1-8B-Instruct"])
def test_a_7b_trains_on_one_80_gib_gpu_beside_vllm(name: str) -> None:
    """bf16, LoRA r=16, 4k rows with checkpointing, vLLM at half the GPU: fits, with room for many
    sequences in vLLM's KV cache."""
    p = plan(name).check()
    assert p.fits and p.peak < 76 * GiB
    assert p.activations < 6 * GiB
    assert p.kv_tokens >= 32 * 4096
    assert "verdict: fits" in p.table()


def test_7b_in_fp32_beside_vllm_is_refused_naming_dtype() -> None:
    """fp32 doubles both copies of the base: at gpu_memory_utilization=0.4 vLLM's share no longer
    holds its own fp32 weights and one sequence of KV cache. The error names bf16 as the fix."""
    fp32 = BF16_4K.model_copy(update={"dtype": "float32"})
    p = plan("Qwen2.5-7B-Instruct", fp32, gpu_memory_utilization=0.4)
    assert not p.fits
    assert p.weights == 2 * 15_231_233_024 == p.engine_weights
    with pytest.raises(ImpossiblePlanError, match=r"dtype='bfloat16'") as e:
        p.check()
    assert "KV cache" in str(e.value) and "max_model_len=4096" in str(e.value)
    assert e.value.changes[0].startswith("dtype='bfloat16'")
    assert plan("Qwen2.5-7B-Instruct", gpu_memory_utilization=0.4).fits  # the change it names fits


def test_long_rows_without_checkpointing_are_refused_naming_checkpointing() -> None:
    """8k-token rows without checkpointing keep every layer's activations (~87 GiB in fp32)."""
    setup = BF16_4K.model_copy(
        update={"dtype": "float32", "gradient_checkpointing": False, "max_seq_len": 8192}
    )
    with pytest.raises(ImpossiblePlanError) as e:
        plan("Qwen2.5-7B-Instruct", setup).check()
    assert "turn on gradient_checkpointing (TrainConfig)" in e.value.changes
    assert any(c.startswith("lower max_seq_len to") for c in e.value.changes)
    assert e.value.where == "GPU 0" and e.value.needed > e.value.available


def test_checkpointing_keeps_one_layer_of_activations() -> None:
    on = plan("Qwen2.5-7B-Instruct")
    off = plan("Qwen2.5-7B-Instruct", BF16_4K.model_copy(update={"gradient_checkpointing": False}))
    offloaded = plan("Qwen2.5-7B-Instruct", BF16_4K.model_copy(update={"offload_activations": True}))
    assert off.activations > 8 * on.activations
    # what offloading moves to the host: each layer's bf16 input, for every layer and token
    assert on.activations - offloaded.activations == 28 * 4096 * 3584 * 2
    assert on.weights == off.weights and on.optimizer == off.optimizer


def test_32b_on_eight_gpus_needs_the_base_sharded() -> None:
    """Each rank holding Qwen3-32B's 61 GiB of bf16 weights leaves no room for vLLM's copy; sharded
    across 8 ranks, with vLLM split 2 or 8 ways, it fits."""
    node = {"gpus": 8, "trainer_ranks": 8}
    with pytest.raises(ImpossiblePlanError) as e:
        plan("Qwen3-32B", **node, data_parallel_size=8).check()
    (change,) = e.value.changes
    assert "shard the base across 8 ranks" in change and "tensor_parallel_size=2" in change
    sharded = plan("Qwen3-32B", **node, shard_base=True, tensor_parallel_size=2, data_parallel_size=4).check()
    layers = 64 * ModelShape.from_config(config("Qwen3-32B")).layer_parameters()
    assert sharded.weights == (layers // 8) * 2 + (65_524_246_528 - 2 * layers)  # embeddings and head whole
    assert sharded.engine_weights == 65_524_246_528 // 2
    assert plan("Qwen3-32B", **node, shard_base=True, tensor_parallel_size=8).check().kv_tokens > 500_000
    # sharded, but each vLLM replica still a whole copy per GPU: refused, naming tensor parallelism
    with pytest.raises(ImpossiblePlanError, match="tensor_parallel_size=2 with data_parallel_size=4"):
        plan("Qwen3-32B", **node, shard_base=True, data_parallel_size=8).check()


def test_32b_on_one_gpu_is_refused() -> None:
    with pytest.raises(ImpossiblePlanError) as e:
        plan("Qwen3-32B").check()
    message = str(e.value)
    assert "Qwen3-32B on 1 x 80.00 GiB GPU" in message and "while sampling" in message
    assert e.value.changes == ["2 GPUs of 80.00 GiB, the base sharded across 2 ranks, tensor_parallel_size=2"]


def test_embedded_model_weights_match_its_checkpoint() -> None:
    """SmolLM2-135M (the embedded model): the plan's fp32 weights are within 5% of its real
    parameter count x 4 bytes, counted from its safetensors header (no weights read)."""
    from journeyman.policy.weights import resolve_base_model

    directory = resolve_base_model(DEFAULT_BASE_MODEL)
    raw = (directory / "model.safetensors").open("rb")
    with raw:
        (length,) = struct.unpack("<Q", raw.read(8))
        header = json.loads(raw.read(length))
    real = 0
    for name, tensor in header.items():
        if name != "__metadata__":
            size = 1
            for dim in tensor["shape"]:
                size *= dim
            real += size
    cfg = json.loads((directory / "config.json").read_text())
    p = plan_memory(cfg, TrainingSetup(dtype="float32"), Layout(device="cpu", gpu_gib=16), model="smollm2")
    assert abs(p.weights - real * 4) <= 0.05 * real * 4
    assert p.parameters == 134_515_008 == real  # tied embeddings: one matrix, counted once


def test_the_register_plan_follows_the_backend_settings() -> None:
    """What LocalBackend.register plans: vLLM's settings and TrainConfig's defaults; checkpointing on
    by default on CUDA only."""
    from journeyman.engine.vllm_server import VLLMConfig

    def register_plan(device: str, dtype: str, vllm: VLLMConfig | None, gib: int) -> MemoryPlan:
        model = ModelConfig(name="m", project="p", lora=R16)
        base = config("Qwen2.5-7B-Instruct")
        return plan_for_backend(
            base, model, device=device, dtype=dtype, trainer=TrainerConfig(), vllm=vllm, memory=(1, gib * GiB)
        )

    cuda = register_plan("cuda", "bfloat16", VLLMConfig(gpu_memory_utilization=0.5), 80)
    assert cuda.layout.engine == "vllm" and cuda.layout.engine_sleeps and cuda.setup.gradient_checkpointing
    assert cuda.setup.max_seq_len == TrainConfig().max_seq_len and cuda.fits
    cpu = register_plan("cpu", "float32", None, 8)
    assert cpu.layout.device == "cpu" and not cpu.setup.gradient_checkpointing and not cpu.fits
    assert "advice" in cpu.table()


def test_register_on_cpu_logs_the_plan_and_does_not_refuse(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU a plan that does not fit is a warning in the log, not a refusal (host memory is
    shared and paged); nothing is loaded by the check."""
    from journeyman.backends.local import LocalBackend
    from journeyman.backends.service import check_memory_plan
    from journeyman.policy.base_weights import BaseWeights

    base = tmp_path / "Qwen3-32B"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(config("Qwen3-32B")))
    backend = LocalBackend(path=tmp_path / "runs", device="cpu")
    with caplog.at_level(logging.INFO, logger="journeyman"):
        model = ModelConfig(name="big", project="p", base_model=str(base))
        check_memory_plan(backend.settings, model, BaseWeights(base, "cpu", backend.settings.dtype))
    text = caplog.text
    assert "Memory plan: Qwen3-32B" in text and "advice" in text


def test_moe_and_partial_configs_are_refused_by_name() -> None:
    with pytest.raises(InvalidFieldError, match="num_experts"):
        ModelShape.from_config({**config("Qwen3-8B"), "num_experts": 128})
    with pytest.raises(InvalidFieldError, match="intermediate_size"):
        ModelShape.from_config(
            {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 9}
        )


def test_cli_prints_the_table_and_exits_by_verdict(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--preset", "qwen2.5-7b-instruct", "--lora-r", "16", "--gpu-gib", "80"])
    assert ok.exit_code == 0, ok.output
    assert "Memory plan: Qwen2.5-7B-Instruct" in ok.output and "verdict: fits" in ok.output
    (tmp_path / "config.json").write_text(json.dumps(config("Qwen3-32B")))
    args = ["plan", "--model-config", str(tmp_path), "--gpus", "8", "--trainer-ranks", "8"]
    args += ["--engine", "vllm"]  # the plan's default is LocalBackend's engine, torch
    refused = runner.invoke(app, [*args, "--data-parallel-size", "8"])
    assert refused.exit_code == 1 and "change: together: shard the base across 8 ranks" in refused.output
    fits = runner.invoke(app, [*args, "--shard-base", "--tensor-parallel-size", "8"])
    assert fits.exit_code == 0 and "(1/8 shard)" in fits.output
    assert runner.invoke(app, ["plan", "--preset", "nope"]).exit_code == 2
    assert runner.invoke(app, ["plan"]).exit_code == 2  # neither a config nor a preset


@pytest.mark.parametrize(("family", "dtype"), [("llama", "bfloat16"), ("qwen3", "float32")])
def test_activation_formula_matches_what_autograd_keeps(family: str, dtype: str) -> None:
    """The plan's activation bytes against the tensors autograd really saves in a forward pass of a
    small random-weight model with a PEFT LoRA on every linear layer (counted once per storage, the
    weights left out): within 5%."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg: dict[str, Any] = {
        "model_type": family,
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 512,
        "tie_word_embeddings": False,
    }
    hf = AutoConfig.for_model(**cfg)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(hf, dtype=getattr(torch, dtype))
    model = get_peft_model(base, PeftLoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = 128
    ids = torch.randint(0, 512, (1, tokens))
    decoder: Any = model.get_base_model().model  # the layers and the final norm, not the LM head
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder(input_ids=ids)  # what the forward keeps for the backward
    setup = TrainingSetup(dtype=dtype, lora=LoraConfig(r=8), max_seq_len=tokens, micro_batch_tokens=tokens)  # pyright: ignore[reportArgumentType]
    p = plan_memory(cfg, setup.model_copy(update={"gradient_checkpointing": False}), Layout(device="cpu"))
    final_norm = tokens * 4 * 256  # its fp32 input
    layer = (p.activations - final_norm) // 3  # without checkpointing: (L + 1) layers and the final norm
    planned, measured = 2 * layer + final_norm, sum(kept.values())
    assert abs(measured - planned) <= 0.05 * measured, (measured, planned)


# -- many models on one base (issue 55) ------------------------------------------------------------
SEVEN_B = PRESETS["qwen2.5-7b-instruct"]


def many(models: int, engine: str = "torch", **layout: Any) -> MemoryPlan:
    """The 7B preset with `journeyman plan`'s defaults (LoRA r=8 on all-linear, 4k rows, 80 GiB),
    `models` models on its base."""
    return plan_memory(SEVEN_B, TrainingSetup(), Layout(engine=engine, **layout), models=models)  # pyright: ignore[reportArgumentType]


def test_eight_models_add_seven_adapters_and_optimizers_not_a_base() -> None:
    """models=8 on the torch engine: the base once, one KV pool (the engine batches every model's
    rows in it); seven more adapters and AdamW states, to the byte; gradients and activations once
    (one model trains at a time). On a shared base no adapter is merged, so the one model's merge
    log goes. Worker replicas are each model's own processes: a base and a KV pool each."""
    one, eight = many(1), many(8)
    assert eight.weights == one.weights and eight.engine_weights == one.engine_weights == 0
    assert (eight.gradients, eight.activations) == (one.gradients, one.activations)
    assert (eight.adapter, eight.optimizer, eight.engine_kv_cache) == (
        8 * one.adapter,
        8 * one.optimizer,
        one.engine_kv_cache,
    )
    each = one.adapter + one.optimizer
    assert eight.per_model == each
    assert one.engine_adapters > 0 == eight.engine_adapters  # merge log: none on a shared base
    assert eight.sampling_peak - one.sampling_peak == 7 * each - one.engine_adapters
    assert eight.kv_tokens == one.kv_tokens  # the one pool, as large as the one model's
    replicas_one, replicas_eight = (many(n, data_parallel_size=2, gpus=2) for n in (1, 8))
    assert replicas_eight.engine_kv_cache == 8 * replicas_one.engine_kv_cache
    # vLLM: one server, one KV pool; each model adds its adapter and AdamW state to the trainer, and
    # an adapter slot inside vLLM's share (its KV pool gives the room), nothing more
    one, eight = many(1, "vllm"), many(8, "vllm")
    each = one.adapter + one.optimizer
    assert eight.sampling_peak - one.sampling_peak == 7 * each == 7 * eight.per_model
    assert eight.engine_weights == one.engine_weights
    assert eight.engine_adapters == 8 * one.engine_adapters  # max_loras=2 slots -> 16, two a model
    assert one.engine_kv_cache - eight.engine_kv_cache == eight.engine_adapters - one.engine_adapters


def test_the_eighth_model_costs_a_share_of_the_first() -> None:
    """What the 8th model adds against the first model's peak: its adapter and AdamW state, with
    either engine one KV pool for all: 0.4% with vLLM, 0.6% with the torch engine (whose one
    model's peak is smaller: no vLLM share of the GPU)."""
    for engine, share in (("vllm", 0.0041), ("torch", 0.0063)):
        first, seven, eight = many(1, engine), many(7, engine), many(8, engine)
        eighth = eight.sampling_peak - seven.sampling_peak
        assert eighth == eight.per_model
        assert eighth / first.peak == pytest.approx(share, abs=0.0005), engine
    assert many(8, "vllm").per_model < 0.05 * many(1, "vllm").peak
    assert many(8).per_model < 0.05 * many(1).peak


def test_models_that_cannot_fit_are_refused_naming_models() -> None:
    """The torch engine's one KV pool leaves room for 205 models' adapters and AdamW states on
    80 GiB, not 256: the refusal names models=205. With vLLM (its share of the GPU taken first) the
    trainer's AdamW states stop at 92."""
    with pytest.raises(ImpossiblePlanError) as e:
        many(256).check()
    assert e.value.changes[0].startswith("models=205 (fewer models on this base")
    assert "256 models' adapters and AdamW state" in str(e.value)
    assert many(205).check().fits and not many(206).fits
    # vLLM: 256 adapters' AdamW states (58 GiB) no longer fit beside its share; 92 do
    with pytest.raises(ImpossiblePlanError, match=r"256 models' adapters") as e:
        many(256, "vllm").check()
    assert e.value.changes == [
        "models=92 (fewer models on this base: each adds its adapter, AdamW state and KV cache)"
    ]
    assert many(92, "vllm").fits


@pytest.mark.parametrize("models", [0, -1, 10**6, 257, True, 2.0])
def test_a_bad_model_count_is_refused_naming_models(models: Any) -> None:
    with pytest.raises(InvalidFieldError, match=r"^models=") as e:
        many(models)
    assert e.value.field == "models" and e.value.value == models
    with pytest.raises(InvalidFieldError, match=r"^models="):
        plan_for_backend(
            SEVEN_B,
            ModelConfig(name="m", project="p"),
            device="cpu",
            dtype="float32",
            trainer=TrainerConfig(),
            vllm=None,
            models=models,
        )


def test_cli_plans_many_models() -> None:
    runner = CliRunner()
    args = ["plan", "--preset", "qwen2.5-7b-instruct", "--models", "8"]
    fits = runner.invoke(app, [*args, "--engine", "vllm"])
    assert fits.exit_code == 0, fits.output
    for line in (
        "trainer: LoRA adapter (fp32) x 8",
        "trainer: AdamW state (fp32) x 8",
        "engine: adapter slots x 8",
    ):
        assert line in fits.output
    assert "each model after the first adds" in fits.output and "verdict: fits" in fits.output
    torch = runner.invoke(app, args)  # the torch engine: one KV pool for every model's rows
    assert torch.exit_code == 0 and "(one pool for all models)" in torch.output, torch.output
    too_many = runner.invoke(app, [*args[:3], "--models", "256"])
    assert too_many.exit_code == 1 and "change: --models 205" in too_many.output
    one = runner.invoke(app, ["plan", "--preset", "qwen2.5-7b-instruct"])
    assert one.output == runner.invoke(app, [*args[:3], "--models", "1"]).output  # models=1: as before
    assert " x " not in one.output.split("GPU 0")[1] and "models:" not in one.output
    for bad in ("0", "1000000"):
        refused = runner.invoke(app, [*args[:3], "--models", bad])
        assert refused.exit_code == 2 and f"models={bad}" in refused.output and "--models" in refused.output
