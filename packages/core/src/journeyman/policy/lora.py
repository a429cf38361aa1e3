"""The trained object: a base model with one LoRA adapter (PEFT), shared by engine and trainer.

In process, the engine samples from the very module the trainer updates, so a new step needs no
weight transfer; `sampling()` and `editing()` hold `lock`, so sampling and a training step never
overlap. Saving writes the adapter in PEFT's format, which vLLM also loads.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import Cache

from journeyman.data.config import LoraConfig
from journeyman.errors import InvalidFieldError
from journeyman.policy.base_weights import BaseWeights
from journeyman.policy.merge import AdapterMerge


def cache_kv(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) of a filled attention cache, to copy a shared prefix into another cache.

    transformers types a layer as possibly empty or linear-attention (no K/V): neither can happen
    after a forward pass of the attention-only models we load, so either is refused loudly.
    """
    out = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError(f"cache layer {i} ({type(layer).__name__}) holds no attention keys and values")
        out.append((keys, values))
    return out


@contextlib.contextmanager
def attention_implementation(causal_lm: Any, name: str) -> Iterator[str]:
    """The model's attention switched to `name` (a registered `AttentionInterface` function) for the
    block; yields the one it had."""
    before = causal_lm.config._attn_implementation
    causal_lm.set_attn_implementation(name)
    try:
        yield before
    finally:
        causal_lm.set_attn_implementation(before)


def with_adapter(base: Any, lora: LoraConfig) -> Any:
    """`base` (a causal LM, already on its device) wrapped with a fresh LoRA adapter by PEFT, in
    eval mode. PEFT keeps the LoRA matrices in float32 under a bf16 base (`autocast_adapter_dtype`),
    so AdamW updates them in full precision."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    base.eval()
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    # LoRA's A matrices start random: drawn under the config's seed, so a model starts from the
    # same adapter whatever ran before it in the process (its global generator is left as it was).
    device = next(base.parameters()).device
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), warnings.catch_warnings():
        # PEFT reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning on every
        # load under transformers 5); our own switch uses the new names (training/trainer.py)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        torch.manual_seed(lora.seed)
        model = get_peft_model(base, peft_config)
    model.eval()
    return model


class LoraPolicy:
    """Base model + LoRA adapter + tokenizer, loaded once per process."""

    def __init__(
        self,
        base: Path | BaseWeights,
        lora: LoraConfig | None = None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        """`base`: the base's weights, or the directory they are in (then `device` and `dtype`, None
        by device, place them; with a `BaseWeights` its own place counts)."""
        self.base = base if isinstance(base, BaseWeights) else BaseWeights(base, device, dtype)
        self.device = self.base.device
        self.dtype = self.base.dtype
        self.lora = lora or LoraConfig()
        self.tokenizer = self.base.tokenizer
        self.model: Any = with_adapter(self.base.load_module(), self.lora)
        # Sampling and a training step never overlap on the shared weights.
        self.lock = threading.RLock()
        # Bumped whenever the adapter weights change (a step, a load): caches of activations
        # computed under older weights (the engine's shared-prefix KV) are stale after it.
        self.version = 0
        # The training step these weights are (what the engine stamps on what they sample). Set on
        # the thread that changes the weights, in the same call: a request served right after a
        # step is labelled with the step that sampled it, not the one the endpoint announces later.
        self.step = 0
        # The adapter is folded into the base weights while sampling (see `sampling`); a bf16 base
        # comes back bit-exact on unmerge (policy/merge.py).
        self.merge = AdapterMerge(self.model)
        # Callers waiting in `editing` or `save`: the engine admits no new rows while there are any, so a
        # continuously fed batch drains, and a new batch waits for them (`sampling`), so a training
        # step gets the weights even when requests queue faster than batches end.
        self.editors_waiting = 0
        self._editors = threading.Condition()
        self._before_edit: list[weakref.WeakMethod[Callable[[], None]]] = []
        self.base.attach(self)  # last: the base's other users stop merging before this one samples

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Hold the weights to sample: the adapter merged into the base linear layers (W + BA), so
        each layer is one matmul, not three plus PEFT's dispatch. They stay merged from batch to
        batch; whatever changes the adapter unmerges first (`editing`). On a base other models
        share (`BaseWeights.shared`) nothing is merged: the adapter runs beside the base layers.
        Waits while an editor is waiting: RLock is not fair, and an engine that releases and
        re-takes it between two batches would otherwise starve a training step forever."""
        with self._editors:
            self._editors.wait_for(lambda: self.editors_waiting == 0)
        with self.lock, self.attention_kernels():
            if not self.base.shared:
                self.merge.merge()
            yield

    def keep_unmerged(self) -> None:
        """Take the adapter out of the base weights, once the batch sampling now ends (another
        model is about to read them); `sampling` merges no more while the base is shared."""
        with self._exclusive():
            self.merge.unmerge()

    @contextlib.contextmanager
    def editing(self) -> Iterator[None]:
        """Hold the weights to train or change the adapter: unmerged, so gradients reach the LoRA
        matrices and a change lands in them alone."""
        with self._exclusive(), self.attention_kernels():
            for ref in self._before_edit:
                release = ref()
                if release is not None:
                    release()
            self.merge.unmerge()
            yield

    def before_edit(self, release: Callable[[], None]) -> None:
        """Call `release` (a bound method, held weakly) whenever `editing` has the weights, before
        anything changes: an engine that keeps memory between batches (its KV slots, its decode
        graphs) lets it go for the step."""
        self._before_edit = [r for r in self._before_edit if r() is not None]
        self._before_edit.append(weakref.WeakMethod(release))

    def attention_kernels(self) -> contextlib.AbstractContextManager[object]:
        """On CUDA, attention without SDPA's cuDNN backend, which builds a plan for each new shape:
        packed rows and growing caches bring new shapes at every step (a bf16 train step on an H200:
        3.6 s with it, 0.9 s without). The flags are process-wide; they are set while the lock is held."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The lock, taken ahead of the engine: while a caller waits here the engine admits no new
        rows and starts no new batch (`editors_waiting`), so it gets the weights within one batch."""
        with self._editors:
            self.editors_waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self._editors:
                self.editors_waiting -= 1
                self._editors.notify_all()
        try:
            yield
        finally:
            self.lock.release()

    @contextlib.contextmanager
    def base_only(self) -> Iterator[None]:
        """The reference policy for KL: the same weights with the adapter switched off."""
        with self.model.disable_adapter():
            yield

    @contextlib.contextmanager
    def swapped(self, path: Path) -> Iterator[None]:
        """The adapter saved at `path` in place of the live one, which is put back after (bit-exact:
        the LoRA matrices are copied aside, not recomputed). Hold `editing()` around it."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        file = path / "adapter_model.safetensors"
        if not file.exists():
            raise InvalidFieldError("checkpoint", str(path), "has no adapter_model.safetensors")
        with self._exclusive():
            kept = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}
            set_peft_model_state_dict(self.model, load_file(str(file), device=str(self.device)))
            self.version += 1  # caches of activations under the live adapter are stale meanwhile
            try:
                yield
            finally:
                set_peft_model_state_dict(self.model, kept)
                self.version += 1

    def sampled_logprobs(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """Teacher-forced logprobs of `token_ids` after `prompt_ids` under the current weights, unmerged
        as the trainer sees them, to compare with what an engine recorded for the same sample."""
        ids = torch.tensor([prompt_ids + token_ids], device=self.device)
        with torch.inference_mode(), self.editing():
            logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), dim=-1)
        n = len(prompt_ids)
        return [float(logp[n - 1 + i, t]) for i, t in enumerate(token_ids)]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        with self._exclusive():  # merged or not: the LoRA matrices are what is saved
            self.model.save_pretrained(str(path))

    def reset(self) -> None:
        """Back to the base model: LoRA's B matrices to zero (as PEFT initialises them), so the
        adapter adds nothing."""
        with self.editing(), torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
            self.version += 1

    def load(self, path: Path) -> None:
        """Load adapter weights saved by `save` into the live adapter (resume)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        file = path / "adapter_model.safetensors"
        if not file.exists():
            raise InvalidFieldError("checkpoint", str(path), "has no adapter_model.safetensors")
        with self.editing():
            set_peft_model_state_dict(self.model, load_file(str(file), device=str(self.device)))
            self.version += 1
