"""The frozen base split across the trainer ranks: each rank holds 1/N of every decoder layer.

With LoRA the base weights carry no gradient and no optimizer state, and every rank holds the same
values; whole on each of N GPUs they are most of a rank's memory (a 32B model in bf16: 65.5 GB a
GPU, beside vLLM's own copy). Sharded, as ZeRO-3 and FSDP lay out frozen weights, each rank keeps
one flat 1/N slice of each decoder layer's frozen tensors, and a layer's full weights exist only
around its use: all-gathered for its forward and freed after it, all-gathered again for its
backward and freed after that. Each gather is started one layer ahead (the next layer's in the
forward, the previous one's in the backward), so on a GPU it runs on NCCL's stream while the
current layer computes. The LoRA matrices (and anything else that trains) stay
whole on every rank; their gradients are all-reduced as with a whole base (`Collective.all_reduce`),
so every rank applies the same AdamW step and a step's result is the one rank's.

Per rank, with b bytes a weight (2 in bf16) and N ranks:

    b · (P_layers / N + P_rest)   resident: the layers' shards, and whole the embeddings, final norm
                                  and LM head (`loss.head_logprobs` reads the head's weight directly)
  + 2 · b · P_layer               two decoder layers' full weights: the running one, the next one
  + the LoRA weights, their gradients and AdamW state, whole (as unsharded)

Qwen2.5-32B (64 layers of 487.6M parameters, 2 × 778.6M of embeddings and head) on 8 ranks:
7.8 + 3.1 + 2.0 = 12.9 GB of base weights a GPU, against 65.5 GB whole (docs/scale.md).

How: a forward pre-hook and a forward hook on each decoder layer (the classes transformers names
in `_no_split_modules`). A layer's frozen parameters are views into one flat buffer whose storage
is freed (resized to 0 bytes) between uses and refilled in place by an all-gather, as FSDP does, so
the weight views autograd saved in the forward read the refilled storage in the backward. The
backward's gather runs from an identity autograd function on the layer's output (its gradient
arrives before any of the layer's own), the free from one on its input (its gradient is complete
once the layer's whole backward has run); the first layer's input needs no gradient, so whatever
is still gathered when a backward ends is freed by a callback queued on the autograd engine. A
layer recomputed by (non-reentrant) activation checkpointing runs inside the backward, where it is
gathered already, and is left gathered for its backward.

Every rank must run the same forwards and backwards in the same order, since each gather is a
collective: the trainer runs as many passes on every rank (`Collective.share`), and nothing may run
the model on rank 0 alone (the in-process engine, SFT on rank 0).

Why not torch's FSDP2 (`fully_shard`): it builds a `DeviceMesh` on torch's global default process
group, where `Collective` keeps one group object per served model; it turns parameters into
DTensors, which PEFT's merge and save and the trainer's direct reads of the LM head would then
meet; and with every sharded parameter frozen, its gradient reduce-scatter (which gloo lacks) and
optimizer-state sharding have nothing to do. What is left of it is this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from journeyman.training.collective import Collective

__all__ = ["ShardedBase", "decoder_layers"]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model, PEFT-wrapped or not: the outermost modules of
    the classes it names in `_no_split_modules` (LlamaDecoderLayer, Qwen2DecoderLayer, ...), in order."""
    get_base = getattr(model, "get_base_model", None)
    causal_lm: Any = get_base() if callable(get_base) else model
    names = set(getattr(causal_lm, "_no_split_modules", None) or ())
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in causal_lm.named_modules():
        if type(module).__name__ in names and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    if not found:
        raise TypeError(
            f"{type(causal_lm).__name__} names no decoder layer class in _no_split_modules: "
            "its base cannot be sharded by layer"
        )
    return [m for _, m in found]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Layer:
    """One decoder layer's frozen weights: this rank's flat shard, and the full buffer that the
    parameters view, its storage empty while the layer is not running."""

    def __init__(
        self, module: torch.nn.Module, index: int, collective: Collective, owner: ShardedBase
    ) -> None:
        self.index, self.collective, self.owner = index, collective, owner
        if module.__dict__.get("_journeyman_sharded"):
            raise ValueError(f"{type(module).__name__} is sharded already: its weights are views of a shard")
        module.__dict__["_journeyman_sharded"] = True
        params = [p for p in module.parameters() if not p.requires_grad]
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise TypeError(f"{type(module).__name__}'s frozen weights mix dtypes or devices: {kinds}")
        ((dtype, device),) = kinds
        world, rank = collective.world, collective.rank
        per = -(-sum(p.numel() for p in params) // world)  # padded so that every rank's shard is equal
        full = torch.zeros(per * world, dtype=dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                full[offset : offset + n].copy_(p.reshape(-1))
                p.data = full[offset : offset + n].view(p.shape)  # the old tensor is freed here
                offset += n
        self.shard = full[rank * per : (rank + 1) * per].clone()
        self.full = full
        self.nbytes = full.numel() * full.element_size()
        self.gathered = True  # the storage holds the full weights, or a gather into it is under way
        self.pending: Callable[[], None] | None = None  # waits for that gather
        self.free()
        self.handles = [
            module.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            module.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def start(self) -> None:
        """Start gathering the full weights, unless they are here or on their way."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.nbytes)
            self.pending = self.collective.all_gather_into(self.full, self.shard)
            self.gathered = True

    def gather(self) -> None:
        """The full weights, here (on a GPU: the current stream waits for them, the host does not)."""
        self.start()
        if self.pending is not None:
            self.pending()
            self.pending = None

    def before_backward(self) -> None:
        """This layer's gradients are next: the last layer's gathers end with the backward, this one
        gathers now, and the one before it starts on its way."""
        self.owner.free_at_end_of_backward()
        self.gather()
        self.owner.prefetch(self.index - 1)

    def free(self) -> None:
        if self.gathered:
            if self.pending is not None:  # never free memory a gather is still writing
                self.pending()
                self.pending = None
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def _before_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.gather()
        if _in_backward():  # a recompute (activation checkpointing): the backward prefetches
            return args, kwargs
        self.owner.prefetch(self.index + 1)
        if torch.is_grad_enabled():
            return _on_hidden(args, kwargs, lambda x: _OnBackward.apply(x, self.free))
        return args, kwargs

    def _after_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if _in_backward():  # recomputed by activation checkpointing: its backward comes next
            return output
        self.free()
        if not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor):
            return _OnBackward.apply(output, self.before_backward) if output.requires_grad else output
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            first: torch.Tensor = output[0]
            if first.requires_grad:
                return (_OnBackward.apply(first, self.before_backward), *output[1:])
        return output


def _on_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], wrap: Callable[[torch.Tensor], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The layer's hidden-state input (first positional, or `hidden_states=`) passed through `wrap`
    when it requires grad."""
    if args and isinstance(args[0], torch.Tensor):
        if args[0].requires_grad:
            return (wrap(args[0]), *args[1:]), kwargs
    elif isinstance(kwargs.get("hidden_states"), torch.Tensor) and kwargs["hidden_states"].requires_grad:
        return args, {**kwargs, "hidden_states": wrap(kwargs["hidden_states"])}
    return args, kwargs


class _OnBackward(torch.autograd.Function):
    """Identity on a tensor; `hook()` runs when the tensor's gradient arrives in the backward. On a
    layer's output it gathers the layer before its own gradients run (`_Layer.before_backward`); on
    its input it frees the layer once its gradient is complete (`_Layer.free`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Callable[[], None]) -> torch.Tensor:
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.hook()
        return grad_outputs[0], None


class ShardedBase:
    """`model`'s decoder layers sharded across `collective`'s ranks, in place (see the module
    docstring). Every rank builds one over the same weights: each keeps its own slice of what it
    loaded, so sharding needs no communication; the model then runs as before, one layer gathered at
    a time, on all ranks together."""

    def __init__(self, model: torch.nn.Module, collective: Collective) -> None:
        self.collective = collective
        self._queued_for = -1  # the backward (graph task) whose end frees what is left gathered
        # one layer at a time, so loading and sharding peak at the whole model plus one layer
        self.layers = [_Layer(m, i, collective, self) for i, m in enumerate(decoder_layers(model))]

    def resident_bytes(self) -> int:
        """Bytes of the decoder layers' weights this rank holds between uses (its shards)."""
        return sum(layer.shard.numel() * layer.shard.element_size() for layer in self.layers)

    def full_bytes(self) -> int:
        """Bytes of the decoder layers' weights whole (with the padding that evens the shards)."""
        return sum(layer.nbytes for layer in self.layers)

    def gathered(self) -> int:
        """How many layers hold their full weights now (0 between passes)."""
        return sum(layer.gathered for layer in self.layers)

    def prefetch(self, index: int) -> None:
        """Start gathering layer `index`, if there is one: the layer that runs after the current one."""
        if 0 <= index < len(self.layers):
            self.layers[index].start()

    def free_at_end_of_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._queued_for:
            self._queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._free_all)  # pyright: ignore[reportAttributeAccessIssue]

    def _free_all(self) -> None:
        for layer in self.layers:
            layer.free()
        self._queued_for = -1
