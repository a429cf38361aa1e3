"""The adapter folded into the base weights while the engine samples, and taken out again exactly.

Merged, each adapted layer is one matmul (W + s·BA) instead of three plus PEFT's dispatch. PEFT's
unmerge subtracts s·BA again, which rounds: in float32 the base drifts by ~1 ulp per cycle, which
is harmless; in bfloat16 one rounding is 2^-9 of the weight, and a merge/unmerge per step would
compound it into the frozen base over a run. So a 16-bit base is not unmerged by arithmetic: the
merge keeps an undo log of each layer's bits and the unmerge writes the old bits back, leaving the
base bit-identical however many cycles run.

The log holds, per weight element, the difference between its merged and base bit patterns as one
int8 (a bf16 weight moved by an adapter changes by a few ulps, so nearly every difference fits),
plus the index and old bits of each element whose difference does not fit (a sign change, or a
weight near zero that the adapter moves by more than its size). A layer the adapter leaves
unchanged (a fresh adapter, B = 0) costs nothing, one with few changed elements keeps only those,
and one whose differences mostly overflow keeps a copy of its bits: never more than the bf16 copy
that merging into a separate buffer would hold, and measured at a seventh of it to about half as
the adapter grows (docs/scale.md, "Precision").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# An element kept as (int64 index, int16 bits) costs 10 bytes; the int8 difference costs 1 per element.
_SPARSE_BYTES = 10
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass
class _Undo:
    """How to put one layer's base weight back: `diff` (int8, merged bits minus base bits) if kept,
    then `old` written at the flat indices `at`; `at` None: `old` is the whole base."""

    weight: torch.Tensor
    diff: torch.Tensor | None
    at: torch.Tensor | None
    old: torch.Tensor

    def nbytes(self) -> int:
        parts = (self.diff, self.at, self.old)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _record(weight: torch.Tensor, before: torch.Tensor) -> _Undo | None:
    """The smallest undo log of `weight` (merged in place) against its base bits `before`: the
    changed elements alone, the int8 differences with the elements that overflow them, or a copy."""
    after = weight.detach().view(before.dtype)
    diff = after.int() - before.int()
    changed = int((diff != 0).sum())
    if changed == 0:
        return None
    fits = diff.abs() <= 127
    overflow = diff.numel() - int(fits.sum())
    sparse, dense, copy = changed * _SPARSE_BYTES, diff.numel() + overflow * _SPARSE_BYTES, 2 * diff.numel()
    if copy <= min(sparse, dense):
        return _Undo(weight, None, None, before)
    if sparse <= dense:
        at = (diff != 0).flatten().nonzero().squeeze(1)
        return _Undo(weight, None, at, before.flatten()[at])
    at = (~fits).flatten().nonzero().squeeze(1)
    return _Undo(weight, torch.where(fits, diff, 0).to(torch.int8), at, before.flatten()[at])


def _restore(undo: _Undo) -> None:
    bits = undo.weight.detach().view(undo.old.dtype)
    if undo.at is None:
        bits.copy_(undo.old)
        return
    if undo.diff is not None:
        bits.copy_(bits.int() - undo.diff.int())  # exact: the base's 16-bit patterns, as ints
    bits.view(-1)[undo.at] = undo.old


class AdapterMerge:
    """Merges the active adapter of a PEFT model into its base weights and unmerges it: a 16-bit
    base through the undo log (bit-exact), a float32 base by PEFT's own subtraction."""

    def __init__(self, model: Any) -> None:
        from peft.tuners.lora import LoraLayer

        self.layers: list[Any] = [m for m in model.modules() if isinstance(m, LoraLayer)]
        self.merged = False
        self._undo: list[_Undo] = []
        self._peft: list[Any] = []  # float32 layers, unmerged by PEFT

    @torch.no_grad()
    def merge(self) -> None:
        if self.merged:
            return
        for layer in self.layers:
            weight = layer.get_base_layer().weight
            bits = _BITS.get(weight.dtype)
            if bits is None:
                layer.merge()
                self._peft.append(layer)
                continue
            before = weight.detach().view(bits).clone()  # one layer's worth at a time
            layer.merge()  # PEFT's arithmetic: W + s·BA, rounded once
            if (undo := _record(weight, before)) is not None:
                self._undo.append(undo)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        for layer in self._peft:
            layer.unmerge()
        for undo in self._undo:
            _restore(undo)
        for layer in self.layers:
            layer.merged_adapters.clear()  # what PEFT's forward reads to skip the adapter
        self._undo, self._peft = [], []
        self.merged = False

    def undo_bytes(self) -> int:
        """Bytes the undo log holds while merged."""
        return sum(u.nbytes() for u in self._undo)
