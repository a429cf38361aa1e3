"""Model families: how each writes a tool call, frames a forced one, and marks its reasoning.

A family is detected from the tokenizer's own chat template (markers only that family's template
has) and can be named instead with `ModelConfig.chat_format`. Rendering always goes through a
chat template (`chat_format.py`); what differs per family is the text the model writes back:

| family  | models                         | a call as the model writes it                          |
|---------|--------------------------------|--------------------------------------------------------|
| hermes  | Qwen2.5, SmolLM2, the fallback | `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>` |
| qwen3   | Qwen3 (reasoning)              | `<think>..</think>` then Hermes calls                  |
| llama3  | Llama 3.1 / 3.2 / 3.3          | `{"name": .., "parameters": {..}}` (`<|python_tag|>` optional) |
| mistral | Mistral v0.3, Nemo, Small      | `[TOOL_CALLS][{"name": .., "arguments": {..}}]`        |
| gemma3  | Gemma 3 (no tools in template) | Hermes calls inside Gemma's own turns                   |

Parsing runs on transformers' declarative response parser (`transformers.utils.chat_parsing`),
the one transformers' own server uses, with a response template per family written here (the
ones transformers ships are private to its server and cover Qwen and Gemma 4 only).
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from journeyman.errors import InvalidFieldError

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
    # the template renders tools itself; False: tools and calls are written Hermes-style into the
    # model's own turns (a template with no tool support)
    native_tools: bool = True

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


HERMES = ChatFamily("hermes", "Qwen2.5, SmolLM2, any ChatML model", _hermes_template(reasoning=False))
FAMILIES: dict[str, ChatFamily] = {
    f.name: f
    for f in (
        HERMES,
        ChatFamily("qwen3", "Qwen3", _hermes_template(reasoning=True), reasoning=True),
        ChatFamily(
            "llama3",
            "Llama 3.1, 3.2, 3.3",
            _LLAMA3_TEMPLATE,
            call_open="",
            call_close="",
            arguments_key="parameters",
            end_of_turn=("<|eot_id|>", "<|eom_id|>"),
        ),
        ChatFamily(
            "mistral",
            "Mistral 7B v0.3, Nemo, Small",
            _MISTRAL_TEMPLATE,
            call_open="[TOOL_CALLS][",
            call_close="]",
            end_of_turn=("</s>",),
            mistral_ids=True,
        ),
        ChatFamily(
            "gemma3",
            "Gemma 3",
            _hermes_template(reasoning=False),
            end_of_turn=("<end_of_turn>", "<eos>"),
            native_tools=False,
        ),
    )
}


def detect_family(template: str | None) -> ChatFamily | None:
    """The family whose markers the chat template has, or None when none matches."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return FAMILIES["mistral"]
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


__all__ = ["FAMILIES", "HERMES", "PARSE_ANCHOR", "ChatFamily", "detect_family", "family_named", "parse_calls"]
