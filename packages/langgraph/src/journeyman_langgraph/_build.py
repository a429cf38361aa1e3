"""Captured calls to histories: a call that continues an earlier call's conversation joins its history.

"Continues" is decided on the messages (the earlier call's request, then its sampled answer), not on
token prefixes: the endpoint splices earlier sampled turns by their text, and when two concurrent
episodes sampled the same text as different token ids the splice may use the other's ids. The
conversation is still one history; the trainer then makes two rows of it, each call with the exact
prompt ids the engine saw, so nothing trained is re-tokenised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from journeyman import History, TokenRecord
from journeyman.capture import CapturedCall
from journeyman.chat_format import assistant_key, openai_message
from openai.types.chat.chat_completion import Choice


def _key(m: dict[str, Any]) -> str:
    """A message as the next request carries it: assistant turns by text and calls (ids may be rewritten)."""
    if m.get("role") == "assistant":
        return "assistant:" + assistant_key(m.get("content"), m.get("tool_calls"))
    return json.dumps(m, sort_keys=True, default=str)


@dataclass
class _Chain:
    items: list[dict[str, Any] | Choice] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    keys: list[str] = field(default_factory=list)  # the conversation so far, last answer included

    def continued_by(self, call: CapturedCall) -> bool:
        msgs = call.request_messages
        return (
            len(msgs) > len(self.keys)
            and [_key(m) for m in msgs[: len(self.keys)]] == self.keys
            and call.tools == self.tools
        )


def histories(calls: list[CapturedCall]) -> list[History]:
    """One History per conversation, in order of each conversation's first call.

    A call joins the latest history whose messages (answer included) its own request starts with;
    otherwise it starts a new one (a side conversation, or a fresh prompt of the same node).
    """
    chains: list[_Chain] = []
    for call in calls:
        raw = call.response["choices"][0]
        choice = Choice.model_validate(raw)
        TokenRecord.model_validate(raw["journeyman"])  # every trained choice carries its exact ids
        chain = next((c for c in reversed(chains) if c.continued_by(call)), None)
        if chain is None:
            chain = _Chain(tools=call.tools)
            chains.append(chain)
        new = call.request_messages[len(chain.keys) :]
        chain.items += [openai_message(m) for m in new]
        chain.items.append(choice)
        chain.keys += [_key(m) for m in new]
        chain.keys.append(_key(raw["message"]))
    return [History(messages_and_choices=c.items, tools=c.tools) for c in chains]
