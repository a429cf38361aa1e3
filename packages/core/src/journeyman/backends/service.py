"""What serves one registered model, and how it is assembled: the first room of `LocalBackend`.

`ServingSettings` holds the backend-wide choices (engine kind, device, dtype, trainer layout,
replicas, trackers), checked once when the backend is made. `assemble` builds a `ServedModel` from
them for one `ModelConfig`, in this order: the base's weights (`BaseWeights`), the memory plan
(refused before anything loads when it cannot fit a GPU), the policy (base + LoRA adapter), the
chat format, the run store (resuming at its last step), the engine, the OpenAI endpoint and its
HTTP thread, the trainer and, when there are any, the other trainer ranks.

A `ServedModel` is what the other rooms work on: a training step's life (`train_step.py`) and live
training (`live_training.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from journeyman.backends.store import RunStore
from journeyman.backends.tracking import Trackers, check_report_to, open_trackers
from journeyman.data.budget import Meter
from journeyman.data.config import ModelConfig, TrainerConfig
from journeyman.data.live_types import LiveConfig
from journeyman.data.types import TrajectoryGroup
from journeyman.errors import InvalidFieldError

if TYPE_CHECKING:
    from journeyman.chat.formats import ChatFormat
    from journeyman.engine import Engine
    from journeyman.engine.vllm_server import VLLMConfig
    from journeyman.policy.base_weights import BaseWeights
    from journeyman.policy.lora import LoraPolicy
    from journeyman.rewards.teacher import Scorer
    from journeyman.serving.endpoint import Endpoint, ServerThread
    from journeyman.training.distributed import RankGroup
    from journeyman.training.sft import SFTTrainer
    from journeyman.training.trainer import GRPOTrainer

log = logging.getLogger("journeyman")

E = TypeVar("E", bound="Engine")


class Live(Protocol):
    """What a served model asks of its live training (`live_training.LiveRun`, which imports this
    module: typed here by what is used, so the two modules form no cycle)."""

    config: LiveConfig

    def stop(self) -> None: ...


@dataclass
class ServedModel:
    """The in-process parts serving one model: its base, policy, engine, endpoint, trainer, run."""

    model: ModelConfig
    base: BaseWeights
    policy: LoraPolicy
    chat_format: ChatFormat
    engine: Engine
    endpoint: Endpoint
    server: ServerThread
    store: RunStore
    trainer: GRPOTrainer
    ranks: RankGroup | None  # the other data-parallel trainer ranks, when there are any
    trackers: Trackers  # where history rows are mirrored (W&B, ...); none by default
    returns_memory: bool = False  # the engine is another process that wants the trainer's cached memory back
    # one step (or step switch) at a time per model: two concurrent train calls would both read
    # step N and both write checkpoint N+1
    step_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sft: SFTTrainer | None = None  # made on the first `train_sft`
    engine_counts: dict[str, int] = field(default_factory=dict)  # `Engine.counters()` at the last step
    live: Live | None = None  # live training, once `LocalBackend.live` started it (a `LiveRun`)
    last_train_row: dict[str, Any] | None = None  # the newest training step's history row (`/metrics`)
    meter: Meter | None = None  # what the run spent against its budget (`data/budget.py`)
    # the backend's other models by name (a distillation teacher may be one), set by the backend
    peers: Callable[[str], ServedModel] | None = None
    teachers: dict[str, Scorer] = field(default_factory=dict)  # distillation teachers, resolved once

    @property
    def vocab_size(self) -> int:
        """The token ids the served model can read: the rows of its input embedding."""
        return int(self.policy.model.get_input_embeddings().num_embeddings)

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

    def refuse_while_live(self, field: str, value: Any) -> None:
        """Refuse a step or a served step chosen past the gate while live training decides them."""
        if self.live is not None and self.live.config.enabled:
            raise InvalidFieldError(
                field,
                value,
                "live training decides what trains and what is served for this model: decide('promote', "
                "step=N) serves a step, or turn it off with LiveConfig(enabled=False)",
            )

    async def serve_checkpoint(self, step: int) -> None:
        """Serve checkpoint `step` (0: the base model) for sampling only; the trainer's optimizer
        state stays where it was. Hold `step_lock`."""
        self.store.check_step(step)
        if step == self.engine.step:
            return
        ckpt = self.store.checkpoint_dir(step)
        if step == 0:  # the base model: a zero adapter, saved where an engine process can load it
            await self.engine.call(self.policy.reset)
            await self.engine.call(self.policy.save, ckpt)
        elif not (ckpt / "adapter_model.safetensors").exists():
            raise InvalidFieldError("step", step, f"no checkpoint at {ckpt} (deleted?)")
        else:
            await asyncio.to_thread(self.store.verify_checkpoint, step)
            await self.engine.call(self.policy.load, ckpt)
        await self.engine.load_adapter(ckpt, step)

    async def serve_trained(self, step: int) -> None:
        """Serve `step` with its adapter and optimizer state in the policy, so the next step trains
        from it (a live candidate's parent, a promoted or rolled-back step)."""
        await self.engine.call(self.restore, step)
        ckpt = self.store.checkpoint_dir(step)
        if step == 0:  # the base model: a zero adapter, saved where an engine process can load it
            await self.engine.call(self.policy.save, ckpt)
        await self.engine.load_adapter(ckpt, step)

    def record(self, row: dict[str, Any], groups: Sequence[TrajectoryGroup] = ()) -> None:
        """One history row, to history.jsonl and then to the trackers (the same row, to the key:
        strict JSON, a NaN metric as None)."""
        written = self.store.append_history({"recorded_at": time.time(), **row})
        if written.get("split") == "train":
            self.last_train_row = written
        self.trackers.log(written, groups)

    def close(self) -> None:
        if self.meter is not None:
            self.meter.flush()
        if self.live is not None:
            self.live.stop()
        self.server.stop()
        self.engine.close()
        if self.ranks is not None:
            self.ranks.close()
        self.trackers.close()


def _default_vllm() -> VLLMConfig:
    from journeyman.engine.vllm_server import VLLMConfig

    return VLLMConfig()


@dataclass
class ServingSettings:
    """How a backend serves and trains every model it registers (`LocalBackend`'s arguments, checked)."""

    engine_kind: str  # "torch" | "vllm"
    vllm_config: VLLMConfig | None
    device: str | None
    dtype: str  # resolved: what the policy, the trainer ranks, the engine replicas and vLLM all get
    trainer: TrainerConfig
    engine_replicas: int
    engine_threads: int | None
    report_to: list[str]

    @classmethod
    def check(
        cls,
        *,
        engine: str | VLLMConfig,
        device: str | None,
        dtype: str | None,
        trainer: TrainerConfig | None,
        engine_replicas: int,
        engine_threads: int | None,
        report_to: Sequence[str],
    ) -> ServingSettings:
        """The settings, or InvalidFieldError naming the argument that cannot work and why."""
        if isinstance(engine, str):
            if engine not in ("torch", "vllm"):
                raise InvalidFieldError(
                    "engine", engine, "supported engines: 'torch', 'vllm' (or a VLLMConfig)"
                )
            vllm_config, engine_kind = None, engine
        else:
            vllm_config, engine_kind = engine, "vllm"
        if engine_replicas < 1:
            raise InvalidFieldError("engine_replicas", engine_replicas, "must be >= 1")
        if engine_replicas > 1 and engine_kind == "vllm":
            raise InvalidFieldError(
                "engine_replicas",
                engine_replicas,
                "is for the torch engine; vLLM runs its own replicas: VLLMConfig(data_parallel_size=N)",
            )
        if engine_threads is not None and (engine_threads < 1 or engine_kind == "vllm"):
            raise InvalidFieldError(
                "engine_threads",
                engine_threads,
                "must be >= 1, and is for the torch engine (vLLM has its own process)",
            )
        trainer = trainer or TrainerConfig()
        if trainer.rank != 0:
            raise InvalidFieldError(
                "trainer.rank",
                trainer.rank,
                "rank 0 runs the backend; start the other ranks with `python -m journeyman.training.distributed`",
            )
        in_process = engine_replicas == 1 and engine_threads is None
        if trainer.shard_base and engine_kind == "torch" and in_process:
            # a sharded base holds 1/N of each layer: the in-process engine would have no whole
            # weights to sample from, and rank 0 must run every forward together with the others
            raise InvalidFieldError(
                "trainer.shard_base",
                True,
                "needs an engine with weights of its own: engine='vllm' (a VLLMConfig) or engine_replicas=N",
            )
        from journeyman.policy.base_weights import pick_device
        from journeyman.policy.precision import resolve_precision

        # None: by device (bf16 on a GPU that has it, else fp32)
        resolved = resolve_precision(dtype, pick_device(device)).dtype
        return cls(
            engine_kind,
            vllm_config,
            device,
            resolved,
            trainer,
            engine_replicas,
            engine_threads,
            check_report_to(report_to),
        )

    @property
    def engine_in_process(self) -> bool:
        """The torch engine samples in this process, from the very weights the trainer updates."""
        return self.engine_kind == "torch" and self.engine_replicas == 1 and self.engine_threads is None


class BaseRegistry:
    """A backend's bases: one `BaseWeights` per (base directory, device, dtype), which every model
    registered on it with that base shares (`policy/base_weights.py`), and the engines on each,
    which the next model on that base joins (`TorchEngine(share_with=)`, `VLLMEngine(share_with=)`)."""

    def __init__(self) -> None:
        self._bases: dict[tuple[str, str | None, str], BaseWeights] = {}
        self._engines: dict[int, list[Engine]] = {}  # by id of the BaseWeights
        self._lock = threading.Lock()  # two models registering at once on one new base

    def engine_on(self, base: BaseWeights, kind: type[E]) -> E | None:
        """An open engine of `kind` sampling from `base`, for another model to join."""
        with self._lock:
            return next((e for e in self._engines.get(id(base), []) if isinstance(e, kind) and e.alive), None)

    def add_engine(self, base: BaseWeights, engine: Engine) -> None:
        with self._lock:
            engines = [e for e in self._engines.get(id(base), []) if e.alive]
            self._engines[id(base)] = [*engines, engine]

    def get(self, path: Path, device: str | None, dtype: str) -> BaseWeights:
        from journeyman.policy.base_weights import BaseWeights

        key = (str(Path(path).resolve()), device, dtype)
        with self._lock:
            if key not in self._bases:
                self._bases[key] = BaseWeights(path, device, dtype)
            return self._bases[key]


def assemble(
    settings: ServingSettings,
    model: ModelConfig,
    run_dir: Path,
    api_key: str,
    bases: BaseRegistry | None = None,
) -> ServedModel:
    """Everything that serves `model`, resumed at its run's last step; its endpoint listens on
    127.0.0.1 and demands `api_key`. Blocking (loads weights): run it on a worker thread. With
    `bases` (the backend's), the model shares the weights of those already served on its base."""
    from journeyman.policy.weights import resolve_base_model

    path = resolve_base_model(model.base_model)  # a bad one is refused before torch loads
    # The heavy modules load here, when a model is first served, not at `import journeyman`.
    bases = bases or BaseRegistry()
    base = bases.get(path, settings.device, settings.dtype)
    # an impossible layout is refused before any weights load
    check_memory_plan(settings, model, base, others=len(base.users()))
    from journeyman.chat.formats import ChatFormat
    from journeyman.policy.lora import LoraPolicy
    from journeyman.serving.endpoint import Endpoint, ServerThread, build_app
    from journeyman.serving.guard import DEFAULT_MAX_BODY_BYTES, Guard
    from journeyman.serving.model_limits import ModelLimits
    from journeyman.training.trainer import GRPOTrainer

    try:
        policy = LoraPolicy(base, model.lora)
    except ValueError as e:  # peft: a target module the model lacks
        raise InvalidFieldError("model.lora.target_modules", model.lora.target_modules, str(e)[:300]) from e
    chat_format = ChatFormat(policy.tokenizer, family=model.chat_format)
    store = RunStore(run_dir)
    meter = Meter(model.name, store.layout.spend, model.budget)
    step = store.resume_step()  # the committed step, or the newest good one if it is corrupt
    engine = _make_engine(settings, bases, base, policy, chat_format, step, store.checkpoint_dir(step))
    context = getattr(policy.model.config, "max_position_embeddings", None)
    if settings.vllm_config is not None:
        context = min(context or settings.vllm_config.max_model_len, settings.vllm_config.max_model_len)
    endpoint = Endpoint(
        engine,
        chat_format,
        model.name,
        default_max_tokens=model.max_tokens,
        max_context=context,
        base_name=model.base_model,
        limits=ModelLimits.of(model),  # so one model cannot fill an engine the others share
        meter=meter,
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
    if settings.trainer.world_size > 1:
        from journeyman.training.distributed import RankGroup

        ranks = RankGroup(settings.trainer, path, model.lora, policy, trainer, settings.dtype)
    server = ServerThread(Guard(build_app(endpoint), api_key, DEFAULT_MAX_BODY_BYTES))
    return ServedModel(
        model,
        base,
        policy,
        chat_format,
        engine,
        endpoint,
        server,
        store,
        trainer,
        ranks,
        trackers=open_trackers(settings.report_to, model, store.root),
        returns_memory=settings.engine_kind == "vllm",
        meter=meter,
    )


def check_memory_plan(
    settings: ServingSettings, model: ModelConfig, base: BaseWeights, others: int = 0
) -> None:
    """Log what each GPU will hold (`backends/memory_plan.py`, from the base's config.json and
    TrainConfig's defaults), counting the `others` models already served on the base with this
    one; on CUDA refuse, with ImpossiblePlanError naming what to change, a layout that cannot fit.
    On the CPU it is advice only: host memory is shared and paged. A vLLM server that several
    models share stays awake through their steps (`engine/vllm_engine.py`): planned so."""
    from journeyman.backends.memory_plan import plan_for_backend

    vllm = settings.vllm_config or (None if settings.engine_kind == "torch" else _default_vllm())
    if vllm is not None and others:
        vllm = vllm.model_copy(update={"sleep_mode": False})
    try:
        plan = plan_for_backend(
            base.config,
            model,
            device=settings.device,
            dtype=settings.dtype,
            trainer=settings.trainer,
            vllm=vllm,
            engine_replicas=settings.engine_replicas,
            models=others + 1,
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
    settings: ServingSettings,
    bases: BaseRegistry,
    base: BaseWeights,
    policy: LoraPolicy,
    chat_format: ChatFormat,
    step: int,
    checkpoint: Path,
) -> Engine:
    """The engine named by `engine=`, to serve `step` (a resumed run's; its adapter is at
    `checkpoint`); each kind's module is imported only when chosen. In process, a model on a base
    already served joins that base's engine."""
    if settings.engine_kind == "vllm":
        from journeyman.engine.vllm_engine import VLLMEngine

        engine = VLLMEngine(
            base.path,
            chat_format.stop_ids,
            settings.vllm_config or _default_vllm(),
            dtype=settings.dtype,
            lora_rank=policy.lora.r,
            share_with=bases.engine_on(base, VLLMEngine),
        )
        bases.add_engine(base, engine)
        return engine
    if settings.engine_in_process:  # samples from the very weights the trainer updates
        from journeyman.engine.torch_engine import TorchEngine

        engine = TorchEngine(policy, chat_format.stop_ids, share_with=bases.engine_on(base, TorchEngine))
        bases.add_engine(base, engine)
        return engine
    from journeyman.engine.replicas import ReplicatedEngine
    from journeyman.engine.torch_process import replica_specs, start_replicas

    if settings.engine_threads is not None and policy.device.type == "cpu":
        # the cores split, not shared: two OpenMP pools on the same cores spin against each other
        import torch

        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) - settings.engine_replicas * settings.engine_threads)
        )

    # N worker processes, each with its own weights, loading each step's checkpoint
    specs = replica_specs(
        base.path,
        policy.lora,
        chat_format.stop_ids,
        settings.engine_replicas,
        dtype=settings.dtype,
        device=settings.device,
        adapter=checkpoint if step > 0 else None,
        step=step,
        threads=settings.engine_threads,
    )
    return ReplicatedEngine(start_replicas(specs))
