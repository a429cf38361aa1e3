"""Messages to token ids and sampled ids back to messages, for one tokenizer and its model family.

Two jobs, one place:
- `prompt_ids` renders an OpenAI message list (with tools) through a chat template and splices in
  the exact ids the engine sampled for earlier assistant turns wherever the template still shows
  that turn as sampled. A prefix-stable template (ChatML, Llama 3) then gives each call a prompt
  that starts with the previous call's prompt + completion, so a multi-turn run trains as one row.
  A template that rewrites history (Qwen3 drops reasoning before the latest user turn, Mistral
  moves the tool list to the latest user turn) gives prompts that do not extend each other; each
  such call is then its own row, trained on exactly the ids it was sampled from (`tokenize.py`).
- `parse` turns sampled ids into `content`, `reasoning_content` and OpenAI `tool_calls` in the
  family's syntax (`chat_families.py`). Malformed tool-call text stays content.

Which template renders: the model's own when it supports tools; for a ChatML model without tool
support, the built-in ChatML + Hermes template; for Gemma 3 (no tools in its template), its own
turns with Google's documented function-calling prompt and Python-style calls written into the
messages; for any other template without tool support, the same with Hermes-style tools and calls.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any

from journeyman.chat._pythonic import python_call
from journeyman.chat.families import (
    FAMILIES,
    HERMES,
    PARSE_ANCHOR,
    ChatFamily,
    detect_family,
    family_named,
    parse_calls,
)
from journeyman.chat.messages import Message, assistant_key
from journeyman.errors import ChatTemplateError, InvalidFieldError

log = logging.getLogger(__name__)

_HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query. You are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML "
    'tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


# What the renderer gives the template itself (besides special tokens and its own arguments): a
# request's `chat_template_kwargs` may not replace them (`{"raise_exception": 1}` broke the template).
_RENDERER_NAMES = frozenset(
    {"messages", "conversations", "raise_exception", "strftime_now", "namespace", "dict"}
    | {"range", "lipsum", "cycler", "joiner"}  # jinja's own globals
)


def builtin_template() -> str:
    return resources.files("journeyman").joinpath("templates/chatml_tools.jinja").read_text()


@dataclass(frozen=True)
class SampledTurn:
    token_ids: list[int]
    reasoning: str | None = None


class SampledTurns:
    """A bounded map from an assistant turn to the token ids the engine sampled for it.

    A turn with tool calls is found by its call ids first: they are unique per sample, while two
    concurrent rollouts of one scenario often write the same call text with different ids (a
    grammar admits several tokenisations), and the text alone would splice one rollout's ids into
    the other's history. The text key is the fallback, for frameworks that rewrite call ids.
    """

    def __init__(self, capacity_tokens: int = 2_000_000) -> None:
        self._turns: OrderedDict[str, tuple[str, SampledTurn]] = OrderedDict()
        self._capacity = capacity_tokens  # ~70 MB of ids; 64 rollouts of 14 turns hold ~200k
        self.tokens = 0
        self.evicted = 0  # turns dropped for room: a client sending one back gets a re-render

    def add(
        self,
        content: str | None,
        tool_calls: Sequence[dict[str, Any]] | None,
        token_ids: list[int],
        reasoning: str | None = None,
    ) -> None:
        key = assistant_key(content, tool_calls)
        for k in filter(None, (key, _call_ids_key(tool_calls))):
            old = self._turns.pop(k, None)
            if old is not None:
                self.tokens -= len(old[1].token_ids)
            self._turns[k] = (key, SampledTurn(token_ids, reasoning))
            self.tokens += len(token_ids)
        while self.tokens > self._capacity and self._turns:
            _, (_, turn) = self._turns.popitem(last=False)
            self.tokens -= len(turn.token_ids)
            self.evicted += 1

    def get(self, content: str | None, tool_calls: Sequence[dict[str, Any]] | None) -> SampledTurn | None:
        key = assistant_key(content, tool_calls)
        by_ids = self._turns.get(_call_ids_key(tool_calls) or "")
        if by_ids is not None and by_ids[0] == key:  # same ids and still the same text
            return by_ids[1]
        by_text = self._turns.get(key)
        return by_text[1] if by_text is not None else None


def _call_ids_key(tool_calls: Sequence[dict[str, Any]] | None) -> str | None:
    ids = [c.get("id") for c in tool_calls or []]
    return "ids:" + "\0".join(ids) if ids and all(ids) else None  # type: ignore[arg-type]


@dataclass
class ParsedTurn:
    """An assistant turn read back from sampled text."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]  # [{"name": .., "arguments": "<json>"}]


# Google's documented Gemma 3 function-calling prompt (ai.google.dev/gemma/docs/capabilities/function-calling)
_PYTHONIC_TOOLS = (
    "You have access to functions. If you decide to invoke any of the function(s),\n you MUST put it in "
    "the format of\n[func_name1(params_name1=params_value1, params_name2=params_value2...), "
    "func_name2(params)]\n\nYou SHOULD NOT include any other text in the response if you call a "
    "function\n{tools}"
)


def _hermes_call(call: dict[str, Any]) -> str:
    fn = call["function"]
    body = {"name": fn["name"], "arguments": fn["arguments"]}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def hermes_messages(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    """The conversation for a template with no tool support: tools after the system prompt, calls
    and tool results as Hermes text in the model's own assistant and user turns."""
    listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools or [])
    return _tools_as_text(
        messages,
        _HERMES_TOOLS.format(tools=listing) if tools else None,
        tools_first=False,
        calls=lambda calls: "\n".join(_hermes_call(c) for c in calls),
        result=lambda text: "<tool_response>\n" + text + "\n</tool_response>",
    )


def pythonic_messages(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    """The conversation for Gemma 3, whose template has no tools: Google's function-calling prompt
    with the tools' definitions before the system prompt, calls as the model's whole answer
    `[f(a="x"), g()]` (values as compact JSON, as the forced-call grammar writes them), results as
    a user turn of ```tool_output``` blocks (roles must alternate)."""
    listing = json.dumps([t.get("function", t) for t in tools or []], ensure_ascii=False, indent=2)
    return _tools_as_text(
        messages,
        _PYTHONIC_TOOLS.format(tools=listing) if tools else None,
        tools_first=True,
        calls=lambda calls: (
            "[" + ", ".join(python_call(c["function"]["name"], _arguments(c)) for c in calls) + "]"
        ),
        result=lambda text: "```tool_output\n" + text + "\n```",
    )


def _tools_as_text(
    messages: list[Message],
    block: str | None,
    *,
    tools_first: bool,
    calls: Callable[[list[dict[str, Any]]], str],
    result: Callable[[str], str],
) -> list[Message]:
    """A conversation for a template with no tool support, in a family's own text: the tools' `block`
    in the system turn (before its prompt, or after), an assistant turn's calls written by `calls`
    after its content, each tool result by `result` in a user turn."""
    out: list[Message] = []
    if block is not None:
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"]
            out.append(
                {
                    "role": "system",
                    "content": f"{block}\n\n{system}" if tools_first else f"{system}\n\n{block}",
                }
            )
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    previous = None
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            out.append({"role": "assistant", "content": "\n".join([*parts, calls(m["tool_calls"])])})
        elif m["role"] == "tool":
            _tool_result(out, previous, result(m["content"]))
        else:
            out.append(m)
        previous = m["role"]
    return out


def _tool_result(out: list[Message], previous: str | None, text: str) -> None:
    """A tool result as a user turn; consecutive results share one turn, as roles must alternate."""
    if previous == "tool":
        out[-1]["content"] += "\n" + text
    else:
        out.append({"role": "user", "content": text})


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    args = call["function"]["arguments"]
    return json.loads(args) if isinstance(args, str) else args


class ChatFormat:
    """The chat template and model family of one tokenizer."""

    def __init__(self, tokenizer: Any, family: str | None = None) -> None:
        self.tokenizer = tokenizer
        own: str | None = getattr(tokenizer, "chat_template", None)
        if not isinstance(own, str) or not own:
            raise ChatTemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "give the model directory a chat_template.jinja (or tokenizer_config.json chat_template)"
            )
        detected = detect_family(own)
        self.family: ChatFamily = family_named(family) if family is not None else (detected or HERMES)
        if family is None and detected is None:
            log.warning(
                "chat template of %r matches no known family (%s): tools and calls are written "
                "Hermes-style into its own turns; set chat_format= to name a family",
                getattr(tokenizer, "name_or_path", "?"),
                ", ".join(FAMILIES),
            )
        if self.family.native_tools and "tools" in own:
            self.template, self.rewrite_tools = own, False
        elif self.family.name == "hermes" and "<|im_start|>" in own:
            self.template, self.rewrite_tools = builtin_template(), False
        else:
            self.template, self.rewrite_tools = own, True
        spec = self.family.response_template
        self._parse_spec: dict[bool, dict[str, Any]] = {
            True: spec,
            False: {**spec, "fields": {k: v for k, v in spec["fields"].items() if k != "tool_calls"}},
        }
        self.eos_id: int = tokenizer.eos_token_id
        self.stop_ids: set[int] = {self.eos_id}
        for name in self.family.end_of_turn:
            tid = tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
                self.stop_ids.add(tid)
        self._check_renders_tools()

    def _check_renders_tools(self) -> None:
        """Render a tool round trip once, so a template that cannot fails here, by name, not mid-run."""
        call = {
            "id": self.family.call_id(),
            "type": "function",
            "function": {"name": "f", "arguments": {"x": 1}},
        }
        probe: list[Message] = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": '{"y": 2}', "tool_call_id": call["id"]},
            {"role": "assistant", "content": "a"},
        ]
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        try:
            text = self.render(probe, [tool], False)
        except Exception as e:  # jinja raises anything: raise_exception, TypeError, UndefinedError
            raise ChatTemplateError(
                f"the chat template ({self.family.name} family) cannot render a tool call and its result: "
                f"{type(e).__name__}: {e}; set chat_format= to another family"
            ) from e
        if '"x": 1' not in text and "x=1" not in text:
            raise ChatTemplateError(
                f"the chat template ({self.family.name} family) drops tool calls from the conversation; "
                "set chat_format= to another family"
            )

    # -- rendering ---------------------------------------------------------------------------------

    @cached_property
    def _renderer_names(self) -> frozenset[str]:
        own = inspect.signature(self.tokenizer.apply_chat_template).parameters
        specials = getattr(self.tokenizer, "special_tokens_map", {}) or {}
        return _RENDERER_NAMES | {n for n, p in own.items() if p.kind is not p.VAR_KEYWORD} | set(specials)

    @cached_property
    def _template_variables(self) -> frozenset[str] | None:
        """The names the template reads from its context; None when jinja cannot parse it here (a
        template with transformers' own tags)."""
        import jinja2
        import jinja2.meta
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        try:
            return frozenset(jinja2.meta.find_undeclared_variables(env.parse(self.template)))
        except jinja2.TemplateSyntaxError:
            return None

    def template_kwargs(
        self, kwargs: Mapping[str, Any] | None, field: str = "chat_template_kwargs"
    ) -> dict[str, Any]:
        """The template variables a request sets (vLLM's `chat_template_kwargs`, e.g.
        `{"enable_thinking": false}`): a name the renderer sets itself (its arguments, a special
        token, a helper) is refused; a name the template never reads is dropped, as it changes nothing."""
        out: dict[str, Any] = {}
        for name, value in (kwargs or {}).items():
            if name in self._renderer_names:
                raise InvalidFieldError(f"{field}.{name}", value, "is set by the chat template's renderer")
            variables = self._template_variables
            if variables is None or name in variables:
                out[name] = value
        return out

    def render(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the template writes it (transformers' renderer, our template choice)."""
        if self.rewrite_tools:
            rewrite = pythonic_messages if self.family.python_kwargs else hermes_messages
            messages, tools = rewrite(messages, tools), None
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **dict(template_kwargs or {}),
            )
        except Exception as e:
            if type(e).__name__ == "TemplateError":  # the template's raise_exception: a bad conversation
                raise InvalidFieldError("messages", None, f"the chat template refused them: {e}") from e
            if template_kwargs:  # a variable of the wrong type for the template (`date_string: 3`)
                raise InvalidFieldError(
                    "chat_template_kwargs",
                    dict(template_kwargs),
                    f"the chat template failed with them: {type(e).__name__}: {e}",
                ) from e
            raise

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
        sampled: SampledTurns | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], int]:
        """Token ids of the prompt, and how many assistant turns were spliced from sampled ids.

        The conversation is rendered once; each earlier assistant turn whose sampled text the render
        still shows (found where the template puts that turn, else searched after the previous
        one) contributes its sampled ids, the text around it is encoded.
        """
        turns: list[tuple[int, SampledTurn]] = []
        if sampled is not None:
            for k, m in enumerate(messages):
                turn = sampled.get(m["content"], m.get("tool_calls")) if m["role"] == "assistant" else None
                if turn is not None:
                    turns.append((k, turn))
                    if turn.reasoning and not m.get("reasoning_content"):
                        # clients drop the field; the template needs it to show the turn as sampled
                        messages = [
                            *messages[:k],
                            {**m, "reasoning_content": turn.reasoning},
                            *messages[k + 1 :],
                        ]
        text = self.render(messages, tools, add_generation_prompt, template_kwargs)
        ids: list[int] = []
        cursor = spliced = 0
        for k, turn in turns:
            found = self._locate(text, cursor, messages[:k], tools, template_kwargs, turn.token_ids)
            if found is None:
                continue  # the template shows this turn otherwise (reasoning dropped, ids added)
            at, length, turn_ids = found
            ids += self.encode(text[cursor:at]) + turn_ids
            cursor = at + length
            spliced += 1
        ids += self.encode(text[cursor:])
        return ids, spliced

    def _locate(
        self,
        text: str,
        cursor: int,
        before: list[Message],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        token_ids: list[int],
    ) -> tuple[int, int, list[int]] | None:
        """(position, length, ids) of a sampled turn in the rendered text, with or without its stop token."""
        try:  # nothing before the turn renders nothing to anchor on (and transformers refuses it)
            header = self.render(before, tools, True, template_kwargs) if before else None
        except InvalidFieldError:  # a template that refuses a partial conversation: search only
            header = None
        candidates = [token_ids]
        if token_ids and token_ids[-1] in self.stop_ids:
            candidates.append(token_ids[:-1])  # the template ends the turn with another stop token
        for ids in candidates:
            turn_text = self.decode(ids)
            if not turn_text:
                continue
            if (
                header is not None
                and len(header) >= cursor
                and text.startswith(header)
                and text.startswith(turn_text, len(header))
            ):
                return len(header), len(turn_text), ids
            at = text.find(turn_text, cursor)
            if at >= 0:
                return at, len(turn_text), ids
        return None

    # -- parsing -----------------------------------------------------------------------------------

    def completion_text(self, token_ids: Sequence[int]) -> str:
        """The sampled text with special tokens (the family's markers) and without the final stop token."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def parse(self, text: str, tools: bool = True) -> ParsedTurn:
        """Content, reasoning and tool calls of sampled text (calls only when the request offered
        tools); malformed tool-call text stays content."""
        if not tools and not self.family.reasoning:
            return ParsedTurn(text, None, [])
        special = self.family.parse_special(text) if tools and self.family.parse_special else None
        if special is not None:
            return ParsedTurn(special[0], None, special[1])
        try:
            parsed = self.tokenizer.parse_response(text, self._parse_spec[tools], prefix=PARSE_ANCHOR)
        except (ValueError, KeyError):  # the parser's word for malformed JSON or a missing key
            parsed = {}
        reasoning = parsed.get("reasoning_content")
        answer = text.split("</think>", 1)[-1].lstrip("\n") if reasoning is not None else text
        calls = parse_calls(parsed.get("tool_calls"))
        if not calls:  # none, or a malformed one: the text stays the answer
            return ParsedTurn(answer, reasoning, [])
        content = (parsed.get("content") or "").strip() or None
        return ParsedTurn(content, reasoning, calls)
