"""The engine interface: token ids in, sampled token ids with their logprobs out.

The endpoint renders messages to ids and parses text back into messages; an engine only samples.
The in-process torch engine (`torch_engine`) and the vLLM engine sit behind this same interface.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# Bounds a request keeps to before it is queued. Unbounded, a hostile value failed every request
# batched with it: max_tokens=10**12 sized a KV cache nobody can allocate.
MAX_TOKENS = 2**20  # an engine also refuses what does not fit its model's context after the prompt
MAX_STOP = 16  # OpenAI takes 4, vLLM any number; each is searched for after every sampled token
MAX_STOP_CHARS = 256
MAX_SCHEMA_CHARS = 2**20
MAX_LITERAL_CHARS = 1024
MAX_SHAPES = 512  # the tools one forced call may choose from, in a syntax with one shape per tool
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit signed integer, as vLLM takes it

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


Shape = tuple[str, str, str]
"""(prefix, schema, suffix): literal text, compact JSON matching the schema, literal text."""


class Constraint(NamedTuple):
    """An output grammar (`grammar.constraint_grammar`): any one of `shapes`, after a free reasoning
    block `(open, close)` when `reasoning` is set (`<think>` text without `</think>`, then `</think>`:
    the grammar applies only to what follows the model's thinking, as vLLM's reasoning parsers do)."""

    shapes: tuple[Shape, ...]
    reasoning: tuple[str, str] | None = None

    def key(self) -> str:
        return "\0".join(p for shape in self.shapes for p in shape) + "\0\0" + "\0".join(self.reasoning or ())


class SamplingParams(BaseModel):
    """How to sample one prompt. Every field is bounded, so a bad value is refused when the params
    are built (a pydantic ValidationError naming it; the endpoint answers 400) instead of failing
    the batch it would join."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=1, ge=1, le=128, description="completions sampled for the prompt")
    temperature: float = Field(
        default=1.0,
        ge=0.0,
        le=2.0,
        allow_inf_nan=False,
        description="softmax temperature; 0 samples greedily (logprobs stay those of temperature 1)",
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="nucleus sampling: the smallest set of tokens whose probability reaches top_p",
    )
    max_tokens: int = Field(
        default=256,
        ge=1,
        le=MAX_TOKENS,
        description="tokens sampled at most per completion (the KV cache is sized by it); an engine "
        "also refuses more than its model's context leaves after the prompt",
    )
    stop: list[StopString] = Field(
        default_factory=list,
        max_length=MAX_STOP,
        description=f"up to {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters; "
        "a completion ends before the first of them it produces",
    )
    seed: int | None = Field(
        default=None,
        ge=SEED_MIN,
        le=SEED_MAX,
        description="a 64-bit signed integer: the same seed gives the same samples whatever they are "
        "batched with; None: unseeded",
    )
    top_logprobs: int = Field(
        default=0, ge=0, le=20, description="most likely alternatives recorded per sampled token"
    )
    json_schema: str | None = Field(
        default=None,
        max_length=MAX_SCHEMA_CHARS,
        description="constrain the output to this JSON schema",
    )
    json_prefix: str = Field(
        default="",
        max_length=MAX_LITERAL_CHARS,
        description="literal text the constrained output starts with",
    )
    json_suffix: str = Field(
        default="",
        max_length=MAX_LITERAL_CHARS,
        description="literal text the constrained output ends with",
    )
    json_or_call: list[Shape] | None = Field(
        default=None,
        max_length=MAX_SHAPES,
        description="(prefix, schema, suffix) of each tool call the output may be instead of the "
        "`json_schema` answer (tools and a response schema in one unforced request; the other tools "
        "of a forced call in a syntax that names the tool outside the JSON)",
    )
    reasoning: tuple[str, str] | None = Field(
        default=None,
        description="(open, close) of the model's reasoning block: free text between them comes "
        "first, the constrained output after `close` (a reasoning model with thinking on)",
    )
    base: bool = Field(
        default=False,
        description="sample from the base model, the adapter disabled (a request that names the base "
        "model, as vLLM serves it beside its LoRAs)",
    )
    adapter: str | None = Field(
        default=None,
        description="sample with the adapter saved in this checkpoint directory instead of the served one "
        "(a request naming `name@<step>` of a step served beside it: live training's candidate); only an "
        "engine with `serves_other_steps` takes it",
    )
    adapter_step: int | None = Field(
        default=None, ge=0, description="the step `adapter` is, stamped on its samples"
    )
    # Unbounded on purpose: only hashed to pick a replica, and the endpoint builds it from the
    # conversation's start (a long system prompt included), which its body limit already bounds.
    affinity: str | None = Field(
        default=None, description="requests with the same key go to the same engine replica (a group)"
    )

    @property
    def constraint(self) -> Constraint | None:
        """The output's grammar when it is constrained: (prefix, schema, suffix), or any of the calls
        `json_or_call` instead; after the reasoning block if any. None when unconstrained."""
        if self.json_schema is None:
            return None
        first = (self.json_prefix, self.json_schema, self.json_suffix)
        return Constraint((first, *(self.json_or_call or ())), self.reasoning)


FinishReason = Literal["stop", "length"]
T = TypeVar("T")


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # the policy step whose weights sampled this (None: the engine's current `step`)
    step: int | None = None


# Called with (completion index, token id) as a streaming engine samples each token.
OnToken = Callable[[int, int], None]


class Engine(ABC):
    """Samples completions for token-id prompts under the current policy step."""

    step: int = 0
    serves_other_steps: bool = False
    """Whether a request may name another checkpoint than the served one (`SamplingParams.adapter`)."""

    @abstractmethod
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: OnToken | None = None
    ) -> list[Sample]:
        """Return `params.n` samples for one prompt. Concurrent calls are batched by the engine.
        `on_token(completion index, token id)` is told of each token as it is sampled (from any
        thread: keep it short); an engine that cannot stream tells it nothing, and the samples
        returned are what count."""

    @abstractmethod
    async def load_adapter(self, path: Path, step: int) -> None:
        """Serve the LoRA adapter saved at `path` as policy `step` for every later request."""

    async def sleep(self) -> None:  # noqa: B027 - optional capability
        """Free accelerator memory for a training step (vLLM on CUDA); a no-op where nothing is freed."""

    async def wake(self) -> None:  # noqa: B027 - optional capability
        """Take the memory back after `sleep`, ready to sample again."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release processes and threads."""

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)`, torch work on the policy this process holds (a training step, a save or
        load of the adapter), off the event loop. Here, on a worker thread: this engine samples
        elsewhere. The in-process engine runs it on its own sampling thread (`TorchEngine.call`)."""
        return await asyncio.to_thread(fn, *args)

    @property
    def requests_served(self) -> int:
        return 0

    def counters(self) -> dict[str, int]:
        """Running counts the step metrics report the change of (`engine_*`); none by default."""
        return {}

    @property
    def alive(self) -> bool:
        """False once the engine can serve nothing more (closed, or its process gone)."""
        return True


def hand_over(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    """Settle `future` (with `error` if given, else `result`) from another thread, on its own loop.
    A future already settled (its caller timed out) or a loop closed meanwhile wants nothing."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)
