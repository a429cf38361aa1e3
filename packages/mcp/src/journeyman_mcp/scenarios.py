"""Tool-use tasks for a server nobody wrote a dataset for.

A generator model proposes tasks under a JSON schema (so even the embedded 135M model answers in
shape); tasks that do not look like tasks are dropped, duplicates removed, and deterministic tasks
built from the tool schemas fill whatever is missing, so generation always yields N valid
scenarios. The result is split into train and eval and saved as JSON that `--scenarios-file`
reads back, and that a user may edit by hand (add `setup` calls and `checks` for a verifiable end
state, see `Check`). A real generator (a URL or a LiteLLM id) writes setup calls and checks itself;
a check may only call a tool that reads (`CheckTools`: the server's MCP annotations, else the
generator's word), and tasks come with difficulty levels (`DIFFICULTY`) and every tool they need.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any, Literal

from journeyman import Backend, InvalidFieldError
from journeyman.integrations import DEFAULT_TIMEOUT_S, LLM, LLMSpec, complete_json, resolve_llm
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


DIFFICULTY = {
    1: "one tool call, every value given in the task",
    2: "two or more tool calls, every value given in the task",
    3: "two or more calls, and an argument of a later call is taken from an earlier call's result",
    4: "as 3, plus a condition on a result (do X only if the result says Y)",
    5: "four or more calls mixing reads and writes, results feeding later calls",
}
"""The difficulty levels the generator is asked for (and shown), so a task set can be made harder
than one forced call, which a greedy small model already gets right on most servers."""


class Scenario(BaseModel):
    id: str
    task: str = Field(description="what the user asks the agent")
    difficulty: int = Field(default=1, ge=1, le=5, description="see DIFFICULTY")
    tools: list[str] = Field(
        default_factory=list,
        description="the tools the task needs; without checks, success = each was called without error",
    )
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


def _schema_task(tool: dict[str, Any], rng: random.Random) -> tuple[str, int]:
    """One call of `tool` as a sentence ("Get the current time with timezone "Asia/Tokyo""), and the
    number of arguments it names."""
    props: dict[str, Any] = (tool.get("parameters") or {}).get("properties") or {}
    required = set((tool.get("parameters") or {}).get("required") or [])
    args = {
        k: example_value(k, v if isinstance(v, dict) else {}, rng)
        for k, v in props.items()
        if k in required or rng.random() < 0.5
    }
    what = (tool.get("description") or tool["name"]).strip().splitlines()[0].rstrip(".")
    shown = ", ".join(f"{k} {json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
    return f"{what[:1].upper()}{what[1:]}" + (f" with {shown}" if shown else ""), len(args)


def schema_scenarios(info: ServerInfo, n: int, seed: int = 0) -> list[Scenario]:
    """N tasks built from the tool schemas alone, arguments filled with example values. Every third
    one (when the server has two tools or more) chains two different tools, so that one forced call
    does not finish it: the proxy "each named tool called without error" needs both."""
    rng = random.Random(seed)
    out: list[Scenario] = []
    tools = [t["function"] for t in info.tools]
    if not tools:
        return out
    attempts = 0
    seen: set[str] = set()
    while len(out) < n and attempts < n * 20:
        first = tools[attempts % len(tools)]
        attempts += 1
        text, n_args = _schema_task(first, rng)
        used = [first["name"]]
        if len(tools) > 1 and len(out) % 3 == 2:
            # any tool but `first` (at index attempts - 1)
            second = tools[(attempts + rng.randrange(len(tools) - 1)) % len(tools)]
            more, n_more = _schema_task(second, rng)
            text = f"{text}. Then: {more[:1].lower()}{more[1:]}. Tell me both results."
            used.append(second["name"])
            difficulty = 2 + min(n_args + n_more, 6) // 2
        else:
            text += ". Tell me the result."
            difficulty = 1 + min(n_args, 4)
        key = _norm(text)
        if key in seen:
            continue
        seen.add(key)
        out.append(
            Scenario(
                id=scenario_id(text),
                task=text,
                difficulty=min(difficulty, 5),
                tools=used,
                source="schema",
            )
        )
    return out


# -- generator model ----------------------------------------------------------------------------------


def generation_schema(tool_names: list[str], n: int, checks: CheckTools | None = None) -> dict[str, Any]:
    """Bounded on purpose: a small model under constrained decoding otherwise writes forever.

    With `checks` (a real generator), each task may also carry `setup` calls and end-state `checks`
    on read-only tools, and the generator says which unannotated tools only read. Arguments are a
    JSON text, not an object: a free-form object is refused by some providers' strict modes."""
    item: dict[str, Any] = {
        "task": {"type": "string", "minLength": 15, "maxLength": 300 if checks is not None else 160},
        "tools": {
            "type": "array",
            "items": {"type": "string", "enum": tool_names},
            "minItems": 1,
            "maxItems": 4,
        },
        "difficulty": {"type": "integer", "enum": list(DIFFICULTY)},
    }
    top: dict[str, Any] = {}
    if checks is not None:
        arguments = {"type": "string", "maxLength": 300, "description": "the arguments as a JSON object"}
        strings = {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 4}
        call = {
            "type": "object",
            "properties": {"tool": {"type": "string", "enum": tool_names}, "arguments": arguments},
            "required": ["tool", "arguments"],
            "additionalProperties": False,
        }
        check = {
            "type": "object",
            "properties": {
                "tool": {"type": "string", "enum": checks.candidates},
                "arguments": arguments,
                "expect_contains": strings,
                "expect_absent": strings,
            },
            "required": ["tool", "arguments", "expect_contains", "expect_absent"],
            "additionalProperties": False,
        }
        item |= {
            "setup": {"type": "array", "items": call, "maxItems": 3},
            "checks": {"type": "array", "items": check, "maxItems": 3},
        }
        if checks.unknown:
            top["read_only_tools"] = {
                "type": "array",
                "items": {"type": "string", "enum": checks.unknown},
                "maxItems": len(checks.unknown),
            }
    scenario = {
        "type": "object",
        "properties": item,
        "required": list(item),
        "additionalProperties": False,
    }
    props = {"scenarios": {"type": "array", "items": scenario, "minItems": 1, "maxItems": n}, **top}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


class CheckTools(BaseModel):
    """Which tools an end-state check may call: read-only by the server's annotations, or unknown
    (no annotations) and then only if the generator lists them in `read_only_tools`."""

    read_only: list[str]
    unknown: list[str]

    @property
    def candidates(self) -> list[str]:
        return self.read_only + self.unknown

    @classmethod
    def of(cls, info: ServerInfo) -> CheckTools:
        names = info.tool_names() + [n for n in info.kinds if n not in info.tool_names()]
        return cls(
            read_only=[n for n in names if info.kind(n) == "read_only"],
            unknown=[n for n in names if info.kind(n) == "unknown"],
        )


def generation_messages(
    info: ServerInfo, n: int, examples: list[Scenario], checks: CheckTools | None = None
) -> list[dict[str, str]]:
    lines = [
        f"- {t['function']['name']}: {(t['function'].get('description') or '').strip()[:200]} "
        f"arguments: {json.dumps((t['function'].get('parameters') or {}).get('properties') or {})[:300]}"
        for t in info.tools
    ]
    res = "".join(f"\n- resource {r['uri']}: {r.get('description', '')[:100]}" for r in info.resources[:10])
    shots = "\n".join(
        json.dumps({"task": s.task, "tools": s.tools, "difficulty": s.difficulty}) for s in examples
    )
    levels = "; ".join(f"{k} = {v}" for k, v in DIFFICULTY.items())
    system = (
        "You write realistic tasks that a user would give an AI agent that has the tools below. Each task "
        "names concrete values (no placeholders), needs at least one tool call, and can be checked from "
        f"the tool results. List every tool the task needs. Vary the tools and the difficulty ({levels}); "
        "most tasks should be 2 or harder."
    )
    if checks is not None:
        system += (
            " For each task, also write `setup`: tool calls that put the server in the state the task "
            "assumes (they run before the agent starts; may be empty), and `checks`: calls of read-only "
            "tools made after the agent finished, with strings the result must contain "
            "(`expect_contains`) or must not contain (`expect_absent`) if and only if the task was done. "
            f"Read-only by the server's own annotations: {checks.read_only or 'none'}."
            + (
                f" Not annotated: {checks.unknown}; list in `read_only_tools` those that only read "
                "(never change state): checks may call only read-only tools."
                if checks.unknown
                else ""
            )
            + " Arguments are a JSON object written as a string."
        )
    user = (
        f"Server: {info.name}\nTools:\n" + "\n".join(lines) + res + f"\n\nExamples:\n{shots}\n\n"
        f'Write {n} new, different tasks as JSON: {{"scenarios": [{{"task": ..., "tools": [...], "difficulty": ...'
        + (', "setup": [...], "checks": [...]' if checks is not None else "")
        + "}]}"
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
    checks: int = Field(default=0, description="end-state checks the generator wrote that were kept")
    checks_rejected: int = Field(
        default=0,
        description="generated checks dropped: a tool that may change state, arguments that are not "
        "a JSON object, or nothing to expect",
    )
    read_only_by_generator: list[str] = Field(
        default_factory=list, description="unannotated tools the generator said only read"
    )


def _arguments(text: Any) -> dict[str, Any] | None:
    """A generated `arguments` field (JSON text; an object is taken as it is), or None."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text) if isinstance(text, str) and text.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _generated(
    item: dict[str, Any], names: list[str], read_only: set[str]
) -> tuple[Scenario | None, int, int]:
    """(the scenario a generated item describes or None, checks kept, checks dropped).

    A check survives only on a tool known to be read-only (a check that writes would make its own
    truth) with a JSON-object argument and at least one expected string; a scenario keeps the setup
    calls that name a real tool with JSON-object arguments, and is dropped if it names no real tool."""
    tools = list(dict.fromkeys(t for t in item.get("tools") or [] if t in names))
    if not tools:
        return None, 0, 0
    setup = [
        ToolCallSpec(tool=c["tool"], arguments=args)
        for c in item.get("setup") or []
        if isinstance(c, dict)
        and c.get("tool") in names
        and (args := _arguments(c.get("arguments"))) is not None
    ]
    checks: list[Check] = []
    dropped = 0
    for c in item.get("checks") or []:
        args = _arguments(c.get("arguments")) if isinstance(c, dict) else None
        contains = (
            [str(x) for x in c.get("expect_contains") or [] if str(x).strip()] if args is not None else []
        )
        absent = [str(x) for x in c.get("expect_absent") or [] if str(x).strip()] if args is not None else []
        if args is None or c.get("tool") not in read_only or not (contains or absent):
            dropped += 1
            continue
        checks.append(Check(tool=c["tool"], arguments=args, expect_contains=contains, expect_absent=absent))
    difficulty = item.get("difficulty", 1)
    task = str(item.get("task", "")).strip()
    scenario = Scenario(
        id=scenario_id(task),
        task=task,
        difficulty=difficulty if difficulty in DIFFICULTY else 1,
        tools=tools,
        source="generator",
        setup=setup,
        checks=checks,
    )
    return scenario, len(checks), dropped


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
    with_checks: bool | None = None,
) -> tuple[list[Scenario], GenerationReport]:
    """`num_scenarios` distinct tasks; generator="none" uses the tool schemas only.

    generator: "local" (the model the backend registered last), "local:<name>" or a TrainableModel,
        an OpenAI-compatible base URL (with `generator_model=`), or a LiteLLM model string; see
        `journeyman.integrations.resolve_llm`. Local models are found on `backend` (the current backend when None).
    with_checks: ask for `setup` calls and end-state `checks` too (see `CheckTools`); by default only
        a real generator (a URL or a LiteLLM id) is asked: the embedded model cannot write them.
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
    report = GenerationReport(requested=num_scenarios, from_generator=0, from_schema=0, rejected=0)
    llm: LLM | None = None
    if generator != "none":
        try:
            llm = await resolve_llm(generator, generator_model, backend=backend, field="generator")
        except (InvalidFieldError, ImportError):
            raise
        except Exception as e:  # a local endpoint that does not answer: fall back, say why
            report.generator_error = f"{type(e).__name__}: {str(e)[:200]}"
    if llm is not None:
        check_tools = (
            CheckTools.of(info) if (with_checks if with_checks is not None else llm.kind != "local") else None
        )
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
                    generation_messages(info, want, shots, check_tools),
                    generation_schema(names, want, check_tools),
                    name="scenarios",
                    params=params,
                    timeout=timeout_s,
                )
                answer = json.loads(text)
                items = answer.get("scenarios", [])
            except (InvalidFieldError, ImportError):
                raise
            except Exception as e:  # a generator that is down or answers junk: fall back, say why
                report.generator_error = f"{type(e).__name__}: {str(e)[:200]}"
                break
            read_only: set[str] = set()
            if check_tools is not None:
                said = [t for t in answer.get("read_only_tools") or [] if t in check_tools.unknown]
                report.read_only_by_generator = sorted(set(report.read_only_by_generator) | set(said))
                read_only = set(check_tools.read_only) | set(report.read_only_by_generator)
            for item in items if isinstance(items, list) else []:
                scenario, kept, dropped = (
                    _generated(item, names, read_only) if isinstance(item, dict) else (None, 0, 0)
                )
                report.checks_rejected += dropped
                if scenario is None or not plausible(scenario.task, info) or _norm(scenario.task) in seen:
                    report.rejected += 1
                    continue
                seen.add(_norm(scenario.task))
                report.checks += kept
                out.append(scenario)
    n_gen = min(len(out), num_scenarios)
    for s in fallback:
        if len(out) >= num_scenarios:
            break
        if _norm(s.task) not in seen:
            seen.add(_norm(s.task))
            out.append(s)
    report.from_generator = n_gen
    report.from_schema = len(out[:num_scenarios]) - n_gen
    return out[:num_scenarios], report


def split(scenarios: list[Scenario], num_eval: int, seed: int = 0) -> tuple[list[Scenario], list[Scenario]]:
    """(train, eval): a seeded shuffle; eval gets `num_eval`, train keeps at least one."""
    if len(scenarios) < 2:
        raise InvalidFieldError("num_scenarios", len(scenarios), "need at least 2 (one train, one eval)")
    num_eval = max(1, min(num_eval, len(scenarios) - 1))
    items = list(scenarios)
    random.Random(seed).shuffle(items)
    return items[num_eval:], items[:num_eval]
