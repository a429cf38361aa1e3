"""`TrainableRunner`: `Runner.run` / `Runner.run_streamed` that also return a Trajectory.

Per run:
- `RunConfig.model_provider` becomes a `JourneymanModelProvider`, so every agent whose model is a
  name (or unset) is served by the trainable model; agents, tools, handoffs, MCP servers,
  guardrails and the user's hooks and trace processors are left as they are.
- Runs started inside the run (a guardrail's own agent, a hook's or a tool's `Runner.run` /
  `Runner.run_streamed`) are served by the same provider and are part of the run: their calls are
  captured with the run's and each of their agents gets a history of its own, as an agent-as-tool's
  does (`_nested`). Runs elsewhere in the process are left as they are.
- The run is an `Episode` (`journeyman.integrations`): the endpoint files each call it serves for this
  run (with its exact token records) under the run's capture id. The id lives in a ContextVar, so
  concurrent runs (separate asyncio tasks) never share calls.
- The run's trace is watched by the `SpanCollector` trace processor, which says which agent made
  each call. Calls and spans are joined per request into the trajectory (`_build`).
- A run that raises (`MaxTurnsExceeded`, an output guardrail's tripwire, `ModelBehaviorError`) is
  still a trajectory of the calls made before the error, with `error` set and the exception object
  itself on `error.exception`, under `on_error="score"` (the default; `journeyman.integrations.Episode`).
  The SDK's `UserError` (a misconfigured agent) always re-raises.
- An input guardrail's tripwire refuses the input, not an answer: the SDK cancels or discards the
  first turn it interrupts, and whether that turn's call had reached the endpoint (guardrails run in
  parallel with it by default) is timing. Its calls are never kept, nor those of the runs nested in
  it (the guardrail agent's own verdict included), so such a run left nothing to train and re-raises
  under "score" (as `Runner.run` does), with or without parallel guardrails. A run that raised
  otherwise (an output guardrail's tripwire) keeps its nested runs' calls with the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING, Any, NamedTuple

from agents import Agent, RunConfig, Runner
from agents.exceptions import InputGuardrailTripwireTriggered, UserError
from agents.result import RunResult, RunResultStreaming
from agents.stream_events import StreamEvent
from agents.tracing import gen_trace_id, get_current_trace
from journeyman import RolloutException
from journeyman.integrations import Episode, ErrorReward, OnError, check_on_error

from ._build import fill_trajectory
from ._nested import serving
from ._provider import JourneymanModelProvider, ModelAPI
from ._tracing import collector

if TYPE_CHECKING:
    from journeyman import TrainableModel, Trajectory


class AgentRun(NamedTuple):
    """What `TrainableRunner.run` returns: the SDK's result and the run's trajectory.

    `result` is None when the run raised and was kept (`on_error="score"`): `trajectory` holds the
    calls made before, `error` (`trajectory.error`) says what it raised, and `exception` is the
    exception object itself, for what the SDK's examples do in an `except` clause:

    >>> run = await runner.run(agent, "Hello, can you help me solve for x: 2x + 3 = 11?")
    >>> if isinstance(run.exception, OutputGuardrailTripwireTriggered):
    ...     print(run.exception.guardrail_result.output.output_info)
    """

    result: RunResult | None
    trajectory: Trajectory

    @property
    def error(self) -> RolloutException | None:
        return self.trajectory.error

    @property
    def exception(self) -> BaseException | None:
        """What the run raised, as raised (None when it returned; in this process only)."""
        return self.trajectory.error.exception if self.trajectory.error is not None else None


class StreamedAgentRun:
    """A streamed run: consume `stream_events()` as with the SDK, then `await trajectory()`.

    A run that raises ends the stream quietly, and `trajectory()` settles it by the runner's
    `on_error` (under `"raise"` the stream raises, as the SDK's does).
    """

    def __init__(
        self, runner: TrainableRunner, result: RunResultStreaming, episode: Episode, trace_id: str
    ) -> None:
        self.result = result
        self._runner = runner
        self._episode = episode
        self._trace_id = trace_id
        self._trajectory: Trajectory | None = None

    async def stream_events(self) -> AsyncIterator[StreamEvent]:
        try:
            async for event in self.result.stream_events():
                yield event
        except Exception as e:
            self._episode.fail(e)
            if self._runner.on_error == "raise":
                await self._settle()  # frees what the endpoint filed for the run, then re-raises `e`

    async def trajectory(self) -> Trajectory:
        """The run's trajectory; drains the stream first if it was not consumed to the end."""
        if self._trajectory is None:
            if not self.result.is_complete:
                async for _ in self.stream_events():
                    pass
            self._trajectory = await self._settle()
        return self._trajectory

    async def _settle(self) -> Trajectory:
        # the SDK's own property covers a stream consumed through `result.stream_events()`
        late = self.result.run_loop_exception
        if self._episode.error is None and isinstance(late, Exception):
            self._episode.fail(late)
        return await self._runner._finish(self._episode, self._trace_id, self.result)


class TrainableRunner:
    """Runs Agents SDK agents on `model` and turns each run into a Trajectory.

    >>> runner = TrainableRunner(model)                    # Responses API, every agent trained
    >>> result, trajectory = await runner.run(agent, "What's the weather in Paris?")
    >>> trajectory.reward = score(result.final_output)

    `api="chat_completions"` uses `OpenAIChatCompletionsModel` instead. `trained_agents` names the
    agents whose calls are trained (default: all served by `model`); the others' calls are kept as
    untrainable additional histories.

    A run that raises (turn limit, output guardrail tripwire, model behaviour error) follows
    `on_error`: `"score"` (default) returns `AgentRun(None, trajectory)`, the trajectory holding the
    calls made before the error, `error` set, the exception object on `AgentRun.exception`, reward
    `error_reward` (a number or a function of the trajectory); `"drop"` raises `RolloutDroppedError`
    (a group counts it as dropped); `"raise"` re-raises. A run that left no call to train re-raises
    under "score" too, and an input guardrail's tripwire always leaves none (the SDK discards the
    turn it interrupts, so its call never counts, however the timing fell). Service failures and
    the SDK's `UserError` always re-raise (`journeyman.integrations.Episode`).
    """

    def __init__(
        self,
        model: TrainableModel,
        *,
        api: ModelAPI = "responses",
        trained_agents: Collection[str] | None = None,
        on_error: OnError = "score",
        error_reward: ErrorReward = 0.0,
    ) -> None:
        self.model = model
        self.provider = JourneymanModelProvider(model, api=api)
        self.trained_agents = set(trained_agents) if trained_agents is not None else None
        self.on_error: OnError = check_on_error(on_error, error_reward)
        self.error_reward = error_reward
        self._collector = collector()

    def _config(self, run_config: RunConfig | None) -> tuple[RunConfig, str]:
        config = run_config or RunConfig()
        current = get_current_trace()
        # Inside the user's own trace the run joins it; otherwise it gets a trace of its own.
        trace_id = current.trace_id if current is not None else (config.trace_id or gen_trace_id())
        config = dataclasses.replace(config, model_provider=self.provider, trace_id=trace_id)
        return config, trace_id

    def _episode(self) -> Episode:
        return Episode(self.model, on_error=self.on_error, error_reward=self.error_reward)

    async def _finish(
        self, episode: Episode, trace_id: str, result: RunResult | RunResultStreaming | None
    ) -> Trajectory:
        """The run's trajectory; for a run that raised, settled by `on_error` (may raise)."""
        calls = [c.call for c in await episode.calls()]  # popped in any case: nothing stays filed
        if isinstance(episode.error, InputGuardrailTripwireTriggered):
            calls = []  # the interrupted first turn: filed or not by the time it tripped is timing
        trajectory = fill_trajectory(episode, calls, self._collector.release(trace_id), self.trained_agents)
        trajectory.metadata["trace_id"] = trace_id
        error = episode.error
        if error is not None:
            if isinstance(error, UserError):  # the agent's setup is wrong, not the policy
                raise error
            run_data = getattr(error, "run_data", None)
            if run_data is not None:
                trajectory.metadata["last_agent"] = run_data.last_agent.name
        elif result is not None:
            trajectory.metadata["last_agent"] = result.last_agent.name
            if isinstance(result.final_output, str):
                trajectory.metadata["final_output"] = result.final_output
        return episode.settle()

    async def run(
        self, starting_agent: Agent[Any], input: Any, *, run_config: RunConfig | None = None, **kwargs: Any
    ) -> AgentRun:
        """`Runner.run(starting_agent, input, **kwargs)` on `model`, plus the run's trajectory.

        `result` is None when the run raised and `on_error="score"` kept it.
        """
        config, trace_id = self._config(run_config)
        self._collector.watch(trace_id)
        episode = self._episode()
        result: RunResult | None = None
        try:
            # an Exception is kept: settled below, with the calls before it
            with episode.running(), serving(self.provider):
                result = await Runner.run(starting_agent, input, run_config=config, **kwargs)
        except BaseException:  # cancelled or interrupted: free what the endpoint filed
            await episode.discard()
            self._collector.release(trace_id)
            raise
        return AgentRun(result, await self._finish(episode, trace_id, result))

    def run_streamed(
        self, starting_agent: Agent[Any], input: Any, *, run_config: RunConfig | None = None, **kwargs: Any
    ) -> StreamedAgentRun:
        """`Runner.run_streamed(...)` on `model`; the returned object streams and gives the trajectory."""
        config, trace_id = self._config(run_config)
        self._collector.watch(trace_id)
        episode = self._episode()
        # The SDK starts the run loop as a task here; the task copies this context: the capture id,
        # and the provider runs nested in it are served by.
        with episode.capture(), serving(self.provider):
            result = Runner.run_streamed(starting_agent, input, run_config=config, **kwargs)
        return StreamedAgentRun(self, result, episode, trace_id)
