"""RULER: relative rewards from a judge model that sees a whole group of trajectories at once.

GRPO only needs rewards that rank the rollouts of one scenario against each other, so a judge that
compares the group side by side ("did the user get what they wanted?") is enough to train on, with
no hand-written reward. The judge sees the shared start of the conversations once, then each
trajectory's own continuation (tool definitions, tool calls and tool results included), and answers
`{"scores": [{"trajectory_id", "explanation", "score"}]}` under a JSON schema that bounds every
field, so even the embedded 135M model answers in shape when constrained decoding is on.

    groups = await jm.gather_trajectory_groups(..., after_each=jm.ruler_score_group)  # judge="local"
    after_each=functools.partial(jm.ruler_score_group, judge="openai/gpt-4o")        # LiteLLM
    after_each=functools.partial(jm.ruler_score_group, judge="http://127.0.0.1:8000/v1",
                                 judge_model="Qwen/Qwen3-32B")                       # any OpenAI-compatible server

Identical trajectories are judged once. Answers are cached on disk, keyed by the judge, the rubric
and the group's content, so scoring the same group again makes no request. See docs/ruler.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from .errors import InvalidFieldError, JourneymanError
from .types import Trajectory, TrajectoryGroup

DEFAULT_RUBRIC = """\
- A trajectory that achieves the user's goal scores clearly higher than any trajectory that does not.
- Among trajectories that achieve the goal, the more efficient one scores higher: fewer detours, \
repeated or needless tool calls, and no padding.
- A trajectory that makes real progress toward the goal without reaching it earns partial credit.
- Make differences in score proportional to differences in quality: nearly equal trajectories get \
nearly equal scores; a much better trajectory gets a much higher score."""

# Part of every cache key: a change to the prompt or schema below must not reuse old answers.
PROMPT_VERSION = "ruler-1"
MAX_SCORE = 10  # the judge answers an integer 0..10; reward = score / 10


class RulerJudgeError(JourneymanError, RuntimeError):
    """The judge's answer was unusable twice (bad JSON, wrong number of scores, unknown ids)."""

    def __init__(self, judge: str, problems: list[str], answers: list[str]) -> None:
        self.judge = judge
        self.problems = problems
        self.answers = answers
        super().__init__(
            f"judge={judge!r} answered wrongly {len(problems)} times: " + "; then ".join(problems)
        )


class RulerScore(BaseModel):
    """One entry of the judge's answer."""

    trajectory_id: str
    explanation: str = ""
    score: float = Field(ge=0, le=MAX_SCORE)


# -- what the judge sees ---------------------------------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def truncate(text: str, limit: int) -> str:
    """Keep the head and the tail of a long text, with a marker saying how much is hidden."""
    if limit <= 0 or len(text) <= limit:
        return text
    head = (limit * 2) // 3
    tail = limit - head
    hidden = len(text) - head - tail
    return (
        f"{text[:head]}\n[... {hidden} of {len(text)} characters truncated ...]\n{text[len(text) - tail :]}"
    )


def _render_tools(tools: list[dict[str, Any]] | None) -> str:
    if not tools:
        return ""
    lines = [json.dumps(t.get("function", t), ensure_ascii=False, sort_keys=True) for t in tools]
    return "<tools>\n" + "\n".join(lines) + "\n</tools>"


def _render_messages(messages: list[dict[str, Any]], max_tool_output_chars: int) -> list[str]:
    """One block of text per message; tool calls and results named, long tool results truncated."""
    names: dict[str, str] = {}
    blocks = []
    for m in messages:
        role = m.get("role", "?")
        if role == "tool":
            name = names.get(str(m.get("tool_call_id")), m.get("name") or "?")
            body = truncate(_text(m.get("content")), max_tool_output_chars)
            blocks.append(f'<tool_result name="{name}">\n{body}\n</tool_result>')
            continue
        parts = [_text(m.get("content"))] if _text(m.get("content")) else []
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            names[str(call.get("id"))] = fn.get("name", "?")
            args = fn.get("arguments", "")
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            parts.append(f'<tool_call name="{fn.get("name", "?")}">{args}</tool_call>')
        body = "\n".join(parts)
        blocks.append(f'<message role="{role}">\n{body}\n</message>')
    return blocks


@dataclass
class _Rendered:
    tools: str
    blocks: list[str]

    @property
    def digest(self) -> str:
        text = self.tools + "\n" + "\n".join(self.blocks)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class JudgePrompt:
    """What the judge is asked: the messages, the ids shown, and the content hash behind each id."""

    messages: list[dict[str, str]]
    ids: list[str]
    digests: list[str]  # digests[i] is the content hash of the trajectory shown as ids[i]
    schema: dict[str, Any]
    group_digests: list[str]  # the content hash of each trajectory of the group, in group order


def score_schema(ids: Sequence[str], explanation_chars: int) -> dict[str, Any]:
    """Every field bounded: a known id, a capped explanation, an integer 0..10, exactly one per id."""
    item = {
        "type": "object",
        "properties": {
            "trajectory_id": {"type": "string", "enum": list(ids)},
            "explanation": {"type": "string", "maxLength": explanation_chars},
            "score": {"type": "integer", "enum": list(range(MAX_SCORE + 1))},
        },
        "required": ["trajectory_id", "explanation", "score"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": item, "minItems": len(ids), "maxItems": len(ids)}
        },
        "required": ["scores"],
        "additionalProperties": False,
    }


def build_prompt(
    trajectories: Sequence[Trajectory],
    rubric: str = DEFAULT_RUBRIC,
    *,
    explanation_chars: int = 200,
    max_tool_output_chars: int = 2000,
) -> JudgePrompt:
    """The judge request for a group: duplicates shown once, the shared start shown once."""
    unique: dict[str, _Rendered] = {}
    group_digests = []
    for t in trajectories:
        r = _Rendered(_render_tools(t.tools), _render_messages(t.messages(), max_tool_output_chars))
        group_digests.append(r.digest)
        unique.setdefault(r.digest, r)
    shown = list(unique.values())
    # Longest shared run of messages, leaving every trajectory at least its last message.
    n_shared = min(len(r.blocks) for r in shown) - 1
    for k in range(max(n_shared, 0)):
        if any(r.blocks[k] != shown[0].blocks[k] for r in shown):
            n_shared = k
            break
    n_shared = max(n_shared, 0)
    shared_tools = all(r.tools == shown[0].tools for r in shown)
    context = ([shown[0].tools] if shared_tools and shown[0].tools else []) + shown[0].blocks[:n_shared]
    ids = [str(i + 1) for i in range(len(shown))]
    parts = ["<context>\n" + ("\n".join(context) if context else "(none)") + "\n</context>"]
    for tid, r in zip(ids, shown, strict=True):
        body = ([r.tools] if not shared_tools and r.tools else []) + r.blocks[n_shared:]
        parts.append(f'<trajectory id="{tid}">\n' + "\n".join(body) + "\n</trajectory>")
    system = (
        "You are a judge. Several agents (trajectories) were each given the same task; they share the "
        "context below and then diverge. Score every trajectory from 0 (worst) to 10 (best) by how well "
        "it served the user, comparing them with each other, using this rubric:\n"
        f"{rubric}\n\n"
        'Answer with JSON only: {"scores": [{"trajectory_id": "<id>", "explanation": "<at most '
        f'{explanation_chars} characters>", "score": <integer 0-10>}}, ...]}}, exactly one entry for each '
        f"of the {len(ids)} trajectories, in the order shown (ids {', '.join(ids)})."
    )
    user = "\n\n".join(parts)
    return JudgePrompt(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        ids=ids,
        digests=[r.digest for r in shown],
        schema=score_schema(ids, explanation_chars),
        group_digests=group_digests,
    )


def parse_scores(content: str | None, ids: Sequence[str]) -> tuple[dict[str, RulerScore] | None, str]:
    """The judge's scores by id, or None and what was wrong with the answer."""
    try:
        data = json.loads(content or "")
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at char {e.pos})"
    raw = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(raw, list):
        return None, 'no "scores" list'
    try:
        scores = [RulerScore.model_validate(s) for s in raw]
    except ValueError as e:
        return None, f"a score entry is malformed ({str(e).splitlines()[0]})"
    got = [s.trajectory_id for s in scores]
    if len(got) != len(ids) or sorted(got) != sorted(ids):
        return None, f"expected one score for each id {list(ids)}, got ids {got}"
    return {s.trajectory_id: s for s in scores}, ""


# -- judges -----------------------------------------------------------------------------------------


@dataclass
class _Judge:
    identity: str  # what the cache key names: the judge's kind, address, model and (local) step
    kind: str  # "openai" | "litellm"
    model: str
    base_url: str | None = None
    api_key: str | None = None


async def _resolve_judge(judge: str, judge_model: str | None, api_key: str | None) -> _Judge:
    if not isinstance(judge, str) or not judge.strip():
        raise InvalidFieldError(
            "judge", judge, 'use "local", "local:<model>", an http(s) base URL, or a LiteLLM model'
        )
    if judge == "local" or judge.startswith("local:"):
        from .backend import local_endpoint

        if judge_model is not None:
            raise InvalidFieldError(
                "judge_model", judge_model, 'name the local model as judge="local:<model>"'
            )
        name, base_url = local_endpoint(judge.partition(":")[2] or None)
        # The served step is part of the judge's identity: a trained policy judging itself is a new judge.
        async with httpx.AsyncClient(timeout=30) as http:
            served = (await http.get(f"{base_url}/models")).json()["data"]
        step = next((m["id"] for m in served if m["id"].startswith(f"{name}@")), name)
        return _Judge(f"local:{step}", "openai", name, base_url, "journeyman")
    if judge.startswith(("http://", "https://")):
        if not judge_model:
            raise InvalidFieldError(
                "judge_model", judge_model, f"judge={judge!r} is a base URL: name the model to ask"
            )
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        return _Judge(f"{judge.rstrip('/')}#{judge_model}", "openai", judge_model, judge.rstrip("/"), key)
    if judge_model is not None:
        raise InvalidFieldError("judge_model", judge_model, "only a base-URL judge takes judge_model")
    return _Judge(f"litellm:{judge}", "litellm", judge, api_key=api_key)


async def _ask(
    judge: _Judge, messages: list[dict[str, str]], schema: dict[str, Any], params: dict[str, Any]
) -> tuple[str, str | None]:
    """(answer text, finish reason) from the judge, with the score schema as response_format."""
    strict = judge.kind == "openai"  # our endpoint and vLLM decode under the schema
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "ruler_scores", "schema": schema, "strict": strict},
    }
    if judge.kind == "litellm":
        try:
            import litellm
        except ImportError as e:
            raise ImportError(
                f'judge={judge.model!r} is a LiteLLM model string: pip install "journeyman[litellm]" '
                '(or use judge="local" or an OpenAI-compatible base URL)'
            ) from e
        extra = {"api_key": judge.api_key} if judge.api_key else {}
        resp = await litellm.acompletion(
            model=judge.model, messages=messages, response_format=response_format, **extra, **params
        )
    else:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=judge.base_url, api_key=judge.api_key, timeout=600.0) as client:
            resp = await client.chat.completions.create(
                model=judge.model,
                messages=messages,
                response_format=response_format,
                **params,  # type: ignore[arg-type]
            )
    choice = resp.choices[0]
    return choice.message.content or "", choice.finish_reason


# -- the cache --------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    from .weights import cache_dir

    return cache_dir() / "ruler"


def _cache_key(
    judge: _Judge, rubric: str, digests: Sequence[str], explanation_chars: int, params: dict[str, Any]
) -> str:
    blob = json.dumps(
        {
            "v": PROMPT_VERSION,
            "judge": judge.identity,
            "rubric": rubric,
            "group": sorted(digests),  # the same set of trajectories in any order
            "explanation_chars": explanation_chars,
            "params": params,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _cache_read(path: Path) -> tuple[dict[str, RulerScore], str] | None:
    try:
        data = json.loads(path.read_text())
        return {d: RulerScore.model_validate(s) for d, s in data["scores"].items()}, str(data["answer"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: ask again


def _cache_write(path: Path, judge: _Judge, scores: dict[str, RulerScore], answer: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    record = {
        "judge": judge.identity,
        "scores": {d: s.model_dump() for d, s in scores.items()},
        "answer": answer,
    }
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # atomic: concurrent scorers never read half a file


# -- the public entry point -------------------------------------------------------------------------


async def ruler_score_group(
    group: TrajectoryGroup,
    judge: str = "local",
    rubric: str | None = None,
    swallow_exceptions: bool = False,
    *,
    judge_model: str | None = None,
    api_key: str | None = None,
    temperature: float = 0.0,
    max_tokens: int | None = None,
    explanation_chars: int = 200,
    max_tool_output_chars: int = 2000,
    judge_params: dict[str, Any] | None = None,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> TrajectoryGroup:
    """Score each trajectory of `group` in [0, 1] relative to the others; return a new group.

    judge: "local" (the model served most recently in this process; works offline),
        "local:<model name>", an OpenAI-compatible base URL such as "http://127.0.0.1:8000/v1" (with
        `judge_model=`; `api_key=` or $OPENAI_API_KEY), or any LiteLLM model string such as
        "openai/gpt-4o" or "anthropic/claude-sonnet-4-5" (`pip install "journeyman[litellm]"`).
    rubric: what "better" means; `DEFAULT_RUBRIC` when None.
    swallow_exceptions: when the judge fails, return the group unscored instead of raising: every
        reward set to the group's mean previous reward (no learning signal), `ruler_skipped` = 1 in
        each trajectory's metrics, the error in `group.metadata["ruler"]`.
    explanation_chars / max_tokens: bound the answer (max_tokens defaults to what the schema needs
        for local and base-URL judges, and to the provider's default for LiteLLM judges).
    max_tool_output_chars: longer tool results are shown as head + tail with a truncation marker.
    judge_params: extra arguments for the completion call (e.g. {"reasoning_effort": "low"}).
    cache_dir / use_cache: answers are kept under `$JOURNEYMAN_CACHE/ruler` unless told otherwise.

    The new group's rewards are score / 10; each trajectory keeps its previous reward as
    `metrics["independent_reward"]` (the first one, if the group was scored before), and gets
    `metrics["ruler_cached"]`, `metrics["ruler_retries"]`, `metrics["ruler_skipped"]` and the judge's
    explanation in `metadata["ruler_explanation"]`.
    """
    if not group.trajectories:
        return group
    if explanation_chars < 0:
        raise InvalidFieldError("explanation_chars", explanation_chars, "must be >= 0")
    if max_tool_output_chars < 1:
        raise InvalidFieldError("max_tool_output_chars", max_tool_output_chars, "must be >= 1")
    rubric = DEFAULT_RUBRIC if rubric is None else rubric
    try:
        return await _score(
            group,
            judge,
            judge_model,
            api_key,
            rubric,
            temperature,
            max_tokens,
            explanation_chars,
            max_tool_output_chars,
            dict(judge_params or {}),
            cache_dir,
            use_cache,
        )
    except (InvalidFieldError, ImportError):
        raise  # a wrong argument or a missing extra is the caller's to fix, never swallowed
    except Exception as e:
        if not swallow_exceptions:
            raise
        return _skipped(group, judge, e)


async def _score(
    group: TrajectoryGroup,
    judge_spec: str,
    judge_model: str | None,
    api_key: str | None,
    rubric: str,
    temperature: float,
    max_tokens: int | None,
    explanation_chars: int,
    max_tool_output_chars: int,
    judge_params: dict[str, Any],
    cache_dir: str | Path | None,
    use_cache: bool,
) -> TrajectoryGroup:
    judge = await _resolve_judge(judge_spec, judge_model, api_key)
    prompt = build_prompt(
        group.trajectories,
        rubric,
        explanation_chars=explanation_chars,
        max_tool_output_chars=max_tool_output_chars,
    )
    params: dict[str, Any] = {"temperature": temperature, **judge_params}
    if max_tokens is None and judge.kind == "openai":
        max_tokens = len(prompt.ids) * (40 + explanation_chars) + 32
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    key = _cache_key(
        judge, rubric, prompt.digests, explanation_chars, {"temperature": temperature, **judge_params}
    )
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / f"{key}.json"

    hit = _cache_read(path) if use_cache else None
    cached, retries = hit is not None, 0
    if hit is not None:
        by_digest, answer = hit
    else:
        messages = list(prompt.messages)
        problems: list[str] = []
        answers: list[str] = []
        for attempt in range(2):  # one retry, told what was wrong
            content, finish = await _ask(judge, messages, prompt.schema, params)
            scores, problem = parse_scores(content, prompt.ids)
            if scores is not None:
                break
            if finish == "length":
                problem += f" (the answer was cut off at max_tokens={params.get('max_tokens')})"
            problems.append(problem)
            answers.append(content)
            if attempt == 0:
                retries = 1
                messages = [
                    *prompt.messages,
                    {"role": "assistant", "content": content},
                    {
                        "role": "user",
                        "content": f"That answer is unusable: {problem}. Answer again: exactly one entry for "
                        f"each trajectory id {', '.join(prompt.ids)}, JSON only.",
                    },
                ]
        else:
            raise RulerJudgeError(judge.identity, problems, answers)
        by_digest = {d: scores[i] for i, d in zip(prompt.ids, prompt.digests, strict=True)}
        answer = content
        if use_cache:
            _cache_write(path, judge, by_digest, answer)

    out = []
    for t, digest in zip(group.trajectories, prompt.group_digests, strict=True):
        s = by_digest[digest]
        metrics = {
            **t.metrics,
            "independent_reward": t.metrics.get("independent_reward", t.reward),
            "ruler_cached": int(cached),
            "ruler_retries": retries,
            "ruler_skipped": 0,
        }
        metadata = {**t.metadata, "ruler_explanation": s.explanation}
        new = t.model_copy(
            deep=True,
            update={
                "reward": s.score / MAX_SCORE,
                "metrics": metrics,
                "metadata": metadata,
                "logs": [*t.logs, f"RULER {s.score:g}/10: {s.explanation}"],
            },
        )
        out.append(new)
    info = {
        "judge": judge.identity,
        "unique": len(prompt.ids),
        "cached": cached,
        "retries": retries,
        "skipped": False,
        "answer": answer,  # the judge's raw JSON, for debugging a judge
    }
    return TrajectoryGroup(out, exceptions=list(group.exceptions), metadata={**group.metadata, "ruler": info})


def _skipped(group: TrajectoryGroup, judge: str, error: Exception) -> TrajectoryGroup:
    """The group with no learning signal left in it: every reward the same (the mean so far)."""
    mean = sum(t.reward for t in group.trajectories) / len(group.trajectories)
    out = []
    for t in group.trajectories:
        metrics = {
            **t.metrics,
            "independent_reward": t.metrics.get("independent_reward", t.reward),
            "ruler_cached": 0,
            "ruler_retries": 0,
            "ruler_skipped": 1,
        }
        out.append(
            t.model_copy(
                deep=True,
                update={"reward": mean, "metrics": metrics, "logs": [*t.logs, f"RULER skipped: {error}"]},
            )
        )
    info = {"judge": judge, "skipped": True, "error": f"{type(error).__name__}: {error}"}
    return TrajectoryGroup(out, exceptions=list(group.exceptions), metadata={**group.metadata, "ruler": info})
