"""Runs started inside a trained run (by guardrails, hooks, tools) are served by it too.

The SDK's agent-based guardrail calls `Runner.run(guardrail_agent, input, context=ctx.context)`
inside the guardrail function: a run of its own, with no `run_config`, so the SDK's default model
provider (OpenAI) would serve it, or fail without a key ("Missing credentials"). `Runner.run`,
`run_sync` and `run_streamed` go through the SDK's default `AgentRunner` (`set_default_agent_runner`,
the SDK's seam for this, marked experimental there), which `install` wraps once per process.
`serving(provider)` marks the trained run's context (a ContextVar, copied into the tasks the run
starts: guardrails, tools, the streamed run loop). A run started inside that context gets the
trained run's provider in its `RunConfig`, by the rule `TrainableRunner` applies to its own run; the
rest of its config is its own (the trained run's config is not handed down: its run-level
guardrails would run again on the guardrail's own run, and so on without end).

Its calls then become the trained run's as an agent-as-tool's do: it runs in the trained run's
capture scope and, nested in its trace, under its own agent span, so its agent gets a history of its
own. Outside any trained run, and for a run whose provider already is a `JourneymanModelProvider`
(the trained run's own, or another trainable model's), the wrapper passes every call on unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Unpack

from agents import RunConfig
from agents.agent import Agent
from agents.items import TResponseInputItem
from agents.result import RunResult, RunResultStreaming
from agents.run import AgentRunner, get_default_agent_runner, set_default_agent_runner
from agents.run_config import RunOptions
from agents.run_context import TContext
from agents.run_state import RunState

from ._provider import JourneymanModelProvider

_provider: ContextVar[JourneymanModelProvider | None] = ContextVar("journeyman_agents_provider", default=None)
_install_lock = threading.Lock()


def _served(options: RunOptions[TContext]) -> RunOptions[TContext]:
    """`options` with the trained run's provider when called inside one (else as given)."""
    provider = _provider.get()
    if provider is None:
        return options
    config = options.get("run_config")
    if config is None:
        config = RunConfig(model_provider=provider)
    elif isinstance(config, dict):  # the SDK coerces a dict into a RunConfig itself
        if isinstance(config.get("model_provider"), JourneymanModelProvider):
            return options
        config = {**config, "model_provider": provider}
    elif isinstance(config.model_provider, JourneymanModelProvider):
        return options
    else:
        config = dataclasses.replace(config, model_provider=provider)
    return {**options, "run_config": config}


class ServingRunner(AgentRunner):
    """The SDK's default runner, wrapped: runs inside a trained run get its provider (see module doc)."""

    def __init__(self, inner: AgentRunner) -> None:
        self.inner = inner

    async def run(
        self,
        starting_agent: Agent[TContext],
        input: str | list[TResponseInputItem] | RunState[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResult:
        return await self.inner.run(starting_agent, input, **_served(kwargs))

    def run_sync(
        self,
        starting_agent: Agent[TContext],
        input: str | list[TResponseInputItem] | RunState[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResult:
        return self.inner.run_sync(starting_agent, input, **_served(kwargs))

    def run_streamed(
        self,
        starting_agent: Agent[TContext],
        input: str | list[TResponseInputItem] | RunState[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResultStreaming:
        return self.inner.run_streamed(starting_agent, input, **_served(kwargs))


def install() -> None:
    """Wrap the SDK's current default runner, unless it is ours (a runner set since is wrapped anew)."""
    with _install_lock:
        current = get_default_agent_runner()
        if not isinstance(current, ServingRunner):
            set_default_agent_runner(ServingRunner(current))


@contextlib.contextmanager
def serving(provider: JourneymanModelProvider) -> Iterator[None]:
    """Runs started in this context (this task and those it starts) are served by `provider`."""
    install()
    token = _provider.set(provider)
    try:
        yield
    finally:
        _provider.reset(token)
