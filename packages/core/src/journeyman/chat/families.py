"""Model families: how each writes a tool call, frames a forced one, and marks its reasoning.

A family is detected from the tokenizer's own chat template (markers only that family's template
has) and can be named instead with `ModelConfig.chat_format`. Rendering always goes through a
chat template (`chat_format.py`); what differs per family is the text the model writes back:

| family      | models                             | a call as the model writes it                          |
|-------------|------------------------------------|--------------------------------------------------------|
| hermes      | Qwen2.5, SmolLM2, the fallback     | `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>` |
| qwen3       | Qwen3 (reasoning)                  | `<think>..</think>` then Hermes calls; grammars after `</think>` |
| llama3      | Llama 3.1 / 3.2 / 3.3              | `{"name": .., "parameters": {..}}` (`<|python_tag|>` optional); built-in tools `<|python_tag|>brave_search.call(query="..")`, raw code = `code_interpreter`, `<|eom_id|>` |
| mistral     | Mistral v0.3, Nemo, Small 3.0      | `[TOOL_CALLS][{"name": .., "arguments": {..}}]`        |
| mistral_v11 | Small 3.2, Magistral, Devstral     | `[TOOL_CALLS]name[ARGS]{..}` (template writes `[ARGS]`) |
| gemma3      | Gemma 3 (no tools in template)     | `[name(k=<json>, ..)]`, Google's documented function calling |

Parsing runs on transformers' declarative response parser (`transformers.utils.chat_parsing`),
the one transformers' own server uses, with a response template per family written here (the
ones transformers ships are private to its server and cover Qwen and Gemma 4 only); syntaxes it
cannot express (Python-style calls, a name outside the JSON) are read by `parse_special` first.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from journeyman.chat._pythonic import parse_python_call
from journeyman.errors import InvalidFieldError

Shape = tuple[str, str, str]  # (prefix, JSON schema, suffix), as `engine.base.Shape`
Calls = list[dict[str, Any]]  # [{"name": .., "arguments": "<json>"}]

PYTHON_KWARGS = "x-journeyman-python-kwargs"
"""A shape's schema `{PYTHON_KWARGS: <parameters schema>}` stands for a Python call's keyword arguments
(`city="Paris", days=2`, each value compact JSON) instead of one JSON object: Gemma 3's calls; the
engine's grammar (`engine/grammar.py`) reads it."""


def python_kwargs_schema(parameters: dict[str, Any]) -> str:
    return json.dumps({PYTHON_KWARGS: parameters})


# The parser cuts the text at its start anchor; we hand it the model's output alone, after this.
PARSE_ANCHOR = "\x00journeyman-completion\x00"

_CALL_JSON = {"content": "json", "transform": {"type": "function", "function": "{content}"}}
_REASONING = {"open": "<think>", "close": "</think>", "content": "text"}
_TEXT = {"content": "text", "content_args": {"strip": False}}


def _hermes_template(reasoning: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {"reasoning_content": _REASONING} if reasoning else {}
    fields["tool_calls"] = {
        "open_pattern": r"\s*<tool_call>",
        "close": "</tool_call>",
        "repeats": True,
        **_CALL_JSON,
    }
    fields["content"] = _TEXT
    return {"start_anchor": PARSE_ANCHOR, "fields": fields}


_LLAMA3_TEMPLATE: dict[str, Any] = {
    "start_anchor": PARSE_ANCHOR,
    "fields": {
        # a call is the whole answer: a JSON object, after an optional <|python_tag|>
        "tool_calls": {
            "open_pattern": r"^\s*(?:<\|python_tag\|>)?\s*(?=\{)",
            "close_pattern": r"\s*;\s*",
            "repeats": True,
            "content": "json",
            "transform": {
                "type": "function",
                "function": {"name": "{content.name}", "arguments": "{content.parameters}"},
            },
        },
        "content": _TEXT,
    },
}

_MISTRAL_TEMPLATE: dict[str, Any] = {
    "start_anchor": PARSE_ANCHOR,
    "fields": {
        "tool_calls": {
            "open": "[TOOL_CALLS]",
            "content": "json",
            "transform_each": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
        },
        "content": _TEXT,
    },
}


_PYTHON_TAG = "<|python_tag|>"


def _llama3_builtin(text: str) -> tuple[str | None, Calls] | None:
    """Llama 3.1's built-in tool calls, which its response template cannot read:
    `<|python_tag|>brave_search.call(query="..")` (any `name.call(k="v")`), and raw Python after
    the tag, which is a `code_interpreter` call. A JSON call after the tag is left to the template."""
    head, tag, rest = text.partition(_PYTHON_TAG)
    if not tag or rest.lstrip().startswith("{"):
        return None
    code = rest.strip()
    parsed = parse_python_call(code) if re.match(r"^[A-Za-z_]\w*\.call\(", code) else None
    name, arguments = parsed if parsed is not None else ("code_interpreter", {"code": code})
    call = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return head.strip() or None, [call]


_MISTRAL_ARGS_CALL = re.compile(r"\[TOOL_CALLS\]([^\[\]\s{]+)\[ARGS\]")


def _mistral_args(text: str) -> tuple[str | None, Calls] | None:
    """Calls as Mistral's v11+ tokenizers write them: `[TOOL_CALLS]name[ARGS]{..}`, repeated."""
    first = _MISTRAL_ARGS_CALL.search(text)
    if first is None:
        return None
    calls, at, decoder = [], first.start(), json.JSONDecoder()
    while at < len(text):
        m = _MISTRAL_ARGS_CALL.match(text, at)
        if m is None:
            if text[at:].strip():
                return None  # text after a call: not a well-formed turn
            break
        try:
            arguments, end = decoder.raw_decode(text, m.end())
        except json.JSONDecodeError:
            return None
        if not isinstance(arguments, dict):
            return None
        calls.append({"name": m.group(1), "arguments": json.dumps(arguments, ensure_ascii=False)})
        at = end
    return text[: first.start()].strip() or None, calls


def _pythonic_list(text: str) -> tuple[str | None, Calls] | None:
    """Gemma 3's documented call syntax: the whole answer is `[f(a=1, b="x"), g()]`."""
    body = text.strip()
    if not (body.startswith("[") and body.endswith(")]")):
        return None
    calls = []
    for part in _split_top_level(body[1:-1]):
        parsed = parse_python_call(part)
        if parsed is None:
            return None
        calls.append({"name": parsed[0], "arguments": json.dumps(parsed[1], ensure_ascii=False)})
    return (None, calls) if calls else None


def _split_top_level(text: str) -> list[str]:
    """`f(a=1), g(b=[1, 2])` -> the calls, split at commas outside brackets and strings."""
    parts, depth, quote, start, k = [], 0, "", 0, 0
    while k < len(text):
        c = text[k]
        if quote:
            if c == "\\":
                k += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:k])
            start = k + 1
        k += 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _mistral_call_id() -> str:
    # Mistral's templates refuse any call id that is not 9 alphanumerics
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ChatFamily:
    """What one model family writes back: its call syntax, forced-call frame and reasoning."""

    name: str
    models: str
    response_template: dict[str, Any] = field(repr=False)
    call_open: str = "<tool_call>\n"
    call_close: str = "\n</tool_call>"
    arguments_key: str = "arguments"
    reasoning: bool = False
    # end-of-turn tokens besides the tokenizer's eos (those the vocabulary has are stop tokens)
    end_of_turn: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
    mistral_ids: bool = False
    # the template renders tools itself; False: tools and calls are written into the model's own
    # turns (a template with no tool support), Hermes-style unless `calls_in_text` says otherwise
    native_tools: bool = True
    # (open, close) of the reasoning block: a forced call or response schema starts after it
    think: tuple[str, str] | None = None
    # calls the response template cannot read (a syntax that is not JSON between markers), tried
    # first: (content, calls), or None to leave the text to the response template
    parse_special: Callable[[str], tuple[str | None, Calls] | None] | None = field(default=None, repr=False)
    # the call's prefix names the tool (`[TOOL_CALLS]{name}[ARGS]`) and the JSON is its arguments
    named_prefix: str | None = None
    # the arguments are a Python call's keywords (`city="Paris"`), not a JSON object
    python_kwargs: bool = False

    def call_id(self) -> str:
        return _mistral_call_id() if self.mistral_ids else _openai_call_id()

    def call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        """The JSON schema of one forced call of `tool`, in the shape this family writes it."""
        fn = tool["function"]
        return {
            "type": "object",
            "properties": {
                "name": {"const": fn["name"]},
                self.arguments_key: fn.get("parameters") or {"type": "object"},
            },
            "required": ["name", self.arguments_key],
        }

    def call_shapes(self, tools: list[dict[str, Any]]) -> list[Shape]:
        """The grammar shapes of one call of any of `tools` (OpenAI function tools): one JSON shape
        naming the tool inside, or, for a syntax that names it outside the JSON, one per tool."""
        if self.named_prefix is not None:
            shapes: list[Shape] = []
            for t in tools:
                parameters = t["function"].get("parameters") or {"type": "object"}
                schema = python_kwargs_schema(parameters) if self.python_kwargs else json.dumps(parameters)
                shapes.append((self.named_prefix.format(name=t["function"]["name"]), schema, self.call_close))
            return shapes
        options = [self.call_schema(t) for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return [(self.call_open, json.dumps(schema), self.call_close)]


HERMES = ChatFamily("hermes", "Qwen2.5, SmolLM2, any ChatML model", _hermes_template(reasoning=False))
FAMILIES: dict[str, ChatFamily] = {
    f.name: f
    for f in (
        HERMES,
        ChatFamily(
            "qwen3",
            "Qwen3",
            _hermes_template(reasoning=True),
            reasoning=True,
            think=("<think>", "</think>\n\n"),
        ),
        ChatFamily(
            "llama3",
            "Llama 3.1, 3.2, 3.3",
            _LLAMA3_TEMPLATE,
            call_open="",
            call_close="",
            arguments_key="parameters",
            end_of_turn=("<|eot_id|>", "<|eom_id|>"),
            parse_special=_llama3_builtin,
        ),
        ChatFamily(
            "mistral",
            "Mistral 7B v0.3, Nemo, Small 3.0",
            _MISTRAL_TEMPLATE,
            call_open="[TOOL_CALLS][",
            call_close="]",
            end_of_turn=("</s>",),
            mistral_ids=True,
        ),
        ChatFamily(
            "mistral_v11",
            "Mistral Small 3.2, Magistral, Devstral, Ministral 3 (v11+ tokenizers)",
            {"start_anchor": PARSE_ANCHOR, "fields": {"content": _TEXT}},
            call_open="[TOOL_CALLS]",
            call_close="",
            end_of_turn=("</s>",),
            mistral_ids=True,
            parse_special=_mistral_args,
            named_prefix="[TOOL_CALLS]{name}[ARGS]",
        ),
        ChatFamily(
            "gemma3",
            "Gemma 3",
            {"start_anchor": PARSE_ANCHOR, "fields": {"content": _TEXT}},
            call_open="[",
            call_close=")]",
            end_of_turn=("<end_of_turn>", "<eos>"),
            native_tools=False,
            parse_special=_pythonic_list,
            named_prefix="[{name}(",
            python_kwargs=True,
        ),
    )
}


def detect_family(template: str | None) -> ChatFamily | None:
    """The family whose markers the chat template has, or None when none matches."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return FAMILIES["mistral_v11" if "[ARGS]" in t else "mistral"]
    if "<|start_header_id|>" in t and "tools" in t:
        return FAMILIES["llama3"]
    if "<start_of_turn>" in t:
        return FAMILIES["gemma3"]
    if "<tool_call>" in t:
        return FAMILIES["qwen3" if "<think>" in t else "hermes"]
    if "<|im_start|>" in t:  # ChatML with no tools: the built-in Hermes/ChatML template
        return HERMES
    return None


def family_named(name: str) -> ChatFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise InvalidFieldError("chat_format", name, f"known families: {sorted(FAMILIES)}") from None


def parse_calls(raw: Any) -> list[dict[str, Any]] | None:
    """OpenAI tool calls from the parser's `tool_calls`, or None when any is malformed."""
    calls = []
    for item in raw or []:
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return None
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append({"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)})
    return calls


__all__ = [
    "FAMILIES",
    "HERMES",
    "PARSE_ANCHOR",
    "ChatFamily",
    "Shape",
    "detect_family",
    "family_named",
    "parse_calls",
]
