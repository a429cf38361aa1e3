"""The vLLM server's side of the GPU handoff (`handoff`) for the vLLM engine (`vllm_engine`): it
sleeps through a training step and wakes in stages, each checked against the device's free memory
first: its weights (re-read from disk at sleep level 2), then the step's adapter, then its KV cache.
A stage that fails is done again by the next wake, which skips the stages already done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from journeyman.engine import handoff
from journeyman.engine.vllm_server import VLLMConfig, VLLMServer
from journeyman.engine.vllm_wire import VLLMWakeError

__all__ = ["LoadAdapter", "VLLMHandoff"]

log = logging.getLogger("journeyman.vllm")

# load (path, step)'s adapter within a timeout (s) and serve it
LoadAdapter = Callable[[Path, int, float], Awaitable[None]]


class VLLMHandoff:
    """Sleep and staged wake of `server`; `awake` is cleared while it sleeps (requests wait on it)."""

    def __init__(self, server: VLLMServer, config: VLLMConfig, probe: handoff.MemoryProbe) -> None:
        self._server = server
        self._config = config
        self.probe = probe
        self.awake = threading.Event()
        self.awake.set()
        self.asleep = False  # put to sleep and not fully woken since
        self.error: str | None = None  # why the last wake stopped, while it stays stopped
        self.seconds: dict[str, float] = {}  # the last wake's time per stage
        self._woken: set[str] = set()  # stages of the current wake already done
        self._released: int | None = None  # device bytes the sleep gave back (weights + KV cache)

    def reset(self) -> None:
        """A fresh server: awake, nothing released."""
        self.asleep, self.error, self._released = False, None, None
        self._woken.clear()

    async def sleep(self) -> None:
        """Requests in flight finish (mode=wait), new ones wait; vLLM drops its KV cache and its
        weights (level 2) or copies them to host memory (level 1)."""
        before = self.probe()
        self.awake.clear()  # requests arriving from now on wait for the wake, here
        try:
            level = self._config.sleep_level
            await self._dev_post("sleep", "/sleep", self._config.request_timeout_s, level=level, mode="wait")
        except BaseException:
            self.awake.set()
            raise
        after = self.probe()
        if not self.asleep and before is not None and after is not None:
            self._released = max(0, after.free_bytes - before.free_bytes)
            log.info("vLLM sleeps (level %d): %.2f GiB freed", level, self._released / handoff.GiB)
        # A wake that stopped part-way is asleep still: what it released is the first sleep's figure.
        self.asleep = True
        self._woken.clear()

    def failed(self, e: BaseException) -> None:
        """A wake stopped: what waited for it fails now (EngineDownError), not later."""
        self.error = f"{type(e).__name__}: {e}"
        self.awake.set()

    def woke(self) -> None:
        """Every stage is awake (what the sleep released is kept: a later sleep may measure none)."""
        self.asleep, self.error = False, None
        self._woken.clear()
        self.awake.set()
        log.info("vLLM awake: %s", ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items()))

    async def stages(self, adapter: tuple[Path, int] | None, load: LoadAdapter) -> None:
        """Wake the stages not done yet; `adapter` is loaded (`load`) between weights and KV cache."""
        probe, timeout = self.probe, self._config.wake_timeout_s
        tp = self._config.tensor_parallel_size
        weights = handoff.weight_bytes(self._server.model_dir, self._server.dtype) // tp
        if "weights" not in self._woken:
            handoff.check_fits("weights", weights, probe)
            t0 = time.perf_counter()
            await self._dev_post("wake weights", "/wake_up", timeout, tags="weights")
            if self._config.sleep_level == 2:
                # level 2 left the weights' memory mapped but empty: re-read them from the
                # checkpoint (vLLM's worker reload_weights, which also resets its LoRA state)
                await self._dev_post("reload weights", "/collective_rpc", timeout, method="reload_weights")
            self.seconds["weights"] = time.perf_counter() - t0
            self._woken.add("weights")
        if adapter is not None and "adapter" not in self._woken:
            handoff.check_fits("adapter", handoff.adapter_bytes(adapter[0]), probe)
            t0 = time.perf_counter()
            try:
                await load(*adapter, timeout)
            except httpx.TimeoutException as e:
                raise self._timed_out("load adapter", e) from e
            except httpx.HTTPError as e:
                raise VLLMWakeError(f"load adapter: {type(e).__name__}: {e}") from e
            self.seconds["adapter"] = time.perf_counter() - t0
            self._woken.add("adapter")
        if "kv_cache" not in self._woken:
            handoff.check_fits("kv_cache", max(0, (self._released or 0) - weights), probe)
            t0 = time.perf_counter()
            await self._dev_post("wake KV cache", "/wake_up", timeout, tags="kv_cache")
            self.seconds["kv_cache"] = time.perf_counter() - t0
            self._woken.add("kv_cache")

    async def _dev_post(self, what: str, path: str, timeout: float, **params: str | int) -> None:
        """POST one of vLLM's dev-mode routes (`VLLM_SERVER_DEV_MODE=1`); a timeout or a refusal
        raises VLLMWakeError naming the stage."""
        # vLLM 0.32 (vllm/entrypoints/serve/dev/sleep/api_router.py, rpc/api_router.py):
        # POST /sleep?level=0..2&mode=abort|wait|keep → {"status": "sleeping", "level": level};
        # POST /wake_up?tags=weights|kv_cache (repeatable; none: all) → {"status": "awake" or, while
        # other tags sleep, "sleeping", "tags": [...]}; POST /collective_rpc {"method", "args",
        # "kwargs"} → {"results": [...]} or an empty 200.
        rpc = path == "/collective_rpc"
        server = self._server
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=timeout) as c:
            try:
                if rpc:
                    resp = await c.post(path, json=params)
                else:
                    resp = await c.post(path, params=params)
            except httpx.TimeoutException as e:
                raise self._timed_out(what, e) from e
            except httpx.HTTPError as e:
                raise VLLMWakeError(
                    f"{what}: {type(e).__name__}: {e}; log tail:\n{server.log_tail(20)}"
                ) from e
        if resp.status_code != 200:
            raise VLLMWakeError(f"{what}: vLLM answered {resp.status_code}: {resp.text[:500]}")

    def _timed_out(self, what: str, e: Exception) -> VLLMWakeError:
        return VLLMWakeError(
            f"{what}: vLLM did not answer within {self._config.wake_timeout_s:g} s "
            f"(VLLMConfig.wake_timeout_s; {type(e).__name__}); log tail:\n{self._server.log_tail(20)}"
        )
