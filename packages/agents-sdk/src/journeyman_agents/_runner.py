"""`TrainableRunner`: `Runner.run` / `Runner.run_streamed` that also return a Trajectory.

Per run:
- `RunConfig.model_provider` becomes a `JourneymanModelProvider`, so every agent whose model is a
  name (or unset) is served by the trainable model; agents, tools, handoffs, MCP servers,
  guardrails and the user's hooks and trace processors are left as they are.
- The run happens inside a capture scope: the endpoint files each call it serves for this run (with
  its exact token records) under the run's capture id. The id lives in a ContextVar, so concurrent
  runs (separate asyncio tasks) never share calls.
- The run's trace is watched by the `SpanCollector` trace processor, which says which agent made
  each call. Calls and spans are joined per request into the trajectory (`_build`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING, Any, NamedTuple

from agents import Agent, RunConfig, Runner
from agents.result import RunResult, RunResultStreaming
from agents.stream_events import StreamEvent
from agents.tracing import gen_trace_id, get_current_trace
from journeyman import CapturedCall, capture_scope

from ._build import build_trajectory
from ._provider import JourneymanModelProvider, ModelAPI
from ._tracing import collector

if TYPE_CHECKING:
    from journeyman import TrainableModel, Trajectory


class AgentRun(NamedTuple):
    """What `TrainableRunner.run` returns: the SDK's result and the run's trajectory."""

    result: RunResult
    trajectory: Trajectory


class StreamedAgentRun:
    """A streamed run: consume `stream_events()` as with the SDK, then `await trajectory()`."""

    def __init__(
        self, runner: TrainableRunner, result: RunResultStreaming, capture_id: str, trace_id: str
    ) -> None:
        self.result = result
        self._runner = runner
        self._capture_id = capture_id
        self._trace_id = trace_id
        self._trajectory: Trajectory | None = None

    def stream_events(self) -> AsyncIterator[StreamEvent]:
        return self.result.stream_events()

    async def trajectory(self) -> Trajectory:
        """The run's trajectory; drains the stream first if it was not consumed to the end."""
        if self._trajectory is None:
            if not self.result.is_complete:
                async for _ in self.result.stream_events():
                    pass
            self._trajectory = await self._runner._finish(self._capture_id, self._trace_id, self.result)
        return self._trajectory


class TrainableRunner:
    """Runs Agents SDK agents on `model` and turns each run into a Trajectory.

    >>> runner = TrainableRunner(model)                    # Responses API, every agent trained
    >>> result, trajectory = await runner.run(agent, "What's the weather in Paris?")
    >>> trajectory.reward = score(result.final_output)

    `api="chat_completions"` uses `OpenAIChatCompletionsModel` instead. `trained_agents` names the
    agents whose calls are trained (default: all served by `model`); the others' calls are kept as
    untrainable additional histories.
    """

    def __init__(
        self,
        model: TrainableModel,
        *,
        api: ModelAPI = "responses",
        trained_agents: Collection[str] | None = None,
    ) -> None:
        self.model = model
        self.provider = JourneymanModelProvider(model, api=api)
        self.trained_agents = set(trained_agents) if trained_agents is not None else None
        self._collector = collector()

    def _config(self, run_config: RunConfig | None) -> tuple[RunConfig, str]:
        config = run_config or RunConfig()
        current = get_current_trace()
        # Inside the user's own trace the run joins it; otherwise it gets a trace of its own.
        trace_id = current.trace_id if current is not None else (config.trace_id or gen_trace_id())
        config = dataclasses.replace(config, model_provider=self.provider, trace_id=trace_id)
        return config, trace_id

    async def _calls(self, capture_id: str) -> list[CapturedCall]:
        return (await self.model.pop_captures([capture_id]))[capture_id]

    async def _finish(
        self, capture_id: str, trace_id: str, result: RunResult | RunResultStreaming
    ) -> Trajectory:
        trajectory = build_trajectory(
            await self._calls(capture_id), self._collector.release(trace_id), self.trained_agents
        )
        trajectory.metadata["trace_id"] = trace_id
        trajectory.metadata["last_agent"] = result.last_agent.name
        if isinstance(result.final_output, str):
            trajectory.metadata["final_output"] = result.final_output
        return trajectory

    async def run(
        self, starting_agent: Agent[Any], input: Any, *, run_config: RunConfig | None = None, **kwargs: Any
    ) -> AgentRun:
        """`Runner.run(starting_agent, input, **kwargs)` on `model`, plus the run's trajectory."""
        config, trace_id = self._config(run_config)
        self._collector.watch(trace_id)
        with capture_scope() as capture_id:
            try:
                result = await Runner.run(starting_agent, input, run_config=config, **kwargs)
            except BaseException:
                await self._calls(capture_id)  # drop what the endpoint filed for the failed run
                self._collector.release(trace_id)
                raise
        return AgentRun(result, await self._finish(capture_id, trace_id, result))

    def run_streamed(
        self, starting_agent: Agent[Any], input: Any, *, run_config: RunConfig | None = None, **kwargs: Any
    ) -> StreamedAgentRun:
        """`Runner.run_streamed(...)` on `model`; the returned object streams and gives the trajectory."""
        config, trace_id = self._config(run_config)
        self._collector.watch(trace_id)
        # The SDK starts the run loop as a task here; the task copies this context, capture id included.
        with capture_scope() as capture_id:
            result = Runner.run_streamed(starting_agent, input, run_config=config, **kwargs)
        return StreamedAgentRun(self, result, capture_id, trace_id)
