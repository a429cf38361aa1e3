"""The public entry: ask the judge about one group (or read its answer from the cache), turn the
scores into rewards, retry once when the answer is unusable."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from journeyman.client.model import TrainableModel
from journeyman.client.protocol import MeteredBackend, charged_model, current_backend
from journeyman.data.budget import BudgetExceededError
from journeyman.data.config import ModelConfig
from journeyman.data.types import Trajectory, TrajectoryGroup
from journeyman.errors import InvalidFieldError, JourneymanError
from journeyman.rewards.llm import LLM, LLMSpec, answer_cost, complete_json, resolve_llm, spec_label
from journeyman.rewards.ruler._cache import cache_key, cache_read, cache_write, default_cache_dir
from journeyman.rewards.ruler._config import RulerConfig
from journeyman.rewards.ruler._prompt import (
    DEFAULT_RUBRIC,
    MAX_SCORE,
    JudgePrompt,
    RulerScore,
    build_prompt,
    parse_scores,
    retry_message,
)

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion

    from journeyman.client.protocol import Backend

Pay = Callable[[LLM, "ChatCompletion | None"], Awaitable[None]]
"""`pay(judge, response)`: check the budget before a call (response None), charge an answer after."""


class RulerJudgeError(JourneymanError, RuntimeError):
    """The judge's answer was unusable twice (bad JSON, wrong number of scores, unknown ids)."""

    def __init__(self, judge: str, problems: list[str], answers: list[str]) -> None:
        self.judge = judge
        self.problems = problems
        self.answers = answers
        super().__init__(
            f"judge={judge!r} answered wrongly {len(problems)} times: " + "; then ".join(problems)
        )


async def ruler_score_group(
    group: TrajectoryGroup,
    judge: LLMSpec = "local",
    rubric: str | None = None,
    swallow_exceptions: bool = False,
    *,
    config: RulerConfig | None = None,
    backend: Backend | None = None,
    charge_to: ModelConfig | None = None,
    **options: Any,
) -> TrajectoryGroup:
    """Score each trajectory of `group` in [0, 1] relative to the others; return a new group.

    judge: "local" (the model the backend registered last; works offline), "local:<model name>" or a
        TrainableModel (e.g. a frozen judge beside the policy), an OpenAI-compatible base URL such as
        "http://127.0.0.1:8000/v1" (with `judge_model=`), or any LiteLLM model string such as
        "openai/gpt-4o" (`pip install "journeyman[litellm]"`). See `journeyman.rewards.llm`.
    rubric: what "better" means; `DEFAULT_RUBRIC` when None.
    swallow_exceptions: when the judge fails, return the group unscored instead of raising: every
        reward set to the group's mean previous reward (no learning signal), `ruler_skipped` = 1 in
        each trajectory's metrics, the error in `group.metadata["ruler"]`. Wrong arguments and a
        missing extra are raised all the same.
    config / **options: a `RulerConfig`, and/or its fields by name (`judge_model=`, `explanation_chars=`,
        `cache_dir=`...), which override the config's.
    backend: where local judges are served; the backend of the latest `model.register` when None.
    charge_to: the model whose budget pays for the judge (`Budget.judge_usd`, `Budget.judge_tokens`):
        before each call its budget is checked (`BudgetExceededError` when spent, never swallowed),
        after it the answer's tokens and price are charged; cached answers cost nothing. None: the
        model a `TrainLoop` (or `journeyman.client.protocol.charging`) trains here, else no one.

    The new group's rewards are score / 10; each trajectory keeps its previous reward as
    `metrics["independent_reward"]` (the first one, if the group was scored before), and gets
    `metrics["ruler_cached"]`, `metrics["ruler_retries"]`, `metrics["ruler_skipped"]` and the judge's
    explanation in `metadata["ruler_explanation"]`.
    """
    if config is not None and not isinstance(config, RulerConfig):
        raise InvalidFieldError("config", config, "expected a journeyman.rewards.ruler.RulerConfig")
    # e.g. ART's third argument, a dict of LiteLLM params, where Journeyman's rubric goes
    if rubric is not None and not isinstance(rubric, str):
        raise InvalidFieldError(
            "rubric", rubric, "must be a string; completion arguments for the judge go in judge_params={...}"
        )
    cfg = (config or RulerConfig()).with_options(**options)
    if not group.trajectories:
        return group
    rubric = DEFAULT_RUBRIC if rubric is None else rubric
    pay = _payer(charge_to if charge_to is not None else charged_model(), backend)
    try:
        return await _score(group, judge, rubric, cfg, backend, pay)
    except (InvalidFieldError, ImportError, BudgetExceededError):
        raise  # a wrong argument, a missing extra or a spent budget is the caller's, never swallowed
    except Exception as e:
        if not swallow_exceptions:
            raise
        return _skipped(group, spec_label(judge), e)


def _payer(model: ModelConfig | None, backend: Backend | None) -> Pay | None:
    """How RULER pays for `model`'s judge: through the backend that keeps its budget (its own when
    it is a registered TrainableModel), if that backend meters spend (`MeteredBackend`)."""
    if model is None:
        return None
    where: Any = backend
    if isinstance(model, TrainableModel):
        with contextlib.suppress(JourneymanError):  # not registered itself: the backend given, or current
            where = model.backend
    if where is None:
        where = current_backend("charge_to")
    if not isinstance(where, MeteredBackend):
        return None
    metered: MeteredBackend = where

    async def pay(judge: LLM, response: ChatCompletion | None) -> None:
        if response is None:
            await metered.charge(model, check=True)
            return
        tokens, usd = answer_cost(judge, response.usage)
        if tokens or usd:
            await metered.charge(model, judge_usd=usd, judge_tokens=tokens, check=False)

    return pay


async def _score(
    group: TrajectoryGroup,
    spec: LLMSpec,
    rubric: str,
    cfg: RulerConfig,
    backend: Backend | None,
    pay: Pay | None,
) -> TrajectoryGroup:
    judge = await resolve_llm(spec, cfg.judge_model, api_key=cfg.api_key, backend=backend, field="judge")
    prompt = build_prompt(
        group.trajectories,
        rubric,
        explanation_chars=cfg.explanation_chars,
        max_tool_output_chars=cfg.max_tool_output_chars,
    )
    sampling = {"temperature": cfg.temperature, **cfg.judge_params}
    params = dict(sampling)
    max_tokens = cfg.max_tokens
    if max_tokens is None and judge.kind != "litellm":
        max_tokens = len(prompt.ids) * (40 + cfg.explanation_chars) + 32
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    key = cache_key(judge.identity, rubric, prompt.digests, cfg.explanation_chars, sampling)
    path = (cfg.cache_dir if cfg.cache_dir is not None else default_cache_dir()) / f"{key}.json"

    hit = cache_read(path) if cfg.use_cache else None
    cached, retries = hit is not None, 0
    if hit is not None:
        by_digest, answer = hit
    else:
        by_digest, answer, retries = await _ask(judge, prompt, params, cfg.timeout_s, pay)
        if cfg.use_cache:
            cache_write(path, judge.identity, by_digest, answer)

    out = []
    for t, digest in zip(group.trajectories, prompt.group_digests, strict=True):
        s = by_digest[digest]
        out.append(
            _rescored(
                t,
                s.score / MAX_SCORE,
                f"RULER {s.score:g}/10: {s.explanation}",
                cached=int(cached),
                retries=retries,
                explanation=s.explanation,
            )
        )
    info = {
        "judge": judge.identity,
        "unique": len(prompt.ids),
        "cached": cached,
        "retries": retries,
        "skipped": False,
        "answer": answer,  # the judge's raw JSON, for debugging a judge
    }
    return _regrouped(group, out, info)


def _rescored(
    t: Trajectory, reward: float, log: str, *, cached: int, retries: int, explanation: str | None = None
) -> Trajectory:
    """A copy of `t` with RULER's reward, its `ruler_*` metrics and a log line; the reward it had
    is kept as `independent_reward`; `explanation` None: RULER skipped the group."""
    metrics = {
        **t.metrics,
        "independent_reward": t.metrics.get("independent_reward", t.reward),
        "ruler_cached": cached,
        "ruler_retries": retries,
        "ruler_skipped": int(explanation is None),
    }
    update: dict[str, Any] = {"reward": reward, "metrics": metrics, "logs": [*t.logs, log]}
    if explanation is not None:
        update["metadata"] = {**t.metadata, "ruler_explanation": explanation}
    return t.model_copy(deep=True, update=update)


def _regrouped(
    group: TrajectoryGroup, trajectories: list[Trajectory], info: dict[str, Any]
) -> TrajectoryGroup:
    """The group with RULER's `trajectories`, and what RULER did in its metadata under `ruler`."""
    return TrajectoryGroup(
        trajectories,
        exceptions=list(group.exceptions),
        dropped=list(group.dropped),
        metadata={**group.metadata, "ruler": info},
        metrics=dict(group.metrics),
        logs=list(group.logs),
    )


async def _ask(
    judge: LLM, prompt: JudgePrompt, params: dict[str, Any], timeout: float, pay: Pay | None
) -> tuple[dict[str, RulerScore], str, int]:
    """(scores by trajectory digest, the raw answer, retries): one retry, told what was wrong. Each
    call is paid for: the budget checked before it, its answer charged after (a wrong one too)."""
    messages = list(prompt.messages)
    problems: list[str] = []
    answers: list[str] = []
    for attempt in range(2):
        responses: list[ChatCompletion] = []
        if pay is not None:
            await pay(judge, None)
        content, finish = await complete_json(
            judge,
            messages,
            prompt.schema,
            name="ruler_scores",
            params=params,
            timeout=timeout,
            on_response=responses.append,
        )
        if pay is not None:
            for response in responses:
                await pay(judge, response)
        scores, problem = parse_scores(content, prompt.ids)
        if scores is not None:
            by_digest = {d: scores[i] for i, d in zip(prompt.ids, prompt.digests, strict=True)}
            return by_digest, content, attempt
        if finish == "length":
            problem += f" (the answer was cut off at max_tokens={params.get('max_tokens')})"
        problems.append(problem)
        answers.append(content)
        if attempt == 0:
            messages = [
                *prompt.messages,
                {"role": "assistant", "content": content},
                retry_message(problem, prompt.ids),
            ]
    raise RulerJudgeError(judge.identity, problems, answers)


def _skipped(group: TrajectoryGroup, judge: str, error: Exception) -> TrajectoryGroup:
    """The group with no learning signal left in it: every reward the same (the mean so far)."""
    mean = sum(t.reward for t in group.trajectories) / len(group.trajectories)
    out = [_rescored(t, mean, f"RULER skipped: {error}", cached=0, retries=0) for t in group.trajectories]
    info = {"judge": judge, "skipped": True, "error": f"{type(error).__name__}: {error}"}
    return _regrouped(group, out, info)


__all__ = ["RulerJudgeError", "ruler_score_group"]
