"""The vLLM engine: token-id prompts sampled by a vLLM server process, LoRA hot-loaded per step.

Our endpoint stays in front: it renders messages to prompt ids (splicing earlier sampled turns) and
parses tool calls; this engine only samples. Each call goes to vLLM's `/v1/completions` with the
prompt *as token ids* and `return_token_ids`, so the ids and logprobs we record are exactly what
vLLM sampled and scored — no detokenize/retokenize round trip. vLLM's logprobs are raw (temperature
1, before top-p), the quantity the trainer computes (the server is started with
`--logprobs-mode raw_logprobs` to pin that).

Each training step is served under its own LoRA name (`policy@<step>`): requests already running
finish on the adapter they started with, and vLLM's prefix cache never mixes two steps' weights.

A server that exits on its own (a crash, the OOM killer) is noticed at once by its supervisor
thread: the requests it held fail with `EngineDownError` (the endpoint's 503, which `gather` counts
against `max_exceptions`), requests that arrive while it restarts fail the same way instead of
waiting, and the restarted server gets the served step's adapter back before it takes requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import httpx

from journeyman.engine.base import Engine, Sample, SamplingParams
from journeyman.engine.grammar import SCHEMA_FIELD, wrapped_ebnf
from journeyman.engine.vllm_server import VLLMConfig, VLLMServer
from journeyman.errors import EngineDownError, InvalidFieldError, JourneymanError

log = logging.getLogger("journeyman.vllm")

_BASE_NAME = "policy"
_TOKEN_ID = "token_id:"


class VLLMRequestError(JourneymanError, RuntimeError):
    """vLLM refused or failed a request; the message carries its status and error text."""


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

    def __init__(
        self,
        model_dir: Path,
        stop_ids: set[int],
        config: VLLMConfig | None = None,
        *,
        dtype: str = "float32",
        lora_rank: int = 8,
    ) -> None:
        self.config = config or VLLMConfig()
        self.stop_ids = sorted(stop_ids)
        self.server = VLLMServer(
            model_dir, self.config, served_name=_BASE_NAME, dtype=dtype, lora_rank=lora_rank
        )
        self.step = 0
        self.adapter_load_seconds: list[float] = []
        self._served = 0
        self._adapters: list[str] = []  # LoRA names registered in vLLM, oldest first
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
            # a dead server's connections break before its supervisor has reaped it: a moment's grace
            for _ in range(40):
                if self._down is not None or not self.server.alive():
                    break
                await asyncio.sleep(0.05)
            if self._down is not None or not self.server.alive():
                raise EngineDownError(
                    f"{what}: the vLLM server exited while serving it ({type(e).__name__}); "
                    f"{self._down or 'restarting it'}; log tail:\n{self.server.log_tail(20)}"
                ) from e
            raise VLLMRequestError(
                f"{what}: {type(e).__name__}: {e} (vLLM server running; log tail:)\n{self.server.log_tail(20)}"
            ) from e
        if resp.status_code == 400:
            raise _Refused(resp)
        if resp.status_code != 200:
            raise VLLMRequestError(f"{what}: vLLM answered {resp.status_code}: {resp.text[:2000]}")
        return resp

    # -- supervision -------------------------------------------------------------------------------

    @property
    def down(self) -> str | None:
        """Why requests are refused now (the server exited, is restarting, or stays down); None when up."""
        return self._down

    def _on_exit(self, code: int) -> None:
        """The server exited on its own (supervisor thread): refuse requests, restart it, or stay down."""
        if self.restarts >= self.config.max_restarts:
            self._down = (
                f"the vLLM server exited with code {code} and was already restarted "
                f"{self.restarts} times (VLLMConfig.max_restarts); it stays down"
            )
            log.error("%s; log: %s", self._down, self.server.log_path)
            return
        self._down = f"the vLLM server exited with code {code} and is restarting"
        log.warning("%s (log: %s)", self._down, self.server.log_path)
        threading.Thread(target=self._restart, name="journeyman-vllm-restart", daemon=True).start()

    def _restart(self) -> None:
        self.restarts += 1
        try:
            self.server.restart()
            self._clients.clear()  # bound to the old server's connections (and maybe its port)
            self._adapters.clear()
            if self._served_adapter is not None:
                asyncio.run(self.load_adapter(*self._served_adapter))
        except Exception as e:
            self._down = f"the vLLM server exited and could not be restarted: {e}"
            log.error("%s", self._down)
            return
        self._down = None
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
        body: dict[str, Any] = {
            "model": self.served_model,
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
        if params.json_schema is not None and (params.json_prefix or params.json_suffix):
            # Tool calls: the JSON sits between literal tags, which only a grammar can say.
            body["structured_outputs"] = {
                "grammar": wrapped_ebnf(params.json_prefix, params.json_schema, params.json_suffix)
            }
        elif params.json_schema is not None:
            # Compact JSON, as the in-process engine emits: a small model given free whitespace pads.
            body["structured_outputs"] = {"json": params.json_schema, "disable_any_whitespace": True}
        return body

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        if not self._awake.is_set():  # a training step has the GPU: wait for it, on any event loop
            await asyncio.to_thread(self._awake.wait)
        try:
            resp = await self._post("/v1/completions", self.request_body(prompt_ids, params), "completion")
        except _Refused as e:  # vLLM's 400: a bad value in this request, named like the endpoint names it
            field = SCHEMA_FIELD if params.json_schema is not None else (e.param or "request")
            value = params.json_schema if params.json_schema is not None else None
            raise InvalidFieldError(field, value, f"vLLM refused it: {e.message}") from None
        data = resp.json()
        samples = [_sample(choice, params.top_logprobs) for choice in sorted(data["choices"], key=_index)]
        if params.json_schema is not None:
            await self._rescore(prompt_ids, samples, str(data.get("model") or self.served_model), params)
        self._served += 1
        return samples

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
        """Load the PEFT adapter saved at `path` as `policy@<step>`; later requests use it."""
        name = f"{_BASE_NAME}@{step}"
        path = Path(path).resolve()
        if not (path / "adapter_config.json").exists():
            raise InvalidFieldError(
                "path", str(path), "is not a PEFT adapter directory (no adapter_config.json)"
            )
        t0 = time.perf_counter()
        # A fresh client: this runs on whatever loop the trainer uses, possibly a short-lived one.
        async with httpx.AsyncClient(
            base_url=self.server.base_url, headers=self.server.headers, timeout=self.config.request_timeout_s
        ) as c:
            body = {"lora_name": name, "lora_path": str(path), "load_inplace": name in self._adapters}
            resp = await c.post("/v1/load_lora_adapter", json=body)
            if resp.status_code != 200:
                raise VLLMRequestError(
                    f"load_lora_adapter {name} from {path}: {resp.status_code}: {resp.text[:2000]}"
                )
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

    async def sleep(self) -> None:
        """Free the GPU for a training step (vLLM sleep level 1: weights to CPU, KV cache dropped)."""
        if not self.server.sleep_mode:
            if not self._warned_sleep:
                log.info("vLLM sleep mode is off (not supported on CPU): the server stays up during training")
                self._warned_sleep = True
            return
        async with httpx.AsyncClient(
            base_url=self.server.base_url, headers=self.server.headers, timeout=self.config.request_timeout_s
        ) as c:
            # mode=wait: requests in flight finish before the engine sleeps, instead of being aborted.
            resp = await c.post("/sleep", params={"level": 1, "mode": "wait"})
            if resp.status_code != 200:
                raise VLLMRequestError(f"sleep: {resp.status_code}: {resp.text[:500]}")
        self._awake.clear()

    async def wake(self) -> None:
        if self._awake.is_set():
            return
        if self._down is not None:  # the server died asleep; the restarted one starts awake
            self._awake.set()
            return
        async with httpx.AsyncClient(
            base_url=self.server.base_url, headers=self.server.headers, timeout=self.config.request_timeout_s
        ) as c:
            resp = await c.post("/wake_up")
            if resp.status_code != 200:
                raise VLLMRequestError(f"wake_up: {resp.status_code}: {resp.text[:500]}")
        self._awake.set()

    def close(self) -> None:
        self.server.stop()
        self._awake.set()
        # Clients bound to other loops cannot be awaited here; drop them (the server is gone anyway).
        self._clients.clear()


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
