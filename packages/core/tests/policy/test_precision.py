"""Precision by device (bf16 where the GPU has it, TF32 for fp32 matmuls on CUDA, fp16 refused) and
the bf16 merge that leaves the frozen base bit-identical however many times the engine merges."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _support import tiny_llama_config
from journeyman.data.config import LoraConfig
from journeyman.errors import InvalidFieldError
from journeyman.policy.lora import with_adapter
from journeyman.policy.merge import AdapterMerge
from journeyman.policy.precision import Precision, choose_precision, enable_tf32, resolve_precision


@pytest.mark.parametrize(
    ("requested", "device", "bf16", "expected"),
    [
        (None, "cuda", True, Precision("bfloat16", tf32=True)),  # A100, H100, L4, ...
        (None, "cuda", False, Precision("float32", tf32=True)),  # V100, T4: fp32, TF32 where it exists
        (None, "cpu", False, Precision("float32", tf32=False)),
        (None, "mps", False, Precision("float32", tf32=False)),
        ("float32", "cuda", True, Precision("float32", tf32=True)),  # asked for: kept, still TF32
        ("bfloat16", "cpu", False, Precision("bfloat16", tf32=False)),  # asked for by name on a CPU
        ("bfloat16", "cuda", True, Precision("bfloat16", tf32=True)),
    ],
)
def test_the_dtype_is_chosen_by_device(
    requested: str | None, device: str, bf16: bool, expected: Precision
) -> None:
    assert choose_precision(requested, device, bf16) == expected


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_float16_is_refused_for_want_of_loss_scaling(device: str) -> None:
    with pytest.raises(InvalidFieldError) as e:
        choose_precision("float16", device, True)
    assert (e.value.field, e.value.value) == ("dtype", "float16")
    assert "loss scaling" in e.value.reason and "bfloat16" in e.value.reason


def test_bf16_on_a_gpu_without_it_and_unknown_dtypes_are_refused() -> None:
    with pytest.raises(InvalidFieldError, match="no native bf16"):
        choose_precision("bfloat16", "cuda", False)
    with pytest.raises(InvalidFieldError, match="float32 or bfloat16") as e:
        choose_precision("float64", "cpu", False)
    assert e.value.field == "dtype"


def test_tf32_is_switched_on_for_float32_matmuls() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        enable_tf32()
        assert torch.get_float32_matmul_precision() == "high"  # = torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)


def test_this_cpu_machine_resolves_to_float32(tmp_path: Path) -> None:
    """No dtype given: float32 on this CPU-only machine, in the backend that hands it to the policy,
    the ranks and the engine; float16 is refused where the user wrote it."""
    import journeyman as jm

    assert resolve_precision(None, torch.device("cpu")) == Precision("float32", tf32=False)
    assert jm.LocalBackend(path=tmp_path).dtype == "float32"
    assert jm.LocalBackend(path=tmp_path, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(InvalidFieldError) as e:
        jm.LocalBackend(path=tmp_path, dtype="float16")
    assert e.value.field == "dtype"


# -- merging into a bf16 base ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One thread, as each xdist worker gets (conftest.py): run alone on the busy 2-core machine,
    two spinning OpenMP threads made a 128x8 @ 8x64 matmul take 55 ms instead of 0.05."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_lora_llama(dtype: torch.dtype, b_scale: float) -> Any:
    """A 2-layer random-weight Llama wrapped with LoRA the way LoraPolicy wraps its model, with B
    drawn at `b_scale` (PEFT starts B at 0, which merges to nothing)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=64)).to(dtype)  # pyright: ignore[reportArgumentType]  (transformers' `.to` stub)
    model = with_adapter(base, LoraConfig(r=8, alpha=16))
    set_b(model, b_scale, seed=1)
    return model


def set_b(model: Any, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def base_bits(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().view(torch.int16).clone() for n, p in model.named_parameters() if "base_layer" in n}


def changed_elements(model: Any, bits: dict[str, torch.Tensor]) -> int:
    return sum(
        int((p.detach().view(torch.int16) != bits[n]).sum()) for n, p in model.named_parameters() if n in bits
    )


def test_50_bf16_merges_leave_the_base_bit_identical() -> None:
    """Merge (sample), unmerge, change the adapter (a train step), 50 times: the bf16 base stays
    bit-identical. B's scale cycles through the undo log's three forms: 1e-6, few elements move
    (kept alone); 1e-3, most move by a few ulps (int8 differences); 1.0, most move by more than an
    int8 of ulps (a copy of the bits), which is the most the log ever holds."""
    model = tiny_lora_llama(torch.bfloat16, 1e-3)
    bits = base_bits(model)
    adapted = sum(p.numel() for n, p in model.named_parameters() if n in bits)
    merge = AdapterMerge(model)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
    merge.merge()
    with torch.no_grad():
        merged = model(input_ids=ids).logits  # PEFT skips the adapter's path: it is in the weights
    assert 0 < (merged.float() - unmerged.float()).abs().max() < 0.05 * unmerged.float().abs().max()
    merge.unmerge()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, unmerged)  # the adapter back on its own path
    scales = {1e-6: 0.2, 1e-3: 1.5, 1.0: 2.0}  # B's scale: the most undo-log bytes per adapted element
    for cycle in range(50):
        scale = list(scales)[cycle % 3]
        set_b(model, scale, seed=cycle)
        merge.merge()
        assert changed_elements(model, bits) > 0  # the adapter's product sits in the base weights
        assert merge.undo_bytes() <= scales[scale] * adapted  # a bf16 copy: 2 bytes an element
        merge.unmerge()
        assert changed_elements(model, bits) == 0


def test_peft_unmerge_in_bf16_does_not_restore_the_base() -> None:
    """What the undo log is for: PEFT's subtraction rounds, so one merge/unmerge already moves the
    frozen base."""
    model = tiny_lora_llama(torch.bfloat16, 1e-2)
    bits = base_bits(model)
    model.merge_adapter()
    model.unmerge_adapter()
    assert changed_elements(model, bits) > 0


def test_a_fresh_adapter_merges_for_free_and_a_float32_base_unmerges_by_subtraction() -> None:
    fresh = tiny_lora_llama(torch.bfloat16, 0.0)
    merge = AdapterMerge(fresh)
    merge.merge()
    assert merge.undo_bytes() == 0
    merge.unmerge()

    model = tiny_lora_llama(torch.float32, 1e-2)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    merge = AdapterMerge(model)
    merge.merge()
    assert merge.undo_bytes() == 0  # no log in fp32: PEFT's arithmetic, ~1 ulp
    assert all(layer.merged for layer in merge.layers)
    merge.unmerge()
    assert not any(layer.merged for layer in merge.layers)
    assert max((p - base[n]).abs().max().item() for n, p in model.named_parameters() if n in base) < 1e-6
