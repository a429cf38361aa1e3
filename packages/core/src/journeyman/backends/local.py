"""LocalBackend: serves and trains models in this process, with the run directory on local disk."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ValidationError

from journeyman._extras import require_backend
from journeyman.backends.store import TRAINING_SPLITS, Attempt, RunStore, write_atomic
from journeyman.backends.tracking import Trackers, check_report_to, open_trackers
from journeyman.client.operations import LOG, TRAIN, TRAIN_SFT
from journeyman.client.protocol import Evaluate, Inference, Progress, named_or_latest
from journeyman.client.wire import body_error
from journeyman.data.config import ModelConfig, SFTConfig, TrainConfig, TrainerConfig, TrainResult, check_name
from journeyman.data.live_types import (
    Decision,
    DecisionAction,
    EpisodeOutcome,
    LiveConfig,
    LiveStatus,
    OutcomeReceipt,
)
from journeyman.data.paths import RunLayout
from journeyman.data.provenance import staleness_metrics
from journeyman.data.trajectory_file import check_trajectories
from journeyman.data.types import History, Trajectory, TrajectoryGroup
from journeyman.errors import CheckpointError, InvalidFieldError, UnknownModelError
from journeyman.rollout.capture import CapturedCall
from journeyman.rollout.observe import GroupContext, emit

if TYPE_CHECKING:
    from journeyman.backends.live_training import LiveRun
    from journeyman.chat.formats import ChatFormat
    from journeyman.engine import Engine
    from journeyman.engine.vllm_server import VLLMConfig
    from journeyman.policy.lora import LoraPolicy
    from journeyman.serving.endpoint import Endpoint, ServerThread
    from journeyman.training.distributed import RankGroup
    from journeyman.training.sft import SFTTrainer
    from journeyman.training.trainer import GRPOTrainer

log = logging.getLogger("journeyman")


def _default_vllm() -> VLLMConfig:
    from journeyman.engine.vllm_server import VLLMConfig

    return VLLMConfig()


def _prefixed(split: str, metrics: Mapping[str, float]) -> dict[str, float]:
    return {f"{split}/{k}": v for k, v in metrics.items()}


def _check_groups(groups: Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
    groups = list(groups)
    if not groups:
        raise InvalidFieldError("groups", groups, "need at least one TrajectoryGroup")
    for i, g in enumerate(groups):
        if not isinstance(g, TrajectoryGroup):
            raise InvalidFieldError(f"groups[{i}]", g, "expected a TrajectoryGroup")
        if g.pending:
            raise InvalidFieldError(
                f"groups[{i}]", f"{len(g.pending)} pending rollouts", "await the group (or gather it) first"
            )
    return groups


def _vocab_size(s: _Service) -> int:
    """The token ids the served model can read: the rows of its input embedding."""
    return int(s.policy.model.get_input_embeddings().num_embeddings)


def _check_token_ids(items: Sequence[Trajectory | TrajectoryGroup], vocab: int, where: str) -> None:
    """Refuse, by path and value, a record's token id the model has no embedding row for (a forged
    or foreign record): checked before anything is written, so it never reaches a run file."""
    for i, item in enumerate(items):
        if isinstance(item, TrajectoryGroup):
            named = [(f"{where}[{i}].trajectories[{j}]", t) for j, t in enumerate(item.trajectories)]
        else:
            named = [(f"{where}[{i}]", item)]
        for path, t in named:
            histories: list[tuple[str, History]] = [(path, t)]
            histories += [
                (f"{path}.additional_histories[{k}]", h) for k, h in enumerate(t.additional_histories)
            ]
            for hpath, h in histories:
                for m, choice in enumerate(h.messages_and_choices):
                    raw = (getattr(choice, "model_extra", None) or {}).get("journeyman")
                    for name in ("prompt_token_ids", "token_ids"):
                        ids = raw.get(name) if isinstance(raw, dict) else getattr(raw, name, None)
                        if ids and not 0 <= min(ids) <= max(ids) < vocab:
                            k = next(k for k, x in enumerate(ids) if not 0 <= x < vocab)
                            raise InvalidFieldError(
                                f"{hpath}.messages_and_choices[{m}].journeyman.{name}[{k}]",
                                ids[k],
                                f"is not a token id of this model (its vocabulary is 0..{vocab - 1})",
                            )


def _result_of(done: dict[str, Any]) -> TrainResult:
    """A stored result back to a TrainResult: a metric stored as null (NaN in strict JSON) is NaN again."""
    metrics = {k: math.nan if v is None else v for k, v in (done.get("metrics") or {}).items()}
    return TrainResult.model_validate({**done, "metrics": metrics})


def _by(row: dict[str, Any], trained_by: str | None) -> dict[str, Any]:
    return row if trained_by is None else {**row, "trained_by": trained_by}


def _not_live(s: _Service, field: str, value: Any) -> None:
    """Refuse a step or a served step chosen past the gate while live training decides them."""
    if s.live is not None and s.live.config.enabled:
        raise InvalidFieldError(
            field,
            value,
            "live training decides what trains and what is served for this model: decide('promote', step=N) "
            "serves a step, or turn it off with LiveConfig(enabled=False)",
        )


def group_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Mean reward and the mean of every trajectory metric, over all trajectories of `groups`; each
    group metric's mean over the groups that have it, as `group_<name>`."""
    trajectories = [t for g in groups for t in g.trajectories]
    metrics: dict[str, float] = {
        "reward": sum(t.reward for t in trajectories) / max(1, len(trajectories)),
        "trajectories": float(len(trajectories)),
    }
    for key in sorted({k for t in trajectories for k in t.metrics}):
        vals = [float(t.metrics[key]) for t in trajectories if key in t.metrics]
        metrics[key] = sum(vals) / len(vals)
    for key in sorted({k for g in groups for k in g.metrics}):  # a group's own numbers: mean over groups
        vals = [float(g.metrics[key]) for g in groups if key in g.metrics]
        metrics[f"group_{key}"] = sum(vals) / len(vals)
    return metrics


@dataclass
class _Service:
    model: ModelConfig
    policy: LoraPolicy
    chat_format: ChatFormat
    engine: Engine
    endpoint: Endpoint
    server: ServerThread
    store: RunStore
    trainer: GRPOTrainer
    ranks: RankGroup | None  # the other data-parallel trainer ranks, when there are any
    trackers: Trackers  # where history rows are mirrored (W&B, ...); none by default
    # one step (or step switch) at a time per model: two concurrent train calls would both read
    # step N and both write checkpoint N+1
    step_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sft: SFTTrainer | None = None  # made on the first `train_sft`
    engine_counts: dict[str, int] = field(default_factory=dict)  # `Engine.counters()` at the last step
    live: LiveRun | None = None  # live training, once `LocalBackend.live` started it

    def engine_metrics(self) -> dict[str, float]:
        """What the engine counted since the last step (prefill tokens, KV reuse), as `engine_*`."""
        now = self.engine.counters()
        # a replaced engine replica counts from 0 again: its first step counts from there
        delta = {f"engine_{k}": float(max(0, v - self.engine_counts.get(k, 0))) for k, v in now.items()}
        self.engine_counts = now
        return delta

    def sft_trainer(self) -> SFTTrainer:
        from journeyman.training.sft import SFTTrainer

        if self.sft is None:
            self.sft = SFTTrainer(self.policy, self.chat_format)
        return self.sft

    def save(self, directory: Path) -> None:
        """The adapter and the optimizer state: what a checkpoint holds."""
        self.policy.save(directory)
        self.trainer.save_optimizer(directory)

    def restore(self, step: int) -> None:
        """Adapter and optimizer back to checkpoint `step` (0: the base model, a fresh optimizer), on
        every rank."""
        if step == 0:
            self.policy.reset()
            self.trainer.optimizer = None
        else:
            ckpt = self.store.checkpoint_dir(step)
            self.policy.load(ckpt)
            self.trainer.load_optimizer(ckpt)
        self.policy.step = step
        if self.ranks is not None:
            self.ranks.sync()

    def updated(self, step: int) -> None:
        """Label the weights as `step`, on the thread that just changed them (see `LoraPolicy.step`)."""
        self.policy.step = step


# What differs between a GRPO step and an SFT step (`LocalBackend._step` runs the rest of a step's
# life, the same for both): `run` updates the adapter from checkpoint `step` while the engine sleeps,
# answering (updated?, metrics); `settle`, once it woke, completes the metrics.


@dataclass
class _GRPOUpdate:
    split: ClassVar[str] = "train"  # where the step's groups and history row go
    groups: list[TrajectoryGroup]
    config: TrainConfig

    async def run(
        self, s: _Service, step: int, on_progress: Progress | None
    ) -> tuple[bool, dict[str, float]]:
        train = s.ranks.step if s.ranks is not None else s.trainer.step

        def update() -> tuple[bool, dict[str, float]]:
            updated, metrics = train(self.groups, self.config, on_progress)
            if updated:
                s.updated(step + 1)
            return updated, metrics

        # on the engine's thread, not a pool thread (`Engine.call`: one OpenMP team per process)
        updated, metrics = await s.engine.call(update)
        metrics.update(staleness_metrics(self.groups, step))
        if not updated:
            log.warning(
                "step %d skipped: none of the %d groups has rewards that differ (nothing to learn from)",
                step,
                len(self.groups),
            )
        return updated, metrics

    async def settle(self, s: _Service, metrics: dict[str, float]) -> dict[str, float]:
        return {**metrics, **s.endpoint.stats()}


@dataclass
class _SFTUpdate:
    split: ClassVar[str] = "sft"
    groups: list[TrajectoryGroup]
    config: SFTConfig
    rows: list[Any]  # `sft_rows`: tokenised before the step began
    data_metrics: dict[str, float]

    async def run(
        self, s: _Service, step: int, on_progress: Progress | None
    ) -> tuple[bool, dict[str, float]]:
        if s.ranks is not None and s.ranks.sharded:  # rank 0 alone holds 1/N of the base
            raise InvalidFieldError(
                "trainer.shard_base", True, "SFT runs on rank 0 alone and needs the whole base there"
            )

        def update() -> dict[str, float]:
            metrics = s.sft_trainer().train(self.rows, self.config, on_progress)
            s.updated(step + 1)
            return metrics

        try:
            return True, await s.engine.call(update)
        except BaseException:
            # earlier optimizer steps of the call changed the adapter: back to the last checkpoint
            await s.engine.call(s.restore, step)
            raise

    async def settle(self, s: _Service, metrics: dict[str, float]) -> dict[str, float]:
        if s.ranks is not None:  # SFT runs on rank 0; the other ranks take its weights
            await s.engine.call(s.ranks.sync)
        return {**self.data_metrics, **metrics}


_Update = _GRPOUpdate | _SFTUpdate


class LocalBackend:
    """Runs engine, endpoint and trainer for each registered model in this process (a `Backend`).

    `engine="torch"` (default) samples in process from the weights the trainer updates.
    `engine="vllm"` (or a `VLLMConfig`) samples through a vLLM server process that hot-loads each step's adapter.
    `trainer=TrainerConfig(world_size=N)` trains data-parallel on N ranks (`distributed.py`);
    `engine_replicas=N` serves through N torch engine worker processes (`engine/torch_process.py`).
    `engine_threads=T` runs the torch engine in worker processes of T CPU threads each (one, unless
    `engine_replicas` says more) that keep sampling while a step trains; the trainer keeps the other
    cores. Default None: the engine samples in this process and takes turns with the trainer.
    `dtype=None` (default) chooses by device: bfloat16 on a GPU with bf16, else float32 (`policy/precision.py`).
    `report_to=["wandb"]` mirrors every history row, each step's config and sample trajectories to
    Weights & Biases (`tracking.py`); off by default.
    """

    def __init__(
        self,
        path: str | Path = ".journeyman",
        *,
        engine: str | VLLMConfig = "torch",
        device: str | None = None,
        dtype: str | None = None,
        trainer: TrainerConfig | None = None,
        engine_replicas: int = 1,
        engine_threads: int | None = None,
        report_to: Sequence[str] = (),
    ) -> None:
        require_backend("LocalBackend")  # a light install fails here, saying what to install
        if isinstance(engine, str):
            if engine not in ("torch", "vllm"):
                raise InvalidFieldError(
                    "engine", engine, "supported engines: 'torch', 'vllm' (or a VLLMConfig)"
                )
            self.vllm_config: VLLMConfig | None = None
            self.engine_kind = engine
        else:
            self.vllm_config, self.engine_kind = engine, "vllm"
        if engine_replicas < 1:
            raise InvalidFieldError("engine_replicas", engine_replicas, "must be >= 1")
        if engine_replicas > 1 and self.engine_kind == "vllm":
            raise InvalidFieldError(
                "engine_replicas",
                engine_replicas,
                "is for the torch engine; vLLM runs its own replicas: VLLMConfig(data_parallel_size=N)",
            )
        if engine_threads is not None and (engine_threads < 1 or self.engine_kind == "vllm"):
            raise InvalidFieldError(
                "engine_threads",
                engine_threads,
                "must be >= 1, and is for the torch engine (vLLM has its own process)",
            )
        self.engine_replicas = engine_replicas
        self.engine_threads = engine_threads
        self.report_to = check_report_to(report_to)
        self.trainer_config = trainer or TrainerConfig()
        if self.trainer_config.rank != 0:
            raise InvalidFieldError(
                "trainer.rank",
                self.trainer_config.rank,
                "rank 0 runs the backend; start the other ranks with `python -m journeyman.training.distributed`",
            )
        if self.trainer_config.shard_base and self.engine_kind == "torch" and self._engine_in_process:
            # a sharded base holds 1/N of each layer: the in-process engine would have no whole
            # weights to sample from, and rank 0 must run every forward together with the others
            raise InvalidFieldError(
                "trainer.shard_base",
                True,
                "needs an engine with weights of its own: engine='vllm' (a VLLMConfig) or engine_replicas=N",
            )
        self.path = Path(path)
        self.device = device
        from journeyman.policy.lora import pick_device
        from journeyman.policy.precision import resolve_precision

        # None: by device (bf16 on a GPU that has it, else fp32); the resolved name is what the
        # policy, the trainer ranks, the engine replicas and vLLM's --dtype all get.
        self.dtype: str = resolve_precision(dtype, pick_device(device)).dtype
        self._services: dict[str, _Service] = {}
        self._registering = asyncio.Lock()
        # The key each model's own endpoint (127.0.0.1) demands: another local user cannot sample
        # from it or file captures; `inference()` hands it to this process's clients.
        self.api_key = secrets.token_urlsafe(24)

    # -- serving -----------------------------------------------------------------------------------

    async def register(self, model: ModelConfig) -> None:
        async with self._registering:  # two calls for one new name must not both load it
            served = self._services.get(model.name)
            if served is None:
                self._services[model.name] = await asyncio.to_thread(self._start, model)
                await self._resume_live(self._services[model.name])
                return
            for field in ("project", "base_model", "lora", "chat_format"):
                if getattr(served.model, field) != getattr(model, field):
                    raise InvalidFieldError(
                        f"model.{field}",
                        getattr(model, field),
                        f"the model {model.name!r} is served with {field}={getattr(served.model, field)!r}; "
                        "register another name for another model",
                    )
            served.model = model  # what may change: max_tokens and the like

    def _start(self, model: ModelConfig) -> _Service:
        from journeyman.policy.weights import resolve_base_model

        weights = resolve_base_model(model.base_model)  # a bad one is refused before torch loads
        self._plan_memory(model, weights)  # an impossible layout is refused before any weights load
        # The heavy modules load here, when a model is first served, not at `import journeyman`.
        from journeyman.chat.formats import ChatFormat
        from journeyman.policy.lora import LoraPolicy
        from journeyman.serving.endpoint import Endpoint, ServerThread, build_app
        from journeyman.training.trainer import GRPOTrainer

        try:
            policy = LoraPolicy(weights, model.lora, device=self.device, dtype=self.dtype)
        except ValueError as e:  # peft: a target module the model lacks
            raise InvalidFieldError(
                "model.lora.target_modules", model.lora.target_modules, str(e)[:300]
            ) from e
        chat_format = ChatFormat(policy.tokenizer, family=model.chat_format)
        store = RunStore(self.run_dir(model))
        step = store.resume_step()  # the committed step, or the newest good one if it is corrupt
        engine = self._make_engine(weights, policy, chat_format, step, store.checkpoint_dir(step))
        context = getattr(policy.model.config, "max_position_embeddings", None)
        if self.vllm_config is not None:
            context = min(context or self.vllm_config.max_model_len, self.vllm_config.max_model_len)
        endpoint = Endpoint(
            engine,
            chat_format,
            model.name,
            default_max_tokens=model.max_tokens,
            max_context=context,
            base_name=model.base_model,
        )
        trainer = GRPOTrainer(policy, chat_format)
        if step > 0:  # resume: the last checkpoint's adapter and optimizer state
            ckpt = store.checkpoint_dir(step)
            policy.load(ckpt)
            trainer.load_optimizer(ckpt)
            engine.step = policy.step = step  # the label the engine stamps on what it samples
        else:
            store.write_state(0, base_model=model.base_model)
        ranks = None
        if self.trainer_config.world_size > 1:
            from journeyman.training.distributed import RankGroup

            ranks = RankGroup(self.trainer_config, weights, model.lora, policy, trainer, self.dtype)
        from journeyman.serving.guard import DEFAULT_MAX_BODY_BYTES, Guard

        server = ServerThread(Guard(build_app(endpoint), self.api_key, DEFAULT_MAX_BODY_BYTES))
        trackers = open_trackers(self.report_to, model, store.root)
        return _Service(
            model, policy, chat_format, engine, endpoint, server, store, trainer, ranks, trackers=trackers
        )

    def _plan_memory(self, model: ModelConfig, weights: Path) -> None:
        """Log what each GPU will hold (`backends/memory_plan.py`, from the base's config.json and
        TrainConfig's defaults); on CUDA refuse, with ImpossiblePlanError naming what to change, a
        layout that cannot fit. On the CPU it is advice only: host memory is shared and paged."""
        import json

        from journeyman.backends.memory_plan import plan_for_backend

        try:
            plan = plan_for_backend(
                json.loads((weights / "config.json").read_text()),
                model,
                device=self.device,
                dtype=self.dtype,
                trainer=self.trainer_config,
                vllm=self.vllm_config or (None if self.engine_kind == "torch" else _default_vllm()),
                engine_replicas=self.engine_replicas,
            )
        except (InvalidFieldError, OSError, ValueError) as e:  # a model the plan does not model
            log.warning("%s: no memory plan (%s)", model.name, e)
            return
        log.info("%s: %s", model.name, plan.table())
        if plan.layout.device == "cuda":
            plan.check()
        elif not plan.fits:
            log.warning(
                "%s: the memory plan does not fit host memory; going on (on the CPU it is advice)", model.name
            )

    def _make_engine(
        self, weights: Path, policy: LoraPolicy, chat_format: ChatFormat, step: int, checkpoint: Path
    ) -> Engine:
        """The engine named by `engine=`, to serve `step` (a resumed run's; its adapter is at
        `checkpoint`); each kind's module is imported only when chosen."""
        if self.engine_kind == "vllm":
            from journeyman.engine.vllm_engine import VLLMEngine
            from journeyman.engine.vllm_server import VLLMConfig

            return VLLMEngine(
                weights,
                chat_format.stop_ids,
                self.vllm_config or VLLMConfig(),
                dtype=self.dtype,
                lora_rank=policy.lora.r,
            )
        if self._engine_in_process:  # samples from the very weights the trainer updates
            from journeyman.engine.torch_engine import TorchEngine

            return TorchEngine(policy, chat_format.stop_ids)
        from journeyman.engine.replicas import ReplicatedEngine
        from journeyman.engine.torch_process import replica_specs, start_replicas

        if self.engine_threads is not None and policy.device.type == "cpu":
            # the cores split, not shared: two OpenMP pools on the same cores spin against each other
            import torch

            torch.set_num_threads(max(1, (os.cpu_count() or 1) - self.engine_replicas * self.engine_threads))

        # N worker processes, each with its own weights, loading each step's checkpoint
        specs = replica_specs(
            weights,
            policy.lora,
            chat_format.stop_ids,
            self.engine_replicas,
            dtype=self.dtype,
            device=self.device,
            adapter=checkpoint if step > 0 else None,
            step=step,
            threads=self.engine_threads,
        )
        return ReplicatedEngine(start_replicas(specs))

    @property
    def _engine_in_process(self) -> bool:
        return self.engine_replicas == 1 and self.engine_threads is None

    def service(self, model: ModelConfig | str) -> _Service:
        """The in-process parts serving `model` (engine, policy, chat format): for tests and benches."""
        name = model if isinstance(model, str) else model.name
        try:
            return self._services[name]
        except KeyError:
            raise UnknownModelError(name, self.registered()) from None

    def registered(self) -> list[str]:
        """Names of the models this backend serves, in order of registration."""
        return list(self._services)

    # -- what `journeyman serve` needs besides the Backend (`ServedBackend`) -----------------------

    def registered_model(self, name: str) -> ModelConfig:
        if name not in self._services:
            raise UnknownModelError(name, self.registered())
        return self._services[name].model

    async def chat_completion(
        self,
        body: dict[str, Any],
        capture_id: str | None = None,
        response_id: str | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> dict[str, Any]:
        """Answered by the endpoint of the model `body` names (`name`, or `name@step`)."""
        name = body.get("model")
        served = self._services.get(name.split("@")[0]) if isinstance(name, str) else None
        if served is None:  # a base model's own name: the first model registered on it serves it
            served = next((s for s in self._services.values() if s.endpoint.base_name == name), None)
        if served is None:
            raise UnknownModelError(str(name), self.served_names())
        return await served.endpoint.chat_completion(body, capture_id, response_id, on_text)

    def served_names(self) -> list[str]:
        return list(dict.fromkeys(n for s in self._services.values() for n in s.endpoint.served_names()))

    def inference(self, model_name: str | None = None) -> Inference:
        model_name = named_or_latest(model_name, self.registered())
        return Inference(
            base_url=self.service(model_name).server.base_url, api_key=self.api_key, model=model_name
        )

    async def get_step(self, model: ModelConfig) -> int:
        return self.service(model).engine.step

    async def pop_captures(
        self, model: ModelConfig, capture_ids: Sequence[str]
    ) -> dict[str, list[CapturedCall]]:
        captures = self.service(model).endpoint.captures
        return {cid: captures.pop(cid) for cid in capture_ids}

    async def serve_step(self, model: ModelConfig, step: int) -> None:
        s = self.service(model)
        _not_live(s, "step", step)
        async with s.step_lock:
            await self._serve_step(s, step)

    @staticmethod
    async def _serve_step(s: _Service, step: int) -> None:
        s.store.check_step(step)
        if step == s.engine.step:
            return
        ckpt = s.store.checkpoint_dir(step)
        if step == 0:  # the base model: a zero adapter, saved where an engine process can load it
            await s.engine.call(s.policy.reset)
            await s.engine.call(s.policy.save, ckpt)
        elif not (ckpt / "adapter_model.safetensors").exists():
            raise InvalidFieldError("step", step, f"no checkpoint at {ckpt} (deleted?)")
        else:
            await asyncio.to_thread(s.store.verify_checkpoint, step)
            await s.engine.call(s.policy.load, ckpt)
        await s.engine.load_adapter(ckpt, step)

    # -- training and the run store ----------------------------------------------------------------

    # `train` and `train_sft` take their arguments as `Backend` declares them (made from the
    # operations table); `_train` and `_train_sft` check and prepare them, `_step` runs the step.

    async def _train(
        self,
        model: ModelConfig,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig | None,
        **step: Any,
    ) -> TrainResult:
        """One training step on `groups`; the endpoint serves the new step when this returns.

        The groups are written to `trajectories/train/<step>.attempt-<id>.jsonl` before the update,
        so a crash loses nothing, and become `<step>.jsonl` when the step commits (`<step>.failed-<id>`
        if the call raises); the adapter and optimizer go to `checkpoints/<step+1>/`, and `state.json`
        commits the step. A call repeating an `idempotency_key` whose step committed returns that
        step's result (after any number of restarts); one whose step was cut off trains it once,
        without writing its groups twice. A record's token id outside the model's vocabulary is
        refused (InvalidFieldError) before anything is written. `on_progress(done, total)` reports
        micro-batches; `trained_by` (who asked: an API token's name) goes into the history row.
        """
        s = self.service(model)
        groups = _check_groups(groups)
        _check_token_ids(groups, _vocab_size(s), "groups")
        return await self._step(s, model, _GRPOUpdate(groups, config or TrainConfig()), **step)

    async def _train_sft(
        self,
        model: ModelConfig,
        trajectories: Iterable[Trajectory | TrajectoryGroup],
        config: SFTConfig | None,
        **step: Any,
    ) -> TrainResult:
        """Supervised fine-tuning on `trajectories` (`sft.py`): one step of the run, like `train`.

        Written to `trajectories/sft/<step>.attempt-<id>.jsonl` (one group per line) before the
        update and kept as `<step>.jsonl` when the step commits; the adapter goes to
        `checkpoints/<step+1>/` (with the GRPO optimizer's state untouched), the history gets one
        `sft/...` row (with `trained_by`, if given), and the endpoint serves the new step when this
        returns. Idempotency keys and token-id checks work as for `train`. `on_progress(done, total)`
        reports optimizer steps.
        """
        config = config or SFTConfig()
        s = self.service(model)
        items, flat = check_trajectories(trajectories)
        _check_token_ids(items, _vocab_size(s), "trajectories")
        from journeyman.training.sft import sft_rows

        # tokenised before anything is written: a trajectory with nothing to train is refused by name
        rows, data_metrics = await asyncio.to_thread(
            sft_rows, flat, s.chat_format, config.max_seq_len, config.long_rows
        )
        groups = [g if isinstance(g, TrajectoryGroup) else TrajectoryGroup([g]) for g in items]
        return await self._step(s, model, _SFTUpdate(groups, config, rows, data_metrics), **step)

    train = TRAIN.implemented_by(_train)
    train_sft = TRAIN_SFT.implemented_by(_train_sft)

    async def _step(
        self,
        s: _Service,
        model: ModelConfig,
        update: _Update,
        *,
        idempotency_key: str | None,
        on_progress: Progress | None,
        trained_by: str | None,
        parent: int | None = None,
    ) -> TrainResult:
        """A step's life, whatever trains it: the idempotency key's earlier result if it has one;
        else the groups written as an attempt, the update with the engine asleep, then the checkpoint
        committed and served, and the history row; the attempt marked failed if anything raises.

        With `parent` (live training: the promoted step, which the engine serves) the step trains
        from it and its checkpoint (the latest + 1) is a candidate: written, not served."""
        if idempotency_key is not None:
            check_name("idempotency_key", idempotency_key)
        async with s.step_lock:
            begun = self._begin(s, model, update.groups, update.split, idempotency_key, parent)
            if isinstance(begun, TrainResult):
                return begun
            attempt = begun
            try:
                s.trackers.config({update.split: update.config.model_dump(mode="json")})
                rollout_metrics = s.engine_metrics()  # the rollouts this step trains on
                # The GPU handoff (engine/handoff.py): the engine sleeps, the trainer steps and gives
                # its cached blocks back, and the engine wakes in stages with the new adapter loaded
                # between its weights and its KV cache (`_checkpoint`'s load_adapter); `wake` finishes
                # a wake that no adapter began (a skipped step, an error).
                await s.engine.sleep()
                try:
                    try:
                        updated, metrics = await update.run(s, attempt.step, on_progress)
                    finally:
                        if self.engine_kind == "vllm":  # another process wants the memory back
                            from journeyman.engine.handoff import return_cached_memory

                            await s.engine.call(return_cached_memory)
                    metrics = {**await update.settle(s, metrics), **rollout_metrics}
                    if updated:
                        return await self._checkpoint(
                            s, model, attempt, metrics, update.groups, idempotency_key, trained_by, parent
                        )
                    result = TrainResult(step=attempt.step, metrics=metrics, skipped=True)  # nothing learned
                    self._commit(s, model, attempt.step, attempt, idempotency_key, result)
                    row = {"step": attempt.step, "split": update.split, "skipped": True}
                    self._record(
                        s, _by({**row, **_prefixed(update.split, metrics)}, trained_by), update.groups
                    )
                    return result
                finally:
                    await s.engine.wake()
            except BaseException:
                s.store.fail_attempt(attempt)  # a no-op once the step committed
                raise

    def _begin(
        self,
        s: _Service,
        model: ModelConfig,
        groups: list[TrajectoryGroup],
        split: str,
        key: str | None,
        parent: int | None = None,
    ) -> Attempt | TrainResult:
        """The attempt of a new update (its step, its groups written and announced); or the result
        of the committed call with idempotency key `key`."""
        if key is not None and (done := s.store.request_result(key)) is not None:
            return _result_of(done)
        step = s.store.latest_step()
        if parent is None:
            _not_live(s, "groups", f"{len(groups)} groups")
        if parent is not None and s.engine.step != parent:
            raise InvalidFieldError("parent", parent, f"is not the step served (step {s.engine.step} is)")
        if parent is None and s.engine.step != step:
            why = (
                "live training serves it (docs/live.md)"
                if s.live is not None
                else f"serve_step({step}) before training"
            )
            raise InvalidFieldError("step", s.engine.step, f"an older checkpoint is served: {why}")
        attempt = s.store.begin_attempt(groups, split, step, key)
        emit(
            groups,
            GroupContext(project=model.project, model=model.name, step=step, split=split, source="train"),
        )
        return attempt

    async def _checkpoint(
        self,
        s: _Service,
        model: ModelConfig,
        attempt: Attempt,
        metrics: dict[str, float],
        groups: list[TrajectoryGroup],
        key: str | None,
        trained_by: str | None,
        parent: int | None = None,
    ) -> TrainResult:
        """Commit the updated adapter as step + 1, serve it (unless it is a live candidate: then the
        parent is served again), and record the step's history row, with its parent."""
        step, split = attempt.step, attempt.split
        new_step = step + 1
        try:
            ckpt = await s.engine.call(s.store.write_checkpoint, new_step, s.save)
        except CheckpointError:
            # Nothing was committed: the step is undone in memory too, so what trains and serves
            # next is the last good step, not weights that exist nowhere on disk.
            await s.engine.call(s.restore, step if parent is None else parent)
            raise
        t0 = time.perf_counter()
        if parent is None:
            await s.engine.load_adapter(ckpt, new_step)
        else:
            await self._serve_trained(s, parent)
        metrics["adapter_load_seconds"] = time.perf_counter() - t0
        result = TrainResult(step=new_step, metrics=metrics)
        self._commit(s, model, new_step, attempt, key, result)
        row = {"step": step, "split": split, "parent": step if parent is None else parent}
        if parent is not None:
            row["candidate"] = new_step
        self._record(s, _by({**row, **_prefixed(split, metrics)}, trained_by), groups)
        return result

    async def _serve_trained(self, s: _Service, step: int) -> None:
        """Serve `step` with its adapter and optimizer state in the policy, so the next step trains
        from it (a live candidate's parent, a promoted or rolled-back step)."""
        await s.engine.call(s.restore, step)
        ckpt = s.store.checkpoint_dir(step)
        if step == 0:  # the base model: a zero adapter, saved where an engine process can load it
            await s.engine.call(s.policy.save, ckpt)
        await s.engine.load_adapter(ckpt, step)

    @staticmethod
    def _commit(
        s: _Service, model: ModelConfig, step: int, attempt: Attempt, key: str | None, result: TrainResult
    ) -> None:
        """state.json names `step`: the attempt's groups become `<step>.jsonl`, `key` answers `result`."""
        request = (key, result.model_dump()) if key is not None else None
        s.store.write_state(step, request=request, attempt=attempt, base_model=model.base_model)

    @staticmethod
    def _record(s: _Service, row: dict[str, Any], groups: Sequence[TrajectoryGroup] = ()) -> None:
        """One history row, to history.jsonl and then to the trackers (the same row, to the key:
        strict JSON, a NaN metric as None)."""
        written = s.store.append_history({"recorded_at": time.time(), **row})
        s.trackers.log(written, groups)

    async def _log(
        self,
        model: ModelConfig,
        groups: Sequence[TrajectoryGroup] | None,
        split: str,
        metrics: Mapping[str, float] | None,
    ) -> dict[str, float]:
        """Record groups (e.g. an evaluation) and/or extra metrics without training: one history row.

        Groups go to `trajectories/<split>/<step>.jsonl` at once; a training split's files hold only
        what trained, so `split="train"` (or "sft") takes metrics only."""
        s = self.service(model)
        if groups is None and not metrics:
            raise InvalidFieldError("groups", None, "log needs groups, metrics, or both")
        step = s.engine.step
        out: dict[str, float] = {}
        if groups is not None:
            check_name("split", split)
            if split in TRAINING_SPLITS:
                raise InvalidFieldError(
                    "split", split, "holds the groups that trained; log evaluated groups under another split"
                )
            groups = _check_groups(groups)
            _check_token_ids(groups, _vocab_size(s), "groups")
            s.store.write_groups(groups, split, step)
            emit(
                groups,
                GroupContext(project=model.project, model=model.name, step=step, split=split, source="log"),
            )
            out = group_metrics(groups)
        out.update(metrics or {})
        self._record(s, {"step": step, "split": split, **_prefixed(split, out)}, groups or ())
        return out

    log = LOG.implemented_by(_log)  # with the arguments' defaults as `Backend` declares them

    # -- live training (`LiveBackend`, backends/live_training.py, docs/live.md) -------------------------------

    async def live(
        self, model: ModelConfig, config: LiveConfig | None = None, *, evaluate: Evaluate | None = None
    ) -> LiveStatus:
        """Start (or reconfigure) live training of `model` (see `LiveBackend.live`); the settings are
        kept in the run directory, so a restarted server goes on (an `evaluate` function is not kept:
        its gate falls back to the canary, or to a person)."""
        s = self.service(model)
        config = config or LiveConfig()
        if not s.engine.serves_other_steps and (config.gate.canary_share > 0 or evaluate is not None):
            raise InvalidFieldError(
                "config.gate.canary_share",
                config.gate.canary_share,
                "this engine serves one step at a time: a candidate cannot be "
                "sampled beside the promoted step; set canary_share=0, no evaluate, and decide by command",
            )
        live_dir = self.run_dir(model) / "live"
        live_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(live_dir / "config.json", config.model_dump_json(indent=1))
        return await self._start_live(s, config, evaluate)

    async def _start_live(self, s: _Service, config: LiveConfig, evaluate: Evaluate | None) -> LiveStatus:
        from journeyman.backends.live_training import LiveRun, LiveServices

        old = s.live
        if old is not None:
            await old.close()  # a step under way finishes first
        model = s.model

        async def train_from(
            groups: list[TrajectoryGroup], config: TrainConfig, key: str, parent: int
        ) -> TrainResult:
            update = _GRPOUpdate(_check_groups(groups), config)
            return await self._step(
                s, model, update, idempotency_key=key, on_progress=None, trained_by="live", parent=parent
            )

        async def serve(step: int) -> None:
            async with s.step_lock:
                s.store.check_step(step)
                await self._serve_trained(s, step)

        def set_route(route: Callable[[str | None], int | None] | None) -> None:
            s.endpoint.route = route

        services = LiveServices(
            name=model.name,
            captures=s.endpoint.captures,
            side_steps=s.endpoint.side_steps,
            set_route=set_route,
            train_from=train_from,
            serve=serve,
            checkpoint_dir=s.store.checkpoint_dir,
            latest_step=s.store.latest_step,
            record=lambda row: self._record(s, row),
        )
        s.live = LiveRun(self.run_dir(model), services, config, evaluate)
        if old is not None:  # reconfigured: the counts go on (outcomes are counted from the journal)
            s.live.counts.update({k: v for k, v in old.counts.items() if k != "outcomes"})
        await s.live.start()
        return s.live.status()

    async def _resume_live(self, s: _Service) -> None:
        path = self.run_dir(s.model) / "live" / "config.json"
        if path.exists():
            await self._start_live(s, LiveConfig.model_validate_json(path.read_text()), None)

    def _live(self, model: ModelConfig) -> LiveRun:
        s = self.service(model)
        if s.live is None:
            raise InvalidFieldError("model", model.name, "live training is off: start it with `live` first")
        return s.live

    async def report_outcome(
        self,
        model: ModelConfig,
        episode_id: str,
        reward: float,
        metrics: Mapping[str, float] | None = None,
        group: str | None = None,
    ) -> OutcomeReceipt:
        run = self._live(model)
        try:
            outcome = EpisodeOutcome(
                episode_id=episode_id, reward=reward, metrics=dict(metrics or {}), group=group
            )
        except ValidationError as e:
            raise body_error(e) from e
        return run.report(outcome)

    async def live_status(self, model: ModelConfig) -> LiveStatus:
        return self._live(model).status()

    async def decide(
        self,
        model: ModelConfig,
        action: DecisionAction,
        step: int | None = None,
        reason: str = "",
        *,
        trained_by: str | None = None,
    ) -> Decision:
        if action not in ("promote", "reject", "rollback"):
            raise InvalidFieldError("action", action, "one of promote, reject, rollback")
        return await self._live(model).decide(action, step, reason or "by command", trained_by or "command")

    async def history(self, model: ModelConfig) -> list[dict[str, Any]]:
        return self.service(model).store.history()

    async def delete_checkpoints(
        self, model: ModelConfig, best_checkpoint_metric: str = "val/reward"
    ) -> list[int]:
        return self.service(model).store.delete_checkpoints(best_checkpoint_metric)

    def run_dir(self, model: ModelConfig) -> Path:
        return RunLayout.of(self.path, model.project, model.name).root

    async def push_run(
        self,
        model: ModelConfig,
        url: str,
        *,
        delete: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> int:
        """Copy `model`'s run (checkpoints, trajectories, history, state) to object storage at `url`
        (any fsspec URL: s3://bucket/prefix, gs://..., a path); returns the files copied. Needs
        `pip install 'journeyman[storage]'`."""
        from journeyman.data.object_store import push_dir

        return await asyncio.to_thread(
            push_dir, self.run_dir(model), url, delete=delete, storage_options=storage_options
        )

    async def pull_run(
        self,
        model: ModelConfig,
        url: str,
        *,
        delete: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> int:
        """Copy a run pushed to `url` into `model`'s run directory, before `register`: registering
        then resumes at its last step. Refused while the model is registered (its run is live)."""
        from journeyman.data.object_store import pull_dir

        if model.name in self._services:
            raise InvalidFieldError(
                "model", model.name, "is registered: pull its run before `register`, which resumes from it"
            )
        return await asyncio.to_thread(
            pull_dir, url, self.run_dir(model), delete=delete, storage_options=storage_options
        )

    def check_step(self, model: ModelConfig, step: int) -> None:
        """Refuse, naming it, a step `model`'s run on disk lacks: read from its run files, so a caller
        can check before `register` loads the model (which `serve_step` would check after)."""
        RunStore(self.run_dir(model)).check_step(step)

    def close(self) -> None:
        for s in self._services.values():
            if s.live is not None:
                s.live.stop()
            s.server.stop()
            s.engine.close()
            if s.ranks is not None:
                s.ranks.close()
            s.trackers.close()
        self._services.clear()

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
