"""The precision the policy runs in, chosen by device: where the hardware is fast, and nothing the
trainer cannot train stably.

- `dtype=None` (the default everywhere) means by device: bfloat16 on a CUDA GPU with native bf16
  (compute capability 8.0 and later: A100, H100, L4, RTX 30xx and later), float32 on any other GPU,
  on the CPU and on MPS. On the CPU bf16 is faster only where the CPU has fast bf16 matmuls
  (`bench/bf16_step.py` tells), and its logprobs drift further from the engine's; ask for it by name.
- On CUDA, float32 matmuls run in TF32 (the LoRA matrices, which PEFT keeps in float32 beside a
  bf16 base, and the whole model in float32): an order of magnitude over true fp32 on Ampere and
  later, with bf16's exponent range and 10 mantissa bits.
- float16 is refused: without loss scaling its gradients underflow, and the trainer has none (no
  `GradScaler`). Every GPU with fast fp16 but no bf16 (V100, T4) trains in float32 instead.

`choose_precision` is the rule, a pure function of what was asked, the device type and whether the
GPU has native bf16, so it is tested without a GPU; `resolve_precision` asks torch for the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from journeyman.errors import InvalidFieldError

Dtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class Precision:
    """What the policy's weights are stored in, and whether float32 matmuls may use TF32."""

    dtype: Dtype
    tf32: bool


def choose_precision(requested: str | None, device_type: str, bf16_supported: bool) -> Precision:
    """The dtype for `requested` (None: by device) on a device of `device_type` ("cuda", "cpu",
    "mps", ...); TF32 on for every CUDA device. Refuses float16 and bf16 on a GPU without it."""
    cuda = device_type == "cuda"
    if requested is None:
        return Precision("bfloat16" if cuda and bf16_supported else "float32", tf32=cuda)
    if requested == "float16":
        raise InvalidFieldError(
            "dtype",
            requested,
            "float16 needs loss scaling, which the trainer does not do: use bfloat16 "
            "(or float32 on a GPU without bf16), or None to choose by device",
        )
    if requested not in ("float32", "bfloat16"):
        raise InvalidFieldError("dtype", requested, "use float32 or bfloat16, or None to choose by device")
    if requested == "bfloat16" and cuda and not bf16_supported:
        raise InvalidFieldError(
            "dtype",
            requested,
            "this GPU has no native bf16 (compute capability below 8.0; vLLM refuses it too): "
            "use float32, or None to choose by device",
        )
    return Precision("bfloat16" if requested == "bfloat16" else "float32", tf32=cuda)


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` computes in bf16 natively (emulation on older GPUs is slower than fp32)."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_precision(requested: str | None, device: torch.device) -> Precision:
    return choose_precision(requested, device.type, bf16_supported(device))


def enable_tf32() -> None:
    """float32 matmuls in TF32 (process-wide; torch applies it on CUDA only). cuDNN convolutions
    already default to TF32 (`torch.backends.cudnn.allow_tf32`)."""
    torch.set_float32_matmul_precision("high")
