"""Many models' LoRA adapters on one base module, each row of a batch through its own model's.

The engine that serves several models on one base (`engine/tenants.py`) runs a module of its own,
built around the base's shared weights with no adapter in it. Forward hooks on its adapted linear
layers add to each row the product of its own model's adapter, `s · B (A x)`, read from the very
LoRA matrices that model's trainer updates. The rows of a batch may belong to any of the models:
each layer gathers every row's A and B from stacks of all the adapters and runs two batched
products (the grouped LoRA product of multi-LoRA servers), not a pass per model. A batch whose rows
are all one model's runs PEFT's own arithmetic (`result + B(A(x)) · s`), so a model alone on the
engine samples what it samples on a PEFT module.

The stacks are copies, rebuilt when any model's weights change (`LoraPolicy.version`, bumped by
whatever changes an adapter while it holds the model's lock); the version is read before the copy,
so a copy torn by a step in progress is never taken for the step's result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

__all__ = ["Adapted", "GroupedLora"]

# PEFT names a layer of the wrapped model under this prefix; the plain module names it without
_PEFT_PREFIX = "base_model.model."


class Adapted(Protocol):
    """What the grouped product reads of a model (`LoraPolicy`): its PEFT module and weights' version."""

    model: Any
    version: int


@dataclass
class _Stack:
    """One layer's adapters, by model: A (models, r, in), B (models, out, r), scaling (models,). A
    model without an adapter on the layer (or a smaller rank, padded) has zeros there."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: torch.Tensor


class GroupedLora:
    """Hooks on `module` (a causal LM without adapters) that add each row's adapter. Set the models
    with `set_models`, and each forward's rows with `rows`; outside `rows` the module is the base."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._linears: dict[str, torch.nn.Module] = dict(module.named_modules())
        self._models: list[Adapted] = []
        self._rows: list[int] | None = None
        self._index: torch.Tensor | None = None
        self._stacks: dict[str, _Stack] = {}
        self._key: tuple[tuple[int, int], ...] = ()
        self._hooks: dict[str, Any] = {}

    def set_models(self, models: Sequence[Adapted]) -> None:
        """The models whose adapters rows may name, by position (a row's model index). Call it while
        no forward runs."""
        self._models = list(models)
        self._key = ()
        names = {n for m in self._models for n, _ in _lora_layers(m.model)}
        for name in list(self._hooks):
            if name not in names:
                self._hooks.pop(name).remove()
        for name in names - set(self._hooks):
            linear = self._linears.get(name)
            if linear is None:
                raise KeyError(f"the engine's base module has no layer {name!r} for an adapter to sit on")
            self._hooks[name] = linear.register_forward_hook(self._hook(name))

    @contextlib.contextmanager
    def rows(self, models: Sequence[int], device: torch.device) -> Iterator[None]:
        """The next forward's batch rows belong to `models` (each an index into `set_models`)."""
        self._refresh()
        self._rows = list(models)
        self._index = torch.tensor(self._rows, device=device)
        try:
            yield
        finally:
            self._rows = self._index = None

    def _refresh(self) -> None:
        """Rebuild the stacks when a model's weights changed since they were copied."""
        key = tuple((id(m), m.version) for m in self._models)  # read before the copy (module docstring)
        if key == self._key:
            return
        self._stacks = {}
        layers = [dict(_lora_layers(m.model)) for m in self._models]
        for name in self._hooks:
            present = [(i, lay[name]) for i, lay in enumerate(layers) if name in lay]
            first = present[0][1]
            rank = max(layer.lora_A["default"].weight.shape[0] for _, layer in present)
            a0, b0 = first.lora_A["default"].weight, first.lora_B["default"].weight
            a = a0.new_zeros((len(self._models), rank, a0.shape[1]))
            b = b0.new_zeros((len(self._models), b0.shape[0], rank))
            scaling = torch.zeros(len(self._models), dtype=a0.dtype, device=a0.device)
            with torch.no_grad():
                for i, layer in present:
                    wa, wb = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                    a[i, : wa.shape[0]] = wa
                    b[i, :, : wb.shape[1]] = wb
                    scaling[i] = float(layer.scaling["default"])
            self._stacks[name] = _Stack(a, b, scaling)
        self._key = key

    def _hook(self, name: str) -> Any:
        def add_adapters(_module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            rows, index = self._rows, self._index
            if rows is None or index is None:
                return out
            stack = self._stacks[name]
            x = args[0].to(stack.a.dtype)
            if len(set(rows)) == 1:  # one model's rows: PEFT's arithmetic, bit for bit
                i = rows[0]
                delta = F.linear(F.linear(x, stack.a[i]), stack.b[i]) * stack.scaling[i]
                return (out + delta).to(out.dtype)
            a, b = stack.a[index], stack.b[index]  # (n, r, in), (n, out, r): each row's own
            delta = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
            return (out + delta * stack.scaling[index][:, None, None]).to(out.dtype)

        return add_adapters


def _lora_layers(peft_model: Any) -> Iterator[tuple[str, Any]]:
    """(name in the plain module, PEFT LoRA layer) for each adapted layer of `peft_model`."""
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            yield name.removeprefix(_PEFT_PREFIX), module
