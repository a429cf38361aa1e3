"""`art.rewards`: RULER with ART's signature, on Journeyman's judge (any LiteLLM model string, an
OpenAI-compatible URL, or "local" for the model the backend serves)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import journeyman as jm
from journeyman.art._unsupported import module_getattr
from journeyman.rewards.ruler import DEFAULT_RUBRIC

__getattr__ = module_getattr("art.rewards", __name__)  # ART's bare `ruler`: a named error

ART_JUDGE = "openai/o3"
"""ART's default judge model."""


async def ruler_score_group(
    group: jm.TrajectoryGroup,
    judge_model: str = ART_JUDGE,
    extra_litellm_params: Mapping[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
) -> jm.TrajectoryGroup | None:
    """Score `group` relative to itself (`journeyman.ruler_score_group`), called as ART calls it.

    `extra_litellm_params` go to the judge's completion call (`api_base` and `api_key` pick its
    endpoint and key); `swallow_exceptions`: `None` when the judge fails (as ART: `gather`'s
    `after_each` then drops the group); `debug`: print the judge's answer."""
    params = dict(extra_litellm_params or {})
    options: dict[str, Any] = {}
    judge: str = judge_model
    base = params.pop("api_base", None) or params.pop("base_url", None)
    if base is not None:  # an OpenAI-compatible server: Journeyman asks it directly
        judge, options["judge_model"] = str(base), judge_model.split("/", 1)[-1]
    if "api_key" in params:
        options["api_key"] = params.pop("api_key")
    if "temperature" in params:
        options["temperature"] = params.pop("temperature")
    if "max_tokens" in params:
        options["max_tokens"] = params.pop("max_tokens")
    scored = await jm.ruler_score_group(
        group, judge, rubric, swallow_exceptions=swallow_exceptions, judge_params=params, **options
    )
    info = scored.metadata.get("ruler", {})
    if debug:
        print(f"[RULER] {info.get('answer') or info}")
    if info.get("skipped"):
        return None
    return scored


__all__ = ["ART_JUDGE", "DEFAULT_RUBRIC", "ruler_score_group"]
