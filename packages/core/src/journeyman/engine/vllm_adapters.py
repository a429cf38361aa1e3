"""The LoRA adapters a vLLM server holds for the vLLM engine (`vllm_engine`).

Each training step is served under its own LoRA name (`policy@<step>`, `lora_name`): requests
already running finish on the adapter they started with, and vLLM's prefix cache never mixes two
steps' weights. The newest two served steps stay registered. A request may name another checkpoint
(`SamplingParams.adapter`, live training's candidate beside the promoted step): it is registered
under its step's name on its first request, which the requests for it meanwhile wait for, and the
newest two such side steps stay registered.

Several models on one server (`VLLMEngine(share_with=)`) keep their adapters apart by name: the
first model's steps are `policy@<step>`, model k's `policy-k@<step>`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import httpx

from journeyman.engine.base import SamplingParams
from journeyman.engine.vllm_wire import VLLMRequestError
from journeyman.errors import EngineDownError

__all__ = ["BASE_NAME", "VLLMAdapters", "lora_name", "step_of"]

log = logging.getLogger("journeyman.vllm")

BASE_NAME = "policy"  # the name vLLM serves the base model under
_KEEP = 2  # registered adapters kept of each kind: a request still running may use the older one


def lora_name(step: int, model: str = BASE_NAME) -> str:
    """The name vLLM serves a step's adapter under (the base model is `BASE_NAME` alone); `model`:
    the model's name on a server several share (`VLLMAdapters.model`)."""
    return f"{model}@{step}"


def step_of(model: str) -> int:
    """The training step whose policy vLLM's `model` is (0: the base model)."""
    return int(model.rsplit("@", 1)[1]) if "@" in model else 0


class VLLMAdapters:
    """The served steps' adapters (newest last), the side steps' and the adapter to load again after
    a restart or a wake. Its coroutines run on the caller's event loop, with the caller's client."""

    def __init__(self, timeout_s: float, model: str = BASE_NAME) -> None:
        self.model = model  # what this model's adapters are named after on the server
        self._timeout_s = timeout_s  # how long a request waits for another's load of its side step
        self._served: list[str] = []  # LoRA names registered in vLLM, oldest first
        # steps served beside them (`SamplingParams.adapter`), oldest first: set once registered
        self._side: dict[str, threading.Event] = {}
        self.current: tuple[Path, int] | None = None  # (path, step) of the adapter served now

    @property
    def served_model(self) -> str:
        """The vLLM model name requests use now: the newest step's adapter, or the base model."""
        return self._served[-1] if self._served else BASE_NAME

    def model_for(self, params: SamplingParams) -> str:
        """The vLLM model a request samples with: the base, the step it names, or the served one."""
        if params.base:
            return BASE_NAME  # vLLM serves the base by its name
        if params.adapter is not None:
            return lora_name(params.adapter_step or 0, self.model)
        return self.served_model

    def forget(self) -> None:
        """A fresh server holds none (the side steps are registered again on their next request)."""
        self._served.clear()
        self._side.clear()

    async def serve(self, c: httpx.AsyncClient, path: Path, step: int) -> None:
        """Register `path` as `step`'s adapter and serve it from now on (`trim` unloads the oldest)."""
        name = lora_name(step, self.model)
        await self._register(c, name, path)
        self._side.pop(name, None)  # a step served beside, now the served one (a promoted candidate)
        if name in self._served:
            self._served.remove(name)
        self._served.append(name)
        self.current = (path, step)

    async def trim(self, c: httpx.AsyncClient) -> None:
        """Unload the served steps' adapters but the newest two."""
        while len(self._served) > _KEEP:
            await _unload(c, self._served.pop(0))

    async def beside(self, c: httpx.AsyncClient, path: Path, name: str, down: str | None) -> None:
        """Register the checkpoint a request names as `name` on its first request (`down`: why the
        server refuses requests now, if it does)."""
        if name in self._served:
            return
        loaded = self._side.get(name)
        if loaded is not None:  # registered, or another request is registering it
            if not await asyncio.to_thread(loaded.wait, self._timeout_s):
                raise VLLMRequestError(f"load adapter {name}: timed out waiting for its load")
            if name in self._side:
                return
            raise VLLMRequestError(f"load adapter {name} failed (see the request that loaded it)")
        if down is not None:
            raise EngineDownError(f"load adapter {name}: {down}")
        self._side[name] = loaded = threading.Event()
        try:
            await self._register(c, name, path.resolve())
        except BaseException:
            self._side.pop(name, None)
            raise
        finally:
            loaded.set()
        while len(self._side) > _KEEP:
            old = next(iter(self._side))
            del self._side[old]
            await _unload(c, old)

    async def _register(self, c: httpx.AsyncClient, name: str, path: Path) -> None:
        """Load the adapter at `path` under `name`. vLLM's LoadLoRAAdapterRequest {lora_name,
        lora_path, load_inplace}: in place when the name may be registered already (a wake that loads
        the served step's adapter again, a candidate promoted, two first requests for one side step)."""
        inplace = name in self._served or name in self._side
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": inplace}
        resp = await c.post("/v1/load_lora_adapter", json=body)
        if resp.status_code != 200:
            raise VLLMRequestError(
                f"load_lora_adapter {name} from {path}: {resp.status_code}: {resp.text[:2000]}"
            )


async def _unload(c: httpx.AsyncClient, name: str) -> None:
    r = await c.post("/v1/unload_lora_adapter", json={"lora_name": name})
    if r.status_code != 200:
        log.warning("could not unload %s from vLLM: %s", name, r.text[:300])
