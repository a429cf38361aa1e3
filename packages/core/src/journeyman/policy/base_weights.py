"""A base model's weights on one device and dtype: the frozen part every LoRA adapter on it shares.

`LoraPolicy` takes its tokenizer and base module from here. Today each served model makes its own
`BaseWeights` (one copy of the base per model, as before); the object is the unit several served
models on one base will share, each with its own adapter.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch

from journeyman.policy.precision import enable_tf32, resolve_precision


def pick_device(device: str | None = None, rank: int | None = None) -> torch.device:
    """`device` as given, by default a GPU when there is one. Plain "cuda" means this rank's GPU:
    rank r of a machine on GPU r mod their count (torchrun's LOCAL_RANK when no rank is given),
    since NCCL needs one GPU per rank."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return torch.device(device)
    local = rank if rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local % max(1, torch.cuda.device_count()))


class BaseWeights:
    """The base model at `path` (a directory of safetensors, `policy/weights.py` resolves names to
    one) for `device` and `dtype` (None: by device, `policy/precision.py`)."""

    def __init__(
        self, path: Path, device: str | torch.device | None = None, dtype: str | None = None
    ) -> None:
        self.path = Path(path)
        self.device = device if isinstance(device, torch.device) else pick_device(device)
        precision = resolve_precision(dtype, self.device)
        if precision.tf32:
            enable_tf32()
        self.dtype_name = precision.dtype
        self.dtype: torch.dtype = getattr(torch, precision.dtype)

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """The base's config.json: what the memory plan sizes."""
        return json.loads((self.path / "config.json").read_text())

    @functools.cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def load_module(self) -> Any:
        """The causal LM on this device and dtype, in eval mode: a new module on every call (an
        adapter is injected into the module it gets)."""
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype)
        # transformers wraps `.to` in a decorator whose stub leaves `self` unbound
        return base.to(self.device)  # pyright: ignore[reportArgumentType]

    def __repr__(self) -> str:
        return f"BaseWeights({str(self.path)!r}, device={str(self.device)!r}, dtype={self.dtype_name!r})"
