"""What of ART's public surface Journeyman does not have, each with what to use instead.

ART code that reaches one of these gets `ArtFeatureNotSupported` naming the ART feature and its
replacement, at the first touch: the import of the module, the attribute, the keyword argument.
(Not an AttributeError or ImportError on purpose: `from art import X` would turn either into a bare
"cannot import name".) Everything else ART's latest release (`openpipe-art` 0.5.23) documents works; the test
that reads the release's wheel (tests/test_art_compat.py) keeps the two lists honest.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from journeyman.errors import JourneymanError

_CAPTURE = (
    "ART's automatic capture of a rollout's calls into a Trajectory; use `async with model.capture() as "
    "cap:` (every completion served in the block, token-exact) and "
    "journeyman.rollout.histories.fill_histories(trajectory, join_calls(cap.calls)) instead"
)
_TOKENS = (
    "ART's client-side tokenization; Journeyman trains on the ids the endpoint sampled: use "
    "journeyman.record_of(choice) (prompt ids, sampled ids, logprobs) instead"
)
_MEGATRON = (
    "ART's Megatron trainer settings; use LocalBackend options (device, trainer=jm.TrainerConfig) instead"
)
_PIPELINE = "ART's pipeline-RL runtime; use journeyman.PipelineTrainer with journeyman.PipelineConfig instead"
_SERVERLESS = (
    "W&B's hosted training service; use art.local.LocalBackend on your GPU, or journeyman.RemoteBackend "
    "to a GPU machine running `journeyman serve`, instead"
)
_DEV = (
    "one of ART's settings for its own engines (vLLM, Unsloth, Tinker, Megatron); use Journeyman's "
    "LocalBackend options (engine, vllm=jm.VLLMConfig(...), trainer=jm.TrainerConfig(...)) instead"
)
_S3 = (
    "ART's S3 helpers; use backend._experimental_push_to_s3 / _experimental_pull_from_s3, or "
    "backend.push_run / pull_run (any fsspec URL), instead"
)
_BENCHMARKS = (
    "ART's benchmark charts; use `await model.history()` (every logged row) and `journeyman view` instead"
)

NOT_SUPPORTED: dict[str, str] = {
    # art
    "art.LocalServingUnavailableError": "ART's vLLM server error; catch journeyman.EngineDownError instead",
    "art.MegatronRuntimeConfig": _MEGATRON,
    "art.MegatronTopologyConfig": _MEGATRON,
    "art.get_megatron_runtime_config": _MEGATRON,
    "art.init_megatron_runtime_config": _MEGATRON,
    "art.MetricDefinition": _PIPELINE,
    "art.PIPELINE_RL_DASHBOARD_DEFAULT_METRICS": _PIPELINE,
    "art.PIPELINE_RL_METRIC_DEFINITIONS": _PIPELINE,
    "art.PIPELINE_RL_SCORE_METRICS": _PIPELINE,
    "art.PipelineAutotuneConfig": _PIPELINE,
    "art.PipelineRuntimeConfig": _PIPELINE,
    "art.ServerlessBackend": _SERVERLESS,
    "art.ServerlessTrainResult": _SERVERLESS,
    "art.serverless": _SERVERLESS,
    "art.capture_yielded_trajectory": _CAPTURE,
    "art.current_trajectory": _CAPTURE,
    "art.no_capture": _CAPTURE,
    "art.trajectory": _CAPTURE,
    "art.trajectory_group": _CAPTURE,
    "art.yield_trajectory": _CAPTURE,
    "art.get_tokenizer": _TOKENS,
    "art.tensorize": _TOKENS,
    "art.tokenize": _TOKENS,
    "art.guided_completion": (
        "vLLM guided-decoding parameters for a tool call; send tool_choice to the endpoint (Journeyman "
        "constrains a forced tool call by grammar) instead"
    ),
    "art.mcp": (
        "ART's MCP scenario generation; use the journeyman-mcp package (`pip install journeyman-mcp`, "
        "the `mcp-rl` command) instead"
    ),
    # art.dev
    "art.dev.BackendModelConfig": _DEV,
    "art.dev.RolloutWeightUpdateMode": _DEV,
    "art.dev.ServerArgs": _DEV,
    "art.dev.TinkerArgs": _DEV,
    "art.dev.TinkerNativeArgs": _DEV,
    "art.dev.TinkerTrainingClientArgs": _DEV,
    "art.dev.VllmRuntimeArgs": _DEV,
    "art.dev.get_openai_server_config": _DEV,
    "art.dev.is_dedicated_mode": _DEV,
    "art.dev.is_external_vllm_mode": _DEV,
    "art.dev.validate_dedicated_config": _DEV,
    "art.dev.TrainSFTConfig": "ART's experimental SFT settings; use journeyman.SFTConfig instead",
    # art.gather, art.trajectories
    "art.gather.GatherContext": (
        "the progress context of ART's gather; use art.gather_trajectory_groups(pbar_desc=..., "
        "max_exceptions=..., after_each=...) instead"
    ),
    "art.gather.set_gather_context": "ART's gather internals; use art.gather_trajectory_groups(...) instead",
    "art.gather.wrap_group_awaitable": "ART's gather internals; use art.gather_trajectory_groups(...) instead",
    # art.rewards, art.utils
    "art.rewards.ruler": (
        "RULER on bare message lists; use art.rewards.ruler_score_group(group, judge_model) instead"
    ),
    "art.utils.format_message": "ART's message pretty-printer; use print(trajectory.messages()) instead",
    "art.utils.get_model_step": "use `await model.get_step()` instead",
    "art.utils.log_http_errors": "ART's HTTP error logger; use art.retry(...) or your own try/except instead",
    "art.utils.record_provenance": (
        "ART's W&B provenance record; Journeyman's run directory (state.json, history.jsonl) is the "
        "record: use `await model.history()` instead"
    ),
    "art.utils.s3": _S3,
    "art.utils.litellm": (
        "ART's LiteLLM-to-OpenAI choice converter; build the Trajectory from openai Choice objects (the "
        "endpoint returns them) instead"
    ),
    "art.utils.benchmarking": _BENCHMARKS,
    "art.utils.old_benchmarking": _BENCHMARKS,
    "art.utils.sft.create_sft_dataset_iterator": (
        "ART's per-batch SFT schedule; use art.utils.sft.train_sft_from_file(...) or "
        "model.train_sft(trajectories, journeyman.SFTConfig(epochs=..., lr_schedule=...)) instead"
    ),
    # keyword arguments and methods
    "art.TrainableModel(run_name=)": (
        "a run_name other than the model's name (ART keeps the run under run_name and serves it as name); "
        "Journeyman keeps and serves a run under one name, and a new name starts a new run: use "
        "name=<the run's name> instead"
    ),
    "art.utils.sft.train_sft_from_file(initial_step=)": (
        "SFT from a file in segments (initial_step/final_step); Journeyman runs the file as one SFT step "
        "of the run: split the file and call train_sft_from_file per part instead"
    ),
    "art.local.LocalBackend(gpu_cost_per_hour_usd=)": (
        "ART's GPU cost metric; compute it from the step times in `await model.history()` instead"
    ),
    "art.TrainSFTConfig(learning_rate=)": (
        "a per-batch list of learning rates; give one rate (journeyman.SFTConfig's lr_schedule shapes it) instead"
    ),
    "art.TrainSFTConfig(assistant_turns=)": (
        "'last' (train only the final assistant turn); Journeyman trains every assistant turn: keep only the "
        "conversation up to that turn in the trajectory instead"
    ),
}


class ArtFeatureNotSupported(JourneymanError, NotImplementedError):
    """An ART feature Journeyman does not have: the message names it and what to use instead."""

    def __init__(self, feature: str, instead: str | None = None) -> None:
        self.feature = feature
        advice = instead if instead is not None else NOT_SUPPORTED[feature]
        super().__init__(f"{feature} is not supported by journeyman.art: {advice}")


def refuse(feature: str) -> NoReturn:
    raise ArtFeatureNotSupported(feature)


def module_getattr(art_module: str, real_module: str) -> Callable[[str], Any]:
    """A module `__getattr__` for the `journeyman.art` module standing in for `art_module`: ART's
    names this module lacks raise ArtFeatureNotSupported; any other name is an AttributeError."""

    def __getattr__(name: str) -> Any:
        feature = f"{art_module}.{name}"
        if feature in NOT_SUPPORTED:
            refuse(feature)
        raise AttributeError(f"module {real_module!r} has no attribute {name!r}")

    return __getattr__


def refused_module(name: str) -> str | None:
    """The ART feature refused for an import of `journeyman.art...` module `name` (or None)."""
    art_name = name.removeprefix("journeyman.")
    parts = art_name.split(".")
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in NOT_SUPPORTED:
            return ".".join(parts[:i])
    return None


class _RefusedModules(importlib.abc.MetaPathFinder):
    """Imports of ART's module paths Journeyman lacks (`art.serverless.backend`, `art.mcp`, ...) under
    `journeyman.art` raise ArtFeatureNotSupported instead of a bare ModuleNotFoundError. Consulted
    last, so it never shadows a real module."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("journeyman.art.") and (feature := refused_module(fullname)):
            refuse(feature)
        return None


def install_refused_modules() -> None:
    if not any(isinstance(f, _RefusedModules) for f in sys.meta_path):
        sys.meta_path.append(_RefusedModules())


__all__ = [
    "NOT_SUPPORTED",
    "ArtFeatureNotSupported",
    "install_refused_modules",
    "module_getattr",
    "refuse",
]
