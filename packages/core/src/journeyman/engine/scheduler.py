"""The in-process engine's worker thread: it admits queued requests into the running batch between
two decode steps (continuous batching: a rollout whose tool call just returned does not wait for
unrelated ones), interleaves their chunked prefill with decoding, and runs torch work handed to it
(`call`) when no row is running.

Requests that cannot join the batch (samples of another step's adapter or of the base model:
`aside`) take turns with the served step's batches: one of them runs, then one batch of the served
step (every request queued for it), then the next of them, each step's (and the base's) queue in
rotation. The served step so waits for at most one request of another's, and each of those for at
most the batch running when it came plus one turn of every other queue: before this, a steady
stream of base-model requests ran 130 times in 90 s while the served step's waited all along.

A request whose caller is gone (the client disconnected, a timeout) leaves the batch at the next
decode step, and an aside stops at its next token: nothing decodes for nobody, and a training step
does not wait behind rows no one reads.

One request's failure stays that request's: a prefill that raises is retried with each of its
requests alone (a cost paid only on failure), and a row that raises while decoding takes only its
own request out (`BatchRunner.advance` reports it). A worker thread that dies fails the requests it
held and is replaced, a bounded number of times (`max_restarts`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from journeyman.engine.base import OnToken, Sample, SamplingParams, T, hand_over
from journeyman.engine.batch import BatchRunner
from journeyman.errors import EngineDownError

__all__ = ["Scheduler", "SchedulerConfig"]

log = logging.getLogger("journeyman.engine")


@dataclass
class SchedulerConfig:
    """How requests are gathered into batches, and how often a worker that dies is replaced."""

    max_batch_rows: int = 64  # rows sampled together at most
    # When no row runs, a new batch gathers requests until none has arrived for `batch_wait_s`, for at most
    # `batch_wait_max_s`. The endpoint hands a burst over one by one (rendering each takes a few
    # ms), so a fixed window from the first request split 32 concurrent rollouts into batches
    # of 1 and 31, and the 31 waited for the first to finish decoding.
    batch_wait_s: float = 0.05
    batch_wait_max_s: float = 0.25
    # A worker thread that dies (a bug, a call that raised past `_run_calls`) fails the jobs it
    # held and is replaced, as a dead replica is (`replicas`); one that dies more than
    # `max_restarts` times within `restart_window_s` stays down: a deterministic crash must not spin.
    max_restarts: int = 3
    restart_window_s: float = 60.0


@dataclass(eq=False)
class _Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[Sample]]
    on_token: OnToken | None = None  # told of each token as it is sampled (streaming)
    tenant: int = 0  # the model it samples from, among the runner's (`tenants`)


@dataclass(eq=False)
class _Call:
    """Torch work handed to the worker thread (`Scheduler.call`, `Scheduler.aside`)."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


Gone = Callable[[], bool]
"""Whether the caller of an `aside` request has given up (its work stops then)."""


_WAKE = object()  # queued by `call`, to wake a take blocked on the queue


class Scheduler:
    """Serves `submit`ted requests and `call`s on one worker thread, started at once."""

    def __init__(self, runner: BatchRunner[_Job], config: SchedulerConfig) -> None:
        self.runner = runner
        self.config = config
        self.batches = 0
        self.rows_joined = 0  # rows admitted while other rows were running
        self.served = 0
        self.cancelled = 0  # requests (and calls) whose caller left before they were answered
        self.restarts = 0
        self._deaths: list[float] = []  # when restarts happened, within the window
        # why requests are refused (closed, or the worker stays down); None while serving. Read and
        # set under `_lock` with each enqueue, so nothing is queued after the last drain.
        self._down: str | None = None
        self._lock = threading.Lock()
        # requests; None: close; `_WAKE`: a call is pending (in `_calls`), for a take blocked here
        self._queue: queue.Queue[_Job | object | None] = queue.Queue()
        self._calls: collections.deque[_Call] = collections.deque()  # run before the next batch
        # `aside` requests by queue (a step's adapter, the base), in turn; `_owed`: one of them ran
        # last, so the served step's next batch comes before another of them
        self._asides: collections.OrderedDict[str, collections.deque[_Call]] = collections.OrderedDict()
        self._owed = False
        self._running: list[_Job] = []  # the jobs whose rows the runner holds
        self.thread = self._start_worker()  # replaced when it dies

    @property
    def alive(self) -> bool:
        return self._down is None

    @property
    def queued(self) -> int:
        """Requests and calls waiting for the worker (a level, read from any thread)."""
        return self._queue.qsize() + len(self._calls) + sum(len(q) for q in list(self._asides.values()))

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_token: OnToken | None = None,
        tenant: int = 0,
    ) -> asyncio.Future[list[Sample]]:
        """Queue a request (checked already: see `BatchRunner.check_prompt`) for model `tenant`; its
        samples come on the returned future, of the running loop, and each token to `on_token` as it
        is sampled."""
        loop = asyncio.get_running_loop()
        job = _Job(prompt_ids, params, loop, loop.create_future(), on_token, tenant)
        with self._lock:
            if self._down is not None:
                raise EngineDownError(self._down)
            self._queue.put(job)
        return job.future

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the worker thread, between two batches, ahead of requests queued.

        On this thread, not another: libgomp gives each thread that runs parallel torch work an
        OpenMP team of its own, and a second team made every later decode step wait on futex wakes."""
        loop = asyncio.get_running_loop()
        call = _Call(functools.partial(fn, *args), loop, loop.create_future())
        with self._lock:
            if self._down is not None:
                raise EngineDownError(self._down)
            self._calls.append(call)  # ahead of every queued request, not behind them
            self._queue.put(_WAKE)
        return await call.future

    async def aside(self, queue_key: str, fn: Callable[[Gone], T]) -> T:
        """Run `fn(gone)` on the worker thread for a request that cannot join the batch, in its turn
        (see the module): requests of the same `queue_key` (a step, the base) run in order, the
        queues in rotation. `gone()` turns true when the caller gives up: `fn` should stop then."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        call = _Call(functools.partial(fn, future.cancelled), loop, future)
        with self._lock:
            if self._down is not None:
                raise EngineDownError(self._down)
            self._asides.setdefault(queue_key, collections.deque()).append(call)
            self._queue.put(_WAKE)
        return await future

    def close(self) -> None:
        """Stop the worker; requests still queued fail with EngineDownError instead of waiting."""
        with self._lock:
            self._down = self._down or "the in-process engine is closed"
            self._queue.put(None)

    def join(self, timeout: float) -> None:
        """Wait for the worker thread to finish after `close`."""
        self.thread.join(timeout)

    # -- the worker thread ---------------------------------------------------------------------------

    def _start_worker(self) -> threading.Thread:
        thread = threading.Thread(target=self._work, name="journeyman-engine", daemon=True)
        thread.start()
        return thread

    def _work(self) -> None:
        carry: list[_Job] = []
        try:
            self._serve(carry)
        except BaseException as e:
            self._died(e, [*self._running, *carry])

    def _died(self, error: BaseException, held: list[_Job]) -> None:
        """The worker is dying of `error`. Never silently: the jobs it held fail (EngineDownError),
        and a fresh worker serves what is queued, unless this one is the `max_restarts`+1-th to die
        within `restart_window_s`; then the engine stays down and every request fails at once."""
        log.error("the in-process engine's worker died", exc_info=error)
        # What the dead worker was doing is dropped with it (the runner's `sampling()` exited as
        # it unwound).
        self._running = []
        self.runner.reset()
        cfg = self.config
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < cfg.restart_window_s]
        with self._lock:
            if self._down is None and len(self._deaths) >= cfg.max_restarts:
                self._down = (
                    f"the in-process engine's worker died {len(self._deaths) + 1} times within "
                    f"{cfg.restart_window_s:g} s (TorchEngine.max_restarts={cfg.max_restarts}); it "
                    f"stays down. Last error: {error!r}"
                )
            if self._down is None:
                try:
                    self.thread = self._start_worker()
                except RuntimeError as e:  # no thread to be had: nothing left to serve with
                    self._down = (
                        f"the in-process engine's worker died ({error!r}) and could not be restarted: {e}"
                    )
                else:
                    self._deaths.append(now)
                    self.restarts += 1
        restarted = self._down is None
        died = EngineDownError(
            f"the in-process engine's worker died while serving this request ({error!r}); "
            + ("a new worker serves the next requests" if restarted else str(self._down))
        )
        for j in held:
            hand_over(j.loop, j.future, error=died)
        if restarted:
            log.warning(
                "the in-process engine's worker restarted (%d in the last %g s, at most %d)",
                len(self._deaths),
                cfg.restart_window_s,
                cfg.max_restarts,
            )
        else:
            log.error("%s", self._down)
            self._fail_queued([], EngineDownError(str(self._down)))

    def _serve(self, carry: list[_Job]) -> None:
        cfg = self.config
        runner = self.runner
        with contextlib.ExitStack() as held:
            while True:
                self._drop_gone()
                if not runner.busy:
                    held.close()  # idle: the weights are free for a training step
                    self._run_calls()
                    if self._asides and not self._owed:
                        self._run_aside()
                        continue
                    # the served step's turn: its batch, gathered as usual; with an aside waiting,
                    # only what is queued now (nothing: the aside's turn again)
                    jobs = self._take(carry, cfg.max_batch_rows, wait=not self._asides, joining=False)
                    if jobs is None:
                        self._fail_queued(carry)
                        return
                    if jobs or not self._calls:  # the served step had its turn (or wanted none)
                        self._owed = False
                    if not jobs:  # a call or an aside came first, or an aside waits
                        continue
                    held.enter_context(runner.sampling())
                    self._admit(jobs, carry)
                    if not runner.busy:  # every job's model is training: let it have a moment
                        time.sleep(0.01)
                elif not runner.weights_wanted and not self._calls and not self._asides:
                    # Requests that arrived during the last step join now. None are admitted while a
                    # training step waits for the weights (or a call or an aside waits): the rows
                    # drain and the step (or the aside, in its turn) gets them.
                    room = cfg.max_batch_rows - runner.row_count
                    jobs = self._take(carry, room, wait=False, joining=True) if room > 0 else []
                    if jobs:
                        self._admit(jobs, carry)
                if runner.filling:
                    self._fill()
                if runner.ready:
                    self._decode()
                elif runner.busy and not runner.filling:  # rows that nothing would ever advance
                    raise RuntimeError(f"{runner.row_count} rows held but none prefilling or ready")

    def _run_calls(self) -> None:
        while self._calls:
            self._run(self._calls.popleft())

    def _run_aside(self) -> None:
        """The aside at the head of the next queue in rotation; that queue goes to the back."""
        key, calls = next(iter(self._asides.items()))
        call = calls.popleft()
        del self._asides[key]
        if calls:
            self._asides[key] = calls
        self._owed = True
        self._run(call)

    def _run(self, call: _Call) -> None:
        if call.future.cancelled():
            self.cancelled += 1
            return
        try:
            result = call.fn()
        except Exception as e:
            hand_over(call.loop, call.future, error=e)
        except BaseException as e:  # it kills the worker (`_died`); the caller hears why
            down = EngineDownError(f"the in-process engine's worker died running this call: {e!r}")
            hand_over(call.loop, call.future, error=down)
            raise
        else:
            hand_over(call.loop, call.future, result)
        if call.future.cancelled():  # an aside that stopped when its caller left
            self.cancelled += 1

    def _drop_gone(self) -> None:
        """Take the rows of requests whose callers gave up out of the batch, before the next step;
        once the engine is closed, every row, failed with EngineDownError: a closing program (its
        end, Ctrl-C) must not wait for them, nor leave this thread in torch as the interpreter exits."""
        closed = self._down
        gone = [j for j in self._running if closed is not None or j.future.cancelled()]
        if gone:
            self.runner.drop(gone)
            self._running = [j for j in self._running if j not in gone]
            for j in gone:
                if j.future.cancelled():
                    self.cancelled += 1
                elif closed is not None:
                    hand_over(j.loop, j.future, error=EngineDownError(closed))

    def _take(self, carry: list[_Job], room: int, wait: bool, joining: bool) -> list[_Job] | None:
        """Jobs for up to `room` rows: with `wait`, block for the first, then gather what arrives
        until a `batch_wait_s` gap (at most `batch_wait_max_s` in all); without, only what is
        queued now; `joining` running rows, only what fits `room` (a new batch's first job always
        does). None: the engine is closing. A pending call (`call`) ends the take with no
        jobs: it runs before the next batch, and the jobs gathered so far wait in `carry`; so does
        an aside that comes while a blocking take has none yet."""
        jobs: list[_Job] = []
        rows = 0
        deadline = last_call = 0.0
        while True:
            if self._calls or (wait and self._asides and not jobs):
                carry[:0] = jobs
                return []
            if carry:
                job: _Job | object | None = carry.pop(0)
            else:
                try:
                    if wait and not jobs:
                        job = self._queue.get()
                    elif wait:
                        job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    else:
                        job = self._queue.get_nowait()
                except queue.Empty:
                    return jobs
            if job is None:
                if jobs or not wait:  # finish what runs; the next blocking take stops
                    self._queue.put(None)
                    return jobs
                return None
            if not isinstance(job, _Job):  # `_WAKE`: the pending call is seen at the loop's top
                continue
            if job.future.cancelled():  # its caller gave up (a timeout): no batch time spent on it
                self.cancelled += 1
                continue
            # The first job of a new batch always fits; running rows take only what fits.
            if (jobs or joining) and rows + job.params.n > room:
                carry.insert(0, job)
                return jobs
            now = time.monotonic()
            if not jobs:
                last_call = now + self.config.batch_wait_max_s
            jobs.append(job)
            rows += job.params.n
            deadline = min(now + self.config.batch_wait_s, last_call)

    def _decode(self) -> None:
        """Sample a token a ready row and answer what that settled, then the forward pass that readies
        the next token. If that raises where no row can be singled out, the jobs whose rows were
        running fail with the error (and leave) while the engine goes on."""
        try:
            step = self.runner.advance()
            for job, error in step.failed:
                self._fail(job, error)
            for job, samples in step.answered:
                self.served += 1
                self._running = [j for j in self._running if j is not job]
                hand_over(job.loop, job.future, samples)
            self.runner.forward(step.keep)
        except Exception as e:
            for j in self.runner.reset():
                self._fail(j, e)

    def _fail(self, job: _Job, error: Exception) -> None:
        """`job` alone fails with `error`."""
        self._running = [j for j in self._running if j is not job]
        hand_over(job.loop, job.future, error=error)

    def _admit(self, jobs: list[_Job], carry: list[_Job]) -> None:
        """Give `jobs` rows in the runner; if that raises, see `_isolate`. Jobs whose model cannot
        take rows now (its training step waits for it, or it joins the engine at its next idle
        moment) stay queued, first in `carry`; those of a model that left fail."""
        jobs, later, refused = self.runner.split(jobs)
        carry[:0] = later
        for job in refused:
            hand_over(job.loop, job.future, error=EngineDownError("this model's engine is closed"))
        if not jobs:
            return
        joined = self.runner.busy
        self._running = [*self._running, *jobs]  # held now: failed, never lost
        try:
            self.runner.admit(jobs)
        except Exception as e:
            jobs = list(dict.fromkeys([*jobs, *self.runner.filling_jobs()]))  # none left prefilling
            self.runner.drop(jobs)
            self._isolate(jobs, e)
            return
        self.batches += 1
        if joined:
            self.rows_joined += sum(j.params.n for j in jobs)

    def _fill(self) -> None:
        """One prefill pass; if it raises, see `_isolate` (for every job still prefilling)."""
        try:
            self.runner.fill()
        except Exception as e:
            jobs = self.runner.filling_jobs()
            self.runner.drop(jobs)
            self._isolate(jobs, e)

    def _isolate(self, jobs: list[_Job], error: Exception) -> None:
        """The admission or prefill of `jobs` raised: one bad request must not fail the well-formed
        ones sent with it. Each is admitted and prefilled alone (a cost paid only on failure): those
        that raise alone fail with their own error, the others stay, ready to sample with the rest;
        no pass of several can fail the same way twice."""
        if len(jobs) > 1:
            log.warning("a prefill of %d requests failed (%r); each is prefilled alone", len(jobs), error)
        for j in jobs:
            try:
                if len(jobs) == 1:
                    raise error
                self.runner.admit([j])
                while self.runner.filling:  # only `j` prefills: the pass that failed left none
                    self.runner.fill()
            except Exception as e:
                self.runner.drop([j])
                self._fail(j, e)

    def _fail_queued(self, carry: list[_Job], down: BaseException | None = None) -> None:
        down = down or EngineDownError("the in-process engine stopped before serving this request")
        waiting: list[_Job | _Call] = [*carry]
        while self._calls:
            waiting.append(self._calls.popleft())
        while self._asides:
            waiting += self._asides.popitem(last=False)[1]
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Job):
                waiting.append(job)
        for j in waiting:
            hand_over(j.loop, j.future, error=down)
