"""The Backend operations in one table: how each travels over HTTP and which token may call it.

`RemoteBackend` makes its methods from these rows (one generic request), `journeyman serve` its
routes (one loop), and the server's door (`serving/guard.py`) the scope each route needs. A row is
made from the protocol's own method, so a method made from it takes its arguments exactly as
`Backend` declares them (defaults included) and type-checks as that method:

    class RemoteBackend:
        async def _send(self, op: Operation[Any], arguments: dict[str, Any]) -> Any: ...
        history = HISTORY.forwarded_to(_send)        # `backend.history(model)`, typed as Backend's

A new operation is a method on `Backend`, its implementation in `LocalBackend`, its body in
`wire.py` and a row here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast

from pydantic import TypeAdapter

from journeyman.client.protocol import Backend, LiveBackend, MeteredBackend
from journeyman.client.wire import (
    PREFIX,
    Body,
    CapturesBody,
    ChargeBody,
    DecideBody,
    DeleteCheckpointsBody,
    LiveBody,
    LogBody,
    OutcomeBody,
    RegisterBody,
    Registered,
    SFTBody,
    StepBody,
    TrainBody,
)
from journeyman.data.config import TrainResult
from journeyman.data.live_types import Decision, LiveStatus, OutcomeReceipt
from journeyman.rollout.capture import CapturedCall

Scope = Literal["sample", "train", "admin"]
"""What a token may call; they nest, sample < train < admin (`serving/api_tokens.py`)."""

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Operation(Generic[F]):
    """One Backend method on the wire."""

    declared: F
    """The `Backend` protocol's method: its name, its arguments."""
    http: Literal["GET", "POST"]
    path: str
    """Under PREFIX; `{name}` is the name of the model the call is about."""
    body: type[Body] | None
    """The request body (the call's arguments less the model), or None for a GET."""
    response: Any
    """The type the answer's JSON is read as."""
    idempotent: bool
    """Retried on any transport failure; otherwise only when the request never left the client."""
    scope: Scope
    gzip: bool = False
    """The body carries trajectories: sent compressed."""
    progress_unit: str | None = None
    """Set for a training call: answered as a stream of `TrainEvent`s whose progress counts these."""

    @property
    def name(self) -> str:
        return self.declared.__name__

    @property
    def route(self) -> str:
        """The last segment of the path, by which the guard finds the route's scope."""
        return self.path.rsplit("/", 1)[-1]

    @property
    def per_model(self) -> bool:
        return "{name}" in self.path

    def url(self, model_name: str | None = None) -> str:
        return PREFIX + (self.path.format(name=model_name) if self.per_model else self.path)

    @functools.cached_property
    def _answer(self) -> TypeAdapter[Any]:
        return TypeAdapter(self.response)

    def answer(self, data: Any) -> Any:
        """The JSON answer of a call as the type the method returns."""
        return self._answer.validate_python(data)

    async def call(self, backend: object, arguments: Mapping[str, Any]) -> Any:
        """Call this operation's method on `backend` (the server's side; `arguments` include the model)."""
        result = getattr(backend, self.name)(**arguments)
        return await result if inspect.isawaitable(result) else result

    def implemented_by(self, implementation: Callable[..., Awaitable[Any]]) -> F:
        """The method of a backend class whose work `implementation(backend, **arguments)` does: the
        protocol's arguments, bound as it declares them (defaults applied), by name."""

        async def run(backend: Any, arguments: dict[str, Any]) -> Any:
            return await implementation(backend, **arguments)

        return self._method(run, implementation.__doc__)

    def forwarded_to(self, send: Callable[[Any, Operation[Any], dict[str, Any]], Awaitable[Any]]) -> F:
        """The method of a backend class that hands every call to `send(backend, op, arguments)`."""

        async def run(backend: Any, arguments: dict[str, Any]) -> Any:
            return await send(backend, self, arguments)

        return self._method(run, None)

    def _method(self, run: Callable[[Any, dict[str, Any]], Awaitable[Any]], doc: str | None) -> F:
        signature = inspect.signature(self.declared)
        this = next(iter(signature.parameters))  # the protocol's `self`

        async def method(backend: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(backend, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            del arguments[this]
            return await run(backend, arguments)

        functools.update_wrapper(method, self.declared)  # name, signature and help as declared
        method.__doc__ = doc or self.declared.__doc__
        return cast(F, method)


# fmt: off
#                              method (Backend's)          http    path under PREFIX                    request body           response                       idempotent scope     gzip  progress unit
REGISTER           = Operation(Backend.register,           "POST", "/register",                         RegisterBody,          Registered,                    True,      "train")
GET_STEP           = Operation(Backend.get_step,           "GET",  "/models/{name}/step",               None,                  int,                           True,      "sample")
TRAIN              = Operation(Backend.train,              "POST", "/models/{name}/train",              TrainBody,             TrainResult,                   True,      "train",  True, "micro-batch")
TRAIN_SFT          = Operation(Backend.train_sft,          "POST", "/models/{name}/train_sft",          SFTBody,               TrainResult,                   True,      "train",  True, "step")
LOG                = Operation(Backend.log,                "POST", "/models/{name}/log",                LogBody,               dict[str, float],              False,     "train",  True)
HISTORY            = Operation(Backend.history,            "GET",  "/models/{name}/history",            None,                  list[dict[str, Any]],          True,      "sample")
POP_CAPTURES       = Operation(Backend.pop_captures,       "POST", "/models/{name}/captures",           CapturesBody,          dict[str, list[CapturedCall]], False,     "sample")
SERVE_STEP         = Operation(Backend.serve_step,         "POST", "/models/{name}/serve_step",         StepBody,              None,                          True,      "train")
DELETE_CHECKPOINTS = Operation(Backend.delete_checkpoints, "POST", "/models/{name}/delete_checkpoints", DeleteCheckpointsBody, list[int],                     False,     "admin")
RUN_DIR            = Operation(Backend.run_dir,            "GET",  "/models/{name}/run_dir",            None,                  Path,                          True,      "sample")
LIVE               = Operation(LiveBackend.live,           "POST", "/models/{name}/live",               LiveBody,              LiveStatus,                    True,      "train")
REPORT_OUTCOME     = Operation(LiveBackend.report_outcome, "POST", "/models/{name}/outcome",            OutcomeBody,           OutcomeReceipt,                True,      "sample")
LIVE_STATUS        = Operation(LiveBackend.live_status,    "GET",  "/models/{name}/live_status",        None,                  LiveStatus,                    True,      "sample")
DECIDE             = Operation(LiveBackend.decide,         "POST", "/models/{name}/decide",             DecideBody,            Decision,                      False,     "train")
CHARGE             = Operation(MeteredBackend.charge,      "POST", "/models/{name}/charge",             ChargeBody,            dict[str, float],              False,     "train")
# fmt: on
# RUN_DIR is served only: a RemoteBackend answers `run_dir` with what `register` answered.

OPERATIONS: tuple[Operation[Any], ...] = (
    REGISTER,
    GET_STEP,
    TRAIN,
    TRAIN_SFT,
    LOG,
    HISTORY,
    POP_CAPTURES,
    SERVE_STEP,
    DELETE_CHECKPOINTS,
    RUN_DIR,
    LIVE,
    REPORT_OUTCOME,
    LIVE_STATUS,
    DECIDE,
    CHARGE,
)

__all__ = ["OPERATIONS", "Operation", "Scope"]
