"""RULER's settings as one typed object, so a judge setup can be built once and passed around."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from journeyman.errors import InvalidFieldError
from journeyman.rewards.llm import DEFAULT_TIMEOUT_S


class RulerConfig(BaseModel):
    """How RULER asks its judge and keeps the answers. Wrong values raise `InvalidFieldError`."""

    model_config = ConfigDict(extra="forbid")

    judge_model: str | None = Field(
        None,
        description='the model to ask when judge= is an http(s) base URL (only then), e.g. "Qwen/Qwen3-32B"',
    )
    api_key: str | None = Field(
        None,
        repr=False,
        description="key for a base-URL judge ($OPENAI_API_KEY when unset) or a LiteLLM judge (its "
        "provider's env var when unset); local judges need none",
    )
    temperature: float = Field(
        0.0, ge=0, description="sampling temperature; 0 so that cached and fresh answers agree"
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="cap on the answer; None = what the schema needs for local and base-URL judges, the "
        "provider's default for LiteLLM judges (reasoning models need room to think)",
    )
    explanation_chars: int = Field(
        200, ge=0, description="longest explanation per trajectory (a maxLength in the answer's schema)"
    )
    max_tool_output_chars: int = Field(
        2000, ge=1, description="longer tool results are shown as head + tail around a truncation marker"
    )
    judge_params: dict[str, Any] = Field(
        default_factory=dict,
        description='extra arguments for the completion call, e.g. {"reasoning_effort": "low"}; part of the cache key',
    )
    cache_dir: Path | None = Field(None, description="where answers are kept; None = $JOURNEYMAN_CACHE/ruler")
    use_cache: bool = Field(True, description="read and write the answer cache; False always asks the judge")
    timeout_s: float = Field(
        DEFAULT_TIMEOUT_S, gt=0, description="seconds one judge call may take before it fails (no hangs)"
    )

    def __init__(self, **data: Any) -> None:
        unknown = sorted(set(data) - set(type(self).model_fields))
        if unknown:
            raise InvalidFieldError(
                unknown[0],
                data[unknown[0]],
                f"not a RULER option; options: {', '.join(type(self).model_fields)}",
            )
        try:
            super().__init__(**data)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise InvalidFieldError(field, err.get("input"), err["msg"]) from None

    def with_options(self, **options: Any) -> RulerConfig:
        """A copy with `options` (field names) replaced, validated like a new config."""
        if not options:
            return self
        return RulerConfig(**{**self.model_dump(), **options})
