"""LocalBackend: serves and trains models in this process, with the run directory on local disk."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from .adapter import LoraPolicy
from .capture import CapturedCall
from .chat_format import ChatFormat
from .endpoint import Endpoint, ServerThread, build_app
from .engine import Engine
from .engine.vllm_server import VLLMConfig
from .errors import InvalidFieldError
from .model import TrainableModel
from .weights import resolve_base_model

# name -> base URL of every model served in this process (the offline `judge="local"` uses it).
_LOCAL_ENDPOINTS: dict[str, str] = {}


def local_endpoint(name: str | None = None) -> tuple[str, str]:
    """(model name, base URL) of a model served in this process: `name`, else the latest registered."""
    if not _LOCAL_ENDPOINTS:
        raise InvalidFieldError("judge", "local", "no model is served in this process: register one first")
    if name is None:
        name = next(reversed(_LOCAL_ENDPOINTS))
    if name not in _LOCAL_ENDPOINTS:
        raise InvalidFieldError("model", name, f"not served here; served: {sorted(_LOCAL_ENDPOINTS)}")
    return name, _LOCAL_ENDPOINTS[name]


@dataclass
class _Service:
    model: TrainableModel
    policy: LoraPolicy
    chat_format: ChatFormat
    engine: Engine
    endpoint: Endpoint
    server: ServerThread


class LocalBackend:
    """Runs engine, endpoint and trainer for each registered model in this process.

    `engine="torch"` (default) samples in process from the weights the trainer updates.
    `engine="vllm"` (or a `VLLMConfig`) samples through a vLLM server process that hot-loads each step's adapter.
    """

    def __init__(
        self,
        path: str | Path = ".journeyman",
        *,
        engine: str | VLLMConfig = "torch",
        device: str | None = None,
        dtype: str = "float32",
    ) -> None:
        self.vllm_config = engine if isinstance(engine, VLLMConfig) else VLLMConfig()
        engine = "vllm" if isinstance(engine, VLLMConfig) else engine
        if engine not in ("torch", "vllm"):
            raise InvalidFieldError("engine", engine, "supported engines: 'torch', 'vllm' (or a VLLMConfig)")
        self.path = Path(path)
        self.engine_kind = engine
        self.device = device
        self.dtype = dtype
        self._services: dict[str, _Service] = {}

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    async def register(self, model: TrainableModel) -> None:
        if model.name in self._services:
            self._services[model.name].model = model
            return
        self._services[model.name] = await asyncio.to_thread(self._start, model)

    def _start(self, model: TrainableModel) -> _Service:
        weights = resolve_base_model(model.base_model)
        policy = LoraPolicy(weights, model.lora, device=self.device, dtype=self.dtype)
        chat_format = ChatFormat(policy.tokenizer)
        engine = self._make_engine(weights, policy, chat_format)
        endpoint = Endpoint(engine, chat_format, model.name, default_max_tokens=model.max_tokens)
        server = ServerThread(build_app(endpoint))
        _LOCAL_ENDPOINTS[model.name] = server.base_url
        self.model_dir(model).mkdir(parents=True, exist_ok=True)
        return _Service(model, policy, chat_format, engine, endpoint, server)

    def _make_engine(self, weights: Path, policy: LoraPolicy, chat_format: ChatFormat) -> Engine:
        """The engine named by `engine=`; each kind's module is imported only when chosen."""
        if self.engine_kind == "vllm":
            from .engine.vllm_engine import VLLMEngine

            return VLLMEngine(
                weights, chat_format.stop_ids, self.vllm_config, dtype=self.dtype, lora_rank=policy.lora.r
            )
        from .engine.torch_engine import TorchEngine

        return TorchEngine(policy, chat_format.stop_ids)

    def service(self, model: TrainableModel) -> _Service:
        try:
            return self._services[model.name]
        except KeyError:
            raise InvalidFieldError("model", model.name, "is not registered with this backend") from None

    def base_url(self, model: TrainableModel) -> str:
        return self.service(model).server.base_url

    def step(self, model: TrainableModel) -> int:
        return self.service(model).engine.step

    def pop_captures(self, model: TrainableModel, capture_id: str) -> list[CapturedCall]:
        return self.service(model).endpoint.captures.pop(capture_id)

    def close(self) -> None:
        for s in self._services.values():
            _LOCAL_ENDPOINTS.pop(s.model.name, None)
            s.server.stop()
            s.engine.close()
        self._services.clear()

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
