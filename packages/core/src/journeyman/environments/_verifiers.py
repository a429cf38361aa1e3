"""verifiers environments: a module (or `.py` file) exposing `load_environment(**kwargs)`, the
Environments Hub convention, or a dotted path to an environment class such as
`verifiers.ReasoningGymEnv`.

The environment runs in a worker process (`_verifiers_worker.py`) of the Python that has verifiers
and the environment's packages installed: `python=/path/to/venv/bin/python` in the SPEC, else this
interpreter. Tasks are the environment's own dataset and eval dataset rows; each rollout goes
through verifiers' `run_rollout` (single-turn, multi-turn and tool environments alike) against this
model's OpenAI-compatible endpoint, its requests marked with an episode's capture id, so every
completion it makes is captured token-exactly whatever the environment does with the answers. The
rubric's reward and every metric it reports go onto the trajectory.

Not bridged: verifiers 0.4's `verifiers.v1` stack (tasksets, harnesses, runtimes); see
docs/environments.md.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from journeyman.data.types import Trajectory
from journeyman.environments._protocol import Sampling, Split, Task, check_split, finite_reward
from journeyman.errors import EnvironmentWorkerError, InvalidFieldError
from journeyman.rollout.capture import CAPTURE_HEADER
from journeyman.rollout.episode import Episode

if TYPE_CHECKING:
    from journeyman.client.model import TrainableModel

WORKER = Path(__file__).with_name("_verifiers_worker.py")
LOAD_TIMEOUT_S = 600.0  # importing verifiers and building a dataset; its first import compiles it
ROLLOUT_TIMEOUT_S = 600.0  # one rollout, all its turns
STDERR_LINES = 40  # the worker's last stderr lines, quoted in its errors


def verifiers(target: str, *, python: str | None = None, **args: Any) -> VerifiersEnvironment:
    """A verifiers environment from Python, its arguments as values (a list of dataset configs, say):
    `verifiers("verifiers.ReasoningGymEnv", python=".venv-vf/bin/python", gym=[...])`. Same as the
    SPEC `verifiers:<target>:k=v,...`; end it with `close()`."""
    if python is not None:
        args["python"] = python
    spec = f"verifiers:{target}"
    if target.endswith(".py"):
        if not Path(target).is_file():
            raise InvalidFieldError("spec", spec, f"no such file: {target}")
        target = str(Path(target).resolve())
    return load_verifiers(target, args, spec=spec)


def load_verifiers(target: str, args: dict[str, Any], *, spec: str) -> VerifiersEnvironment:
    """The environment `target` names, started in a worker of `args.pop("python")` (default: this
    interpreter). A target without `load_environment` or an environment that fails to load is an
    `InvalidFieldError` on `spec`, with the worker's message."""
    args = dict(args)
    python = str(args.pop("python", sys.executable))
    timeout_s = float(args.pop("rollout_timeout_s", ROLLOUT_TIMEOUT_S))
    if not Path(python).exists():
        raise InvalidFieldError("spec", spec, f"python={python}: no such interpreter")
    return VerifiersEnvironment(
        _Worker(python, target, args, spec=spec), name=f"verifiers:{target}", timeout_s=timeout_s
    )


class VerifiersEnvironment:
    """A verifiers environment behind the seam, running in its worker."""

    def __init__(self, worker: _Worker, *, name: str, timeout_s: float = ROLLOUT_TIMEOUT_S) -> None:
        self.name = name
        self.kind = worker.kind
        self.version = worker.version
        self.timeout_s = timeout_s
        self._worker = worker

    def tasks(self, split: Split) -> Sequence[Task]:
        split = check_split(split)
        return [
            Task(id=f"{split}-{i}", input={"split": split, "index": i})
            for i in range(self._worker.sizes[split])
        ]

    async def rollout(self, model: TrainableModel, task: Task, sampling: Sampling) -> Trajectory:
        where = model.inference()
        episode = Episode(model, on_error="raise")
        request = {
            "split": task.input["split"],
            "index": int(task.input["index"]),
            "base_url": where.base_url,
            "api_key": where.api_key,
            "model": model.name,
            "headers": {CAPTURE_HEADER: episode.new_capture_id()},
            "sampling": {"temperature": sampling.temperature, "max_tokens": sampling.max_tokens},
            "timeout_s": self.timeout_s,
        }
        try:
            done = await self._worker.call(request, self.timeout_s + 30.0)
        except BaseException:
            await episode.discard()
            raise
        trajectory = await episode.finish()
        trajectory.reward = finite_reward(done.get("reward"))
        for key, value in (done.get("metrics") or {}).items():
            trajectory.metrics[str(key)] = finite_reward(value, f"metrics.{key}")
        if done.get("stop_condition"):
            trajectory.metadata["stop_condition"] = str(done["stop_condition"])
        return trajectory

    def close(self) -> None:
        """End the worker (done at exit otherwise)."""
        self._worker.close()


class _Worker:
    """The worker process and its line protocol: requests written under a lock, answers read by a
    thread and handed to the asyncio future that waits for each."""

    def __init__(self, python: str, target: str, args: dict[str, Any], *, spec: str) -> None:
        self.spec = spec
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[dict[str, Any]]]] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._ready = threading.Event()
        self._hello: dict[str, Any] = {}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        try:
            self._proc = subprocess.Popen(
                [python, str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                text=True,
                encoding="utf-8",
            )
        except OSError as e:
            raise InvalidFieldError("spec", spec, f"cannot start {python}: {e}") from e
        self._finalizer = weakref.finalize(self, _kill, self._proc)  # also runs at exit
        threading.Thread(target=self._read_stderr, daemon=True, name="verifiers-stderr").start()
        threading.Thread(target=self._read_stdout, daemon=True, name="verifiers-stdout").start()
        self._send({"op": "load", "target": target, "args": args})
        if not self._ready.wait(LOAD_TIMEOUT_S):
            self.close()
            raise EnvironmentWorkerError(
                spec, f"did not load within {LOAD_TIMEOUT_S:.0f} s", self.stderr_tail()
            )
        if self._hello.get("op") != "ready":
            self.close()
            why = self._hello.get("error") or "the worker exited while loading"
            raise InvalidFieldError("spec", spec, f"{why}\n{self.stderr_tail()}".strip())
        self.kind = str(self._hello.get("name", "?"))
        self.version = str(self._hello.get("version", "?"))
        self.sizes: dict[str, int] = {s: int(n) for s, n in self._hello["sizes"].items()}

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        with self._lock:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()

    async def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The worker's answer to one rollout request; its error raised as `EnvironmentWorkerError`
        (the worker died) or `RuntimeError` (the rollout failed there)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        with self._lock:
            request_id = self._next
            self._next += 1
            self._pending[request_id] = (loop, future)
        try:
            if self._proc.poll() is not None:
                raise EnvironmentWorkerError(
                    self.spec, f"exited with {self._proc.returncode}", self.stderr_tail()
                )
            try:
                self._send({"op": "rollout", "id": request_id, **request})
            except OSError as e:
                raise EnvironmentWorkerError(
                    self.spec, f"cannot be written to ({e})", self.stderr_tail()
                ) from e
            try:
                answer = await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                raise TimeoutError(f"the verifiers worker gave no answer within {timeout_s:.0f} s") from None
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def _read_stdout(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                self._stderr.append(line.rstrip())
                continue
            if message.get("op") in ("ready", "error"):
                self._hello = message
                if "traceback" in message:
                    self._stderr.extend(str(message["traceback"]).splitlines()[-STDERR_LINES:])
                self._ready.set()
                continue
            with self._lock:
                waiting = self._pending.get(message.get("id", -1))
            if waiting is not None:
                loop, future = waiting
                loop.call_soon_threadsafe(_settle, future, message, None)
        self._proc.wait()
        self._ready.set()
        died = EnvironmentWorkerError(self.spec, f"exited with {self._proc.returncode}", self.stderr_tail())
        with self._lock:
            waiting_all = list(self._pending.values())
        for loop, future in waiting_all:
            loop.call_soon_threadsafe(_settle, future, None, died)

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr.append(line.rstrip())

    def close(self) -> None:
        self._finalizer()


def _settle(
    future: asyncio.Future[dict[str, Any]], value: dict[str, Any] | None, error: BaseException | None
) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value or {})


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        try:
            assert proc.stdin is not None
            proc.stdin.close()  # end of input ends the worker
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired, AssertionError):
            proc.kill()
            proc.wait(timeout=5)
