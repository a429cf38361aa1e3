"""A base model's weights on one device and dtype: the frozen part every LoRA adapter on it shares.

`LoraPolicy` takes its tokenizer and base module from here. A backend keeps one `BaseWeights` per
(base, device, dtype) (`backends/service.py: BaseRegistry`), so the models registered on it with the same base hold one
copy of its tensors: each further model's module is built around the first one's parameters, and
costs its adapter, its optimizer state and its engine's KV, not another base.

Shared weights are read-only: while two or more policies use them, none folds its adapter into
them to sample (`LoraPolicy.sampling`), since a merged adapter would be every other model's too.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Protocol

import torch

from journeyman.policy.precision import enable_tf32, resolve_precision


class WeightsUser(Protocol):
    """What shares the weights (`LoraPolicy`): told to stop folding its adapter into them."""

    def keep_unmerged(self) -> None: ...


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
        # The first module's parameters, by name: every later module is built around them.
        self._tensors: dict[str, torch.nn.Parameter] | None = None
        self._users: list[weakref.ref[WeightsUser]] = []
        self._lock = threading.Lock()

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
        adapter is injected into the module it gets), all of them on one copy of the weights. A
        later call loads the files again and then drops that copy for the first one's tensors, so
        registering a model briefly holds a second base (what is resident after is one)."""
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype)
        # transformers wraps `.to` in a decorator whose stub leaves `self` unbound
        base = base.to(self.device)  # pyright: ignore[reportArgumentType]
        with self._lock:
            if self._tensors is None:
                self._tensors = dict(base.named_parameters())
                return base
            for name, p in base.named_parameters():  # tied weights are one parameter, named once
                p.data = self._tensors[name].data
        return base

    def attach(self, policy: WeightsUser) -> None:
        """`policy` samples and trains on these weights from now on. Those already on them stop
        folding their adapters in (`LoraPolicy.keep_unmerged`) before this returns, so `policy`'s
        module never reads another model's adapter in the base."""
        with self._lock:
            others = [p for p in self.users() if p is not policy]
            self._users = [weakref.ref(p) for p in (*others, policy)]
        for other in others:
            other.keep_unmerged()

    def users(self) -> list[WeightsUser]:
        """The live policies on these weights, in the order they attached."""
        return [p for ref in self._users if (p := ref()) is not None]

    @property
    def shared(self) -> bool:
        """Two or more policies use these weights: they stay read-only (nobody merges)."""
        return len(self.users()) > 1

    def __repr__(self) -> str:
        return f"BaseWeights({str(self.path)!r}, device={str(self.device)!r}, dtype={self.dtype_name!r})"
