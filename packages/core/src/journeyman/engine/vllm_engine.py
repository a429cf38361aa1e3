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
promoted step): it is registered under its step's name on first use and sampled in the same batches.

A server that exits on its own (a crash, the OOM killer) is noticed at once by its supervisor
thread: the requests it held fail with `EngineDownError` (the endpoint's 503, which `gather` counts
against `max_exceptions`), requests that arrive while it restarts fail the same way instead of
waiting, and the restarted server gets the served step's adapter back before it takes requests.
One that exits while asleep is restarted when the training step ends (at the wake), not beside it:
a fresh server takes its whole memory budget at start-up, which the trainer holds mid-step.

On CUDA, vLLM sleeps through each training step and wakes in stages, each checked against the
device's free memory first (`handoff.py`): its weights (re-read from disk at sleep level 2), then
the step's adapter, then its KV cache. A wake that is refused or times out leaves the engine asleep
and its requests failing fast (`EngineDownError`) until a later wake succeeds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import httpx

from journeyman.engine import handoff
from journeyman.engine.base import Engine, OnToken, Sample, SamplingParams
from journeyman.engine.grammar import SCHEMA_FIELD, is_plain_schema, wrapped_ebnf
from journeyman.engine.vllm_server import VLLMConfig, VLLMServer
from journeyman.errors import EngineDownError, InvalidFieldError, JourneymanError

log = logging.getLogger("journeyman.vllm")

_BASE_NAME = "policy"
_TOKEN_ID = "token_id:"


class VLLMRequestError(JourneymanError, RuntimeError):
    """vLLM refused or failed a request; the message carries its status and error text."""


class VLLMWakeError(VLLMRequestError):
    """A stage of vLLM's wake timed out (`VLLMConfig.wake_timeout_s`) or was refused. The engine
    stays asleep, its requests failing with EngineDownError, until a later wake succeeds."""


class _Refused(Exception):
    def __init__(self, resp: httpx.Response) -> None:
        try:
            err = resp.json().get("error") or {}
        except ValueError:
            err = {}
        self.message: str = str(err.get("message") or resp.text[:2000])
        self.param: str | None = err.get("param")
        super().__init__(self.message)


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
    ) -> None:
        """`memory_probe` reads the device's free memory before each wake stage (None answers: no
        check, as on the CPU)."""
        self.config = config or VLLMConfig()
        self.stop_ids = sorted(stop_ids)
        self.server = VLLMServer(
            model_dir, self.config, served_name=_BASE_NAME, dtype=dtype, lora_rank=lora_rank
        )
        self.step = 0
        self.adapter_load_seconds: list[float] = []
        self._served = 0
        self._adapters: list[str] = []  # LoRA names registered in vLLM, oldest first
        # steps served beside them (`SamplingParams.adapter`), oldest first: set once registered
        self._side: dict[str, threading.Event] = {}
        # httpx clients are bound to the event loop they were first used on; the endpoint's server
        # thread and the caller's loop (training, tests) each get their own.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        self._awake = threading.Event()  # cleared while vLLM sleeps through a training step
        self._awake.set()
        self._warned_sleep = False
        self._served_adapter: tuple[Path, int] | None = None  # (path, step) of the adapter served now
        self._down: str | None = None  # why requests are refused, while the server is down
        self.restarts = 0
        # the handoff (sleep → train → staged wake); see the module docstring
        self.memory_probe = memory_probe
        self._asleep = False  # put to sleep and not fully woken since
        self._woken: set[str] = set()  # stages of the current wake already done
        self._released: int | None = None  # device bytes the sleep gave back (weights + KV cache)
        self._wake_error: str | None = None  # why the last wake stopped, while it stays stopped
        self._restart_pending = False  # exited asleep: restart at the wake
        self._restarting = False
        self.wake_seconds: dict[str, float] = {}  # the last wake's time per stage
        self.server.on_exit = self._on_exit
        self.server.start()

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def requests_served(self) -> int:
        return self._served

    @property
    def served_model(self) -> str:
        """The vLLM model name requests use now: the newest step's adapter, or the base model."""
        return self._adapters[-1] if self._adapters else _BASE_NAME

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
        self._check(resp, what)
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

    @staticmethod
    def _check(resp: httpx.Response, what: str) -> None:
        if resp.status_code == 400:
            raise _Refused(resp)
        if resp.status_code != 200:
            raise VLLMRequestError(f"{what}: vLLM answered {resp.status_code}: {resp.text[:2000]}")

    # -- supervision -------------------------------------------------------------------------------

    @property
    def down(self) -> str | None:
        """Why requests are refused now (the server exited, is restarting, or stays down); None when up."""
        return self._down

    def _on_exit(self, code: int) -> None:
        """The server exited on its own (supervisor thread): refuse requests, restart it, or stay down."""
        if self._asleep:  # the trainer has the GPU: a fresh server would take memory it holds
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
        """A fresh server (it starts awake), serving the served step's adapter."""
        self._restarting = True
        self.restarts += 1
        try:
            self.server.restart()
            self._clients.clear()  # bound to the old server's connections (and maybe its port)
            self._adapters.clear()
            self._side.clear()  # registered again on their next request
            self._asleep, self._wake_error, self._released = False, None, None
            self._woken.clear()
            if self._served_adapter is not None:
                asyncio.run(self.load_adapter(*self._served_adapter))
        except Exception as e:
            self._down = f"the vLLM server exited and could not be restarted: {e}"
            self._restarting = False
            log.error("%s", self._down)
            return
        self._down = None
        self._restarting = False
        self._awake.set()
        log.warning(
            "vLLM restarted (%d of %d) in %.1f s, serving step %d",
            self.restarts,
            self.config.max_restarts,
            self.server.startup_seconds,
            self.step,
        )

    # -- sampling ----------------------------------------------------------------------------------

    def request_body(self, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        """The `/v1/completions` body for one prompt (fields as vLLM 0.32's CompletionRequest names them)."""
        if params.base:
            model = _BASE_NAME  # vLLM serves the base by its name
        elif params.adapter is not None:
            model = _lora_name(params.adapter_step or 0)
        else:
            model = self.served_model
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt_ids,  # token ids: vLLM does not tokenize, so no BOS/whitespace drift
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "stop": params.stop,
            "stop_token_ids": self.stop_ids,
            "seed": params.seed,
            "logprobs": max(1, params.top_logprobs),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # top-logprob keys as ids, not lossy strings
            "skip_special_tokens": True,
        }
        constraint = params.constraint
        if constraint is not None and not is_plain_schema(constraint):
            # Tool calls (JSON between literal tags) and reasoning first: only a grammar can say them.
            body["structured_outputs"] = {"grammar": wrapped_ebnf(constraint)}
        elif params.json_schema is not None:
            # Compact JSON, as the in-process engine emits: a small model given free whitespace pads.
            body["structured_outputs"] = {"json": params.json_schema, "disable_any_whitespace": True}
        return body

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None = None
    ) -> list[Sample]:
        if not self._awake.is_set():  # a training step has the GPU: wait for it, on any event loop
            await asyncio.to_thread(self._awake.wait)
        if self._wake_error is not None:
            raise EngineDownError(f"completion: vLLM did not wake: {self._wake_error}")
        body = self.request_body(prompt_ids, params)
        if params.adapter is not None:
            await self._beside(Path(params.adapter), str(body["model"]))
        try:
            if on_token is None:
                choices = (await self._post("/v1/completions", body, "completion")).json()["choices"]
            else:
                choices = await self._stream(body, on_token)
        except _Refused as e:  # vLLM's 400: a bad value in this request, named like the endpoint names it
            field = SCHEMA_FIELD if params.json_schema is not None else (e.param or "request")
            value = params.json_schema if params.json_schema is not None else None
            raise InvalidFieldError(field, value, f"vLLM refused it: {e.message}") from None
        samples = [_sample(choice, params.top_logprobs) for choice in sorted(choices, key=_index)]
        # the adapter this request named is the policy that sampled it, whatever loaded since
        name = str(body["model"])
        for s in samples:
            s.step = int(name.rsplit("@", 1)[1]) if "@" in name else 0
        if params.json_schema is not None:
            await self._rescore(prompt_ids, samples, str(body.get("model") or self.served_model), params)
        self._served += 1
        return samples

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
                    self._check(resp, what)
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for part in json.loads(line[len("data: ") :]).get("choices", []):
                        i = _index(part)
                        into = choices.setdefault(
                            i,
                            {"index": i, "token_ids": [], "text": "", "finish_reason": None, "logprobs": {}},
                        )
                        ids = part.get("token_ids") or []
                        for t in ids:
                            on_token(i, int(t))
                        into["token_ids"] += ids
                        into["text"] += part.get("text") or ""
                        into["finish_reason"] = part.get("finish_reason") or into["finish_reason"]
                        lp = part.get("logprobs") or {}
                        for key in ("token_logprobs", "top_logprobs"):
                            into["logprobs"].setdefault(key, []).extend(lp.get(key) or [])
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
        body: dict[str, Any] = {
            "model": model,
            "prompt": [prompt_ids + s.token_ids for s in rows],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": params.top_logprobs,
        }
        try:
            resp = await self._post("/v1/completions", body, "rescore constrained sample")
        except _Refused as e:
            raise VLLMRequestError(f"rescore constrained sample: vLLM refused it: {e.message}") from None
        choices = sorted(resp.json()["choices"], key=_index)
        n = len(prompt_ids)
        for sample, choice in zip(rows, choices, strict=True):
            entries = (choice.get("prompt_logprobs") or [])[n : n + len(sample.token_ids)]
            if len(entries) != len(sample.token_ids):
                raise VLLMRequestError(
                    f"vLLM returned {len(entries)} prompt logprobs for {len(sample.token_ids)} sampled tokens"
                )
            sample.logprobs = [
                float(e[str(t)]["logprob"]) for e, t in zip(entries, sample.token_ids, strict=True)
            ]
            if params.top_logprobs:
                sample.top_logprobs = [
                    sorted(((int(k), float(v["logprob"])) for k, v in e.items()), key=lambda x: -x[1])[
                        : params.top_logprobs
                    ]
                    for e in entries
                ]

    # -- training side -----------------------------------------------------------------------------

    async def load_adapter(self, path: Path, step: int) -> None:
        """Load the PEFT adapter saved at `path` as `policy@<step>`; later requests use it. While the
        engine sleeps this is the middle stage of its wake: weights, this adapter, KV cache."""
        path = Path(path).resolve()
        if not (path / "adapter_config.json").exists():
            raise InvalidFieldError(
                "path", str(path), "is not a PEFT adapter directory (no adapter_config.json)"
            )
        if self._asleep:
            await self._wake((path, step))
            return
        if self._down is not None and not self._restarting:
            raise EngineDownError(f"load adapter of step {step}: {self._down}")
        await self._load(path, step, self.config.request_timeout_s)

    async def _load(self, path: Path, step: int, timeout: float) -> None:
        name = _lora_name(step)
        t0 = time.perf_counter()
        # A fresh client: this runs on whatever loop the trainer uses, possibly a short-lived one.
        async with httpx.AsyncClient(
            base_url=self.server.base_url, headers=self.server.headers, timeout=timeout
        ) as c:
            await self._register(c, name, path)
            self._side.pop(name, None)  # a step served beside, now the served one (a promoted candidate)
            if name in self._adapters:
                self._adapters.remove(name)
            self._adapters.append(name)
            self.step = step
            self._served_adapter = (path, step)
            # Keep the newest two registered (requests still running may use the previous one).
            while len(self._adapters) > 2:
                old = self._adapters.pop(0)
                r = await c.post("/v1/unload_lora_adapter", json={"lora_name": old})
                if r.status_code != 200:
                    log.warning("could not unload %s from vLLM: %s", old, r.text[:300])
        seconds = time.perf_counter() - t0
        self.adapter_load_seconds.append(seconds)
        log.info("vLLM serves step %d (adapter %s) after a %.3f s load", step, path, seconds)

    async def _register(self, c: httpx.AsyncClient, name: str, path: Path) -> None:
        """Load the adapter at `path` under `name`. vLLM's LoadLoRAAdapterRequest {lora_name,
        lora_path, load_inplace}: in place when the name may be registered already (a wake that loads
        the served step's adapter again, a candidate promoted, two first requests for one side step)."""
        inplace = name in self._adapters or name in self._side
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": inplace}
        resp = await c.post("/v1/load_lora_adapter", json=body)
        if resp.status_code != 200:
            raise VLLMRequestError(
                f"load_lora_adapter {name} from {path}: {resp.status_code}: {resp.text[:2000]}"
            )

    async def _beside(self, path: Path, name: str) -> None:
        """Register the checkpoint a request names (a step served beside the current one) as `name` on
        its first request, which the requests for it meanwhile wait for; the newest two stay registered."""
        if name in self._adapters:
            return
        loaded = self._side.get(name)
        if loaded is not None:  # registered, or another request is registering it
            if not await asyncio.to_thread(loaded.wait, self.config.request_timeout_s):
                raise VLLMRequestError(f"load adapter {name}: timed out waiting for its load")
            if name in self._side:
                return
            raise VLLMRequestError(f"load adapter {name} failed (see the request that loaded it)")
        if self._down is not None:
            raise EngineDownError(f"load adapter {name}: {self._down}")
        self._side[name] = loaded = threading.Event()
        try:
            await self._register(self._client(), name, path.resolve())
        except BaseException:
            self._side.pop(name, None)
            raise
        finally:
            loaded.set()
        while len(self._side) > 2:
            old = next(iter(self._side))
            del self._side[old]
            r = await self._client().post("/v1/unload_lora_adapter", json={"lora_name": old})
            if r.status_code != 200:
                log.warning("could not unload %s from vLLM: %s", old, r.text[:300])

    async def sleep(self) -> None:
        """Free the GPU for a training step: requests in flight finish (mode=wait), new ones wait;
        vLLM drops its KV cache and its weights (level 2) or copies them to host memory (level 1)."""
        if not self.server.sleep_mode:
            if not self._warned_sleep:
                log.info("vLLM sleep mode is off (not supported on CPU): the server stays up during training")
                self._warned_sleep = True
            return
        if self._down is not None:  # restarting or down: nothing to put to sleep
            return
        before = self.memory_probe()
        self._awake.clear()  # requests arriving from now on wait for the wake, here
        try:
            level = self.config.sleep_level
            await self._dev_post("sleep", "/sleep", self.config.request_timeout_s, level=level, mode="wait")
        except BaseException:
            self._awake.set()
            raise
        after = self.memory_probe()
        if not self._asleep and before is not None and after is not None:
            self._released = max(0, after.free_bytes - before.free_bytes)
            log.info("vLLM sleeps (level %d): %.2f GiB freed", level, self._released / handoff.GiB)
        # A wake that stopped part-way is asleep still: what it released is the first sleep's figure.
        self._asleep = True
        self._woken.clear()

    async def wake(self) -> None:
        """Take the GPU back after `sleep`, in stages (weights, the served adapter, KV cache)."""
        if self._asleep:
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
            await self._wake_stages(adapter)
        except BaseException as e:
            self._wake_error = f"{type(e).__name__}: {e}"
            self._awake.set()  # what waited for the wake fails now (EngineDownError), not later
            raise
        self._asleep, self._wake_error = False, None
        self._woken.clear()
        self._awake.set()
        log.info("vLLM awake: %s", ", ".join(f"{k} {v:.2f} s" for k, v in self.wake_seconds.items()))

    async def _wake_stages(self, adapter: tuple[Path, int] | None) -> None:
        probe, timeout = self.memory_probe, self.config.wake_timeout_s
        tp = self.config.tensor_parallel_size
        weights = handoff.weight_bytes(self.server.model_dir, self.server.dtype) // tp
        if "weights" not in self._woken:
            handoff.check_fits("weights", weights, probe)
            t0 = time.perf_counter()
            await self._dev_post("wake weights", "/wake_up", timeout, tags="weights")
            if self.config.sleep_level == 2:
                # level 2 left the weights' memory mapped but empty: re-read them from the
                # checkpoint (vLLM's worker reload_weights, which also resets its LoRA state)
                await self._dev_post("reload weights", "/collective_rpc", timeout, method="reload_weights")
            self.wake_seconds["weights"] = time.perf_counter() - t0
            self._woken.add("weights")
        target = adapter or self._served_adapter
        if target is not None and "adapter" not in self._woken:
            handoff.check_fits("adapter", handoff.adapter_bytes(target[0]), probe)
            t0 = time.perf_counter()
            try:
                await self._load(*target, timeout)
            except httpx.TimeoutException as e:
                raise self._timed_out("load adapter", e) from e
            except httpx.HTTPError as e:
                raise VLLMWakeError(f"load adapter: {type(e).__name__}: {e}") from e
            self.wake_seconds["adapter"] = time.perf_counter() - t0
            self._woken.add("adapter")
        if "kv_cache" not in self._woken:
            handoff.check_fits("kv_cache", max(0, (self._released or 0) - weights), probe)
            t0 = time.perf_counter()
            await self._dev_post("wake KV cache", "/wake_up", timeout, tags="kv_cache")
            self.wake_seconds["kv_cache"] = time.perf_counter() - t0
            self._woken.add("kv_cache")

    async def _restart_at_wake(self, adapter: tuple[Path, int] | None) -> None:
        """The server exited asleep: start a fresh one now that the trainer is done; it starts awake,
        serving `adapter` (else the served one)."""
        if self.restarts >= self.config.max_restarts:
            self._restart_pending = False
            self._down = (
                f"{self._down}; it was already restarted {self.restarts} times (VLLMConfig.max_restarts) "
                "and stays down"
            )
            self._asleep = False
            self._awake.set()
            raise EngineDownError(f"wake: {self._down}")
        reading = self.memory_probe()
        if reading is not None:  # vLLM takes its whole budget at start-up
            handoff.check_fits(
                "restart", int(self.config.gpu_memory_utilization * reading.total_bytes), lambda: reading
            )
        self._restart_pending = False
        if adapter is not None:
            self._served_adapter = adapter  # the fresh server starts on the new step's adapter
        await asyncio.to_thread(self._restart)
        if self._down is not None:
            raise EngineDownError(f"wake: {self._down}")

    async def _dev_post(self, what: str, path: str, timeout: float, **params: str | int) -> None:
        """POST one of vLLM's dev-mode routes (`VLLM_SERVER_DEV_MODE=1`); a timeout or a refusal
        raises VLLMWakeError naming the stage."""
        # vLLM 0.32 (vllm/entrypoints/serve/dev/sleep/api_router.py, rpc/api_router.py):
        # POST /sleep?level=0..2&mode=abort|wait|keep → {"status": "sleeping", "level": level};
        # POST /wake_up?tags=weights|kv_cache (repeatable; none: all) → {"status": "awake" or, while
        # other tags sleep, "sleeping", "tags": [...]}; POST /collective_rpc {"method", "args",
        # "kwargs"} → {"results": [...]} or an empty 200.
        rpc = path == "/collective_rpc"
        async with httpx.AsyncClient(
            base_url=self.server.base_url, headers=self.server.headers, timeout=timeout
        ) as c:
            try:
                if rpc:
                    resp = await c.post(path, json=params)
                else:
                    resp = await c.post(path, params=params)
            except httpx.TimeoutException as e:
                raise self._timed_out(what, e) from e
            except httpx.HTTPError as e:
                raise VLLMWakeError(
                    f"{what}: {type(e).__name__}: {e}; log tail:\n{self.server.log_tail(20)}"
                ) from e
        if resp.status_code != 200:
            raise VLLMWakeError(f"{what}: vLLM answered {resp.status_code}: {resp.text[:500]}")

    def _timed_out(self, what: str, e: Exception) -> VLLMWakeError:
        return VLLMWakeError(
            f"{what}: vLLM did not answer within {self.config.wake_timeout_s:g} s "
            f"(VLLMConfig.wake_timeout_s; {type(e).__name__}); log tail:\n{self.server.log_tail(20)}"
        )

    def close(self) -> None:
        self.server.stop()
        self._awake.set()
        # Clients bound to other loops cannot be awaited here; drop them (the server is gone anyway).
        self._clients.clear()


def _lora_name(step: int) -> str:
    """The name vLLM serves a step's adapter under (the base model is `_BASE_NAME` alone)."""
    return f"{_BASE_NAME}@{step}"


def _index(choice: dict[str, Any]) -> int:
    return int(choice.get("index", 0))


def _token_id(token: str) -> int:
    return int(token[len(_TOKEN_ID) :]) if token.startswith(_TOKEN_ID) else -1


def _sample(choice: dict[str, Any], top_k: int) -> Sample:
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise VLLMRequestError(
            "vLLM returned no token_ids (return_token_ids is not supported by this version)"
        )
    lp = choice.get("logprobs") or {}
    logprobs = [float(x) if x is not None else float("nan") for x in lp.get("token_logprobs") or []]
    if len(logprobs) != len(token_ids):
        raise VLLMRequestError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    top: list[list[tuple[int, float]]] = []
    if top_k:
        for entry in lp.get("top_logprobs") or []:
            ranked = sorted(((_token_id(t), v) for t, v in (entry or {}).items()), key=lambda x: -x[1])
            top.append(ranked[:top_k])
    finish = choice.get("finish_reason") or "length"
    if finish not in ("stop", "length"):  # "abort" / "error": the sample is incomplete
        raise VLLMRequestError(f"vLLM finished a sample with finish_reason={finish!r}")
    return Sample(list(token_ids), logprobs, finish, choice.get("text", ""), top)
