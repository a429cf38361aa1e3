"""The torch engine in a worker process: one engine replica with its own copy of the weights.

`LocalBackend(engine_replicas=N)` serves through N of these behind `ReplicatedEngine`. A worker
loads the base model and the served step's adapter itself, from the checkpoint the trainer wrote
(as vLLM does), so replicas sample in parallel instead of taking turns on one set of weights, and
a replica that crashes or is killed loses only the requests it held: they fail with
`EngineDownError` (the endpoint's 503), and `ReplicatedEngine` restarts it at the next step.

A worker is `python -m journeyman.engine.torch_process`, not a multiprocessing child: spawn would
re-run the user's script in it (training scripts rarely guard `asyncio.run(main())`). The wire is a
socket pair carrying length-framed JSON (`WorkerSpec` first, then `_Call` down and `_Reply` up): no
port to guard, no pickled data, and a dead worker is an EOF on the parent's side at once. Sampling
is bounded by the endpoint's `request_timeout_s` (a cancelled request is cancelled in the worker
too); starting and loading an adapter by this module's own timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from journeyman.data.config import LoraConfig
from journeyman.engine.base import Engine, OnToken, Sample, SamplingParams, hand_over
from journeyman.errors import EngineDownError, EngineTimeoutError, InvalidFieldError, JourneymanError

log = logging.getLogger("journeyman.engine")


class EngineReplicaError(JourneymanError, RuntimeError):
    """An engine replica's worker process failed a request with an unexpected error (named in the message)."""


class WorkerSpec(BaseModel):
    """What a worker process loads: the same base model and LoRA shape as the trainer's."""

    base_model: str
    lora: LoraConfig
    dtype: str = "float32"
    device: str | None = None
    stop_ids: list[int]
    threads: int = 1
    adapter: str | None = None  # the served step's checkpoint directory; None: the base model
    step: int = 0


class _Call(BaseModel):
    id: int
    op: Literal["generate", "load", "cancel"]
    prompt_ids: list[int] = []
    params: SamplingParams | None = None
    path: str | None = None
    step: int = 0


class _Failure(BaseModel):
    type: str
    message: str
    field: str | None = None  # set for an InvalidFieldError, re-raised as one (the endpoint's 400)
    value: str | None = None
    reason: str | None = None


class _Reply(BaseModel):
    id: int
    samples: list[Sample] = []
    error: _Failure | None = None


class TorchProcessEngine(Engine):
    """Parent-side handle: requests go down the pipe, a reader thread settles their futures (on
    whichever event loop asked, so the endpoint's server thread and the backend's loop both can)."""

    # the worker's TorchEngine samples another checkpoint (or the base) one row at a time, reading
    # it from the same disk: live training's candidate and canary work through a replica too
    serves_other_steps = True

    def __init__(
        self,
        spec: WorkerSpec,
        name: str = "engine replica",
        start_timeout_s: float = 600.0,
        load_timeout_s: float = 300.0,
    ) -> None:
        self.spec = spec
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.load_timeout_s = load_timeout_s
        self.step = spec.step
        self._served = 0
        self._lock = threading.Lock()  # the pipe's writer side, the pending table and `_down`
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[_Reply]]] = {}
        self._n = 0
        self._down: str | None = "not started"
        ours, theirs = socket.socketpair()
        with theirs:  # closed here once the worker holds it: its exit is then an EOF on ours
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=[theirs.fileno()]
            )
        self._socket = ours  # kept to shut down: closing an fd a thread blocks on wakes nothing
        self._conn = Connection(os.dup(ours.fileno()))
        self._conn.send_bytes(spec.model_dump_json().encode())
        self._reader: threading.Thread | None = None

    def wait_ready(self) -> None:
        """Block until the worker has loaded the model (`start_timeout_s`), then serve."""
        try:
            if not self._conn.poll(self.start_timeout_s):
                self.process.kill()
                raise EngineDownError(
                    f"{self.name} did not load its model within {self.start_timeout_s:.0f} s"
                )
            ready = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise EngineDownError(f"{self.name} exited while starting (code {self._exit_code()})") from None
        if "error" in ready:
            raise EngineDownError(f"{self.name} could not start: {ready['error']}")
        self._down = None
        self._reader = threading.Thread(target=self._read, name=f"{self.name} reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._down is None

    @property
    def requests_served(self) -> int:
        return self._served

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None = None
    ) -> list[Sample]:
        # the worker process answers whole: a streamed request gets its text at the end
        reply = await self._call(_Call(id=0, op="generate", prompt_ids=prompt_ids, params=params), None)
        self._served += 1
        return reply.samples

    async def load_adapter(self, path: Path, step: int) -> None:
        await self._call(_Call(id=0, op="load", path=str(path), step=step), self.load_timeout_s)
        self.step = step
        self.spec = self.spec.model_copy(update={"adapter": str(path), "step": step})

    def restarted(self, path: Path | None, step: int) -> TorchProcessEngine:
        """A fresh worker with this one's spec, serving the adapter at `path` (None: the base model)."""
        self.close()
        spec = self.spec.model_copy(update={"adapter": None if path is None else str(path), "step": step})
        return TorchProcessEngine(spec, self.name, self.start_timeout_s, self.load_timeout_s)

    async def _call(self, call: _Call, timeout: float | None) -> _Reply:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_Reply] = loop.create_future()
        with self._lock:
            if self._down is not None:
                raise EngineDownError(f"{self.name} is down: {self._down}")
            self._n += 1
            call.id = self._n
            self._pending[call.id] = (loop, future)
            try:
                self._conn.send_bytes(call.model_dump_json().encode())
            except OSError as e:  # the worker is gone; the reader fails the rest
                del self._pending[call.id]
                raise EngineDownError(f"{self.name} is down: {e}") from None
        try:
            reply = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self._cancel(call.id)
            raise EngineTimeoutError(f"{self.name}: {call.op} took longer than {timeout} s") from None
        except asyncio.CancelledError:
            self._cancel(call.id)
            raise
        if reply.error is not None:
            raise _raised(self.name, reply.error)
        return reply

    def _cancel(self, id: int) -> None:
        """The caller gave up (the endpoint's timeout): the worker drops the request too."""
        with self._lock:
            if self._pending.pop(id, None) is None or self._down is not None:
                return
            with contextlib.suppress(OSError):
                self._conn.send_bytes(_Call(id=id, op="cancel").model_dump_json().encode())

    def _read(self) -> None:
        try:
            while True:
                reply = _Reply.model_validate_json(self._conn.recv_bytes())
                with self._lock:
                    entry = self._pending.pop(reply.id, None)
                if entry is not None:  # None: cancelled meanwhile
                    hand_over(*entry, reply)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("%s: unreadable reply; the replica is taken down", self.name)
            self.process.kill()
        why = f"its process (pid {self.process.pid}) exited with code {self._exit_code()}"
        with self._lock:
            self._down = self._down or why
            pending, self._pending = self._pending, {}
        for loop, future in pending.values():
            hand_over(loop, future, error=EngineDownError(f"{self.name} is down: {why}"))
        if pending:
            log.error("%s is down (%s): %d requests failed", self.name, why, len(pending))

    def close(self) -> None:
        with self._lock:
            self._down = self._down or "closed"
        with contextlib.suppress(OSError):  # an EOF both ways: the worker stops, our reader returns
            self._socket.shutdown(socket.SHUT_RDWR)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=10)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._conn.close()
        self._socket.close()

    def _exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None


def start_replicas(specs: list[WorkerSpec]) -> list[TorchProcessEngine]:
    """Start one worker per spec, all loading at once, and wait for every one."""
    engines = [TorchProcessEngine(spec, f"engine replica {i}") for i, spec in enumerate(specs)]
    try:
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


def _raised(name: str, f: _Failure) -> Exception:
    if f.field is not None:
        return InvalidFieldError(f.field, f.value, f.reason or f.message)
    if f.type == "EngineDownError":
        return EngineDownError(f"{name}: {f.message}")
    return EngineReplicaError(f"{name}: {f.type}: {f.message}")


# -- the worker process ----------------------------------------------------------------------------


def _worker_main(conn: Connection) -> None:
    import torch

    s = WorkerSpec.model_validate_json(conn.recv_bytes())
    torch.set_num_threads(s.threads)
    try:
        from journeyman.engine.torch_engine import TorchEngine
        from journeyman.policy.lora import LoraPolicy

        policy = LoraPolicy(Path(s.base_model), s.lora, device=s.device, dtype=s.dtype)
        if s.adapter is not None:
            policy.load(Path(s.adapter))
        engine = TorchEngine(policy, set(s.stop_ids))
        engine.step = s.step
    except Exception as e:
        conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return
    conn.send_bytes(json.dumps({"ready": os.getpid()}).encode())
    try:
        asyncio.run(_serve(policy, engine, conn))
    finally:
        engine.close()
        engine.join(timeout=10)  # a torch thread still running at exit aborts the process


async def _serve(policy: Any, engine: Engine, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    def read() -> None:  # blocking reads off the loop; None: the parent closed the pipe or died
        try:
            while True:
                raw = conn.recv_bytes()
                loop.call_soon_threadsafe(inbox.put_nowait, raw)
        except (EOFError, OSError):
            loop.call_soon_threadsafe(inbox.put_nowait, None)

    threading.Thread(target=read, name="journeyman-replica-reader", daemon=True).start()
    running: dict[int, asyncio.Task[None]] = {}

    async def answer(call: _Call) -> None:
        try:
            if call.op == "generate":
                assert call.params is not None
                reply = _Reply(id=call.id, samples=await engine.generate(call.prompt_ids, call.params))
            else:
                assert call.path is not None
                await engine.call(policy.load, Path(call.path))
                await engine.load_adapter(Path(call.path), call.step)
                reply = _Reply(id=call.id)
        except InvalidFieldError as e:
            reply = _Reply(
                id=call.id,
                error=_Failure(
                    type=type(e).__name__, message=str(e), field=e.field, value=str(e.value), reason=e.reason
                ),
            )
        except Exception as e:
            reply = _Reply(id=call.id, error=_Failure(type=type(e).__name__, message=str(e)))
        finally:
            running.pop(call.id, None)
        conn.send_bytes(reply.model_dump_json().encode())

    while (raw := await inbox.get()) is not None:
        call = _Call.model_validate_json(raw)
        if call.op == "cancel":
            if (task := running.get(call.id)) is not None:
                task.cancel()
            continue
        running[call.id] = asyncio.create_task(answer(call))  # asyncio.run cancels the rest at the end


def replica_specs(
    base_model: Path,
    lora: LoraConfig,
    stop_ids: set[int],
    replicas: int,
    *,
    dtype: str,
    device: str | None,
    adapter: Path | None,
    step: int,
    threads: int | None = None,
) -> list[WorkerSpec]:
    """One spec per replica: `threads` CPU threads each (None: the cores split between them); on
    CUDA, replica i on GPU i mod count."""
    import torch

    threads = threads or max(1, (os.cpu_count() or 1) // replicas)
    gpus = torch.cuda.device_count() if device in (None, "cuda") else 0
    return [
        WorkerSpec(
            base_model=str(base_model),
            lora=lora,
            dtype=dtype,
            device=f"cuda:{i % gpus}" if gpus else device,
            stop_ids=sorted(stop_ids),
            threads=threads,
            adapter=None if adapter is None else str(adapter),
            step=step,
        )
        for i in range(replicas)
    ]


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])))
