"""A training step's life on a served model, once for GRPO and SFT: the second room of `LocalBackend`.

`run_step` is the life: the idempotency key's earlier result, if it has one (a key is scoped to the
model, whose run directory keeps it, and the operation; sent with another call, it is refused:
`IdempotencyKeyReusedError`); else the groups written as an attempt (`begin`), the update with the
engine asleep, the checkpoint committed and served, and the history row (`checkpoint`); the attempt marked failed if anything raises. What differs between
GRPO and SFT is an update (`GRPOUpdate`, `SFTUpdate`): `run` changes the adapter from checkpoint
`step` while the engine sleeps and answers (updated?, metrics); `settle`, once it woke, completes the
metrics. `log_groups` records groups and metrics without training: one history row.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from journeyman.backends.service import ServedModel
from journeyman.backends.store import TRAINING_SPLITS, Attempt, groups_text
from journeyman.client.protocol import Progress
from journeyman.data.config import SFTConfig, TrainConfig, TrainResult, check_name
from journeyman.data.provenance import staleness_metrics
from journeyman.data.trajectory_file import check_trajectories
from journeyman.data.types import History, Trajectory, TrajectoryGroup
from journeyman.errors import (
    CheckpointError,
    IdempotencyKeyReusedError,
    InvalidFieldError,
    NoLearningSignalError,
)
from journeyman.rollout.observe import GroupContext, emit

log = logging.getLogger("journeyman")


# -- checking what arrives ------------------------------------------------------------------------


def check_groups(groups: Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
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


def check_token_ids(items: Sequence[Trajectory | TrajectoryGroup], vocab: int, where: str) -> None:
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


# -- the two kinds of update ----------------------------------------------------------------------


@dataclass
class GRPOUpdate:
    split: ClassVar[str] = "train"  # where the step's groups and history row go
    groups: list[TrajectoryGroup]
    config: TrainConfig
    skip_reason: str | None = None  # set by `run` when nothing was learned
    teacher_metrics: dict[str, float] = field(default_factory=dict)  # `distill`: what scoring took

    @classmethod
    def prepare(
        cls, s: ServedModel, groups: Sequence[TrajectoryGroup], config: TrainConfig | None
    ) -> GRPOUpdate:
        groups = check_groups(groups)
        check_token_ids(groups, s.vocab_size, "groups")
        return cls(groups, config or TrainConfig())

    async def run(
        self, s: ServedModel, step: int, on_progress: Progress | None
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
        metrics.update(self.teacher_metrics)
        if not updated:
            self.skip_reason = no_signal_reason(self.groups, metrics, self.config)
            if self.config.on_no_signal == "error":
                raise NoLearningSignalError(
                    "groups",
                    [g.rewards() for g in self.groups],
                    f"{self.skip_reason} (TrainConfig.on_no_signal='error' refuses such a step; 'skip' goes on)",
                )
            log.warning("step %d skipped: %s", step, self.skip_reason)
        return updated, metrics

    async def settle(self, s: ServedModel, metrics: dict[str, float]) -> dict[str, float]:
        return {**metrics, **s.endpoint.stats()}


def no_signal_reason(
    groups: Sequence[TrajectoryGroup], metrics: Mapping[str, float], config: TrainConfig
) -> str:
    """Why a GRPO step had nothing to learn from (the trainer's metrics say which groups it dropped),
    and what would give it something: one line for the result, the log and the error."""
    n, zero = len(groups), int(metrics.get("groups_zero_signal", 0))
    if zero < n:
        return f"the {n - zero} of {n} groups whose rewards differ have no sampled tokens to train"
    if config.advantages == "given":
        return f"every reward of the {n} groups is 0 (advantages='given': a reward is its advantage)"
    equal = (
        f"span less than min_reward_spread={config.min_reward_spread:g}"
        if config.min_reward_spread > 0
        else "are all equal (or it has one rollout)"
    )
    return (
        f"in each of the {n} groups the rewards {equal}: GRPO learns from differences within a group; "
        "give partial credit, vary the scenarios' difficulty, or roll out more per group"
    )


@dataclass
class SFTUpdate:
    split: ClassVar[str] = "sft"
    skip_reason: ClassVar[None] = None  # an SFT step always trains
    groups: list[TrajectoryGroup]
    config: SFTConfig
    rows: list[Any]  # `sft_rows`: tokenised before the step began
    data_metrics: dict[str, float]

    @classmethod
    async def prepare(
        cls, s: ServedModel, trajectories: Iterable[Trajectory | TrajectoryGroup], config: SFTConfig | None
    ) -> SFTUpdate:
        config = config or SFTConfig()
        items, flat = check_trajectories(trajectories)
        check_token_ids(items, s.vocab_size, "trajectories")
        from journeyman.training.sft import sft_rows

        # tokenised before anything is written: a trajectory with nothing to train is refused by name
        rows, data_metrics = await asyncio.to_thread(
            sft_rows, flat, s.chat_format, config.max_seq_len, config.long_rows
        )
        groups = [g if isinstance(g, TrajectoryGroup) else TrajectoryGroup([g]) for g in items]
        return cls(groups, config, rows, data_metrics)

    async def run(
        self, s: ServedModel, step: int, on_progress: Progress | None
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

    async def settle(self, s: ServedModel, metrics: dict[str, float]) -> dict[str, float]:
        if s.ranks is not None:  # SFT runs on rank 0; the other ranks take its weights
            await s.engine.call(s.ranks.sync)
        return {**self.data_metrics, **metrics}


Update = GRPOUpdate | SFTUpdate


# -- the life -------------------------------------------------------------------------------------


async def run_step(
    s: ServedModel,
    update: Update,
    *,
    idempotency_key: str | None,
    on_progress: Progress | None,
    trained_by: str | None,
    parent: int | None = None,
) -> TrainResult:
    """A step's life, whatever trains it (see the module's docstring).

    With `parent` (live training: the promoted step, which the engine serves) the step trains from
    it and its checkpoint (the latest + 1) is a candidate: written, not served."""
    if idempotency_key is not None:
        check_name("idempotency_key", idempotency_key)
    if isinstance(update, GRPOUpdate) and update.config.distill is not None:
        # before anything is written: the attempt's file keeps the teacher's logprobs with the groups
        # (a retry asks the teacher nothing again), and a teacher that fails leaves no attempt
        from journeyman.backends.teachers import score_for_step

        update.teacher_metrics = await score_for_step(s, update.groups, update.config.distill.teacher)
    text = await asyncio.to_thread(groups_text, update.groups)  # tens of MB, once, off the event loop
    async with s.step_lock:
        begun = begin(s, update, text, idempotency_key, parent)
        if isinstance(begun, TrainResult):
            return begun
        attempt = begun
        try:
            if s.meter is not None:
                s.meter.check("training")  # BudgetExceededError: the attempt is dropped, nothing trains
            s.trackers.config({update.split: update.config.model_dump(mode="json")})
            rollout_metrics = s.engine_metrics()  # the rollouts this step trains on
            # The GPU handoff (engine/handoff.py): the engine sleeps, the trainer steps and gives
            # its cached blocks back, and the engine wakes in stages with the new adapter loaded
            # between its weights and its KV cache (`checkpoint`'s load_adapter); `wake` finishes
            # a wake that no adapter began (a skipped step, an error).
            await s.engine.sleep()
            try:
                try:
                    updated, metrics = await update.run(s, attempt.step, on_progress)
                finally:
                    if s.returns_memory:  # another process wants the memory back
                        from journeyman.engine.handoff import return_cached_memory

                        await s.engine.call(return_cached_memory)
                metrics = {**await update.settle(s, metrics), **rollout_metrics}
                if s.meter is not None:  # spent: the tokens it trained on, and what came before
                    s.meter.add(trained_tokens=int(metrics.get("trained_tokens", 0)))
                    metrics.update({f"spend_{k}": v for k, v in s.meter.spent().items()})
                if updated:
                    return await checkpoint(
                        s, attempt, metrics, update.groups, idempotency_key, trained_by, parent
                    )
                result = TrainResult(  # nothing learned
                    step=attempt.step, metrics=metrics, skipped=True, skip_reason=update.skip_reason
                )
                commit(s, attempt.step, attempt, idempotency_key, result)
                row = {"step": attempt.step, "split": update.split, "skipped": True}
                s.record(_by({**row, **_prefixed(update.split, metrics)}, trained_by), update.groups)
                return result
            finally:
                await s.engine.wake()
        except BaseException:
            s.store.fail_attempt(attempt)  # a no-op once the step committed
            raise


def request_sha256(update: Update, text: str) -> str:
    """The digest of a training call: its operation (split), its config as it trains, its groups
    (`text`, as `groups_text` renders them). A retry of a key matches the call the key named."""
    return hashlib.sha256(f"{update.split}\n{update.config.model_dump_json()}\n{text}".encode()).hexdigest()


def begin(
    s: ServedModel, update: Update, text: str, key: str | None, parent: int | None = None
) -> Attempt | TrainResult:
    """The attempt of a new update (its step, its groups written and announced; `text`: the groups
    rendered, `groups_text`); or the result of the committed call of this operation with idempotency
    key `key`, when this is that call (`request_sha256`; a record from before digests were kept
    matches any)."""
    groups, split = update.groups, update.split
    digest = request_sha256(update, text) if key is not None else None
    if key is not None and (done := s.store.request_result(key, split)) is not None:
        if done.get("request_sha256") not in (None, digest):
            raise IdempotencyKeyReusedError(
                "idempotency_key",
                key,
                f"names another {split} call of this model (the one that made step {done.get('step')}), "
                "with other groups or config: a key names one call; send a new key with a new call",
            )
        return _result_of(done)
    step = s.store.latest_step()
    if parent is None:
        s.refuse_while_live("groups", f"{len(groups)} groups")
    if parent is not None and s.engine.step != parent:
        raise InvalidFieldError("parent", parent, f"is not the step served (step {s.engine.step} is)")
    if parent is None and s.engine.step != step:
        why = (
            "live training serves it (docs/live.md)"
            if s.live is not None
            else f"serve_step({step}) before training"
        )
        raise InvalidFieldError("step", s.engine.step, f"an older checkpoint is served: {why}")
    attempt = s.store.begin_attempt(groups, split, step, key, text, digest)
    model = s.model
    emit(
        groups, GroupContext(project=model.project, model=model.name, step=step, split=split, source="train")
    )
    return attempt


async def checkpoint(
    s: ServedModel,
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
        await s.serve_trained(parent)
    metrics["adapter_load_seconds"] = time.perf_counter() - t0
    result = TrainResult(step=new_step, metrics=metrics)
    commit(s, new_step, attempt, key, result)
    row = {"step": step, "split": split, "parent": step if parent is None else parent}
    if parent is not None:
        row["candidate"] = new_step
    s.record(_by({**row, **_prefixed(split, metrics)}, trained_by), groups)
    return result


def commit(s: ServedModel, step: int, attempt: Attempt, key: str | None, result: TrainResult) -> None:
    """state.json names `step`: the attempt's groups become `<step>.jsonl`, `key` answers `result`."""
    request = None
    if key is not None:  # the key answers this result, and only to this very call (`request_sha256`)
        request = (key, {**result.model_dump(), "request_sha256": attempt.request_sha256})
    s.store.write_state(step, request=request, attempt=attempt, base_model=s.model.base_model)


# -- recording without training -------------------------------------------------------------------


def log_groups(
    s: ServedModel,
    groups: Sequence[TrajectoryGroup] | None,
    split: str,
    metrics: Mapping[str, float] | None,
) -> dict[str, float]:
    """Record groups (e.g. an evaluation) and/or extra metrics without training: one history row.

    Groups go to `trajectories/<split>/<step>.jsonl` at once; a training split's files hold only
    what trained, so `split="train"` (or "sft") takes metrics only."""
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
        groups = check_groups(groups)
        check_token_ids(groups, s.vocab_size, "groups")
        s.store.write_groups(groups, split, step)
        model = s.model
        emit(
            groups,
            GroupContext(project=model.project, model=model.name, step=step, split=split, source="log"),
        )
        out = group_metrics(groups)
    out.update(metrics or {})
    s.record({"step": step, "split": split, **_prefixed(split, out)}, groups or ())
    return out


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


def _prefixed(split: str, metrics: Mapping[str, float]) -> dict[str, float]:
    return {f"{split}/{k}": v for k, v in metrics.items()}


def _result_of(done: dict[str, Any]) -> TrainResult:
    """A stored result back to a TrainResult: a metric stored as null (NaN in strict JSON) is NaN again."""
    metrics = {k: math.nan if v is None else v for k, v in (done.get("metrics") or {}).items()}
    kept = {k: v for k, v in done.items() if k != "request_sha256"}
    return TrainResult.model_validate({**kept, "metrics": metrics})


def _by(row: dict[str, Any], trained_by: str | None) -> dict[str, Any]:
    return row if trained_by is None else {**row, "trained_by": trained_by}
