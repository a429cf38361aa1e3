"""ART's `art.dev` settings (its GPU-side configuration, unstable in ART too), accepted as ART spells
them and translated into Journeyman's where Journeyman has the knob: LoRA rank/alpha/dropout/targets,
learning rate, grad norm, weight decay, AdamW betas, row length. The others (vLLM and Unsloth
arguments, ART's own loss variants) have no counterpart here: each is named in a warning, once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, TypedDict

from journeyman.art._unsupported import module_getattr

__all__ = [
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "LoRAConfig",
    "OpenAIServerConfig",
    "PeftArgs",
    "TrainConfig",
    "TrainerArgs",
    "lora_config_fields",
    "lora_fields",
    "train_fields",
    "warn_unsupported",
]

__getattr__ = module_getattr("art.dev", __name__)  # ART's engine settings we lack: named errors


class InitArgs(TypedDict, total=False):
    max_seq_length: int
    load_in_4bit: bool
    load_in_8bit: bool
    fast_inference: bool
    gpu_memory_utilization: float
    max_lora_rank: int
    use_exact_model_name: bool


class EngineArgs(TypedDict, total=False):
    gpu_memory_utilization: float
    max_model_len: int
    enforce_eager: bool
    tensor_parallel_size: int
    enable_sleep_mode: bool
    max_num_seqs: int


class PeftArgs(TypedDict, total=False):
    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]
    random_state: int
    bias: str
    use_gradient_checkpointing: bool | str


class TrainerArgs(TypedDict, total=False):
    learning_rate: float
    max_grad_norm: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    gradient_checkpointing: bool
    gradient_accumulation_steps: int
    per_device_train_batch_size: int


class LoRAConfig(TypedDict, total=False):
    """ART's `lora_config=` of a TrainableModel (`art.LoRAConfig`): rank, alpha, dropout and target
    modules become Journeyman's LoraConfig; the rest (Unsloth's options) is warned about."""

    rank: int
    alpha: int
    dropout: float
    target_modules: list[str]
    random_state: int
    bias: str
    use_gradient_checkpointing: str
    use_rslora: bool
    max_seq_length: int


class InternalModelConfig(TypedDict, total=False):
    """ART's `_internal_config` of a TrainableModel."""

    init_args: InitArgs
    engine_args: EngineArgs
    peft_args: PeftArgs
    trainer_args: TrainerArgs
    torchtune_args: dict[str, Any]


class TrainConfig(TypedDict, total=False):
    """ART's `_config=` of `model.train` (the keyword arguments of `backend.train` now)."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float
    importance_sampling_level: str
    kl_penalty_coef: float
    logprob_calculation_chunk_size: int
    max_grad_norm: float
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float


class OpenAIServerConfig(TypedDict, total=False):
    """ART's vLLM server settings for `model.register(backend, _openai_client_config=...)`."""

    log_file: str
    server_args: dict[str, Any]
    engine_args: EngineArgs


# ART name -> Journeyman TrainConfig field, for what means the same thing.
_TRAIN = {
    "learning_rate": "learning_rate",
    "beta": "kl_coef",
    "kl_penalty_coef": "kl_coef",
    "epsilon": "eps",
    "epsilon_high": "eps_high",
    "max_grad_norm": "max_grad_norm",
    "weight_decay": "weight_decay",
    "scale_rewards": "scale_rewards",
    "truncated_importance_sampling": "tis_cap",
    "max_seq_length": "max_seq_len",
    "gradient_checkpointing": "gradient_checkpointing",
    "loss_fn": "loss",  # ART 0.5.23: "cispo" | "ppo", both Journeyman losses
}
# ART's training settings with no counterpart here (warned about, once each).
ART_ONLY_TRAIN = frozenset(
    {
        "advantage_balance",
        "allow_training_without_logprobs",
        "importance_sampling_level",
        "logprob_calculation_chunk_size",
        "max_negative_advantage_importance_sampling_weight",
        "mask_prob_ratio",
        "num_trajectories_learning_rate_multiplier_power",
        "packed_sequence_length",
        "plot_tensors",
        "ppo",
        "precalculate_logprobs",
        "save_checkpoint",
        "scale_learning_rate_by_reward_std_dev",
        "verbose",
        "gradient_accumulation_steps",
        "per_device_train_batch_size",
        # ART 0.5.23's LocalBackend.train
        "adam_params",
        "final_training_step",
        "grad_accumulation_sequences",
        "kimi_k2_tau",
        "kl_penalty_reference_step",
        "kl_penalty_source",
        "kl_ref_adapter_path",
        "loss_fn_config",
        "normalize_advantages",
        "optimizer_save_interval",
    }
)
ART_TRAIN_NAMES = frozenset(_TRAIN) | ART_ONLY_TRAIN | {"adam_beta1", "adam_beta2"}
_PEFT = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules"}
_PEFT |= {"random_state": "seed"}
_LORA_CONFIG = {"rank": "r", "alpha": "alpha", "dropout": "dropout", "target_modules": "target_modules"}
_LORA_CONFIG |= {"random_state": "seed"}

_warned: set[str] = set()


def warn_unsupported(name: str, why: str) -> None:
    """Say once per process that an ART setting has no effect here."""
    if name in _warned:
        return
    _warned.add(name)
    warnings.warn(f"journeyman.art: {name} {why}", UserWarning, stacklevel=3)


def train_fields(settings: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Journeyman `TrainConfig` fields for ART training settings (`backend.train` kwargs, `art.dev.TrainConfig`,
    `trainer_args`); an ART setting without a counterpart is warned about; a name ART does not have
    either is refused (TypeError naming it)."""
    unknown = sorted(set(settings) - ART_TRAIN_NAMES)
    if unknown:
        raise TypeError(f"{where}: unknown argument(s) {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for name, value in settings.items():
        if name in _TRAIN:
            out[_TRAIN[name]] = value
        elif name in ("adam_beta1", "adam_beta2"):
            betas = list(out.get("betas", (0.9, 0.99)))
            betas[name == "adam_beta2"] = value
            out["betas"] = tuple(betas)
        elif name == "ppo" and value:
            out["loss"] = "ppo"  # Journeyman's default loss is PPO's clipped surrogate already
        elif name in ("verbose",) or (name == "save_checkpoint" and value):
            continue  # what Journeyman does anyway: progress is shown, every step is checkpointed
        else:
            warn_unsupported(
                f"{where} {name}={value!r}", "has no counterpart in Journeyman and is not applied"
            )
    return out


def lora_fields(internal: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(LoraConfig fields, TrainConfig fields) from ART's `_internal_config`; the rest is warned about."""
    lora: dict[str, Any] = {}
    train: dict[str, Any] = {}
    for section, values in internal.items():
        if not isinstance(values, Mapping):
            warn_unsupported(
                f"_internal_config[{section!r}]", "has no counterpart in Journeyman and is not applied"
            )
            continue
        for name, value in values.items():
            if section == "peft_args" and name in _PEFT:
                lora[_PEFT[name]] = value
            elif section in ("trainer_args", "init_args") and name in ART_TRAIN_NAMES:
                train |= train_fields({name: value}, f"_internal_config[{section!r}]")
            else:
                warn_unsupported(
                    f"_internal_config[{section!r}][{name!r}]={value!r}",
                    "is a GPU/engine setting of ART's with no counterpart in Journeyman; not applied",
                )
    return lora, train


def lora_config_fields(lora_config: Mapping[str, Any]) -> dict[str, Any]:
    """Journeyman LoraConfig fields for ART's `lora_config=`; its Unsloth-only options are warned about."""
    out: dict[str, Any] = {}
    for name, value in lora_config.items():
        if name in _LORA_CONFIG:
            out[_LORA_CONFIG[name]] = value
        else:
            warn_unsupported(
                f"lora_config[{name!r}]={value!r}",
                "has no counterpart in Journeyman's LoraConfig; not applied",
            )
    return out
