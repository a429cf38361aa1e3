"""PipelineTrainer: rollouts and training at the same time, with a bound on staleness.

The synchronous loop gathers every group, trains, then gathers again: while the trainer runs no
rollout advances, and while rollouts wait on their tools the trainer idles. Here rollout workers
keep starting groups (up to `max_in_flight`) and the trainer takes groups as they finish:

    rollouts ──> finished groups (journal) ──> [stale? no signal?] ──> train step ──> served
        ^                                                                  │
        └──────────── the engine serves each new step as soon as it lands ─┘

Every sampled token carries the step of the weights that sampled it and its logprob under them
(`TokenRecord.step`, `.logprobs`), so off-policy data is corrected exactly, token by token: the loss
weighs each token by π_θ / π_behaviour (see `TrainConfig.tis_cap`), and a rollout whose turns
straddle a step is valid, each turn with its own step. A group whose oldest token is more than
`max_steps_off_policy` steps behind is dropped and counted. `docs/pipeline.md` has the measured
wall-clock gains and the reasons behind the defaults.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from journeyman.client.protocol import charging
from journeyman.data.config import TrainConfig, TrainResult
from journeyman.data.journal import GroupJournal
from journeyman.data.provenance import oldest_step
from journeyman.data.types import RolloutEnd, Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError, TooManyExceptionsError

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel

log = logging.getLogger(__name__)

S = TypeVar("S")
RolloutFn = Callable[["TrainableModel", S], Awaitable[Trajectory]]
AfterEach = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None] | TrajectoryGroup | None]


def _pipeline_train_config() -> TrainConfig:
    # Decoupled PPO (AReaL): the ratio is taken against the trainer's own logprobs (1 at the
    # step's start), and each token is weighted by π_trainer / π_behaviour truncated at 2, so a
    # token sampled a step ago still teaches, by its exact weight, instead of being clipped out.
    return TrainConfig(tis_cap=2.0)


class PipelineConfig(BaseModel):
    """How the pipeline runs: group shape, staleness bound, evaluation, fault handling."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(default=4, ge=1, description="rollouts per scenario (one GRPO group)")
    groups_per_step: int = Field(default=2, ge=1, description="groups trained in each step")
    max_steps_off_policy: int = Field(
        default=1,
        ge=0,
        description="drop a group whose oldest sampled token is more than this many steps behind the "
        "step it would train (counted as `stale_groups`); 0 trains only groups sampled wholly by the "
        "current step",
    )
    max_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="groups rolling out or waiting to train at once; None = groups_per_step * "
        "(max_steps_off_policy + 1): enough to fill the next step while this one trains, few enough "
        "that they are not stale when their turn comes",
    )
    skip_zero_variance: bool = Field(
        default=True,
        description="drop a group whose rewards are all equal before it takes a place in a step "
        "(it has no advantage to learn from); counted as `zero_variance_groups`. Never with "
        "`train.distill`: there the teacher's per-token signal trains every group",
    )
    eval_every: int = Field(
        default=0, ge=0, description="evaluate on `eval_scenarios` every this many trained steps (0: never)"
    )
    max_exceptions: int | float = Field(
        default=0,
        ge=0,
        description="rollouts that may raise (a count, or a fraction in (0, 1) of the rollouts so far) "
        "before the run stops with TooManyExceptionsError, as `gather_trajectory_groups` counts them",
    )
    train: TrainConfig = Field(
        default_factory=_pipeline_train_config,
        description="the step's training settings; the default weighs off-policy tokens by their "
        "importance ratio truncated at 2 (tis_cap=2.0)",
    )
    journal: Path | None = Field(
        default=None,
        description="where finished groups are written before they train (a restart trains those not "
        "yet trained); None = `<run_dir>/pipeline` when the run directory is on this machine, else "
        "`.journeyman-pipeline/<project>/<model>`",
    )
    progress: bool = Field(default=True, description="show a progress bar")


class TimelineEvent(BaseModel):
    """One span of work, for the timeline picture: a group's rollouts, a train step, an evaluation."""

    kind: Literal["rollout", "train", "eval"]
    start: float = Field(description="seconds since the pipeline started")
    end: float
    step: int = Field(description="the step served when the span began")


class PipelineResult(BaseModel):
    """What a `PipelineTrainer.train` call did."""

    steps: int = Field(description="steps trained by this call (skipped steps included)")
    final_step: int
    trained_groups: int
    stale_groups: int = Field(description="groups dropped for being past `max_steps_off_policy`")
    zero_variance_groups: int
    exceptions: int
    skipped_steps: int = Field(
        default=0, description="steps that had nothing to learn from (the backend's log says why)"
    )
    rollouts: int
    resumed_groups: int = Field(description="finished groups found in the journal and trained here")
    wall_seconds: float
    timeline: list[TimelineEvent] = Field(default_factory=list)
    history: list[dict[str, float]] = Field(
        default_factory=list, description="each step's metrics, as its TrainResult gave them"
    )


class _Bar:
    """The progress line: steps done, with rollouts in flight, queue depth, staleness, reward."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="pipeline", unit="step", disable=not enabled)

    def show(self, **fields: object) -> None:
        self._bar.set_postfix({k: v for k, v in fields.items() if v is not None}, refresh=True)

    def advance(self) -> None:
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


async def _scenarios_of(scenarios: Iterable[S] | AsyncIterable[S]) -> AsyncIterator[S]:
    if isinstance(scenarios, AsyncIterable):
        async for s in scenarios:
            yield s
    else:
        for s in scenarios:
            yield s


class PipelineTrainer(Generic[S]):
    """Train `model` on `rollout(model, scenario)` groups while more groups roll out.

        trainer = jm.PipelineTrainer(model, rollout, itertools.cycle(scenarios),
                                     jm.PipelineConfig(group_size=4, groups_per_step=2))
        result = await trainer.train(num_steps=20)

    Works on any Backend (`LocalBackend`, `RemoteBackend`): it is built on `model.train`,
    `model.log` and the model's endpoint. Ctrl-C (or cancelling `train`) abandons the rollouts in
    flight and lets a step that is training commit before it returns; finished groups not yet
    trained stay in the journal and train first on the next call, with any process.
    """

    def __init__(
        self,
        model: TrainableModel,
        rollout: RolloutFn[S],
        scenarios: Iterable[S] | AsyncIterable[S],
        config: PipelineConfig | None = None,
        *,
        eval_scenarios: Sequence[S] = (),
        after_each: AfterEach | None = None,
    ) -> None:
        self.model, self.rollout, self.scenarios = model, rollout, scenarios
        self.config = config or PipelineConfig()
        if self.config.eval_every and not eval_scenarios:
            raise InvalidFieldError("eval_scenarios", eval_scenarios, "eval_every > 0 needs scenarios")
        self.eval_scenarios = list(eval_scenarios)
        self.after_each = after_each

    def _journal_dir(self) -> Path:
        if self.config.journal is not None:
            return self.config.journal
        run_dir = self.model.run_dir
        if run_dir.exists():
            return run_dir / "pipeline"
        return Path(".journeyman-pipeline") / self.model.project / self.model.name

    async def train(self, num_steps: int) -> PipelineResult:
        """Train `num_steps` steps (a step with no signal counts); returns what happened."""
        if num_steps < 1:
            raise InvalidFieldError("num_steps", num_steps, "must be >= 1")
        return await _Run(self, num_steps).run()


class _Run(Generic[S]):
    """One `train` call's state: the workers, the queue, the counts."""

    def __init__(self, trainer: PipelineTrainer[S], num_steps: int) -> None:
        cfg = trainer.config
        self.t, self.cfg, self.model, self.num_steps = trainer, cfg, trainer.model, num_steps
        self.cap = cfg.max_in_flight or cfg.groups_per_step * (cfg.max_steps_off_policy + 1)
        self.journal = GroupJournal(trainer._journal_dir())
        # finished groups by id; None wakes the trainer to see that the scenarios ran out
        self.queue: asyncio.Queue[tuple[str, TrajectoryGroup] | None] = asyncio.Queue()
        self.room = asyncio.Condition()
        self.in_flight = 0  # groups rolling out or waiting to train
        self.rolling = 0
        self.rolling_starts: Counter[int] = Counter()  # the step each rolling group started at
        self.ready: list[tuple[str, TrajectoryGroup]] = []  # finished, fit, not yet taken
        self.oldest: dict[str, int | None] = {}  # each ready group's oldest sampled step, read once
        self.step = 0
        self.t0 = time.perf_counter()
        self.tasks: set[asyncio.Task[None]] = set()
        self.counts = {"rollouts": 0, "exceptions": 0, "stale": 0, "zero": 0, "trained": 0, "skipped": 0}
        self.raised: list[BaseException] = []  # what each counted exception was, for TooManyExceptionsError
        self.timeline: list[TimelineEvent] = []
        self.history: list[dict[str, float]] = []
        self.exhausted = False
        self.last_metrics: dict[str, float] = {}
        self.training: asyncio.Task[TrainResult] | None = None  # the step being trained

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self) -> PipelineResult:
        self.step = await self.model.get_step()
        sent, resumed = self.journal.pending()
        for gid, group in resumed:
            self.in_flight += 1
            self.queue.put_nowait((gid, group))
        n_resumed = len(resumed) + (len(sent.groups) if sent is not None else 0)
        if n_resumed:
            log.info("pipeline: %d finished groups from the journal train first", n_resumed)
        bar = _Bar(self.num_steps, self.cfg.progress)
        with charging(self.model):  # the rollouts' tasks copy this context: RULER in them charges this model
            producer = asyncio.create_task(self._produce())
        steps = 0
        try:
            while steps < self.num_steps:
                if sent is not None and sent.groups:
                    # the call a crash cut off, again with its key: trained once, whether or not
                    # its step committed before the crash
                    batch, key, sent = sent.groups, sent.key, None
                else:
                    batch, key = await self._next_batch(bar), None
                if batch is None:
                    break
                await self._train(batch, key)
                steps += 1
                bar.advance()
                self._show(bar)
                if self.cfg.eval_every and steps % self.cfg.eval_every == 0:
                    await self._evaluate()
        finally:
            producer.cancel()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(producer, *self.tasks, return_exceptions=True)
            bar.close()
        return PipelineResult(
            steps=steps,
            final_step=self.step,
            trained_groups=self.counts["trained"],
            stale_groups=self.counts["stale"],
            zero_variance_groups=self.counts["zero"],
            exceptions=self.counts["exceptions"],
            skipped_steps=self.counts["skipped"],
            rollouts=self.counts["rollouts"],
            resumed_groups=n_resumed,
            wall_seconds=self._now(),
            timeline=self.timeline,
            history=self.history,
        )

    # -- rollouts ----------------------------------------------------------------------------------

    async def _produce(self) -> None:
        try:
            async for scenario in _scenarios_of(self.t.scenarios):
                async with self.room:
                    await self.room.wait_for(lambda: self.in_flight < self.cap)
                    self.in_flight += 1
                # counted as rolling from here, not from when the task first runs: the trainer
                # must never see an empty queue and nothing rolling while a group is on its way
                self.rolling += 1
                self.rolling_starts[self.step] += 1
                task = asyncio.create_task(self._roll(scenario, self.step))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        finally:
            self.exhausted = True
            self.queue.put_nowait(None)

    async def _roll(self, scenario: S, step: int) -> None:
        start = self._now()
        try:
            group = TrajectoryGroup(self.t.rollout(self.model, scenario) for _ in range(self.cfg.group_size))
            await group.resolve(self._on_result)
            if self.t.after_each is not None and group.trajectories:
                out: Any = self.t.after_each(group)
                if inspect.isawaitable(out):
                    out = await out
                group = out if isinstance(out, TrajectoryGroup) else group
        except Exception as e:
            # `after_each` raised (a rollout's own exception is on the group): the group is lost,
            # its place freed, and the run goes on, as a judge error in `gather` would not
            log.exception("pipeline: a group failed after its rollouts; it is not trained")
            self.counts["exceptions"] += 1
            self.raised.append(e)
            await self._release(1)
            self.queue.put_nowait(None)  # the trainer may be waiting on this very group
            return
        finally:
            self.rolling -= 1
            self.rolling_starts[step] -= 1
        gid = secrets.token_hex(12)
        self.journal.add(gid, group)  # before it can train: a crash from here on keeps it
        self.timeline.append(TimelineEvent(kind="rollout", start=start, end=self._now(), step=step))
        self.queue.put_nowait((gid, group))

    def _on_result(self, group: TrajectoryGroup, end: RolloutEnd) -> None:
        self.counts["rollouts"] += 1
        if end == "exception":
            self.counts["exceptions"] += 1
            if (e := group.exceptions[-1].exception) is not None:
                self.raised.append(e)

    async def _release(self, n: int) -> None:
        async with self.room:
            self.in_flight -= n
            self.room.notify_all()

    # -- training ----------------------------------------------------------------------------------

    def _too_many_exceptions(self) -> bool:
        limit = self.cfg.max_exceptions
        if 0 < limit < 1:
            limit = limit * max(1, self.counts["rollouts"])
        return self.counts["exceptions"] > limit

    async def _next_batch(self, bar: _Bar) -> list[tuple[str, TrajectoryGroup]] | None:
        """The next step's groups, oldest first, dropping stale and signal-less ones on the way;
        None when the scenarios ran out before a whole step was ready.

        Oldest first, and waiting for a group still rolling that would be stale at the next step:
        groups start in waves (a step frees its groups' places at once), so two steps in a row
        otherwise take the young groups of a wave and leave its old ones to go stale."""
        n = self.cfg.groups_per_step
        while True:
            while not self.queue.empty():
                await self._admit(self.queue.get_nowait(), bar)
            for entry in [e for e in self.ready if self._stale(self.oldest[e[0]])]:
                self.ready.remove(entry)
                await self._drop(entry[0], "stale", bar)
            if len(self.ready) >= n and not self._worth_waiting(n):
                self.ready.sort(key=lambda e: self.oldest[e[0]] or 0)
                return await self._take(self.ready[:n])
            if self.exhausted and self.queue.empty() and not self.rolling:
                return await self._take(self.ready) or None  # the scenarios ran out: what there is
            await self._admit(await self.queue.get(), bar)

    async def _take(self, batch: list[tuple[str, TrajectoryGroup]]) -> list[tuple[str, TrajectoryGroup]]:
        taken = {gid for gid, _ in batch}
        self.ready = [e for e in self.ready if e[0] not in taken]
        for gid in taken:
            del self.oldest[gid]
        await self._release(len(batch))
        return batch

    def _worth_waiting(self, n: int) -> bool:
        """Whether a group still rolling would be stale after this step and could take a place in
        it that a younger group would otherwise take."""
        edge = self.step - self.cfg.max_steps_off_policy
        urgent_ready = sum(1 for gid, _ in self.ready if (self.oldest[gid] or 0) <= edge)
        urgent_rolling = sum(c for s, c in self.rolling_starts.items() if s <= edge)
        return urgent_ready < n and urgent_rolling > 0

    async def _admit(self, item: tuple[str, TrajectoryGroup] | None, bar: _Bar) -> None:
        """A finished group into `ready`, unless it is unfit (dropped, its place freed)."""
        if item is None:
            return  # the scenarios ran out, or a group was lost: `_next_batch` looks again
        gid, group = item
        if self._too_many_exceptions():
            raise TooManyExceptionsError(
                self.counts["exceptions"],
                self.counts["rollouts"],
                self.cfg.max_exceptions,
                [g for _, g in self.ready] + [group],
                self.raised,
            )
        oldest = oldest_step(group)
        why = self._unfit(group, oldest)
        if why is not None:
            await self._drop(gid, why, bar)
        else:
            self.ready.append((gid, group))
            self.oldest[gid] = oldest

    async def _drop(self, gid: str, why: Literal["stale", "zero"], bar: _Bar) -> None:
        self.oldest.pop(gid, None)
        await self._release(1)
        self.counts[why] += 1
        self.journal.settle([gid], why, self.step)
        self._show(bar)

    def _stale(self, oldest: int | None) -> bool:
        return oldest is not None and self.step - oldest > self.cfg.max_steps_off_policy

    def _unfit(self, group: TrajectoryGroup, oldest: int | None) -> Literal["stale", "zero"] | None:
        if not group.trajectories:
            return "zero"
        if self._stale(oldest):
            return "stale"
        skips = self.cfg.skip_zero_variance and self.cfg.train.distill is None
        if skips and not group.has_signal(self.cfg.train.min_reward_spread):
            return "zero"
        return None

    async def _train(self, batch: list[tuple[str, TrajectoryGroup]], key: str | None = None) -> None:
        ids = [gid for gid, _ in batch]
        key = key or "pipeline-" + hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:32]
        self.journal.settle(ids, "training", self.step, key)  # a restart retries this very call
        start, step = self._now(), self.step
        # shielded: a cancel (Ctrl-C) lets the step commit, then the run stops
        self.training = task = asyncio.create_task(
            self.model.train([g for _, g in batch], self.cfg.train, idempotency_key=key)
        )
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            result = await task
            self._trained(ids, batch, result, start, step)
            raise
        self._trained(ids, batch, result, start, step)

    def _trained(
        self,
        ids: list[str],
        batch: list[tuple[str, TrajectoryGroup]],
        result: TrainResult,
        start: float,
        step: int,
    ) -> None:
        self.journal.settle(ids, "trained", result.step)
        self.counts["trained"] += len(batch)
        self.counts["skipped"] += result.skipped  # the backend logged why; the bar counts them
        self.step = result.step
        self.timeline.append(TimelineEvent(kind="train", start=start, end=self._now(), step=step))
        row = {
            **result.metrics,
            "pipeline/stale_groups": float(self.counts["stale"]),
            "pipeline/zero_variance_groups": float(self.counts["zero"]),
            "pipeline/queue": float(self.queue.qsize() + len(self.ready)),
            "pipeline/rolling": float(self.rolling),
            "pipeline/step_rollouts": float(sum(len(g.trajectories) for _, g in batch)),
            "pipeline/exceptions": float(self.counts["exceptions"]),
            "pipeline/skipped": float(result.skipped),
        }
        self.history.append(row)
        self.last_metrics = row

    async def _evaluate(self) -> None:
        start, step = self._now(), self.step
        groups = [TrajectoryGroup([self.t.rollout(self.model, s)]) for s in self.t.eval_scenarios]
        await asyncio.gather(*(g.resolve() for g in groups))
        kept = [g for g in groups if g.trajectories]
        if kept:
            await self.model.log(kept, split="val")
        self.timeline.append(TimelineEvent(kind="eval", start=start, end=self._now(), step=step))

    def _show(self, bar: _Bar) -> None:
        m = self.last_metrics
        bar.show(
            step=self.step,
            rolling=self.rolling,
            queue=self.queue.qsize() + len(self.ready),
            stale=self.counts["stale"],
            zero=self.counts["zero"],
            skipped=self.counts["skipped"] or None,
            behind=f"{m['staleness_mean']:.2f}" if "staleness_mean" in m else None,
            reward=f"{m['reward']:.3f}" if "reward" in m else None,
        )


__all__ = ["PipelineConfig", "PipelineResult", "PipelineTrainer", "TimelineEvent"]
