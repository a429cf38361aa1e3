"""LocalBackend: serves and trains models in this process, with the run directory on local disk.

The Backend's entry point, read as a list of operations. The work is done in three rooms:
- `service.py`: what serves a model (base weights, policy, engine, endpoint, trainer), assembled on
  `register` from this backend's `ServingSettings`;
- `train_step.py`: a training step's life, once for GRPO and SFT (`train`, `train_sft`, `log`);
- `live_training.py`: live training (`live`, `report_outcome`, `live_status`, `decide`).
"""

from __future__ import annotations

import asyncio
import secrets
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from journeyman._extras import require_backend
from journeyman.backends.live_training import live_run, outcome_of, start_live
from journeyman.backends.service import BaseRegistry, ServedModel, ServingSettings
from journeyman.backends.store import RunStore
from journeyman.backends.train_step import GRPOUpdate, SFTUpdate, log_groups, run_step
from journeyman.client.operations import (
    CHARGE,
    DECIDE,
    LIVE,
    LIVE_STATUS,
    LOG,
    REPORT_OUTCOME,
    TRAIN,
    TRAIN_SFT,
)
from journeyman.client.protocol import Evaluate, Inference, named_or_latest
from journeyman.data.config import ModelConfig, SFTConfig, TrainConfig, TrainerConfig, TrainResult
from journeyman.data.live_types import Decision, DecisionAction, LiveConfig, LiveStatus, OutcomeReceipt
from journeyman.data.paths import RunLayout
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError, UnknownModelError
from journeyman.rollout.capture import CapturedCall, capture_key

if TYPE_CHECKING:
    from journeyman.engine.vllm_server import VLLMConfig


ENGINE_EXIT_WAIT_S = 30.0
"""How long closing waits for an engine's worker to end: a closed engine drops the rows it decodes at
the next step (`Scheduler._drop_gone`), then puts its weights back (the 135M model: 23 s at most,
measured with 6 other test processes on 2 cores; well under a second alone)."""


def _close_services(services: dict[str, ServedModel]) -> None:
    """Close every service, then wait for each engine's worker thread to end (`ENGINE_EXIT_WAIT_S`)."""
    for s in services.values():
        s.close()
    for s in services.values():
        if isinstance(join := getattr(s.engine, "join", None), Callable):
            join(ENGINE_EXIT_WAIT_S)
    services.clear()


StorageOptions = dict[str, Any] | None
"""fsspec's options for the object store a run is pushed to or pulled from (credentials, endpoint)."""


class LocalBackend:
    """Runs engine, endpoint and trainer for each registered model in this process (a `Backend`).

    `engine="torch"` (default) samples in process from the very weights the trainer updates (the
    policy's LoRA adapter is shared in memory, no copy per step).
    `engine="vllm"` (or a `VLLMConfig`) samples through a vLLM server process that loads each step's adapter.
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
        self.settings = ServingSettings.check(
            engine=engine,
            device=device,
            dtype=dtype,
            trainer=trainer,
            engine_replicas=engine_replicas,
            engine_threads=engine_threads,
            report_to=report_to,
        )
        self.path = Path(path)
        self._services: dict[str, ServedModel] = {}
        # One copy of each base's weights, whatever number of models are registered on it.
        self._bases = BaseRegistry()
        # Closed when collected or at interpreter exit if the program never closes it (it raised, was
        # interrupted, or just ended): the engine's worker would otherwise still be in torch while
        # the interpreter tears torch down, and the process abort with "terminate called without an
        # active exception" (exit code 134) after the program's own output.
        self._finalizer = weakref.finalize(self, _close_services, self._services)
        self._registering = asyncio.Lock()
        # The key each model's own endpoint (127.0.0.1) demands: another local user cannot sample
        # from it or file captures; `inference()` hands it to this process's clients.
        self.api_key = secrets.token_urlsafe(24)

    # The settings under the names they have always had as the backend's attributes.
    @property
    def engine_kind(self) -> str:
        return self.settings.engine_kind

    @property
    def vllm_config(self) -> VLLMConfig | None:
        return self.settings.vllm_config

    @property
    def device(self) -> str | None:
        return self.settings.device

    @property
    def dtype(self) -> str:
        return self.settings.dtype

    @property
    def trainer_config(self) -> TrainerConfig:
        return self.settings.trainer

    @property
    def engine_replicas(self) -> int:
        return self.settings.engine_replicas

    @property
    def engine_threads(self) -> int | None:
        return self.settings.engine_threads

    @property
    def report_to(self) -> list[str]:
        return self.settings.report_to

    # -- serving -----------------------------------------------------------------------------------

    async def register(self, model: ModelConfig) -> None:
        async with self._registering:  # two calls for one new name must not both load it
            served = self._services.get(model.name)
            if served is None:
                from journeyman.backends.live_training import resume_live
                from journeyman.backends.service import assemble

                served = await asyncio.to_thread(
                    assemble, self.settings, model, self.run_dir(model), self.api_key, self._bases
                )
                self._services[model.name] = served
                served.peers = self.service  # a distillation teacher may be another model here
                await resume_live(served)
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
            served.endpoint.limits.configure(model)  # its caps on rows in flight and requests
            if served.meter is not None:
                served.meter.configure(model.budget)  # what was spent stays counted

    def service(self, model: ModelConfig | str) -> ServedModel:
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

    async def chat_completion(self, body: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Answered by the endpoint of the model `body` names (`name`, or `name@step`); the other
        arguments are `Endpoint.chat_completion`'s, handed on as given (`ServedBackend` declares them)."""
        name = body.get("model")
        served = self._services.get(name.split("@")[0]) if isinstance(name, str) else None
        if served is None:  # a base model's own name: the first model registered on it serves it
            served = next((s for s in self._services.values() if s.endpoint.base_name == name), None)
        if served is None:
            raise UnknownModelError(str(name), self.served_names())
        return await served.endpoint.chat_completion(body, *args, **kwargs)

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
        captures = self.service(model).endpoint.captures  # the caller's own (`capture_key`)
        return {cid: captures.pop(capture_key(cid)) for cid in capture_ids}

    async def serve_step(self, model: ModelConfig, step: int) -> None:
        s = self.service(model)
        s.refuse_while_live("step", step)
        async with s.step_lock:
            await s.serve_checkpoint(step)

    # -- training: a step's life (`train_step.py`) ---------------------------------------------------
    # `train`, `train_sft` and `log` take their arguments as `Backend` declares them (made from the
    # operations table); an update checks and prepares them, `run_step` runs the step.

    async def _train(
        self, model: ModelConfig, groups: Sequence[TrajectoryGroup], config: TrainConfig | None, **step: Any
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
        return await run_step(s, GRPOUpdate.prepare(s, groups, config), **step)

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
        s = self.service(model)
        return await run_step(s, await SFTUpdate.prepare(s, trajectories, config), **step)

    async def _log(
        self,
        model: ModelConfig,
        groups: Sequence[TrajectoryGroup] | None,
        split: str,
        metrics: Mapping[str, float] | None,
    ) -> dict[str, float]:
        """Record groups and/or metrics without training: one history row (see `log_groups`)."""
        return log_groups(self.service(model), groups, split, metrics)

    train = TRAIN.implemented_by(_train)
    train_sft = TRAIN_SFT.implemented_by(_train_sft)
    log = LOG.implemented_by(_log)  # with the arguments' defaults as `Backend` declares them

    # -- live training (`LiveBackend`; `live_training.py`, docs/live.md) -----------------------------

    async def _live(
        self, model: ModelConfig, config: LiveConfig | None, evaluate: Evaluate | None
    ) -> LiveStatus:
        """Start (or reconfigure) live training of `model` (see `LiveBackend.live`); the settings are
        kept in the run directory, so a restarted server goes on (an `evaluate` function is not kept:
        its gate falls back to the canary, or to a person)."""
        return await start_live(self.service(model), config or LiveConfig(), evaluate)

    async def _report_outcome(self, model: ModelConfig, **outcome: Any) -> OutcomeReceipt:
        return live_run(self.service(model)).report(outcome_of(**outcome))

    async def _live_status(self, model: ModelConfig) -> LiveStatus:
        return live_run(self.service(model)).status()

    async def _decide(
        self,
        model: ModelConfig,
        action: DecisionAction,
        step: int | None,
        reason: str,
        trained_by: str | None,
    ) -> Decision:
        if action not in ("promote", "reject", "rollback"):
            raise InvalidFieldError("action", action, "one of promote, reject, rollback")
        run = live_run(self.service(model))
        return await run.decide(action, step, reason or "by command", trained_by or "command")

    live = LIVE.implemented_by(_live)
    report_outcome = REPORT_OUTCOME.implemented_by(_report_outcome)
    live_status = LIVE_STATUS.implemented_by(_live_status)
    decide = DECIDE.implemented_by(_decide)

    # -- spend made outside the backend (`MeteredBackend`) -----------------------------------------

    async def _charge(
        self, model: ModelConfig, judge_usd: float, judge_tokens: int, check: bool
    ) -> dict[str, float]:
        """Add a judge's cost to `model`'s spend, then (`check`) refuse more judging past a limit."""
        if judge_usd < 0 or judge_tokens < 0:
            raise InvalidFieldError(
                "judge_usd" if judge_usd < 0 else "judge_tokens",
                min(judge_usd, judge_tokens),
                "spend is >= 0",
            )
        meter = self.service(model).meter
        if meter is None:
            return {}
        meter.add(judge_usd=judge_usd, judge_tokens=judge_tokens)
        if check:
            meter.check("judging")
        return meter.spent()

    charge = CHARGE.implemented_by(_charge)

    # -- the run directory -------------------------------------------------------------------------

    async def history(self, model: ModelConfig) -> list[dict[str, Any]]:
        return self.service(model).store.history()

    async def delete_checkpoints(
        self, model: ModelConfig, best_checkpoint_metric: str = "val/reward"
    ) -> list[int]:
        return self.service(model).store.delete_checkpoints(best_checkpoint_metric)

    def run_dir(self, model: ModelConfig) -> Path:
        return RunLayout.of(self.path, model.project, model.name).root

    async def push_run(
        self, model: ModelConfig, url: str, *, delete: bool = False, storage_options: StorageOptions = None
    ) -> int:
        """Copy `model`'s run (checkpoints, trajectories, history, state) to object storage at `url`
        (any fsspec URL: s3://bucket/prefix, gs://..., a path); returns the files copied. Needs
        `pip install 'journeyman[storage]'`."""
        from journeyman.data.object_store import push_dir

        return await asyncio.to_thread(
            push_dir, self.run_dir(model), url, delete=delete, storage_options=storage_options
        )

    async def pull_run(
        self, model: ModelConfig, url: str, *, delete: bool = False, storage_options: StorageOptions = None
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
        self._finalizer()  # once: a later call, and the one at exit, do nothing

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
