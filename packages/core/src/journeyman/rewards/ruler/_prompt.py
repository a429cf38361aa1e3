"""What the judge sees and what it must answer: pure functions of the trajectories, no I/O.

The judge sees the shared start of the conversations once, then each distinct trajectory's own
continuation (tool definitions, tool calls and tool results included), and answers
`{"scores": [{"trajectory_id", "explanation", "score"}]}` under a JSON schema that bounds every
field: a free number let the 135M model write a 150-digit "score" under constrained decoding.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from journeyman.chat.messages import text_of
from journeyman.data.types import Trajectory

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


class RulerScore(BaseModel):
    """One entry of the judge's answer."""

    trajectory_id: str
    explanation: str = ""
    score: float = Field(ge=0, le=MAX_SCORE)


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
        text = text_of(m.get("content"), strict=False)
        if role == "tool":
            name = names.get(str(m.get("tool_call_id")), m.get("name") or "?")
            body = truncate(text, max_tool_output_chars)
            blocks.append(f'<tool_result name="{name}">\n{body}\n</tool_result>')
            continue
        parts = [text] if text else []
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


def retry_message(problem: str, ids: Sequence[str]) -> dict[str, str]:
    """What the judge is told after an unusable answer: what was wrong, and the shape wanted."""
    return {
        "role": "user",
        "content": f"That answer is unusable: {problem}. Answer again: exactly one entry for "
        f"each trajectory id {', '.join(ids)}, JSON only.",
    }
