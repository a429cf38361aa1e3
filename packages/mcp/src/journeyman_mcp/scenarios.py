"""Tool-use tasks for a server nobody wrote a dataset for.

A generator model proposes tasks under a JSON schema (so even the embedded 135M model answers in
shape); tasks that do not look like tasks are dropped, duplicates removed, and deterministic tasks
built from the tool schemas fill whatever is missing, so generation always yields N valid
scenarios. The result is split into train and eval and saved as JSON that `--scenarios-file`
reads back, and that a user may edit by hand (add `setup` calls and `checks` for a verifiable end
state, see `Check`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any, Literal

from journeyman import Backend, InvalidFieldError
from journeyman.llm import DEFAULT_TIMEOUT_S, LLM, LLMSpec, complete_json, resolve_llm
from pydantic import BaseModel, Field

from .server import ServerInfo


class ToolCallSpec(BaseModel):
    """A tool call the harness makes itself (scenario setup), not the agent."""

    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Check(ToolCallSpec):
    """After the episode, call `tool` on the same session; pass when its text matches."""

    expect_contains: list[str] = Field(default_factory=list, description="every string must appear")
    expect_absent: list[str] = Field(default_factory=list, description="no string may appear")

    def passes(self, text: str) -> bool:
        low = text.lower()
        return all(s.lower() in low for s in self.expect_contains) and not any(
            s.lower() in low for s in self.expect_absent
        )


class Scenario(BaseModel):
    id: str
    task: str = Field(description="what the user asks the agent")
    difficulty: int = Field(1, ge=1, le=5)
    tools: list[str] = Field(default_factory=list, description="the tools the task is about (a hint)")
    source: Literal["generator", "schema", "file"] = "file"
    setup: list[ToolCallSpec] = Field(default_factory=list, description="calls made before the episode")
    checks: list[Check] = Field(default_factory=list, description="end-state checks after the episode")


class ScenarioSet(BaseModel):
    server: str
    tools: list[str]
    train: list[Scenario]
    eval: list[Scenario]

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: Path) -> ScenarioSet:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InvalidFieldError("scenarios_file", str(path), f"cannot read it: {e}") from None
        for split in ("train", "eval"):
            for s in data.get(split, []):
                s.setdefault("source", "file")
        return cls.model_validate(data)


def scenario_id(task: str) -> str:
    return hashlib.sha256(_norm(task).encode()).hexdigest()[:10]


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


# -- deterministic scenarios from the tool schemas -----------------------------------------------

_SAMPLES: dict[str, list[Any]] = {
    "timezone": ["Europe/London", "Asia/Tokyo", "America/New_York", "Europe/Paris", "Australia/Sydney"],
    "time": ["09:30", "14:00", "18:45", "07:15"],
    "message": ["hello world", "good morning", "the build is green", "see you at noon"],
    "text": ["hello world", "quarterly report", "meeting notes"],
    "query": ["weather in Paris", "python asyncio", "open source licenses"],
    "name": ["alice", "project-x", "notes"],
    "title": ["buy milk", "call the bank", "water the plants", "book a dentist visit"],
    "path": ["README.md", "notes.txt"],
    "url": ["https://example.com"],
}
_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]


def example_value(name: str, schema: dict[str, Any], rng: random.Random) -> Any:
    """A plausible value for one property: enum, default, examples, then name and type heuristics."""
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    if schema.get("examples"):
        return rng.choice(schema["examples"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind is None and schema.get("anyOf"):
        return example_value(name, schema["anyOf"][0], rng)
    if kind in ("integer", "number"):
        lo = schema.get("minimum", 1)
        hi = schema.get("maximum", max(lo + 9, 10))
        v = rng.randint(int(lo), int(hi))
        return v if kind == "integer" else float(v)
    if kind == "boolean":
        return rng.choice([True, False])
    if kind == "array":
        return [example_value(name, schema.get("items") or {"type": "string"}, rng)]
    if kind == "object":
        return {}
    if "default" in schema:
        return schema["default"]
    key = name.lower()
    for hint, values in _SAMPLES.items():
        if hint in key:
            return rng.choice(values)
    return rng.choice(_WORDS)


def schema_scenarios(info: ServerInfo, n: int, seed: int = 0) -> list[Scenario]:
    """N tasks built from the tool schemas alone: one tool each, arguments filled with example values."""
    rng = random.Random(seed)
    out: list[Scenario] = []
    tools = list(info.tools)
    if not tools:
        return out
    attempts = 0
    seen: set[str] = set()
    while len(out) < n and attempts < n * 20:
        tool = tools[attempts % len(tools)]["function"]
        attempts += 1
        props: dict[str, Any] = (tool.get("parameters") or {}).get("properties") or {}
        required = set((tool.get("parameters") or {}).get("required") or [])
        args = {
            k: example_value(k, v if isinstance(v, dict) else {}, rng)
            for k, v in props.items()
            if k in required or rng.random() < 0.5
        }
        what = (tool.get("description") or tool["name"]).strip().splitlines()[0].rstrip(".")
        shown = ", ".join(f"{k} {json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
        task = f"{what[:1].upper()}{what[1:]}" + (f" with {shown}" if shown else "") + ". Tell me the result."
        key = _norm(task)
        if key in seen:
            continue
        seen.add(key)
        out.append(
            Scenario(
                id=scenario_id(task),
                task=task,
                difficulty=1 + min(len(args), 4),
                tools=[tool["name"]],
                source="schema",
            )
        )
    return out


# -- generator model ----------------------------------------------------------------------------------


def generation_schema(tool_names: list[str], n: int) -> dict[str, Any]:
    """Bounded on purpose: a small model under constrained decoding otherwise writes forever."""
    item = {
        "type": "object",
        "properties": {
            "task": {"type": "string", "minLength": 15, "maxLength": 160},
            "tool": {"type": "string", "enum": tool_names},
            "difficulty": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
        },
        "required": ["task", "tool", "difficulty"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"scenarios": {"type": "array", "items": item, "minItems": 1, "maxItems": n}},
        "required": ["scenarios"],
        "additionalProperties": False,
    }


def generation_messages(info: ServerInfo, n: int, examples: list[Scenario]) -> list[dict[str, str]]:
    lines = [
        f"- {t['function']['name']}: {(t['function'].get('description') or '').strip()[:200]} "
        f"arguments: {json.dumps((t['function'].get('parameters') or {}).get('properties') or {})[:300]}"
        for t in info.tools
    ]
    res = "".join(f"\n- resource {r['uri']}: {r.get('description', '')[:100]}" for r in info.resources[:10])
    shots = "\n".join(
        json.dumps({"task": s.task, "tool": s.tools[0], "difficulty": s.difficulty}) for s in examples
    )
    system = (
        "You write realistic tasks that a user would give an AI agent that has the tools below. Each task "
        "names concrete values (no placeholders), needs at least one tool call, and can be checked from "
        "the tool results. Vary the tools and the difficulty (1 = one call, 5 = several calls)."
    )
    user = (
        f"Server: {info.name}\nTools:\n" + "\n".join(lines) + res + f"\n\nExamples:\n{shots}\n\n"
        f'Write {n} new, different tasks as JSON: {{"scenarios": [{{"task": ..., "tool": ..., "difficulty": ...}}]}}'
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def plausible(task: str, info: ServerInfo) -> bool:
    """A cheap filter for what a weak generator writes: real words, and about one of the tools."""
    words = re.findall(r"[A-Za-z]{2,}", task)
    if len(words) < 4 or len(task) > 300:
        return False
    if len(set(w.lower() for w in words)) < len(words) / 2:  # "the the the the"
        return False
    vocab = set()
    for t in info.tools:
        fn = t["function"]
        vocab |= {
            w for w in re.findall(r"[a-z]{4,}", (fn["name"] + " " + (fn.get("description") or "")).lower())
        }
        vocab |= {
            w
            for w in re.findall(
                r"[a-z]{4,}", " ".join((fn.get("parameters") or {}).get("properties") or {}).lower()
            )
        }
    return bool(vocab & {w.lower() for w in words})


class GenerationReport(BaseModel):
    requested: int
    from_generator: int
    from_schema: int
    rejected: int
    generator_error: str | None = None


async def generate_scenarios(
    info: ServerInfo,
    num_scenarios: int,
    *,
    generator: LLMSpec = "local",
    generator_model: str | None = None,
    backend: Backend | None = None,
    batch_size: int = 4,
    max_tokens: int = 400,
    temperature: float = 1.0,
    seed: int = 0,
    max_generator_calls: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[list[Scenario], GenerationReport]:
    """`num_scenarios` distinct tasks; generator="none" uses the tool schemas only.

    generator: "local" (the model the backend registered last), "local:<name>" or a TrainableModel,
        an OpenAI-compatible base URL (with `generator_model=`), or a LiteLLM model string; see
        `journeyman.llm`. Local models are found on `backend` (the current backend when None).
    The generator is asked in batches; a generator that fails or writes junk costs nothing but
    time, because schema tasks fill the rest. A wrong spec or a missing extra is raised.
    """
    if num_scenarios < 1:
        raise InvalidFieldError("num_scenarios", num_scenarios, "must be >= 1")
    if not info.tools:
        raise InvalidFieldError("tools", [], "the server offers no tools to build tasks around")
    fallback = schema_scenarios(info, num_scenarios * 2, seed=seed)
    names = info.tool_names()
    out: list[Scenario] = []
    seen: set[str] = set()
    rejected = 0
    error: str | None = None
    llm: LLM | None = None
    if generator != "none":
        try:
            llm = await resolve_llm(generator, generator_model, backend=backend, field="generator")
        except (InvalidFieldError, ImportError):
            raise
        except Exception as e:  # a local endpoint that does not answer: fall back, say why
            error = f"{type(e).__name__}: {str(e)[:200]}"
    if llm is not None:
        calls = (
            max_generator_calls if max_generator_calls is not None else -(-num_scenarios // batch_size) + 1
        )
        rng = random.Random(seed)
        for i in range(calls):
            if len(out) >= num_scenarios:
                break
            shots = rng.sample(fallback, min(2, len(fallback)))
            want = min(batch_size, num_scenarios - len(out))
            params: dict[str, Any] = {"temperature": temperature}
            if llm.kind != "litellm":  # a provider's own default leaves reasoning models room to think
                params |= {"max_tokens": max_tokens, "seed": seed + i}
            try:
                text, _ = await complete_json(
                    llm,
                    generation_messages(info, want, shots),
                    generation_schema(names, want),
                    name="scenarios",
                    params=params,
                    timeout=timeout_s,
                )
                items = json.loads(text).get("scenarios", [])
            except (InvalidFieldError, ImportError):
                raise
            except Exception as e:  # a generator that is down or answers junk: fall back, say why
                error = f"{type(e).__name__}: {str(e)[:200]}"
                break
            for item in items:
                task = str(item.get("task", "")).strip()
                tool = item.get("tool")
                key = _norm(task)
                if not plausible(task, info) or key in seen or tool not in names:
                    rejected += 1
                    continue
                seen.add(key)
                out.append(
                    Scenario(
                        id=scenario_id(task),
                        task=task,
                        difficulty=int(item.get("difficulty", 1)),
                        tools=[tool],
                        source="generator",
                    )
                )
    n_gen = len(out)
    for s in fallback:
        if len(out) >= num_scenarios:
            break
        if _norm(s.task) not in seen:
            seen.add(_norm(s.task))
            out.append(s)
    return out[:num_scenarios], GenerationReport(
        requested=num_scenarios,
        from_generator=min(n_gen, num_scenarios),
        from_schema=len(out[:num_scenarios]) - min(n_gen, num_scenarios),
        rejected=rejected,
        generator_error=error,
    )


def split(scenarios: list[Scenario], num_eval: int, seed: int = 0) -> tuple[list[Scenario], list[Scenario]]:
    """(train, eval): a seeded shuffle; eval gets `num_eval`, train keeps at least one."""
    if len(scenarios) < 2:
        raise InvalidFieldError("num_scenarios", len(scenarios), "need at least 2 (one train, one eval)")
    num_eval = max(1, min(num_eval, len(scenarios) - 1))
    items = list(scenarios)
    random.Random(seed).shuffle(items)
    return items[num_eval:], items[:num_eval]
