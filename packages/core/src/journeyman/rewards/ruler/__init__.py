"""RULER: relative rewards from a judge model that sees a whole group of trajectories at once.

GRPO only needs rewards that rank the rollouts of one scenario against each other, so a judge that
compares the group side by side ("did the user get what they wanted?") is enough to train on, with
no hand-written reward.

    groups = await jm.gather_trajectory_groups(..., after_each=jm.ruler_score_group)  # judge="local"
    after_each=functools.partial(jm.ruler_score_group, judge="openai/gpt-4o")        # LiteLLM
    after_each=functools.partial(jm.ruler_score_group, judge="http://127.0.0.1:8000/v1",
                                 judge_model="Qwen/Qwen3-32B")                       # any OpenAI-compatible server
    after_each=functools.partial(jm.ruler_score_group, judge=frozen_judge,            # a TrainableModel
                                 config=RulerConfig(explanation_chars=40))

By job: `_prompt` (what the judge sees and must answer: pure functions), `_cache` (answers on disk,
keyed by judge, rubric and group content), `_score` (the entry point: ask, retry once, turn scores
into rewards); the judge itself is resolved and asked through `journeyman.rewards.llm`. See docs/ruler.md.
"""

from __future__ import annotations

from journeyman.rewards.ruler._cache import default_cache_dir
from journeyman.rewards.ruler._config import RulerConfig
from journeyman.rewards.ruler._prompt import (
    DEFAULT_RUBRIC,
    MAX_SCORE,
    PROMPT_VERSION,
    JudgePrompt,
    RulerScore,
    build_prompt,
    parse_scores,
    score_schema,
    truncate,
)
from journeyman.rewards.ruler._score import RulerJudgeError, ruler_score_group

__all__ = [
    "DEFAULT_RUBRIC",
    "MAX_SCORE",
    "PROMPT_VERSION",
    "JudgePrompt",
    "RulerConfig",
    "RulerJudgeError",
    "RulerScore",
    "build_prompt",
    "default_cache_dir",
    "parse_scores",
    "ruler_score_group",
    "score_schema",
    "truncate",
]
