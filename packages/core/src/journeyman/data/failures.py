"""Runs that raised become trajectories: the calls made before the error, kept and trained.

RL learns from a run that hit its turn limit, tripped a guardrail or crashed a node as much as from
one that finished: every call it made was sampled by the policy, and a low reward says so. ART keeps
such runs too. An integration (LangGraph's `@trajectory`, the Agents SDK's `TrainableRunner`) builds the
partial trajectory from the endpoint's captured calls, exact token records included, and hands it
here with the exception; `on_error` decides what becomes of it:

- `"score"` (the default): keep it, `error` set (type, message, traceback), reward `error_reward`
  (a number, 0.0 unless set, or a function of the trajectory) unless the run set one before it
  raised (LangGraph: `current_trajectory().reward = ...`); RULER or the user may score it again
  later. `gather_trajectory_groups` counts it as `errored`, apart from `exceptions`.
- `"drop"`: discard it; the group counts it under `dropped`, not against `max_exceptions`.
- `"raise"`: re-raise the exception, as a run that left nothing (the group's `exceptions`).

Whatever the policy, a failure of the service re-raises (the endpoint unreachable or answering
5xx, a timeout, Journeyman's own errors): it says nothing about the policy, and `max_exceptions`
must see it. So does a run with no captured call (nothing to train), and cancellation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast, get_args

import httpx
import openai

from journeyman.data.types import RolloutException, Trajectory
from journeyman.errors import InvalidFieldError, JourneymanError, RolloutDroppedError

OnError = Literal["score", "drop", "raise"]
ErrorReward = float | Callable[[Trajectory], float]


def check_on_error(on_error: object, error_reward: object) -> OnError:
    """Validate an integration's `on_error=` / `error_reward=` arguments; returns the policy."""
    if on_error not in get_args(OnError):
        raise InvalidFieldError("on_error", on_error, "use 'score' (keep and train), 'drop' or 'raise'")
    if not callable(error_reward) and (
        isinstance(error_reward, bool) or not isinstance(error_reward, int | float)
    ):
        raise InvalidFieldError(
            "error_reward", error_reward, "a number, or a function of the failed Trajectory returning one"
        )
    return cast(OnError, on_error)


def is_service_error(e: BaseException) -> bool:
    """Whether `e` is the service failing rather than the agent: never kept as a trajectory.

    A 400 is the agent's doing (its conversation outgrew the context, a malformed request it wrote);
    every other HTTP status, a connection error or timeout, and Journeyman's own errors are not.
    """
    if isinstance(e, openai.APIStatusError):
        return e.status_code != 400
    return isinstance(e, openai.APIError | httpx.HTTPError | JourneymanError)


def settle_failed_run(
    trajectory: Trajectory, error: BaseException, on_error: OnError, error_reward: ErrorReward = 0.0
) -> Trajectory:
    """Apply `on_error` to a run that raised `error`; `trajectory` holds the calls made before it.

    Returns the trajectory to keep (`error` set; reward `error_reward` unless the run set one), or
    raises: `error` itself under "raise" and for what is never kept (see the module docstring),
    `RolloutDroppedError` under "drop".
    """
    if on_error == "raise" or not isinstance(error, Exception) or is_service_error(error):
        raise error
    if on_error == "drop":
        raise RolloutDroppedError(error) from error
    if not trajectory.records() and not any(h.records() for h in trajectory.additional_histories):
        raise error  # no call reached the endpoint: nothing to train, a rollout that left nothing
    trajectory.error = RolloutException.from_exception(error)
    trajectory.metrics["errored"] = True  # integrations set False on the rest: `model.log` shows the fraction
    if "reward" not in trajectory.model_fields_set:  # a reward the run set before it raised wins
        trajectory.reward = error_reward(trajectory) if callable(error_reward) else float(error_reward)
    trajectory.log(f"the run raised {type(error).__name__}: {error} (kept: on_error='score')")
    return trajectory


__all__ = ["ErrorReward", "OnError", "check_on_error", "is_service_error", "settle_failed_run"]
