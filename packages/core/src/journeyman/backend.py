"""LocalBackend: serves and trains models in this process, with the run directory on local disk."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .adapter import LoraPolicy
from .capture import CapturedCall
from .chat_format import ChatFormat
from .endpoint import Endpoint, ServerThread, build_app
from .engine import Engine
from .engine.vllm_server import VLLMConfig
from .errors import InvalidFieldError
from .model import TrainableModel
from .observe import GroupContext, emit
from .store import RunStore
from .train import GRPOTrainer, TrainConfig, TrainResult
from .types import TrajectoryGroup
from .weights import resolve_base_model

log = logging.getLogger("journeyman")


def _prefixed(split: str, metrics: dict[str, float]) -> dict[str, float]:
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


# name -> base URL of every model served in this process (the offline `judge="local"` uses it).
_LOCAL_ENDPOINTS: dict[str, str] = {}


def local_endpoint(name: str | None = None) -> tuple[str, str]:
    """(model name, base URL) of a model served in this process: `name`, else the latest registered."""
    if not _LOCAL_ENDPOINTS:
        raise InvalidFieldError("judge", "local", "no model is served in this process: register one first")
    if name is None:
        name = next(reversed(_LOCAL_ENDPOINTS))
    if name not in _LOCAL_ENDPOINTS:
        raise InvalidFieldError("model", name, f"not served here; served: {sorted(_LOCAL_ENDPOINTS)}")
    return name, _LOCAL_ENDPOINTS[name]


@dataclass
class _Service:
    model: TrainableModel
    policy: LoraPolicy
    chat_format: ChatFormat
    engine: Engine
    endpoint: Endpoint
    server: ServerThread
    store: RunStore
    trainer: GRPOTrainer


class LocalBackend:
    """Runs engine, endpoint and trainer for each registered model in this process.

    `engine="torch"` (default) samples in process from the weights the trainer updates.
    `engine="vllm"` (or a `VLLMConfig`) samples through a vLLM server process that hot-loads each step's adapter.
    """

    def __init__(
        self,
        path: str | Path = ".journeyman",
        *,
        engine: str | VLLMConfig = "torch",
        device: str | None = None,
        dtype: str = "float32",
    ) -> None:
        self.vllm_config = engine if isinstance(engine, VLLMConfig) else VLLMConfig()
        engine = "vllm" if isinstance(engine, VLLMConfig) else engine
        if engine not in ("torch", "vllm"):
            raise InvalidFieldError("engine", engine, "supported engines: 'torch', 'vllm' (or a VLLMConfig)")
        self.path = Path(path)
        self.engine_kind = engine
        self.device = device
        self.dtype = dtype
        self._services: dict[str, _Service] = {}

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    async def register(self, model: TrainableModel) -> None:
        if model.name in self._services:
            self._services[model.name].model = model
            return
        self._services[model.name] = await asyncio.to_thread(self._start, model)

    def _start(self, model: TrainableModel) -> _Service:
        weights = resolve_base_model(model.base_model)
        policy = LoraPolicy(weights, model.lora, device=self.device, dtype=self.dtype)
        chat_format = ChatFormat(policy.tokenizer)
        engine = self._make_engine(weights, policy, chat_format)
        endpoint = Endpoint(engine, chat_format, model.name, default_max_tokens=model.max_tokens)
        store = RunStore(self.model_dir(model))
        trainer = GRPOTrainer(policy, chat_format)
        step = store.latest_step()
        if step > 0:  # resume: the last checkpoint's adapter and optimizer state
            ckpt = store.checkpoint_dir(step)
            policy.load(ckpt)
            trainer.load_optimizer(ckpt)
            engine.step = step
        else:
            store.write_state(0, base_model=model.base_model)
        server = ServerThread(build_app(endpoint))
        _LOCAL_ENDPOINTS[model.name] = server.base_url
        return _Service(model, policy, chat_format, engine, endpoint, server, store, trainer)

    def _make_engine(self, weights: Path, policy: LoraPolicy, chat_format: ChatFormat) -> Engine:
        """The engine named by `engine=`; each kind's module is imported only when chosen."""
        if self.engine_kind == "vllm":
            from .engine.vllm_engine import VLLMEngine

            return VLLMEngine(
                weights, chat_format.stop_ids, self.vllm_config, dtype=self.dtype, lora_rank=policy.lora.r
            )
        from .engine.torch_engine import TorchEngine

        return TorchEngine(policy, chat_format.stop_ids)

    def service(self, model: TrainableModel) -> _Service:
        try:
            return self._services[model.name]
        except KeyError:
            raise InvalidFieldError("model", model.name, "is not registered with this backend") from None

    def base_url(self, model: TrainableModel) -> str:
        return self.service(model).server.base_url

    def step(self, model: TrainableModel) -> int:
        return self.service(model).engine.step

    def pop_captures(self, model: TrainableModel, capture_id: str) -> list[CapturedCall]:
        return self.service(model).endpoint.captures.pop(capture_id)

    async def train(
        self, model: TrainableModel, groups: Sequence[TrajectoryGroup], config: TrainConfig | None = None
    ) -> TrainResult:
        """One training step on `groups`; the endpoint serves the new step when this returns.

        The groups are written to `trajectories/train/<step>.jsonl` before the update, so a crash
        loses nothing; the adapter and optimizer go to `checkpoints/<step+1>/` after it.
        """
        config = config or TrainConfig()
        s = self.service(model)
        groups = _check_groups(groups)
        step = s.engine.step
        s.store.write_groups(groups, "train", step)
        emit(
            groups,
            GroupContext(project=model.project, model=model.name, step=step, split="train", source="train"),
        )
        sleep, wake = getattr(s.engine, "sleep", None), getattr(s.engine, "wake", None)
        if sleep is not None:
            await sleep()
        try:
            updated, metrics = await asyncio.to_thread(s.trainer.step, groups, config)
        finally:
            if wake is not None:
                await wake()
        if not updated:
            log.warning(
                "step %d skipped: none of the %d groups has rewards that differ (nothing to learn from)",
                step,
                len(groups),
            )
            s.store.append_history(
                {"step": step, "split": "train", "skipped": True, **_prefixed("train", metrics)}
            )
            return TrainResult(step=step, metrics=metrics, skipped=True)
        new_step = step + 1
        ckpt = s.store.checkpoint_dir(new_step)
        await asyncio.to_thread(s.policy.save, ckpt)
        await asyncio.to_thread(s.trainer.save_optimizer, ckpt)
        t0 = time.perf_counter()
        await s.engine.load_adapter(ckpt, new_step)
        metrics["adapter_load_seconds"] = time.perf_counter() - t0
        s.store.write_state(new_step, base_model=model.base_model)
        s.store.append_history({"step": step, "split": "train", **_prefixed("train", metrics)})
        return TrainResult(step=new_step, metrics=metrics)

    async def log(
        self, model: TrainableModel, groups: Sequence[TrajectoryGroup], split: str = "val"
    ) -> dict[str, float]:
        """Record groups (e.g. an evaluation) without training: trajectories and a history row."""
        s = self.service(model)
        groups = _check_groups(groups)
        step = s.engine.step
        s.store.write_groups(groups, split, step)
        emit(
            groups,
            GroupContext(project=model.project, model=model.name, step=step, split=split, source="log"),
        )
        rewards = [t.reward for g in groups for t in g.trajectories]
        metrics: dict[str, float] = {
            "reward": sum(rewards) / max(1, len(rewards)),
            "trajectories": float(len(rewards)),
        }
        for key in sorted({k for g in groups for t in g.trajectories for k in t.metrics}):
            vals = [float(t.metrics[key]) for g in groups for t in g.trajectories if key in t.metrics]
            metrics[key] = sum(vals) / len(vals)
        s.store.append_history({"step": step, "split": split, **_prefixed(split, metrics)})
        return metrics

    def store(self, model: TrainableModel) -> RunStore:
        return self.service(model).store

    def close(self) -> None:
        for s in self._services.values():
            _LOCAL_ENDPOINTS.pop(s.model.name, None)
            s.server.stop()
            s.engine.close()
        self._services.clear()

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
