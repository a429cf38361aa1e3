"""Messages to token ids and sampled text back to messages, for one tokenizer.

Two jobs, one place:
- `prompt_ids` renders an OpenAI message list (with tools) through the chat template, one message at
  a time, and splices in the exact ids the engine sampled for earlier assistant turns. The model
  then sees precisely what it generated, and each call's prompt starts with the previous call's
  prompt + completion, so a multi-turn run trains as one sequence with no re-tokenisation drift.
- `parse_completion` turns generated text into `content` + OpenAI `tool_calls` (Hermes-style
  `<tool_call>{"name": .., "arguments": ..}</tool_call>`). Malformed tool-call text stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from importlib import resources
from typing import Any

from .errors import InvalidFieldError
from .messages import assistant_key

# How a forced tool call is framed (the template renders past calls the same way).
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def builtin_template() -> str:
    return resources.files("journeyman").joinpath("templates/chatml_tools.jinja").read_text()


class SampledTurns:
    """A bounded map from an assistant turn to the token ids the engine sampled for it.

    A turn with tool calls is found by its call ids first: they are unique per sample, while two
    concurrent rollouts of one scenario often write the same call text with different ids (a
    grammar admits several tokenisations), and the text alone would splice one rollout's ids into
    the other's history. The text key is the fallback, for frameworks that rewrite call ids.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        self._turns: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()
        self._capacity = capacity

    def add(
        self, content: str | None, tool_calls: Sequence[dict[str, Any]] | None, token_ids: list[int]
    ) -> None:
        key = assistant_key(content, tool_calls)
        for k in filter(None, (key, _call_ids_key(tool_calls))):
            self._turns[k] = (key, token_ids)
            self._turns.move_to_end(k)
        while len(self._turns) > self._capacity:
            self._turns.popitem(last=False)

    def get(self, content: str | None, tool_calls: Sequence[dict[str, Any]] | None) -> list[int] | None:
        key = assistant_key(content, tool_calls)
        by_ids = self._turns.get(_call_ids_key(tool_calls) or "")
        if by_ids is not None and by_ids[0] == key:  # same ids and still the same text
            return by_ids[1]
        by_text = self._turns.get(key)
        return by_text[1] if by_text is not None else None


def _call_ids_key(tool_calls: Sequence[dict[str, Any]] | None) -> str | None:
    ids = [c.get("id") for c in tool_calls or []]
    return "ids:" + "\0".join(ids) if ids and all(ids) else None  # type: ignore[arg-type]


def parse_completion(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into (content, tool_calls). Malformed tool-call text stays as content."""
    blocks = list(_TOOL_CALL.finditer(text))
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    content = _TOOL_CALL.sub("", text).strip()
    return (content or None), calls


def _raise(message: str) -> None:
    raise InvalidFieldError("messages", None, message)


def _jinja_env() -> Any:
    # The same settings transformers uses for chat templates; our own so that an empty
    # conversation (the system turn alone) renders too.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    return env


class ChatFormat:
    """The chat template of one tokenizer, with Hermes-style tools when its own template has none."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.template: str = own if own and "tools" in own else builtin_template()
        self._compiled = _jinja_env().from_string(self.template)
        self.eos_text: str = tokenizer.eos_token
        self.eos_id: int = tokenizer.eos_token_id
        self.stop_ids: set[int] = {self.eos_id}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
                self.stop_ids.add(tid)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        return self._compiled.render(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token or "",
            eos_token=self.eos_text,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        sampled: SampledTurns | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[list[int], int]:
        """Token ids of the prompt, and how many assistant turns were spliced from sampled ids."""
        start = 1 if messages[0]["role"] == "system" else 0
        prev = self.render(messages[:start], tools, False) if start else self.render([], tools, False)
        ids = self.encode(prev)
        spliced = 0
        for k in range(start, len(messages)):
            full = self.render(messages[: k + 1], tools, False)
            if not full.startswith(prev):  # a template that is not prefix-stable: no splicing possible
                text = self.render(messages, tools, add_generation_prompt)
                return self.encode(text), 0
            segment = full[len(prev) :]
            msg = messages[k]
            turn = (
                sampled.get(msg["content"], msg.get("tool_calls"))
                if sampled and msg["role"] == "assistant"
                else None
            )
            if turn is not None:
                header = self.render(messages[:k], tools, True)[len(prev) :]
                end = segment.rfind(self.eos_text)
                if segment.startswith(header) and end >= 0:
                    body = turn if turn and turn[-1] in self.stop_ids else [*turn, self.eos_id]
                    ids += self.encode(header) + body + self.encode(segment[end + len(self.eos_text) :])
                    spliced += 1
                    prev = full
                    continue
            ids += self.encode(segment)
            prev = full
        if add_generation_prompt:
            ids += self.encode(self.render(messages, tools, True)[len(prev) :])
        return ids, spliced
