"""The vLLM engine: token-id prompts sampled by a vLLM server process, LoRA hot-loaded per step.

Our endpoint stays in front: it renders messages to prompt ids (splicing earlier sampled turns) and
parses tool calls; this engine only samples. Each call goes to vLLM's `/v1/completions` with the
prompt *as token ids* and `return_token_ids`, so the ids and logprobs we record are exactly what
vLLM sampled and scored — no detokenize/retokenize round trip. vLLM's logprobs are raw (temperature
1, before top-p), the quantity the trainer computes (the server is started with
`--logprobs-mode raw_logprobs` to pin that).

Each training step is served under its own LoRA name (`policy@<step>`): requests already running
finish on the adapter they started with, and vLLM's prefix cache never mixes two steps' weights. A
request may name another checkpoint (`SamplingParams.adapter`, live training's candidate beside the
promoted step): it is registered under its step's name on first use and sampled in the same batches
(`vllm_adapters`). The bodies sent and the answers read are in `vllm_wire`.

A server that exits on its own (a crash, the OOM killer) is noticed at once by its supervisor
thread: the requests it held fail with `EngineDownError` (the endpoint's 503, which `gather` counts
against `max_exceptions`), requests that arrive while it restarts fail the same way instead of
waiting, and the restarted server gets the served step's adapter back before it takes requests.
One that exits while asleep is restarted when the training step ends (at the wake), not beside it:
a fresh server takes its whole memory budget at start-up, which the trainer holds mid-step.

On CUDA, vLLM sleeps through each training step and wakes in stages, each checked against the
device's free memory first (`vllm_handoff`, `handoff`): its weights (re-read from disk at sleep level 2), then
the step's adapter, then its KV cache. A wake that is refused or times out leaves the engine asleep
and its requests failing fast (`EngineDownError`) until a later wake succeeds.

Several models on one base share one server (`share_with`, which `backends/service.py` uses for
every model registered on a base already served): each model's steps are adapters of their own
names (`vllm_adapters`), sampled in the same batches, and a restarted server gets every model's
served adapter back. A server that several models share does not sleep through a step: that would
stall every other model's traffic for it; the memory plan then checks that the trainer fits beside
vLLM awake (`backends/service.py: check_memory_plan`). vLLM batches at most `--max-loras` adapters
together; a server needs two a model (`vllm_server.lora_slots`) for every model's rows to share its
batches. A model that joins beyond that restarts the server with twice the slots: the requests
and adapter loads in flight finish first, new ones wait, and every model's served adapter is loaded
again before they go on (`_grow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from journeyman.engine import handoff
from journeyman.engine.base import Engine, OnToken, Sample, SamplingParams
from journeyman.engine.grammar import SCHEMA_FIELD
from journeyman.engine.vllm_adapters import BASE_NAME, VLLMAdapters, step_of
from journeyman.engine.vllm_handoff import VLLMHandoff
from journeyman.engine.vllm_server import VLLMConfig, VLLMServer, lora_slots
from journeyman.engine.vllm_wire import (
    Refused,
    VLLMRequestError,
    VLLMWakeError,
    add_chunk,
    check,
    completion_body,
    rescore_body,
    rescored,
    samples,
)
from journeyman.errors import EngineDownError, InvalidFieldError

__all__ = ["VLLMEngine", "VLLMRequestError", "VLLMWakeError"]

log = logging.getLogger("journeyman.vllm")


class _Gate:
    """The requests and adapter loads on a server, counted, so that a restart on purpose (`_grow`)
    lets those inside finish and holds back new ones until the fresh server is up."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._shut = False

    @contextlib.asynccontextmanager
    async def passage(self) -> AsyncIterator[None]:
        while True:
            with self._cond:
                if not self._shut:
                    self._inside += 1
                    break
            await asyncio.to_thread(self._wait_open)
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    def _wait_open(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._shut)

    @contextlib.contextmanager
    def shut(self, timeout_s: float) -> Iterator[None]:
        """Closed to newcomers, once those inside have left (or `timeout_s` passed), until the end."""
        with self._cond:
            self._shut = True
            if not self._cond.wait_for(lambda: self._inside == 0, timeout_s):
                log.warning(
                    "%d vLLM requests still running after %.0f s; restarting anyway", self._inside, timeout_s
                )
        try:
            yield
        finally:
            with self._cond:
                self._shut = False
                self._cond.notify_all()


@dataclass
class _Supervision:
    """The server's state, one for every model it serves (`VLLMEngine.share_with`)."""

    engines: list[VLLMEngine] = field(default_factory=list)  # the open engines on the server
    gate: _Gate = field(default_factory=_Gate)  # what runs on it, held back while it is replaced
    down: str | None = None  # why requests are refused, while the server is down
    restarts: int = 0
    restart_pending: bool = False  # exited asleep: restart at the wake
    restarting: bool = False


class VLLMEngine(Engine):
    """Samples through a vLLM OpenAI server that this engine starts, supervises and stops."""

    serves_other_steps = True  # vLLM batches requests for several LoRAs together

    def __init__(
        self,
        model_dir: Path,
        stop_ids: set[int],
        config: VLLMConfig | None = None,
        *,
        dtype: str = "float32",
        lora_rank: int = 8,
        memory_probe: handoff.MemoryProbe = handoff.cuda_memory,
        share_with: VLLMEngine | None = None,
    ) -> None:
        """`memory_probe` reads the device's free memory before each wake stage (None answers: no
        check, as on the CPU). With `share_with` (another model's engine on the same base), this
        model samples on that engine's server, and `config` is that engine's."""
        self.stop_ids = sorted(stop_ids)
        self.step = 0
        self.adapter_load_seconds: list[float] = []
        self._served = 0
        self._warned_sleep = False
        # httpx clients are bound to the event loop they were first used on; the endpoint's server
        # thread and the caller's loop (training, tests) each get their own.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        if share_with is not None:
            self.config, self.server = share_with.config, share_with.server
            self.sleep_wake, self._sup = share_with.sleep_wake, share_with._sup
            self.adapters = VLLMAdapters(
                self.config.request_timeout_s, f"{BASE_NAME}-{len(self._sup.engines)}"
            )
            self._sup.engines.append(self)
            slots = lora_slots(len(self._sup.engines), self.config.max_loras)
            if slots > self.config.max_loras:
                try:
                    self._grow(slots)
                except BaseException:
                    self._sup.engines.remove(self)
                    raise
            return
        self.config = config or VLLMConfig()
        self.server = VLLMServer(
            model_dir, self.config, served_name=BASE_NAME, dtype=dtype, lora_rank=lora_rank
        )
        self._sup = _Supervision(engines=[self])
        self.adapters = VLLMAdapters(self.config.request_timeout_s)
        # the handoff (sleep → train → staged wake); see the module docstring
        self.sleep_wake = VLLMHandoff(self.server, self.config, memory_probe)
        self.server.on_exit = self._on_exit
        self.server.start()

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def alive(self) -> bool:
        """Until this model's engine is closed (a server restarting is still this engine's)."""
        return self in self._sup.engines

    @property
    def shared(self) -> bool:
        """Other models sample on this engine's server."""
        return len(self._sup.engines) > 1

    @property
    def _down(self) -> str | None:
        return self._sup.down

    @_down.setter
    def _down(self, why: str | None) -> None:
        self._sup.down = why

    @property
    def restarts(self) -> int:
        return self._sup.restarts

    @property
    def _restart_pending(self) -> bool:
        return self._sup.restart_pending

    @_restart_pending.setter
    def _restart_pending(self, pending: bool) -> None:
        self._sup.restart_pending = pending

    @property
    def _restarting(self) -> bool:
        return self._sup.restarting

    @_restarting.setter
    def _restarting(self, restarting: bool) -> None:
        self._sup.restarting = restarting

    @property
    def requests_served(self) -> int:
        return self._served

    @property
    def memory_probe(self) -> handoff.MemoryProbe:
        return self.sleep_wake.probe

    @property
    def wake_seconds(self) -> dict[str, float]:
        """The last wake's time per stage."""
        return self.sleep_wake.seconds

    @property
    def served_model(self) -> str:
        """The vLLM model name requests use now: the newest step's adapter, or the base model."""
        return self.adapters.served_model

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(
                base_url=self.server.base_url,
                headers=self.server.headers,
                timeout=httpx.Timeout(self.config.request_timeout_s, connect=10.0),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
            self._clients[loop] = client
        return client

    async def _post(self, path: str, body: dict[str, Any], what: str) -> httpx.Response:
        if self._down is not None:
            raise EngineDownError(f"{what}: {self._down}")
        try:
            resp = await self._client().post(path, json=body)
        except httpx.HTTPError as e:
            raise await self._broken(e, what) from e
        check(resp, what)
        return resp

    async def _broken(self, e: httpx.HTTPError, what: str) -> Exception:
        """The error of a request whose connection failed: the server died, or the request did."""
        # a dead server's connections break before its supervisor has reaped it: a moment's grace
        for _ in range(40):
            if self._down is not None or not self.server.alive():
                break
            await asyncio.sleep(0.05)
        if self._down is not None or not self.server.alive():
            return EngineDownError(
                f"{what}: the vLLM server exited while serving it ({type(e).__name__}); "
                f"{self._down or 'restarting it'}; log tail:\n{self.server.log_tail(20)}"
            )
        return VLLMRequestError(
            f"{what}: {type(e).__name__}: {e} (vLLM server running; log tail:)\n{self.server.log_tail(20)}"
        )

    # -- supervision -------------------------------------------------------------------------------

    @property
    def down(self) -> str | None:
        """Why requests are refused now (the server exited, is restarting, or stays down); None when up."""
        return self._down

    def _on_exit(self, code: int) -> None:
        """The server exited on its own (supervisor thread): refuse requests, restart it, or stay down."""
        if self.sleep_wake.asleep:  # the trainer has the GPU: a fresh server would take memory it holds
            self._down = f"the vLLM server exited with code {code} while asleep; it restarts when it wakes"
            self._restart_pending = True
            log.warning("%s (log: %s)", self._down, self.server.log_path)
            return
        if self.restarts >= self.config.max_restarts:
            self._down = (
                f"the vLLM server exited with code {code} and was already restarted "
                f"{self.restarts} times (VLLMConfig.max_restarts); it stays down"
            )
            log.error("%s; log: %s", self._down, self.server.log_path)
            return
        self._down = f"the vLLM server exited with code {code} and is restarting"
        log.warning("%s (log: %s)", self._down, self.server.log_path)
        self._restarting = True
        threading.Thread(target=self._restart, name="journeyman-vllm-restart", daemon=True).start()

    def _restart(self) -> None:
        """A fresh server (it starts awake), serving each model's served step's adapter."""
        self._restarting = True
        self._sup.restarts += 1
        try:
            self.server.restart()
            self.sleep_wake.reset()
            for engine in self._sup.engines:
                engine._clients.clear()  # bound to the old server's connections (and maybe its port)
                engine.adapters.forget()
                if engine.adapters.current is not None:
                    asyncio.run(engine.load_adapter(*engine.adapters.current))
        except Exception as e:
            self._down = f"the vLLM server exited and could not be restarted: {e}"
            self._restarting = False
            log.error("%s", self._down)
            return
        self._down = None
        self._restarting = False
        self.sleep_wake.awake.set()
        log.warning(
            "vLLM restarted (%d of %d) in %.1f s, serving step %d",
            self.restarts,
            self.config.max_restarts,
            self.server.startup_seconds,
            self.step,
        )

    def _grow(self, slots: int) -> None:
        """Restart the shared server with `slots` adapters a batch (`--max-loras`), blocking: those
        running on it finish first, new requests wait, every model's served adapter is loaded again.
        A fresh server that does not start gives way to one as before (a warning: its models' rows
        then batch `max_loras` adapters at a time)."""
        self.sleep_wake.awake.wait()  # not while a step holds the GPU (a lone model's server sleeps)
        old = self.config
        log.info(
            "vLLM restarts for %d models on one server: max_loras %d -> %d",
            len(self._sup.engines),
            old.max_loras,
            slots,
        )
        with self._sup.gate.shut(old.request_timeout_s):
            try:
                self._relaunch(old.model_copy(update={"max_loras": slots}))
            except Exception as e:
                log.warning(
                    "vLLM did not restart with max_loras=%d (%s); serving %d models with %d",
                    slots,
                    e,
                    len(self._sup.engines),
                    old.max_loras,
                )
                self._relaunch(old)

    def _relaunch(self, config: VLLMConfig) -> None:
        self._down = f"the vLLM server restarts (max_loras={config.max_loras})"
        try:
            self.server.relaunch(config)
            for engine in self._sup.engines:
                engine.config = config
                engine._clients.clear()  # bound to the old server's connections (and maybe its port)
                engine.adapters.forget()
                if engine.adapters.current is not None:
                    asyncio.run(engine._load(*engine.adapters.current, config.request_timeout_s))
        except Exception as e:
            self._down = f"the vLLM server could not be restarted: {e}"
            raise
        self._down = None

    # -- sampling ----------------------------------------------------------------------------------

    def request_body(self, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        """The `/v1/completions` body for one prompt (fields as vLLM 0.32's CompletionRequest names them)."""
        return completion_body(prompt_ids, params, self.adapters.model_for(params), self.stop_ids)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None = None
    ) -> list[Sample]:
        if not self.sleep_wake.awake.is_set():  # a training step has the GPU: wait for it, on any loop
            await asyncio.to_thread(self.sleep_wake.awake.wait)
        if self.sleep_wake.error is not None:
            raise EngineDownError(f"completion: vLLM did not wake: {self.sleep_wake.error}")
        async with self._sup.gate.passage():  # held back while the server is replaced (`_grow`)
            return await self._generate(prompt_ids, params, on_token)

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None
    ) -> list[Sample]:
        body = self.request_body(prompt_ids, params)
        name = str(body["model"])  # the policy that samples it, whatever loads meanwhile
        if params.adapter is not None:
            await self.adapters.beside(self._client(), Path(params.adapter), name, self._down)
        try:
            if on_token is None:
                choices = (await self._post("/v1/completions", body, "completion")).json()["choices"]
            else:
                choices = await self._stream(body, on_token)
        except Refused as e:  # vLLM's 400: a bad value in this request, named like the endpoint names it
            field = SCHEMA_FIELD if params.json_schema is not None else (e.param or "request")
            value = params.json_schema if params.json_schema is not None else None
            raise InvalidFieldError(field, value, f"vLLM refused it: {e.message}") from None
        out = samples(choices, params.top_logprobs, step_of(name))
        if params.json_schema is not None:
            await self._rescore(prompt_ids, out, name or self.served_model, params)
        self._served += 1
        return out

    async def _stream(self, body: dict[str, Any], on_token: OnToken) -> list[dict[str, Any]]:
        """The completion streamed (`stream`): each token to `on_token` as its chunk arrives, and the
        choices put together as the unstreamed answer has them (token ids, logprobs, text, finish)."""
        what = "completion"
        if self._down is not None:
            raise EngineDownError(f"{what}: {self._down}")
        choices: dict[int, dict[str, Any]] = {}
        try:
            async with self._client().stream(
                "POST", "/v1/completions", json={**body, "stream": True}
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    check(resp, what)
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for part in json.loads(line[len("data: ") :]).get("choices", []):
                            add_chunk(choices, part, on_token)
        except httpx.HTTPError as e:
            raise await self._broken(e, what) from e
        return list(choices.values())

    async def _rescore(
        self, prompt_ids: list[int], samples: list[Sample], model: str, params: SamplingParams
    ) -> None:
        """Replace grammar-masked logprobs by the policy's own, as the in-process engine records them.

        vLLM applies the grammar's token mask to the logits before it computes even "raw" logprobs,
        so a constrained sample comes back renormalised over the allowed tokens (forced tokens at
        0.0). The trainer scores the same ids without a mask: a mismatch that would bias every
        importance ratio. One unconstrained prefill of prompt + sample (prompt_logprobs), on the
        same adapter, gives the trainer's numbers.
        """
        rows = [s for s in samples if s.token_ids]
        if not rows:
            return
        body = rescore_body(prompt_ids, rows, model, params.top_logprobs)
        try:
            resp = await self._post("/v1/completions", body, "rescore constrained sample")
        except Refused as e:
            raise VLLMRequestError(f"rescore constrained sample: vLLM refused it: {e.message}") from None
        rescored(rows, resp.json()["choices"], len(prompt_ids), params.top_logprobs)

    # -- training side -----------------------------------------------------------------------------

    async def load_adapter(self, path: Path, step: int) -> None:
        """Load the PEFT adapter saved at `path` as `policy@<step>`; later requests use it. While the
        engine sleeps this is the middle stage of its wake: weights, this adapter, KV cache."""
        path = Path(path).resolve()
        if not (path / "adapter_config.json").exists():
            raise InvalidFieldError(
                "path", str(path), "is not a PEFT adapter directory (no adapter_config.json)"
            )
        if self.sleep_wake.asleep:
            await self._wake((path, step))
            return
        async with self._sup.gate.passage():
            if self._down is not None and not self._restarting:
                raise EngineDownError(f"load adapter of step {step}: {self._down}")
            await self._load(path, step, self.config.request_timeout_s)

    async def _load(self, path: Path, step: int, timeout: float) -> None:
        t0 = time.perf_counter()
        # A fresh client: this runs on whatever loop the trainer uses, possibly a short-lived one.
        async with httpx.AsyncClient(
            base_url=self.server.base_url, headers=self.server.headers, timeout=timeout
        ) as c:
            await self.adapters.serve(c, path, step)
            self.step = step
            await self.adapters.trim(c)
        seconds = time.perf_counter() - t0
        self.adapter_load_seconds.append(seconds)
        log.info("vLLM serves step %d (adapter %s) after a %.3f s load", step, path, seconds)

    async def sleep(self) -> None:
        """Free the GPU for a training step: requests in flight finish (mode=wait), new ones wait;
        vLLM drops its KV cache and its weights (level 2) or copies them to host memory (level 1).
        Not on a server other models share (see the module)."""
        if self.shared and not self.sleep_wake.asleep:
            if not self._warned_sleep:
                log.info("vLLM serves several models: it stays awake through each one's training steps")
                self._warned_sleep = True
            return
        if not self.server.sleep_mode:
            if not self._warned_sleep:
                log.info("vLLM sleep mode is off (not supported on CPU): the server stays up during training")
                self._warned_sleep = True
            return
        if self._down is not None:  # restarting or down: nothing to put to sleep
            return
        await self.sleep_wake.sleep()

    async def wake(self) -> None:
        """Take the GPU back after `sleep`, in stages (weights, the served adapter, KV cache)."""
        if self.sleep_wake.asleep:
            await self._wake(None)

    async def _wake(self, adapter: tuple[Path, int] | None) -> None:
        """Wake in stages, each checked against free memory first; `adapter` (else the served one)
        is loaded between the weights and the KV cache. A stage that fails leaves the engine asleep
        (requests fail fast) and raises; the next wake starts at that stage."""
        try:
            if self._restart_pending:
                await self._restart_at_wake(adapter)
                return
            if self._down is not None:
                raise EngineDownError(f"wake: {self._down}")
            await self.sleep_wake.stages(adapter or self.adapters.current, self._load)
        except BaseException as e:
            self.sleep_wake.failed(e)
            raise
        self.sleep_wake.woke()

    async def _restart_at_wake(self, adapter: tuple[Path, int] | None) -> None:
        """The server exited asleep: start a fresh one now that the trainer is done; it starts awake,
        serving `adapter` (else the served one)."""
        if self.restarts >= self.config.max_restarts:
            self._restart_pending = False
            self._down = (
                f"{self._down}; it was already restarted {self.restarts} times (VLLMConfig.max_restarts) "
                "and stays down"
            )
            self.sleep_wake.asleep = False
            self.sleep_wake.awake.set()
            raise EngineDownError(f"wake: {self._down}")
        reading = self.memory_probe()
        if reading is not None:  # vLLM takes its whole budget at start-up
            handoff.check_fits(
                "restart", int(self.config.gpu_memory_utilization * reading.total_bytes), lambda: reading
            )
        self._restart_pending = False
        if adapter is not None:
            self.adapters.current = adapter  # the fresh server starts on the new step's adapter
        await asyncio.to_thread(self._restart)
        if self._down is not None:
            raise EngineDownError(f"wake: {self._down}")

    def close(self) -> None:
        """Stop the server, unless other models still sample on it (then this model leaves it)."""
        engines = self._sup.engines
        if self in engines:
            engines.remove(self)
        if engines:
            self._clients.clear()
            return
        self.server.stop()
        self.sleep_wake.awake.set()
        # Clients bound to other loops cannot be awaited here; drop them (the server is gone anyway).
        self._clients.clear()
