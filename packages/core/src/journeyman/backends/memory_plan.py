"""A memory plan before anything loads: what each GPU will hold, from the base model's config.json.

`plan_memory(config, setup, layout)` sizes, for the busiest GPU (GPU 0: it holds trainer rank 0 and
the engine's first worker), the trainer's base weights, its LoRA adapter, gradients and AdamW state,
the activations of the largest micro-batch (with and without gradient checkpointing), the LM
head's logits, and the engine's own weights, adapter slots and KV cache; then the two moments that
bound a step: training (the engine asleep) and sampling (the engine awake beside the trainer's
resident state). `MemoryPlan.check()` refuses a plan that does not fit with `ImpossiblePlanError`,
naming the changes that would make it fit, each tried on the plan itself.

`models=N`: N models registered on one backend with the same base share one copy of its weights
(issue 55); each further model adds its own adapter and AdamW state. The in-process torch engine
serves them all in one batch from one KV pool (`engine/tenants.py`); worker replicas (a process of
each model's engine) keep a pool and a base each; vLLM serves them all from one server, N adapters
resident beside one KV pool.

Pure arithmetic on shapes (no torch), so `journeyman plan` answers in a second on any machine and
`LocalBackend.register` asks before it loads a byte. What is an estimate, not a measurement: the
CUDA context of each process, vLLM's runtime (profile-run activations, sampler, CUDA graphs) and
allocator fragmentation (a fixed share of the GPU is kept free for it). The activation formula is
checked against the bytes autograd saves on a small model (packages/core/tests/backends/test_memory_plan.py).

Only dense decoder-only transformers of the Llama family are modelled (Llama, Qwen2, Qwen3,
Mistral, SmolLM and the like); a mixture-of-experts config is refused by name.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from journeyman.data.config import LoraConfig, ModelConfig, TrainConfig, TrainerConfig, micro_batch_tokens
from journeyman.errors import ImpossiblePlanError, InvalidFieldError

if TYPE_CHECKING:
    from journeyman.engine.vllm_server import VLLMConfig

__all__ = [
    "PRESETS",
    "Layout",
    "MemoryPlan",
    "ModelShape",
    "TrainingSetup",
    "plan_for_backend",
    "plan_memory",
    "preset_config",
]

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# what a process's CUDA context, cuBLAS/NCCL workspaces and the like take outside the allocator
_PROCESS_OVERHEAD = GiB
# the share of each GPU left free for the caching allocator's fragmentation and what is not counted
_HEADROOM = 0.05
# rows of logits per chunk in training/loss.py's `head_logprobs`: 16 MiB of fp32 logits
_HEAD_CHUNK_BYTES = 1 << 24
# the most models one plan sizes on a base (`models`): more than any one GPU holds adapters for
MAX_MODELS = 256
# vLLM sizes its KV cache after a profile run of this many tokens (its server's default
# max_num_batched_tokens) and keeps sampler logits for this many sequences (max_num_seqs)
_VLLM_PROFILE_TOKENS = 8192
_VLLM_MAX_SEQS = 256

# the projections of a decoder layer, as PEFT names them, with where they sit in the layer
_PROJECTIONS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class ModelShape(BaseModel):
    """The sizes of a dense decoder-only model that memory depends on, read from its config.json."""

    model_config = ConfigDict(frozen=True)

    model_type: str = ""
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool = False
    qkv_bias: bool = Field(default=False, description="q, k, v projections carry a bias (Qwen2 always)")
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = Field(default=False, description="an RMSNorm over each head of q and k (Qwen3)")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """The shape in a Hugging Face config.json (a multimodal one's `text_config`); a missing size or
        a mixture-of-experts model is refused by name."""
        c: Mapping[str, Any] = config.get("text_config") or config
        for key in _MOE_KEYS:
            if c.get(key):
                raise InvalidFieldError(
                    f"config.{key}", c[key], "mixture-of-experts models are not modelled by the memory plan"
                )
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in need if not isinstance(c.get(k), int)]
        if missing:
            raise InvalidFieldError(
                "config", sorted(c)[:20], f"not a decoder-only transformer config: no {', '.join(missing)}"
            )
        heads = c["num_attention_heads"]
        model_type = str(c.get("model_type") or config.get("model_type") or "")
        attention_bias = bool(c.get("attention_bias", False))
        return cls(
            model_type=model_type,
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab_size=c["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
            qkv_bias=attention_bias or model_type == "qwen2",  # Qwen2's q/k/v always have a bias
            o_bias=attention_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=model_type.startswith("qwen3"),
        )

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection of one decoder layer."""
        h, q, kv, i = self.hidden_size, self.q_width, self.kv_width, self.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def layer_parameters(self) -> int:
        """Weights, biases and norms of one decoder layer."""
        n = sum(a * b for a, b in self.projections().values())
        if self.qkv_bias:
            n += self.q_width + 2 * self.kv_width
        if self.o_bias:
            n += self.hidden_size
        if self.mlp_bias:
            n += 2 * self.intermediate_size + self.hidden_size
        n += 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return n

    def root_parameters(self) -> int:
        """Embeddings, the LM head (unless tied to them) and the final norm: the parameters outside the layers."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def parameters(self) -> int:
        return self.num_hidden_layers * self.layer_parameters() + self.root_parameters()

    def adapted(self, target_modules: list[str] | str) -> tuple[list[str], list[str]]:
        """(projections of each layer, modules outside the layers) that LoRA adapts, matched as PEFT
        matches: "all-linear" is every linear layer but the LM head; a name matches a module whose
        path ends with it; any other string is a regular expression over the full module path."""
        outer = {"lm_head": "lm_head", "embed_tokens": "model.embed_tokens"}
        if target_modules == "all-linear":
            return list(_PROJECTIONS), []
        if isinstance(target_modules, str):
            try:
                pattern = re.compile(target_modules)
            except re.error as e:
                raise InvalidFieldError(
                    "lora.target_modules", target_modules, f"not a regular expression: {e}"
                ) from None
            inner = [p for p, path in _PROJECTIONS.items() if pattern.fullmatch(f"model.layers.0.{path}")]
            return inner, [o for o, path in outer.items() if pattern.fullmatch(path)]
        inner: list[str] = []
        others: list[str] = []
        for name in target_modules:
            hits = [p for p, path in _PROJECTIONS.items() if f"layers.0.{path}".endswith(name)]
            hits += [o for o, path in outer.items() if path.endswith(name)]
            if not hits:
                raise InvalidFieldError(
                    "lora.target_modules",
                    name,
                    f"no module of a {self.model_type or 'decoder'} model is named so "
                    f"({', '.join([*_PROJECTIONS, *outer])})",
                )
            inner += [h for h in hits if h in _PROJECTIONS and h not in inner]
            others += [h for h in hits if h in outer and h not in others]
        return inner, others

    def lora_parameters(self, r: int, target_modules: list[str] | str) -> int:
        """Parameters of a rank-`r` adapter: r·(in + out) per adapted linear or embedding."""
        inner, outer = self.adapted(target_modules)
        shapes = self.projections()
        n = self.num_hidden_layers * sum(r * sum(shapes[p]) for p in inner)
        return n + len(outer) * r * (self.vocab_size + self.hidden_size)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """K and V of every layer for one token, on one of `tensor_parallel` GPUs (KV heads are split
        across them, or replicated where there are fewer heads than GPUs)."""
        heads = math.ceil(self.num_key_value_heads / tensor_parallel)
        return 2 * self.num_hidden_layers * heads * self.head_dim * dtype_bytes


class TrainingSetup(BaseModel):
    """What the trainer runs: precision, adapter, and the longest micro-batch it builds."""

    dtype: Literal["float32", "bfloat16"] = Field(
        default="bfloat16", description="weights and activations of the base model (LoRA stays float32)"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    max_seq_len: int = Field(default=4096, ge=16, description="longest row trained (TrainConfig.max_seq_len)")
    micro_batch_tokens: int = Field(
        default=1024, ge=16, description="tokens per forward/backward (a longer row runs alone)"
    )
    gradient_checkpointing: bool = Field(
        default=True,
        description="keep each decoder layer's input only and recompute the layer in the backward pass",
    )
    offload_activations: bool = Field(
        default=False, description="keep the checkpointed layer inputs in host memory (with checkpointing)"
    )
    autocast_bf16: bool = Field(default=False, description="bf16 autocast over a float32 base")

    @property
    def tokens(self) -> int:
        """Tokens in the largest micro-batch: a row longer than the budget runs alone."""
        return max(self.micro_batch_tokens, self.max_seq_len)


class Layout(BaseModel):
    """Where trainer and engine run: the GPUs of one node and how they are shared."""

    device: Literal["cuda", "cpu"] = Field(default="cuda", description="cpu: the plan sizes host memory")
    gpus: int = Field(default=1, ge=1, description="GPUs on the node")
    gpu_gib: float = Field(
        default=80.0, gt=0, description="memory of one GPU, GiB (an H100 80GB shows 79.2 to torch)"
    )
    trainer_ranks: int = Field(
        default=1, ge=1, description="trainer ranks, one per GPU from GPU 0 (TrainerConfig.world_size)"
    )
    shard_base: bool = Field(
        default=False,
        description="the frozen base is sharded across the trainer ranks (FSDP) instead of copied to each",
    )
    engine: Literal["torch", "vllm"] = Field(default="vllm", description="torch (in process) or vllm")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one vLLM replica spans")
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        description="engine replicas (vLLM data parallelism; torch: engine_replicas), one per GPU",
    )
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1, description="share of each GPU vLLM takes while awake (VLLMConfig)"
    )
    engine_sleeps: bool = Field(
        default=True, description="vLLM sleeps during each training step (sleep mode)"
    )
    engine_dtype: Literal["float32", "bfloat16"] | None = Field(
        default=None, description="vLLM's dtype; None: the trainer's"
    )
    max_model_len: int = Field(default=4096, ge=16, description="longest sequence the engine serves")
    max_loras: int = Field(default=2, ge=1, description="adapters vLLM keeps resident")
    cpu_kv_cache_gib: float = Field(
        default=2.0, gt=0, description="vLLM's KV cache on CPU, GiB (VLLMConfig.cpu_kvcache_gb)"
    )
    engine_rows: int = Field(default=64, ge=1, description="rows the torch engine samples at once")

    @model_validator(mode="after")
    def _fits_node(self) -> Layout:
        if self.device == "cuda" and self.trainer_ranks > self.gpus:
            raise InvalidFieldError(
                "trainer_ranks", self.trainer_ranks, f"one rank per GPU: the node has {self.gpus}"
            )
        if self.engine == "torch" and self.tensor_parallel_size > 1:
            raise InvalidFieldError(
                "tensor_parallel_size",
                self.tensor_parallel_size,
                "the torch engine has no tensor parallelism: use vllm",
            )
        if self.device == "cuda" and self.tensor_parallel_size * self.data_parallel_size > self.gpus:
            raise InvalidFieldError(
                "tensor_parallel_size",
                self.tensor_parallel_size,
                f"x data_parallel_size={self.data_parallel_size} needs more GPUs than the node's {self.gpus}",
            )
        return self

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_gib * GiB)


def _activation_bytes_per_layer(shape: ModelShape, setup: TrainingSetup, inner: list[str]) -> int:
    """Bytes one token keeps for the backward pass of one decoder layer, LoRA on `inner`.

    With a = the activation dtype's bytes (2 in bf16 or under autocast, 4 in fp32), h hidden, q =
    heads x head_dim, kv = KV heads x head_dim, i intermediate, r the LoRA rank:

      2 RMSNorms           2 · 4 h          each keeps its input in fp32 (its output is read only by
                                            frozen weights and by LoRA's own copy, below)
      attention            a (2q + 2kv)     q and k after RoPE, v, the output (a fused kernel keeps
                                            no scores; the per-head log-sum-exp is left out)
      Qwen3's q/k norms    4 (q + kv)       their fp32 inputs
      SwiGLU MLP           3 a i            gate, SiLU(gate) and up (their product is read only by
                                            the frozen down projection and LoRA's copy)
      LoRA, per adapted    4 in + 4 r       PEFT casts the projection's input to the adapter's fp32
      projection                            (a copy per projection in bf16; in fp32 the input itself,
                                            once per distinct input, none for o_proj, whose input
                                            is the attention output) and keeps A·x for B

    The frozen base weights keep no inputs: their input gradients need only the weights. Checked
    against the bytes autograd saves on small Llama and Qwen3 models (packages/core/tests/backends/test_memory_plan.py).
    """
    a = 2 if setup.autocast_bf16 or setup.dtype == "bfloat16" else 4
    h, q, kv, i = shape.hidden_size, shape.q_width, shape.kv_width, shape.intermediate_size
    n = 2 * 4 * h + a * (2 * q + 2 * kv) + 3 * a * i
    if shape.qk_norm:
        n += 4 * (q + kv)
    projections = shape.projections()
    n += 4 * setup.lora.r * len(inner)
    if a == 2:  # a fp32 copy of its input for each adapted projection (2 bytes under autocast)
        n += (2 if setup.autocast_bf16 else 4) * sum(projections[p][0] for p in inner)
    else:  # fp32: projections that share an input share the tensor kept; o_proj's is the attention
        # output, kept already (the fused kernels lay it out so that the head merge is a view)
        inputs = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
        inputs["down_proj"] = "down"
        n += 4 * sum(projections[p][0] for p in {inputs[p]: p for p in inner if p in inputs}.values())
    return n


class MemoryPlan(BaseModel):
    """What the busiest GPU (GPU 0) holds while training and while sampling, in bytes, and whether it fits."""

    model: str
    shape: ModelShape
    setup: TrainingSetup
    layout: Layout
    parameters: int = Field(description="the base model's parameters")
    lora_parameters: int
    # the trainer on GPU 0
    weights: int = Field(description="base weights (its shard when sharded)")
    gathered_weights: int = Field(description="sharded base: the decoder layer gathered whole while it runs")
    adapter: int = Field(description="LoRA weights, float32")
    gradients: int = Field(description="LoRA gradients, float32")
    optimizer: int = Field(description="AdamW's two float32 moments per LoRA weight")
    activations: int = Field(description="what the backward pass of the largest micro-batch keeps")
    head_logits: int = Field(description="the LM head's chunked logits and the gradient of its input")
    trainer_overhead: int = Field(description="the trainer process's CUDA context and workspaces")
    # the engine's share of GPU 0
    engine_weights: int = Field(description="the engine's own copy of the base (0: it shares the trainer's)")
    engine_adapters: int = Field(description="vLLM's LoRA slots; the torch engine's merge undo log")
    engine_runtime: int = Field(description="engine activations, sampler, CUDA graphs and context")
    engine_kv_cache: int
    engine_asleep: int = Field(description="what the engine keeps while the trainer runs")
    kv_bytes_per_token: int
    models: int = Field(
        default=1,
        description="models sharing this base on one backend: each adds its adapter, optimizer state "
        "and KV cache, not a base",
    )
    per_model: int = Field(
        default=0,
        description="what each model after the first adds to GPU 0 while sampling: its adapter and "
        "AdamW state, and the torch engine's KV cache (a worker replica: its whole engine)",
    )
    # the verdict
    training_peak: int
    sampling_peak: int
    usable: int = Field(description="the GPU's memory less the headroom kept free")
    problems: list[str] = Field(default_factory=list)
    changes: list[str] = Field(default_factory=list, description="changes that each make the plan fit")

    @computed_field
    @property
    def fits(self) -> bool:
        """True when nothing in `problems`: both moments fit, and vLLM's KV cache holds a sequence."""
        return not self.problems

    @property
    def peak(self) -> int:
        return max(self.training_peak, self.sampling_peak)

    @property
    def kv_tokens(self) -> int:
        """Tokens of one KV pool: the engine's one, or each model's replica's."""
        return max(0, self.engine_kv_cache) // self._kv_pools() // max(1, self.kv_bytes_per_token)

    def _kv_pools(self) -> int:
        """KV pools the engine's share holds: one per model for torch worker replicas (each model's
        own processes), else one for all (vLLM's, or the in-process engine's mixed batches)."""
        return self.models if self.layout.engine == "torch" and self.layout.data_parallel_size > 1 else 1

    def check(self) -> MemoryPlan:
        """This plan, or ImpossiblePlanError naming what does not fit and what to change."""
        if self.fits:
            return self
        where = "host memory" if self.layout.device == "cpu" else "GPU 0"
        fixes = "; or ".join(self.changes) if self.changes else "a node with more or larger GPUs"
        raise ImpossiblePlanError(
            f"{self.model} on {self._node()}: {' '.join(self.problems)} _Change: {fixes}.",
            needed=self.peak,
            available=self.usable,
            where=where,
            changes=list(self.changes),
        )

    def _node(self) -> str:
        if self.layout.device == "cpu":
            return f"the CPU ({_gib(self.layout.gpu_bytes)} GiB)"
        return (
            f"{self.layout.gpus} x {_gib(self.layout.gpu_bytes)} GiB GPU{'s' if self.layout.gpus > 1 else ''}"
        )

    def table(self) -> str:
        """The plan as a fixed-width table, GiB per line: what `journeyman plan` prints and the run log keeps."""
        s, lay = self.setup, self.layout
        targets = (
            s.lora.target_modules
            if isinstance(s.lora.target_modules, str)
            else ",".join(s.lora.target_modules)
        )
        if lay.engine == "vllm":
            engine = (
                f"vLLM tp={lay.tensor_parallel_size} dp={lay.data_parallel_size} "
                f"gpu_memory_utilization={lay.gpu_memory_utilization:g} {lay.engine_dtype or s.dtype}"
                f"{', sleeps while training' if lay.engine_sleeps else ', awake while training'}"
            )
        else:
            engine = "torch engine " + (
                "in the trainer's process"
                if lay.data_parallel_size == 1
                else f"x{lay.data_parallel_size} replicas"
            )
        ckpt = "on" if s.gradient_checkpointing else "off"
        if s.gradient_checkpointing and s.offload_activations:
            ckpt += ", layer inputs offloaded to host"
        # with several models on the base: what each of them holds is marked "x N", its bytes all N's
        n = self.models
        each = f" x {n}" if n > 1 else ""
        replicas = lay.engine == "torch" and lay.data_parallel_size > 1  # a worker replica per model
        engine_each = each if replicas else ""
        if n == 1:
            adapters = "engine: adapter slots / merge log"
        elif lay.engine == "vllm":
            adapters = f"engine: adapter slots{each}"
        elif replicas:
            adapters = f"engine: adapters (fp32){each}"
        else:
            adapters = "engine: merge log (none: the base is shared)"
        rows = [
            (
                "trainer: base weights" + (f" (1/{lay.trainer_ranks} shard)" if self._sharded() else ""),
                self.weights,
            ),
            ("trainer: layer gathered whole (sharded base)", self.gathered_weights),
            (f"trainer: LoRA adapter (fp32){each}", self.adapter),
            ("trainer: LoRA gradients (fp32)" + (", one step" if n > 1 else ""), self.gradients),
            (f"trainer: AdamW state (fp32){each}", self.optimizer),
            (f"trainer: activations ({s.tokens} tokens)", self.activations),
            ("trainer: LM head logits (chunked)", self.head_logits),
            ("trainer: CUDA context" if lay.device == "cuda" else "trainer: process", self.trainer_overhead),
            (
                "engine: weights"
                + (" (shared with the trainer)" if self.engine_weights == 0 else "")
                + engine_each,
                self.engine_weights,
            ),
            (adapters, self.engine_adapters),
            (f"engine: runtime (activations, graphs){engine_each}", self.engine_runtime),
            (
                "engine: KV cache"
                + (each if self._kv_pools() > 1 else " (one pool for all models)" if n > 1 else ""),
                max(0, self.engine_kv_cache),
            ),
            (f"engine: kept while training (asleep){engine_each}", self.engine_asleep),
        ]
        where = "host" if lay.device == "cpu" else "GPU 0"
        lines = [
            f"Memory plan: {self.model}: {self.parameters / 1e9:.2f} B parameters, {s.dtype}; "
            f"LoRA r={s.lora.r} on {targets}: {self.lora_parameters / 1e6:.1f} M",
            f"layout: {self._node()}; {lay.trainer_ranks} trainer rank{'s' if lay.trainer_ranks > 1 else ''} "
            f"(base {'sharded' if self._sharded() else 'copied to each'}); {engine}",
            f"rows: max_seq_len={s.max_seq_len}, micro_batch_tokens={s.micro_batch_tokens}; gradient checkpointing {ckpt}",
        ]
        if n > 1:
            lines.append(
                f"models: {n} on this base, the trainer's copy of it counted once; each holds its adapter and AdamW "
                + ("state and its KV cache (x " if lay.engine == "torch" else "state (x ")
                + f"{n}); one model trains at a time"
                + ("; each model's worker replica loads its own base" if replicas else "")
            )
        lines += ["", f"  {where:<44}{'GiB':>9}"]
        lines += [f"  {name:<44}{_gib(b):>9}" for name, b in rows]
        if n > 1:
            lines.append(f"  {'each model after the first adds':<44}{_gib(self.per_model):>9}")
        lines += [
            f"  {'= while training':<44}{_gib(self.training_peak):>9}",
            f"  {'= while sampling':<44}{_gib(self.sampling_peak):>9}",
            f"  {f'usable ({_gib(lay.gpu_bytes)} less {_HEADROOM:.0%} kept free)':<44}{_gib(self.usable):>9}",
            "",
        ]
        kv = (
            f"KV cache {self.kv_tokens:,} tokens = {self.kv_tokens // lay.max_model_len:,} sequences of {lay.max_model_len}"
            + (" for each model" if self._kv_pools() > 1 else "")
            if self.engine_kv_cache > 0
            else "no KV cache"
        )
        if self.fits:
            lines.append(f"verdict: fits ({kv}; peak {_gib(self.peak)} of {_gib(self.usable)} GiB)")
        else:
            lines.append("verdict: does NOT fit. " + " ".join(self.problems))
            lines += [f"  change: {c}" for c in self.changes] or ["  change: a node with more or larger GPUs"]
        if lay.device == "cpu":
            lines.append(
                "(on the CPU the plan is advice: host memory is shared and paged, so nothing is refused)"
            )
        return "\n".join(lines)

    def _sharded(self) -> bool:
        return self.layout.shard_base and self.layout.trainer_ranks > 1


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f}"


def plan_memory(
    config: Mapping[str, Any] | ModelShape,
    setup: TrainingSetup,
    layout: Layout,
    *,
    model: str | None = None,
    suggest: bool = True,
    flag: Callable[[str], str] | None = None,
    models: int = 1,
) -> MemoryPlan:
    """The memory plan of training `config`'s model with `setup` on `layout` (see the module docstring).

    `models`: how many models share this base on one backend (1 to MAX_MODELS); the base is counted
    once, each model's adapter and AdamW state once per model, and the torch engine's KV cache once
    per model (vLLM: one KV pool, an adapter slot per model).

    When it does not fit and `suggest` is on, `changes` lists each single change that makes it fit
    (fewer models, dtype, gradient checkpointing, sharding the base, vLLM tensor parallelism, a lower
    gpu_memory_utilization, a shorter max_seq_len or max_model_len), or else the first combination
    of them that does. `flag(field)`: how the caller spells a TrainingSetup or Layout field or
    `models` (the CLI: its option), for changes worded as those; by default they are worded as
    Python settings."""
    models = _check_models(models)
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    name = model or (_name_of(config) if not isinstance(config, ModelShape) else shape.model_type) or "model"
    plan = _compute(shape, setup, layout, name, models)
    if not plan.fits and suggest:
        plan.changes = _changes(shape, setup, layout, name, flag, models)
    return plan


def _check_models(models: object) -> int:
    """`models` as given, or InvalidFieldError naming it: a whole number from 1 to MAX_MODELS."""
    if isinstance(models, bool) or not isinstance(models, int) or not 1 <= models <= MAX_MODELS:
        raise InvalidFieldError(
            "models",
            models,
            f"the models sharing one base on a backend: a whole number from 1 to {MAX_MODELS}",
        )
    return models


def _name_of(config: Mapping[str, Any]) -> str:
    named = config.get("_name_or_path")
    if isinstance(named, str) and named:
        return named.rstrip("/").split("/")[-1]
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else str(config.get("model_type") or "")


def _compute(
    shape: ModelShape, setup: TrainingSetup, layout: Layout, name: str, models: int = 1
) -> MemoryPlan:
    b = DTYPE_BYTES[setup.dtype]
    a = 2 if setup.autocast_bf16 or setup.dtype == "bfloat16" else 4
    h, v, n = shape.hidden_size, shape.vocab_size, setup.tokens
    cuda = layout.device == "cuda"
    params = shape.parameters()
    inner, outer = shape.adapted(setup.lora.target_modules)
    lora_params = shape.lora_parameters(setup.lora.r, setup.lora.target_modules)

    # -- the trainer ---------------------------------------------------------------------------
    sharded = layout.shard_base and layout.trainer_ranks > 1
    if sharded:
        # training/sharding.py: each rank keeps 1/N of every decoder layer and the embeddings, final
        # norm and head whole; a layer's full weights exist while it runs, and the next layer's
        # gather starts one layer ahead: two layers whole at once
        layers = shape.num_hidden_layers * shape.layer_parameters()
        weights = (layers // layout.trainer_ranks + shape.root_parameters()) * b
        gathered = 2 * shape.layer_parameters() * b
    else:
        weights, gathered = params * b, 0
    # fp32 weights, gradients and AdamW's m and v. Each of the models on the base keeps its adapter
    # and AdamW state between steps; gradients exist only during a step (zero_grad frees them), and
    # one model trains at a time on a GPU, so they and the activations below are counted once.
    adapter, gradients, optimizer = 4 * lora_params * models, 4 * lora_params, 8 * lora_params * models
    layer = n * _activation_bytes_per_layer(shape, setup, inner)
    final_norm = n * 4 * h  # the final RMSNorm's fp32 input
    if setup.gradient_checkpointing:
        # each layer's input kept (on the host when offloaded); in the backward pass one layer is
        # recomputed whole and its gradients made: two layers' worth at once
        kept = 0 if setup.offload_activations else shape.num_hidden_layers * n * h * a
        activations = kept + 2 * layer + final_norm
    else:
        # every layer's saved tensors, plus one layer's worth of gradients in the backward pass
        activations = (shape.num_hidden_layers + 1) * layer + final_norm
    if "lm_head" in outer:
        # a trained head goes through autograd: (N, V) fp32 logits and five more of their size
        head = 6 * n * v * 4
    else:
        rows = max(1, _HEAD_CHUNK_BYTES // (4 * v))
        head = rows * v * (b + 4) + 2 * n * h * a  # a chunk in dtype and fp32; hidden and its gradient
    overhead = _PROCESS_OVERHEAD if cuda else 0
    resident = weights + adapter + optimizer + overhead

    # -- the engine's share of GPU 0 ---------------------------------------------------------------
    problems: list[str] = []
    eb = DTYPE_BYTES[layout.engine_dtype or setup.dtype]
    tp = layout.tensor_parallel_size
    kv_token = shape.kv_bytes_per_token(eb, tp)
    if layout.engine == "vllm":
        # httpx and the supervisor: only when asked
        from journeyman.engine.vllm_server import lora_rank_for, lora_slots

        # one server serves every model on the base: two adapter slots a model (max_loras doubled as
        # models join, `lora_slots`), all beside one KV pool, which the extra slots shrink
        slots = lora_slots(models, layout.max_loras) * shape.lora_parameters(
            lora_rank_for(setup.lora.r), setup.lora.target_modules
        )
        engine_weights = params * eb // tp
        engine_adapters = slots * eb // tp
        widths = shape.q_width + 2 * shape.kv_width + 3 * shape.intermediate_size + 2 * h
        engine_runtime = (
            _VLLM_PROFILE_TOKENS * widths * eb // tp + 2 * _VLLM_MAX_SEQS * v * 4 + _PROCESS_OVERHEAD
        )
        if cuda:  # vLLM takes its share of the GPU and fills what its weights leave with KV cache
            budget = int(layout.gpu_memory_utilization * layout.gpu_bytes)
            kv_cache = budget - engine_weights - engine_adapters - engine_runtime
        else:  # on CPU its KV cache is a fixed size (VLLM_CPU_KVCACHE_SPACE)
            kv_cache = int(layout.cpu_kv_cache_gib * GiB)
            budget = engine_weights + engine_adapters + engine_runtime + kv_cache
        engine_awake = budget
        engine_asleep = _PROCESS_OVERHEAD if layout.engine_sleeps and cuda else budget
        per_model = 12 * lora_params  # the trainer's adapter and AdamW state; vLLM's slot is in its share
        if kv_cache < layout.max_model_len * kv_token:
            sized = (
                f"gpu_memory_utilization={layout.gpu_memory_utilization:g} x {_gib(layout.gpu_bytes)} GiB "
                f"less its weights {_gib(engine_weights)}, adapter slots and runtime"
                if cuda
                else "VLLMConfig.cpu_kvcache_gb"
            )
            problems.append(
                f"vLLM's KV cache ({_gib(max(0, kv_cache))} GiB: {sized}) holds less than one sequence of "
                f"max_model_len={layout.max_model_len} ({_gib(layout.max_model_len * kv_token)} GiB): "
                "vLLM refuses to start."
            )
    else:
        own_copy = layout.data_parallel_size > 1  # replica processes each load their own weights
        engine_weights = params * eb if own_copy else 0
        adapted = shape.num_hidden_layers * sum(
            x * y for p, (x, y) in shape.projections().items() if p in inner
        )
        # merging a 16-bit base keeps an undo log of about half the adapted weights (policy/merge.py);
        # a replica keeps its adapter, unmerged, in fp32
        # merging a 16-bit base keeps an undo log of about half the adapted weights (policy/merge.py);
        # a replica keeps its adapter, unmerged, in fp32. On a base several models share nothing is
        # merged (the adapter runs beside the base layers): no undo log
        undo_log = adapted * b // 2 if b == 2 and models == 1 else 0
        engine_adapters = 4 * lora_params if own_copy else undo_log
        # one pool of KV slots (engine/kv.py): the in-process engine batches every model's rows in it,
        # a model's replica processes keep their own
        kv_one = layout.engine_rows * layout.max_model_len * kv_token
        # prefill of one longest row: its MLP's widest tensors, and logits at the last positions
        engine_runtime = layout.max_model_len * 3 * shape.intermediate_size * eb + layout.engine_rows * v * 4
        if own_copy:
            engine_runtime += overhead
        # a worker replica is a process of its model's engine that loads its own base (only models in
        # the trainer's process share one): every model's replica on GPU 0 is a whole engine
        copies = models if own_copy else 1
        engine_weights, engine_adapters, engine_runtime = (
            x * copies for x in (engine_weights, engine_adapters, engine_runtime)
        )
        kv_cache = kv_one * copies
        engine_awake = engine_weights + engine_adapters + engine_runtime + kv_cache
        # replicas never sleep; the in-process engine holds nothing while the trainer runs
        engine_asleep = engine_awake if own_copy else 0
        per_model = 12 * lora_params + (engine_awake // models if own_copy else 0)
    training = resident + gathered + gradients + activations + head + engine_asleep
    sampling = resident + engine_awake
    usable = int(layout.gpu_bytes * (1 - _HEADROOM))
    where = "host memory" if not cuda else "GPU 0"
    if training > usable:
        problems.insert(
            0,
            f"{where} needs {_gib(training)} GiB while training (base {_gib(weights + gathered)}, activations "
            f"{_gib(activations)} for {n} tokens, engine asleep {_gib(engine_asleep)}) of {_gib(usable)} GiB usable.",
        )
    if sampling > usable:
        what = (
            f"vLLM's {layout.gpu_memory_utilization:g} of the GPU ({_gib(engine_awake)})"
            if layout.engine == "vllm"
            else f"the engine's {_gib(engine_awake)} (KV cache of {layout.engine_rows} rows"
            + (f" for each of {models} models)" if models > 1 and layout.data_parallel_size > 1 else ")")
        )
        several = (
            f", of it {models} models' adapters and AdamW state {_gib(adapter + optimizer)},"
            if models > 1
            else ""
        )
        problems.insert(
            0,
            f"{where} needs {_gib(sampling)} GiB while sampling (the trainer's resident {_gib(resident)}"
            f"{several} beside {what}) of {_gib(usable)} GiB usable.",
        )
    return MemoryPlan(
        model=name,
        shape=shape,
        setup=setup,
        layout=layout,
        parameters=params,
        lora_parameters=lora_params,
        weights=weights,
        gathered_weights=gathered,
        adapter=adapter,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        head_logits=head,
        trainer_overhead=overhead,
        engine_weights=engine_weights,
        engine_adapters=engine_adapters,
        engine_runtime=engine_runtime,
        engine_kv_cache=kv_cache,
        engine_asleep=engine_asleep,
        kv_bytes_per_token=kv_token,
        models=models,
        per_model=per_model,
        training_peak=training,
        sampling_peak=sampling,
        usable=usable,
        problems=problems,
    )


_Change = Callable[[TrainingSetup, Layout], tuple[TrainingSetup, Layout]]


@dataclass(frozen=True)
class _Kind:
    """One kind of change, its settings mildest first. A structural kind (precision, checkpointing,
    sharding, tensor parallelism) is combined with others at its strongest setting; a tunable one
    (a utilization, a length) is searched for the mildest setting that fits."""

    options: list[tuple[str, _Change]]
    structural: bool
    precision: bool = False  # dtype, checkpointing, offload: kept when a larger node is proposed


# names a TrainingSetup or Layout field as the caller spells it (the CLI: its flag); None: Python
_Flag = Callable[[str], str] | None


def _say(flag: _Flag, python: str, settings: Mapping[str, Any], what: str = "") -> str:
    """A change as Python settings (`python`), or as the command line's flags when `flag` names them."""
    if flag is None:
        return python
    said = " ".join(
        flag(k) if v is True else f"{flag(k)} {v:g}" if isinstance(v, float) else f"{flag(k)} {v}"
        for k, v in settings.items()
    )
    return f"{what} ({said})" if what else said


def _kinds(shape: ModelShape, setup: TrainingSetup, layout: Layout, flag: _Flag = None) -> list[_Kind]:
    def upd(model: Any, **kw: Any) -> Any:
        return model.model_copy(update=kw)

    kinds: list[_Kind] = []
    if setup.dtype == "float32":
        why = "float32 weights, activations and KV cache take twice the memory"
        label = _say(flag, "dtype='bfloat16'", {"dtype": "bfloat16"}) + f" ({why})"
        kinds.append(
            _Kind(
                [(label, lambda s, lay: (upd(s, dtype="bfloat16"), upd(lay, engine_dtype=None)))], True, True
            )
        )
    if not setup.gradient_checkpointing:
        label = _say(flag, "turn on gradient_checkpointing (TrainConfig)", {"gradient_checkpointing": True})
        kinds.append(_Kind([(label, lambda s, lay: (upd(s, gradient_checkpointing=True), lay))], True, True))
    gpus, cuda = layout.gpus, layout.device == "cuda"
    if cuda and gpus > 1 and not (layout.shard_base and layout.trainer_ranks == gpus):
        what = f"shard the base across {gpus} ranks"
        python = f"{what} (TrainerConfig(world_size={gpus}) with the base sharded)"
        label = _say(flag, python, {"trainer_ranks": gpus, "shard_base": True}, what)
        kinds.append(
            _Kind([(label, lambda s, lay: (s, upd(lay, trainer_ranks=gpus, shard_base=True)))], True)
        )
    vllm = layout.engine == "vllm" and cuda
    if vllm:
        options: list[tuple[str, _Change]] = []
        for tp in (2, 4, 8, 16):
            if tp <= layout.tensor_parallel_size or tp > gpus or shape.num_attention_heads % tp:
                continue
            dp = min(layout.data_parallel_size, gpus // tp)  # replicas x tp within the node
            label = f"tensor_parallel_size={tp}" + (
                f" with data_parallel_size={dp}" if dp != layout.data_parallel_size else ""
            )
            parallel = {"tensor_parallel_size": tp} | (
                {"data_parallel_size": dp} if dp != layout.data_parallel_size else {}
            )
            options.append(
                (
                    _say(flag, label + " (VLLMConfig)", parallel),
                    lambda s, lay, tp=tp, dp=dp: (
                        s,
                        upd(lay, tensor_parallel_size=tp, data_parallel_size=dp),
                    ),
                )
            )
        if options:
            kinds.append(_Kind(options, True))
    if setup.gradient_checkpointing and not setup.offload_activations:
        label = _say(flag, "turn on offload_activations (TrainConfig)", {"offload_activations": True})
        kinds.append(_Kind([(label, lambda s, lay: (upd(s, offload_activations=True), lay))], True, True))
    if vllm:
        now = layout.gpu_memory_utilization
        utils = sorted(
            (u / 20 for u in range(2, 19) if not math.isclose(u / 20, now)), key=lambda u: abs(u - now)
        )
        options = [
            (
                _say(flag, f"gpu_memory_utilization={u:g} (VLLMConfig)", {"gpu_memory_utilization": u}),
                lambda s, lay, u=u: (s, upd(lay, gpu_memory_utilization=u)),
            )
            for u in utils
        ]
        kinds.append(_Kind(options, False))
    options = [
        (
            _say(
                flag,
                f"lower max_seq_len to {n} (TrainConfig; longer rows are fitted by long_rows)",
                {"max_seq_len": n},
            ),
            lambda s, lay, n=n: (upd(s, max_seq_len=n, micro_batch_tokens=min(s.micro_batch_tokens, n)), lay),
        )
        for n in _shorter(setup.max_seq_len)
    ]
    kinds.append(_Kind(options, False))
    options = [
        (
            _say(flag, f"lower max_model_len to {n} (VLLMConfig)", {"max_model_len": n}),
            lambda s, lay, n=n: (s, upd(lay, max_model_len=n)),
        )
        for n in _shorter(layout.max_model_len)
    ]
    if vllm:
        kinds.append(_Kind(options, False))
    return kinds


def _shorter(length: int) -> list[int]:
    """Lengths below `length` worth proposing, longest first: multiples of 1024 down to 1024."""
    return [n for n in range((length - 1) // 1024 * 1024, 1023, -1024)]


def _changes(
    shape: ModelShape, setup: TrainingSetup, layout: Layout, name: str, flag: _Flag = None, models: int = 1
) -> list[str]:
    """Each kind's mildest change that alone makes the plan fit (the most of `models` that fits
    first); if none does, the first combination (structural changes added in order, each followed
    by a search of the tunable ones) that does, all `models` kept."""

    def fits(change: _Change, s: TrainingSetup, lay: Layout) -> tuple[TrainingSetup, Layout] | None:
        try:
            s, lay = change(s, lay)
        except InvalidFieldError:  # a layout the node cannot hold
            return None
        return (s, lay) if _compute(shape, s, lay, name, models).fits else None

    kinds = _kinds(shape, setup, layout, flag)
    singles = [
        next((label for label, change in kind.options if fits(change, setup, layout)), None) for kind in kinds
    ]
    fewer = next((m for m in range(models - 1, 0, -1) if _compute(shape, setup, layout, name, m).fits), None)
    if fewer is not None:
        python = (
            f"models={fewer} (fewer models on this base: each adds its adapter, AdamW state and KV cache)"
        )
        singles.insert(0, _say(flag, python, {"models": fewer}))
    if any(singles):
        return [label for label in singles if label]
    tunables = [k for k in kinds if not k.structural]

    def together(s: TrainingSetup, lay: Layout, chosen: list[str]) -> list[str] | None:
        if _compute(shape, s, lay, name, models).fits:
            return ["together: " + ", ".join(chosen)]
        for tunable in tunables:
            for label, change in tunable.options:
                if fits(change, s, lay):
                    return ["together: " + ", ".join([*chosen, label])]
        return None

    s, lay, chosen, precision = setup, layout, [], []
    for kind in (k for k in kinds if k.structural):
        for label, change in kind.options:  # mildest first, with what is chosen so far
            s2, lay2 = change(s, lay)
            if found := together(s2, lay2, [*chosen, label]):
                return found
        label, change = kind.options[-1]  # not enough: keep the strongest, add the next kind
        s, lay = change(s, lay)
        chosen.append(label)
        precision += [label] if kind.precision else []
    if layout.device != "cuda":
        return []
    # not on these GPUs: the smallest node of the same GPUs that holds it, the base sharded across
    # all of them, as asked or with the precision changes above
    for gpus in (2, 4, 8, 16, 32, 64):
        for tp in (1, 2, 4, 8, 16):
            if gpus <= layout.gpus or tp > gpus or shape.num_attention_heads % tp:
                continue
            if tp > 1 and layout.engine != "vllm":  # the torch engine has no tensor parallelism
                continue
            node = {"gpus": gpus, "trainer_ranks": gpus, "shard_base": True, "tensor_parallel_size": tp}
            node["data_parallel_size"] = 1
            for s2, lay2, extra in ((setup, layout, []), (s, lay, precision)):
                if _compute(shape, s2, lay2.model_copy(update=node), name, models).fits:
                    where = (
                        f"{gpus} GPUs of {_gib(layout.gpu_bytes)} GiB, the base sharded across {gpus} ranks"
                    )
                    python = where + (f", tensor_parallel_size={tp}" if tp > 1 else "")
                    flags = {"gpus": gpus, "trainer_ranks": gpus, "shard_base": True}
                    flags |= {"tensor_parallel_size": tp} if tp > 1 else {}
                    node_change = _say(flag, python, flags, f"{gpus} GPUs of {_gib(layout.gpu_bytes)} GiB")
                    return [", ".join([node_change, *extra])]
    return []


def plan_for_backend(
    config: Mapping[str, Any],
    model: ModelConfig,
    *,
    device: str | None,
    dtype: str,
    trainer: TrainerConfig,
    vllm: VLLMConfig | None,
    engine_replicas: int = 1,
    train: TrainConfig | None = None,
    memory: tuple[int, int] | None = None,
    models: int = 1,
) -> MemoryPlan:
    """The plan of what `LocalBackend.register` is about to load: the layout from the backend's
    settings, the rows from `train` (TrainConfig's defaults: the plan is made before any step says
    otherwise), the device's memory as `memory` (GPUs, bytes of each) or else asked of torch; on the
    CPU it is the host's. `models`: the models that will share this base on the backend, this one
    included (see `plan_memory`)."""
    _check_models(models)
    from journeyman.policy.base_weights import pick_device

    where = pick_device(device)
    cuda = where.type == "cuda"
    if memory is not None:
        gpus, size = memory
    elif cuda:
        import torch

        gpus, size = torch.cuda.device_count(), torch.cuda.get_device_properties(where).total_memory
    else:
        gpus, size = 1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    train = train or TrainConfig()
    checkpointing = getattr(train, "gradient_checkpointing", None)
    setup = TrainingSetup(
        dtype="bfloat16" if dtype == "bfloat16" else "float32",
        lora=model.lora,
        max_seq_len=train.max_seq_len,
        micro_batch_tokens=micro_batch_tokens(
            train.micro_batch_tokens, train.max_seq_len, "cuda" if cuda else "cpu"
        ),
        gradient_checkpointing=cuda if checkpointing is None else checkpointing,
        offload_activations=cuda and bool(getattr(train, "offload_activations", False)),
        autocast_bf16=train.autocast_bf16,
    )
    # ranks on this node: all of them, unless torchrun spread them over several
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", trainer.world_size))
    if vllm is not None:
        engine: dict[str, Any] = {
            "engine": "vllm",
            "tensor_parallel_size": getattr(vllm, "tensor_parallel_size", 1),
            "data_parallel_size": vllm.data_parallel_size,
            "gpu_memory_utilization": vllm.gpu_memory_utilization,
            "engine_sleeps": cuda if vllm.sleep_mode is None else vllm.sleep_mode,
            "engine_dtype": vllm.dtype if vllm.dtype in ("float32", "bfloat16") else None,
            "max_model_len": vllm.max_model_len,
            "max_loras": vllm.max_loras,
            "cpu_kv_cache_gib": vllm.cpu_kvcache_gb,
        }
    else:  # the torch engine's rows are as long as the trainer's
        engine = {
            "engine": "torch",
            "data_parallel_size": engine_replicas,
            "max_model_len": train.max_seq_len,
        }
    layout = Layout(
        device="cuda" if cuda else "cpu",
        gpus=max(1, gpus),
        gpu_gib=size / GiB,
        trainer_ranks=ranks,
        shard_base=bool(getattr(trainer, "shard_base", False)),
        **engine,
    )
    # the hub id a config names, else the base model's directory name, else its architecture
    named = config.get("_name_or_path") or PurePath(model.base_model).name or _name_of(config)
    return plan_memory(config, setup, layout, model=PurePath(str(named)).name, models=models)


# The config.json fields the plan reads, of the models users train most (model_configs.json beside
# packages/core/tests/backends/test_memory_plan.py holds the whole files; a test keeps these equal to them). The embedded model's is read from disk.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b-instruct": {
        "_name_or_path": "Qwen/Qwen2.5-7B-Instruct",
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "qwen3-8b": {
        "_name_or_path": "Qwen/Qwen3-8B",
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 128,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "qwen3-32b": {
        "_name_or_path": "Qwen/Qwen3-32B",
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 128,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "llama-3.1-8b-instruct": {
        "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """A preset's config fields by name (any case); the embedded model's config.json from its weights."""
    key = name.lower()
    if key in PRESETS:
        return dict(PRESETS[key])
    from journeyman.data.config import DEFAULT_BASE_MODEL

    if key == DEFAULT_BASE_MODEL:
        import json

        from journeyman.policy.weights import resolve_base_model

        return {
            "_name_or_path": DEFAULT_BASE_MODEL,
            **json.loads((resolve_base_model(key) / "config.json").read_text()),
        }
    raise InvalidFieldError("preset", name, f"known presets: {', '.join([*PRESETS, DEFAULT_BASE_MODEL])}")
