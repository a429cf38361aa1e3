"""Live training of one served model: episodes from live traffic, outcomes whenever they arrive,
candidates trained in the background, a gate before anything serves, rollback. See docs/live.md.

An episode is a capture id (`x-journeyman-capture: <id>` on its requests; the endpoint files each
call under it). Its outcome (`report_outcome`) takes the calls filed so far, joins them into one
trajectory by core's rule (`rollout/histories.py`) and writes it to the journal before it answers,
so `kill -9` loses no scored episode. Calls that arrive within `settle_s` after the outcome join it
too. When enough scored episodes wait, a step trains from the promoted step (never from a rejected
candidate) on the exact served tokens, each with its advantage (`rollout/baseline.py`) as its reward;
the new checkpoint is a candidate, served beside the promoted step (as `name@<step>` and to the
canary share of new episodes) until the gate decides. Every decision is a history row.

An episode is the calls of the token that reports its outcome (`rollout/capture.py`: another
token's requests under the same id are another episode). An outcome is checked whole before anything
happens (`EpisodeOutcome`'s bounds: a finite reward within ±MAX_OUTCOME_REWARD, so the baseline and
every statistic made of rewards stay finite); its calls are taken, and the baseline moves, only once
it is on disk. A batch that cannot train (an episode journaled before those bounds, or a train call
that failed MAX_BATCH_FAILURES times for the batch's own fault, as a non-finite loss) is set aside
with its reason: a history row, `set_aside` in the counts and in settled.jsonl; never retried.

<run_dir>/live/
    groups.jsonl, settled.jsonl   the journal (`data/journal.py`) of scored episodes, a group of
                                  one trajectory each (metadata: episode id, group key, baseline at
                                  arrival, serving step); every line is fsynced before the answer
    state.json                    promoted step, the candidate, each candidate's parent
    open_calls.jsonl              the calls of episodes whose outcome has not come (`Captures.
                                  keep_on_disk`): filed again after a restart
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from journeyman.backends.service import ServedModel
from journeyman.backends.store import write_atomic
from journeyman.backends.train_step import GRPOUpdate, check_groups, run_step
from journeyman.client.protocol import Evaluate
from journeyman.client.wire import body_error
from journeyman.data.budget import BudgetExceededError, Meter
from journeyman.data.config import TrainConfig, TrainResult
from journeyman.data.journal import GroupJournal
from journeyman.data.live_types import (
    MAX_OUTCOME_REWARD,
    Decision,
    DecisionAction,
    EpisodeOutcome,
    LiveConfig,
    LiveStatus,
    OutcomeReceipt,
)
from journeyman.data.provenance import oldest_step, trained_records
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError
from journeyman.rollout.baseline import RunningBaseline, advantages
from journeyman.rollout.capture import CapturedCall, Captures, capture_key
from journeyman.rollout.histories import join_calls, trajectory_of

log = logging.getLogger("journeyman.backends.live_training")

TICK_S = 0.2
KEPT_DECISIONS = 20
MAX_BATCH_FAILURES = 3  # failed train calls of one batch, for a fault of its own, before it is set aside
RETRY_S = 1.0  # a failed batch is tried again after this, doubled each failure (at most RETRY_MAX_S)
RETRY_MAX_S = 60.0  # the longest wait before a failed batch is tried again
_OWN_FAULTS = (ValueError, TypeError, KeyError, ArithmeticError)
"""What a batch's own content raises (a refused field, a non-finite loss: `grad_norm=nan`): after
MAX_BATCH_FAILURES it is set aside. Anything else (a disk, an engine) is the server's, tried again."""

TrainFrom = Callable[[list[TrajectoryGroup], TrainConfig, str, int], Awaitable[TrainResult]]
"""`(groups, config, idempotency key, parent step)`: a step from `parent`; the result's step is the
new checkpoint, which is written but not served."""


@dataclass
class LiveServices:
    """What live training needs of the backend that serves the model."""

    name: str
    captures: Captures
    side_steps: dict[int, Path]
    """The endpoint's steps served beside the promoted one (`Endpoint.side_steps`)."""
    set_route: Callable[[Callable[[str | None], int | None] | None], None]
    train_from: TrainFrom
    serve: Callable[[int], Awaitable[None]]
    """Serve `step` on the bare model name (adapter and optimizer back to it: the next step trains from it)."""
    checkpoint_dir: Callable[[int], Path]
    latest_step: Callable[[], int]
    record: Callable[[dict[str, Any]], None]
    """Append a history row."""
    meter: Meter | None = None
    """The run's spend against its budget (`live status` shows it)."""


@dataclass
class _Settling:
    """A scored episode whose later calls may still come (until `until`, time.monotonic)."""

    outcome: EpisodeOutcome
    calls: list[CapturedCall]
    baseline: float
    until: float
    key: str  # its capture key: the episode id of the token that reported it (`capture_key`)
    group: TrajectoryGroup | None = None  # as last written


def _served_step(group: TrajectoryGroup) -> int | None:
    records = trained_records([group])
    return records[0].step if records else None


def _replay(
    journal: GroupJournal,
) -> tuple[dict[str, EpisodeOutcome], RunningBaseline, list[tuple[int | None, float]]]:
    """What the journal says so far: each scored episode's outcome by id, the baselines they moved,
    and (serving step, reward) in arrival order. A reward outside the range outcomes have (a journal
    written before they were bounded) moves nothing; its episode is set aside when it comes to train."""
    known: dict[str, EpisodeOutcome] = {}
    baseline = RunningBaseline()
    scored: list[tuple[int | None, float]] = []
    for row in GroupJournal.lines(journal.groups):
        if row["id"] in known:
            continue
        t = TrajectoryGroup.model_validate(row["group"])
        outcome = t.trajectories[0].metadata["outcome"]
        try:
            known[row["id"]] = EpisodeOutcome.model_validate(outcome)
        except ValidationError:  # past today's bounds: still an outcome, never trained (`_unfit`)
            known[row["id"]] = EpisodeOutcome.model_construct(**outcome)
            continue
        baseline.add(outcome.get("group"), outcome["reward"])
        scored.append((_served_step(t), outcome["reward"]))
    return known, baseline, scored


def _unfit(group: TrajectoryGroup) -> str | None:
    """Why a journaled episode cannot train (one written before outcomes were bounded), or None."""
    t = group.trajectories[0]
    reward, baseline = t.reward, t.metadata.get("baseline")
    if not (math.isfinite(reward) and abs(reward) <= MAX_OUTCOME_REWARD):
        return f"reward {reward!r} is outside ±{MAX_OUTCOME_REWARD:g} (MAX_OUTCOME_REWARD)"
    if not isinstance(baseline, int | float) or not abs(baseline) <= MAX_OUTCOME_REWARD:
        return f"its baseline {baseline!r} is not a number within ±{MAX_OUTCOME_REWARD:g}"
    return None


def _decision_row(d: Decision, parent: int | None, extra: dict[str, float]) -> dict[str, Any]:
    """A decision's history row (`extra`: the numbers behind it, as `live/<name>`)."""
    row: dict[str, Any] = {"step": d.step, "split": "live", "decision": d.action, "served": d.served}
    row.update({"parent": parent, "reason": d.reason, "by": d.by})
    return {**row, **{f"live/{k}": v for k, v in extra.items()}}


def _var(xs: list[float]) -> float:
    return statistics.variance(xs) if len(xs) >= 2 else 0.0


class LiveRun:
    """The live state of one model: outcomes, the journal, the trainer loop, the gate."""

    def __init__(
        self, run_dir: Path, services: LiveServices, config: LiveConfig, evaluate: Evaluate | None = None
    ) -> None:
        self.s, self.config, self.evaluate = services, config, evaluate
        self.folder = run_dir / "live"
        self.journal = GroupJournal(self.folder, fsync=True)
        self.state_path = self.folder / "state.json"
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.promoted: int = int(state.get("promoted", services.latest_step()))
        self.candidate: int | None = state.get("candidate")
        self.parents: dict[int, int] = {int(k): v for k, v in state.get("parents", {}).items()}
        self.rejected: set[int] = set(state.get("rejected", []))
        self.decisions = [Decision.model_validate(d) for d in state.get("decisions", [])]
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "outcomes",
                "duplicates",
                "refused_expired",
                "unknown",
                "stale",
                "trained",
                "steps",
                "set_aside",
                "decided_promote",
                "decided_reject",
                "decided_rollback",
            ),
            0,
        )
        self.known, self.baseline, self.scored = _replay(self.journal)
        self.counts["outcomes"] = len(self.known)
        sent, waiting = self.journal.pending()
        self.sent = sent  # a train call a kill cut off: retried first, with its key
        now = time.monotonic()
        self.waiting: dict[str, tuple[TrajectoryGroup, float]] = {gid: (g, now) for gid, g in waiting}
        self.settling: dict[str, _Settling] = {}
        self.task: asyncio.Task[None] | None = None
        self.busy: asyncio.Task[Any] | None = None  # a step training or a gate evaluating
        self.candidate_since = len(self.scored)  # index into `scored` when the candidate began to be judged
        self.evaluated: set[int] = set()  # candidates the eval function has judged
        self.scores: dict[int, float] = {}  # each step's eval score (scored once)
        # (step, eval) of the best step promoted under this evaluation; in memory like the scores, as
        # another run's (or another eval function's) numbers do not compare
        self.best: tuple[int, float] | None = None
        self.error: str | None = None
        self.failures: dict[str, int] = {}  # failed train calls each waiting episode was in, so far
        self.retry_at = 0.0  # time.monotonic() before which a failed batch is not tried again

    # -- the served steps --------------------------------------------------------------------

    async def start(self) -> None:
        """Serve the promoted step on the bare name (a restart finds the latest checkpoint loaded),
        the candidate beside it, and run the loop."""
        await self.s.serve(self.promoted)
        self._serve_candidate()
        self.s.captures.max_age_s = self.config.episode_ttl_s
        # open episodes' calls on disk as they are filed: an outcome after a crash finds them
        restored = await asyncio.to_thread(self.s.captures.keep_on_disk, self.folder / "open_calls.jsonl")
        if restored:
            log.info("%s: %d calls of open episodes restored from before a restart", self.s.name, restored)
        if self.task is None:
            self.task = asyncio.create_task(self._loop())

    def stop(self) -> None:
        """Stop the loop. A step or a decision under way is not cut off (a step cut off in the middle
        would leave the weights changed and unsaved): `close` waits for it."""
        if self.task is not None:
            self.task.cancel()
        self.task = None
        self.s.set_route(None)

    async def close(self) -> None:
        """Stop the loop and wait for the step or decision under way, if any."""
        self.stop()
        if self.busy is not None:
            with contextlib.suppress(Exception):
                await self.busy

    def _serve_candidate(self) -> None:
        self.s.side_steps.clear()
        if self.candidate is None:
            self.s.set_route(None)
            return
        self.s.side_steps[self.candidate] = self.s.checkpoint_dir(self.candidate)
        self.s.set_route(self._route)

    def _route(self, episode_id: str | None) -> int | None:
        """The canary: a share of episodes, by a hash of their id (every call of one episode alike)."""
        share, candidate = self.config.gate.canary_share, self.candidate
        if episode_id is None or candidate is None or share <= 0:
            return None
        h = int.from_bytes(hashlib.sha256(f"{candidate}:{episode_id}".encode()).digest()[:8], "big")
        return candidate if h / 2**64 < share else None

    def _save(self) -> None:
        state = {
            "promoted": self.promoted,
            "candidate": self.candidate,
            "parents": self.parents,
            "rejected": sorted(self.rejected),
            "decisions": [d.model_dump() for d in self.decisions[-KEPT_DECISIONS:]],
        }
        write_atomic(self.state_path, json.dumps(state, indent=1))

    # -- outcomes ----------------------------------------------------------------------------

    def report(self, outcome: EpisodeOutcome) -> OutcomeReceipt:
        """Record an episode's outcome (idempotent: the same outcome again changes nothing). The
        episode is the calls the caller's own token filed under its id (`capture_key`). They are
        taken, and the baseline moves, only once the episode is on disk: an outcome refused or
        failed leaves everything as it was, and a good one can be posted again."""
        eid = outcome.episode_id
        key = capture_key(eid)
        if key in self.known:
            if self.known[key] != outcome:
                raise InvalidFieldError(
                    "reward",
                    outcome.reward,
                    f"episode {eid!r} already has an outcome (reward {self.known[key].reward}); an outcome is final",
                )
            self.counts["duplicates"] += 1
            settling = self.settling.get(key)
            calls = len(settling.calls) if settling is not None else 0
            return OutcomeReceipt(episode_id=eid, status="duplicate", calls=calls, step=None)
        calls = self.s.captures.peek(key)
        if not calls:
            if self.s.captures.was_dropped(key):
                self.counts["refused_expired"] += 1
                raise InvalidFieldError(
                    "episode_id",
                    eid,
                    f"expired: no outcome came within episode_ttl_s ({self.config.episode_ttl_s:g} s) of its last call",
                )
            self.counts["unknown"] += 1
            raise InvalidFieldError(
                "episode_id",
                eid,
                "no request carried it (header x-journeyman-capture), or another outcome took its calls",
            )
        baseline = self.baseline.value(outcome.group)
        settling = _Settling(outcome, calls, baseline, time.monotonic() + self.config.settle_s, key)
        group = self._write(settling, calls)  # on disk before the answer: a kill loses none
        self.s.captures.take(key, len(calls))
        self.baseline.add(outcome.group, outcome.reward)
        self.known[key] = outcome
        self.counts["outcomes"] += 1
        step = _served_step(group)
        self.scored.append((step, outcome.reward))
        self.settling[key] = settling
        return OutcomeReceipt(episode_id=eid, status="accepted", calls=len(calls), step=step)

    def _write(self, e: _Settling, calls: list[CapturedCall]) -> TrajectoryGroup:
        """The episode of `calls` into the journal (fsynced); then it is `e`'s (`e.calls`, `e.group`)."""
        meta = {"episode_id": e.outcome.episode_id, "outcome": e.outcome.model_dump(), "baseline": e.baseline}
        t: Trajectory = trajectory_of(
            join_calls(calls), reward=e.outcome.reward, metrics=dict(e.outcome.metrics), metadata=meta
        )
        group = TrajectoryGroup([t])
        self.journal.add(e.key, group)
        e.calls, e.group = calls, group
        return group

    def _settle(self) -> None:
        now = time.monotonic()
        for key, e in list(self.settling.items()):
            if self.s.captures.in_flight(key):  # a call of it is being answered: wait for it
                e.until = now + self.config.settle_s
                continue
            later = self.s.captures.peek(key)
            if later:  # calls served after the outcome: the episode is written again, whole
                self._write(e, e.calls + later)
                self.s.captures.take(key, len(later))
                e.until = now + self.config.settle_s
            elif now >= e.until:
                del self.settling[key]
                assert e.group is not None
                self.waiting[key] = (e.group, now)

    # -- the loop ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the loop goes on; status shows the error
                log.exception("live loop")
                self.error = f"{type(e).__name__}: {e}"
            await asyncio.sleep(TICK_S)

    async def tick(self) -> None:
        """One round: expire, settle, and start a step or a gate evaluation if one is due."""
        self.s.captures.expire()
        self._settle()
        if self.busy is not None and not self.busy.done():
            return
        if self.busy is not None:
            error = self.busy.exception() if not self.busy.cancelled() else None
            self.busy = None
            if error is not None:
                self.error = f"{type(error).__name__}: {error}"
                log.error("live: %s", self.error)
        if not self.config.enabled:
            return
        if self.candidate is not None:
            if self.evaluate is not None and self.candidate not in self.evaluated:
                self.busy = asyncio.create_task(self._evaluate(self.candidate))
            else:
                self._judge_canary()
            return
        self._check_rollback()
        if time.monotonic() < self.retry_at:  # a batch failed: not again at once
            return
        batch = self._due()
        if batch is not None:
            self.busy = asyncio.create_task(self._train(*batch))

    def _due(self) -> tuple[list[tuple[str, TrajectoryGroup]], str | None] | None:
        if self.sent is not None:  # kept until it trains or is set aside
            return self.sent.groups, self.sent.key
        for eid, (group, _) in list(self.waiting.items()):  # too far behind the step it would train
            oldest = oldest_step(group)
            if oldest is not None and self.promoted - oldest > self.config.max_steps_off_policy:
                del self.waiting[eid]
                self.journal.settle([eid], "stale", self.promoted)
                self.counts["stale"] += 1
        c = self.config
        ready = list(self.waiting.items())
        if len(ready) >= c.episodes_per_step:
            due = True
        elif c.max_wait_s is not None and len(ready) >= c.min_episodes:
            due = time.monotonic() - min(at for _, (_, at) in ready) >= c.max_wait_s
        else:
            due = False
        if not due:
            return None
        return [(eid, g) for eid, (g, _) in ready[: c.episodes_per_step]], None

    async def _train(self, batch: list[tuple[str, TrajectoryGroup]], key: str | None) -> None:
        """Train `batch` (with `key`: the call a restart retries). An episode that cannot train is set
        aside first; a call that fails for the batch's own fault MAX_BATCH_FAILURES times sets the
        batch aside, one that fails otherwise is tried again later (RETRY_S, doubling)."""
        parent = self.promoted
        why = {eid: _unfit(g) for eid, g in batch}
        for reason in dict.fromkeys(w for w in why.values() if w is not None):
            self._set_aside([eid for eid, w in why.items() if w == reason], parent, reason)
        batch = [(eid, g) for eid, g in batch if why[eid] is None]
        ids = [eid for eid, _ in batch]
        if not ids:
            return
        key = key or "live-" + hashlib.sha256("\n".join(ids).encode()).hexdigest()[:32]
        self.journal.settle(ids, "training", parent, key)  # a restart retries this very call
        try:
            groups = _advantage_groups([g for _, g in batch])
            result = await self.s.train_from(groups, self.config.train, key, parent)
        except BudgetExceededError as e:  # the run stops here; its episodes wait in the journal
            self.error = f"stopped: {e}"
            self.s.record({"step": parent, "split": "live", "stopped": str(e)})
            log.warning("live %s: %s", self.s.name, self.error)
            self.stop()
            return
        except Exception as e:
            if not self._failed(ids, parent, e):
                raise  # the loop shows it (`status().error`) and tries the batch again later
            return
        self.journal.settle(ids, "trained", result.step)
        self.sent = None
        for eid in ids:
            self.waiting.pop(eid, None)
            self.failures.pop(eid, None)
        self.counts["trained"] += len(ids)
        self.counts["steps"] += 1
        log.info("live %s: %d episodes trained: %s", self.s.name, len(ids), result.skip_reason or result.step)
        if result.skipped or result.step == parent:
            return
        self.parents[result.step] = parent
        self.candidate = result.step
        self.candidate_since = len(self.scored)  # index into `scored` when the candidate began to be judged
        self._save()
        self._serve_candidate()

    def _failed(self, ids: list[str], parent: int, e: Exception) -> bool:
        """Count a failed train call of `ids`; True when that set them aside (the batch's own fault,
        MAX_BATCH_FAILURES times), else the batch waits RETRY_S (doubling) before it is tried again."""
        n = max(self.failures.get(eid, 0) for eid in ids) + 1
        self.failures.update(dict.fromkeys(ids, n))
        if isinstance(e, _OWN_FAULTS) and n >= MAX_BATCH_FAILURES:
            self._set_aside(ids, parent, f"its train call failed {n} times: {type(e).__name__}: {e}"[:500])
            return True
        self.retry_at = time.monotonic() + min(RETRY_MAX_S, RETRY_S * 2 ** (n - 1))
        return False

    def _set_aside(self, ids: list[str], parent: int, reason: str) -> None:
        """Episodes that cannot train: never trained (kept in the journal, `set_aside` in
        settled.jsonl), counted, and a history row says why."""
        self.journal.settle(ids, "set_aside", parent)
        for eid in ids:
            self.waiting.pop(eid, None)
            self.failures.pop(eid, None)
        if self.sent is not None:  # the rest of a call a restart retries goes on without them
            self.sent.groups = [(i, g) for i, g in self.sent.groups if i not in ids]
            self.sent = self.sent if self.sent.groups else None
        self.counts["set_aside"] += len(ids)
        self.error = f"set aside {len(ids)} episodes: {reason}"
        self.s.record({"step": parent, "split": "live", "set_aside": len(ids), "reason": reason})
        log.warning("live %s: %s", self.s.name, self.error)

    # -- the gate ----------------------------------------------------------------------------

    async def _evaluate(self, candidate: int) -> None:
        """The user's evaluation of the candidate and of the promoted step (each step scored once);
        a worse candidate is rejected, else promoted, or left to the canary when it has a share."""
        assert self.evaluate is not None
        try:
            for step in (candidate, self.promoted):
                if step not in self.scores:
                    self.scores[step] = await self.evaluate(f"{self.s.name}@{step}")
        except Exception as e:  # a gate that cannot evaluate does not promote
            self.evaluated.add(candidate)
            await self.decide(
                "reject", candidate, f"evaluation failed: {type(e).__name__}: {e}"[:500], "gate"
            )
            return
        mine, theirs = self.scores[candidate], self.scores[self.promoted]
        self.evaluated.add(candidate)
        if self.best is None or theirs > self.best[1]:
            self.best = (self.promoted, theirs)
        bar_step, bar = (self.promoted, theirs)
        if self.config.gate.against == "best":
            bar_step, bar = self.best
        margin = self.config.gate.margin
        kind = "best so far, " if bar_step != self.promoted else ""
        numbers = f"eval {mine:.3f} vs {bar:.3f} for step {bar_step} ({kind}margin {margin:g})"
        extra = {"eval": mine, "eval_promoted": theirs, "eval_bar": bar}
        if mine < bar - margin:
            await self.decide("reject", candidate, f"evaluation: worse, {numbers}", "gate", extra)
        elif self.config.gate.canary_share <= 0:
            await self.decide("promote", candidate, f"evaluation: not worse, {numbers}", "gate", extra)

    def canary(self) -> tuple[list[float], list[float]]:
        """Live rewards since the candidate was made: (the candidate's, the promoted step's)."""
        since = self.scored[self.candidate_since :]
        return (
            [r for s, r in since if s == self.candidate],
            [r for s, r in since if s == self.promoted],
        )

    def _judge_canary(self) -> None:
        g = self.config.gate
        if g.canary_share <= 0 or self.candidate is None:
            return  # a person (or an eval function) decides
        mine, theirs = self.canary()
        if min(len(mine), len(theirs)) < g.canary_episodes:
            return
        m, t = statistics.fmean(mine), statistics.fmean(theirs)
        diff = m - t
        se = math.sqrt(_var(mine) / len(mine) + _var(theirs) / len(theirs))
        numbers = (
            f"canary {m:.3f} (n={len(mine)}) vs {t:.3f} (n={len(theirs)}) for step "
            f"{self.promoted}: difference {diff:+.3f}, SE {se:.3f}"
        )
        extra = {"canary_reward": m, "canary_promoted_reward": t, "canary_se": se}
        if diff < -g.margin - g.z * se:
            action: DecisionAction = "reject"
            reason = f"{numbers}: worse by more than margin {g.margin:g} + {g.z:g} SE"
        else:
            action, reason = "promote", f"{numbers}: not worse by more than margin {g.margin:g} + {g.z:g} SE"
        self.busy = asyncio.create_task(self.decide(action, self.candidate, reason, "gate", extra))

    def _check_rollback(self) -> None:
        g, step = self.config.gate, self.promoted
        parent = self.parents.get(step)
        if parent is None or self.busy is not None:
            return
        mine = [r for s, r in self.scored if s == step][-g.rollback_episodes :]
        theirs = [r for s, r in self.scored if s == parent]
        if len(mine) < g.rollback_episodes or not theirs:
            return
        m, t = statistics.fmean(mine), statistics.fmean(theirs)
        if m < t - g.rollback_drop:
            reason = (
                f"live reward {m:.3f} over its last {len(mine)} episodes is below its parent "
                f"step {parent}'s {t:.3f} by more than rollback_drop {g.rollback_drop:g}"
            )
            extra = {"live_reward": m, "parent_reward": t}
            self.busy = asyncio.create_task(self.decide("rollback", step, reason, "rollback", extra))

    async def decide(
        self,
        action: DecisionAction,
        step: int | None,
        reason: str,
        by: str,
        extra: dict[str, float] | None = None,
    ) -> Decision:
        """Promote or reject a candidate, or roll the promoted step back (to `step`'s parent): the
        served steps change, and the decision is a history row."""
        if action in ("promote", "reject"):
            step = self.candidate if step is None else step
            if step is None:
                raise InvalidFieldError("step", None, f"no candidate to {action}: name a step")
            if action == "reject" and step != self.candidate:
                raise InvalidFieldError("step", step, f"is not the candidate ({self.candidate})")
            if not 0 <= step <= self.s.latest_step():
                raise InvalidFieldError("step", step, f"the run has steps 0..{self.s.latest_step()}")
            if action == "promote":
                await self.s.serve(step)
                self.promoted = step
                self.rejected.discard(step)
                score = self.scores.get(step)
                if score is not None and (self.best is None or score > self.best[1]):
                    self.best = (step, score)
            else:
                self.rejected.add(step)
            if step == self.candidate:
                self.candidate = None
        else:
            rolled = self.promoted if step is None else step
            if rolled != self.promoted:
                raise InvalidFieldError("step", rolled, f"is not the promoted step ({self.promoted})")
            parent = self.parents.get(rolled)
            if parent is None:
                raise InvalidFieldError("step", rolled, "has no parent on record to roll back to")
            await self.s.serve(parent)
            self.promoted = parent
            self.rejected.add(rolled)
            if self.best is not None and self.best[0] == rolled:
                self.best = None  # a bar its live traffic refuted; the next evaluation sets another
            step = rolled
            self.candidate = None  # a candidate made from the rolled-back step is not judged further
        decision = Decision(
            action=action, step=step, served=self.promoted, reason=reason, by=by, at=time.time()
        )
        self.decisions.append(decision)
        self.counts[f"decided_{action}"] += 1
        self._save()
        self._serve_candidate()
        self.s.record(_decision_row(decision, self.parents.get(step), extra or {}))
        log.info("live %s: %s step %d (%s); serving %d", self.s.name, action, step, reason, self.promoted)
        return decision

    # -- status ------------------------------------------------------------------------------

    def status(self) -> LiveStatus:
        mine, theirs = self.canary() if self.candidate is not None else ([], [])
        counts = {**self.counts, "expired": self.s.captures.dropped}
        meter = self.s.meter
        return LiveStatus(
            enabled=self.config.enabled,
            promoted=self.promoted,
            candidate=self.candidate,
            latest=self.s.latest_step(),
            episodes_open=len(self.s.captures),
            episodes_waiting=len(self.waiting) + len(self.settling),
            counts=counts,
            canary={
                "candidate_episodes": float(len(mine)),
                "candidate_reward": statistics.fmean(mine) if mine else 0.0,
                "promoted_episodes": float(len(theirs)),
                "promoted_reward": statistics.fmean(theirs) if theirs else 0.0,
            },
            decisions=self.decisions[-KEPT_DECISIONS:],
            busy=self.busy is not None and not self.busy.done(),
            error=self.error,
            spent=meter.spent() if meter is not None else {},
            limits=meter.budget.limits() if meter is not None else {},
        )


def _advantage_groups(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The batch as trained: each episode's reward replaced by its advantage (`rollout/baseline.py`),
    the raw reward kept as the metric `live_reward`; episodes sharing a key form one group."""
    episodes = [g.trajectories[0] for g in groups]
    keyed = [(t.metadata["outcome"].get("group"), t.reward, float(t.metadata["baseline"])) for t in episodes]
    out: dict[Any, list[Trajectory]] = {}
    for i, (t, a) in enumerate(zip(episodes, advantages(keyed), strict=True)):
        trained = t.model_copy(update={"reward": a, "metrics": {**t.metrics, "live_reward": t.reward}})
        key = keyed[i][0]
        out.setdefault(key if key is not None else ("lone", i), []).append(trained)
    return [TrajectoryGroup(ts) for ts in out.values()]


# -- a served model's live training (what `LocalBackend`'s live operations call) -------------------


async def start_live(
    s: ServedModel, config: LiveConfig, evaluate: Evaluate | None, *, resumed: bool = False
) -> LiveStatus:
    """Start (or reconfigure) live training of `s`. The settings are kept in the run directory, so
    a restarted server goes on (`resumed`: from those settings); an `evaluate` function is not kept:
    its gate falls back to the canary, or to a person."""
    folder = s.store.root / "live"
    if not resumed:
        if not s.engine.serves_other_steps and (config.gate.canary_share > 0 or evaluate is not None):
            raise InvalidFieldError(
                "config.gate.canary_share",
                config.gate.canary_share,
                "this engine serves one step at a time: a candidate cannot be "
                "sampled beside the promoted step; set canary_share=0, no evaluate, and decide by command",
            )
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "config.json", config.model_dump_json(indent=1))
    old = s.live
    if old is not None:
        await live_run(s).close()  # a step under way finishes first
    if config.budget is not None and s.meter is not None:
        s.meter.configure(config.budget)  # what was spent stays counted

    async def train_from(
        groups: list[TrajectoryGroup], config: TrainConfig, key: str, parent: int
    ) -> TrainResult:
        update = GRPOUpdate(check_groups(groups), config)
        return await run_step(
            s, update, idempotency_key=key, on_progress=None, trained_by="live", parent=parent
        )

    async def serve(step: int) -> None:
        async with s.step_lock:
            s.store.check_step(step)
            await s.serve_trained(step)

    def set_route(route: Callable[[str | None], int | None] | None) -> None:
        s.endpoint.route = route

    services = LiveServices(
        name=s.model.name,
        captures=s.endpoint.captures,
        side_steps=s.endpoint.side_steps,
        set_route=set_route,
        train_from=train_from,
        serve=serve,
        checkpoint_dir=s.store.checkpoint_dir,
        latest_step=s.store.latest_step,
        record=s.record,
        meter=s.meter,
    )
    run = LiveRun(s.store.root, services, config, evaluate)
    if isinstance(old, LiveRun):  # reconfigured: the counts go on (outcomes are counted from the journal)
        run.counts.update({k: v for k, v in old.counts.items() if k != "outcomes"})
    s.live = run
    await run.start()
    return run.status()


async def resume_live(s: ServedModel) -> None:
    """Live training again as it was configured, if it was (a registered model's run directory)."""
    path = s.store.root / "live" / "config.json"
    if path.exists():
        await start_live(s, LiveConfig.model_validate_json(path.read_text()), None, resumed=True)


def live_run(s: ServedModel) -> LiveRun:
    if not isinstance(s.live, LiveRun):
        raise InvalidFieldError(
            "model", s.model.name, "live training is off: start it (model.live, or `journeyman live start`)"
        )
    return s.live


def outcome_of(
    episode_id: str, reward: float, metrics: Mapping[str, float] | None, group: str | None
) -> EpisodeOutcome:
    """The outcome as posted, or the error naming the field a bad one got wrong."""
    try:
        return EpisodeOutcome(episode_id=episode_id, reward=reward, metrics=dict(metrics or {}), group=group)
    except ValidationError as e:
        raise body_error(e) from e


__all__ = ["Evaluate", "LiveRun", "LiveServices", "TrainFrom", "live_run", "resume_live", "start_live"]
