"""Captured calls to histories: which call continues which conversation, decided in one place.

The rule. A call continues a history when the history's last prompt ids + sampled ids are a prefix
of the call's prompt ids (`extends`). The endpoint splices earlier sampled turns back by their
exact ids (found by tool-call ids first), so a tool loop is one token sequence, and the trainer
(`tokenize`) makes one row of it by the same predicate. Token ids, not messages, because two
rollouts of one scenario often write the same call text with different ids: their next requests
carry equal messages, and a message-level join would hand one rollout's call to the other's
history (the splice bug); their prompt ids still differ, so each joins its own.

The fallback, for foreign calls only (e.g. Langfuse traces of another stack, which carry no token
records): the message keys of the history so far (`messages.message_key`, its last answer
included) are a prefix of the call's request, and the tools are equal. A call with a record never
joins a history without one, nor the reverse.

Around the rule:
- Partitions: the caller gives each call a key (the agent, the trace); calls of different
  partitions never join. Among candidates the latest history of the partition wins.
- Retries: a call that continues nothing but asks exactly what a history's last call asked (same
  prompt ids; foreign: same messages and tools) is a client retry. It takes the earlier call's
  place, and the superseded call becomes a history of its own, `superseded` and untrained: its
  answer never reached the agent, so the reward says nothing about it. It is never merged into
  the retried one. Should a later call continue it after all (two rollouts that share a prompt
  sampled in one capture), it is an ordinary history again.
- A call that continues nothing else starts a history (a fresh prompt, a side task, a handoff to
  an agent with its own system prompt).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from openai.types.chat.chat_completion import Choice

from journeyman.chat.messages import Message, message_key, openai_message
from journeyman.data.types import History, TokenRecord, Tool, Trajectory, record_of
from journeyman.errors import InvalidFieldError
from journeyman.rollout.capture import CapturedCall

T = TypeVar("T")


def extends(prefix: Sequence[T], seq: Sequence[T]) -> bool:
    """Whether `seq` starts with `prefix` (equal sequences included): the one continuation test."""
    n = len(prefix)
    return len(seq) >= n and list(seq[:n]) == list(prefix)


@dataclass
class CallHistory:
    """One conversation rebuilt from captured calls, with what the join knows about it."""

    partition: Hashable
    items: list[Message | Choice]
    """Plain OpenAI messages for what each call added to the request, then the call's Choice
    (carrying its token record)."""
    tools: list[Tool] | None
    calls: list[int]
    """Indexes, into the calls given to `join_calls`, of this history's calls, in order."""
    trainable: bool
    superseded: bool = False
    """A retried call's earlier answer, which the client never used (never main, never trained)."""

    def history(self) -> History:
        return History(messages_and_choices=self.items, tools=self.tools, trainable=self.trainable)


@dataclass
class _Step:
    index: int
    call: CapturedCall
    choice: Choice
    record: TokenRecord | None
    keys: list[str]  # message keys of the request, then of the answer (foreign calls only)

    def continued_by(self, step: _Step) -> bool:
        if self.record is not None and step.record is not None:
            done = [*self.record.prompt_token_ids, *self.record.token_ids]
            return extends(done, step.record.prompt_token_ids)
        if self.record is None and step.record is None:
            return step.call.tools == self.call.tools and extends(self.keys, step.keys[:-1])
        return False

    def same_request(self, step: _Step) -> bool:
        if self.record is not None and step.record is not None:
            return self.record.prompt_token_ids == step.record.prompt_token_ids
        if self.record is None and step.record is None:
            return step.call.tools == self.call.tools and self.keys[:-1] == step.keys[:-1]
        return False


@dataclass
class _Thread:
    partition: Hashable
    steps: list[_Step] = field(default_factory=list)
    superseded: bool = False


def _step(i: int, call: CapturedCall, exact: bool) -> _Step:
    choices = call.response.get("choices") or []
    if not choices:
        raise InvalidFieldError(f"calls[{i}].response.choices", choices, "a served call has a choice")
    raw = choices[0]
    choice = Choice.model_validate(raw)
    record = record_of(choice)
    if record is None and exact:
        raise InvalidFieldError(
            f"calls[{i}].response.choices[0].journeyman",
            None,
            "a call served by the Journeyman endpoint carries its token record; "
            "pass exact=False to join foreign calls by their messages",
        )
    keys = []
    if record is None:
        keys = [message_key(m) for m in call.request_messages]
        keys.append(message_key({**raw["message"], "role": "assistant"}))
    return _Step(i, call, choice, record, keys)


def _call_history(thread: _Thread, trained: Collection[Hashable] | None) -> CallHistory:
    items: list[Message | Choice] = []
    prev: _Step | None = None
    for step in thread.steps:
        request = step.call.request_messages
        # a continuing call repeats the history: skip its messages and the answer the Choice stands for
        new = request if prev is None else request[len(prev.call.request_messages) + 1 :]
        items += [openai_message(m) for m in new]
        items.append(step.choice)
        prev = step
    trainable = not thread.superseded and (trained is None or thread.partition in trained)
    return CallHistory(
        partition=thread.partition,
        items=items,
        tools=thread.steps[0].call.tools,
        calls=[s.index for s in thread.steps],
        trainable=trainable,
        superseded=thread.superseded,
    )


def join_calls(
    calls: Sequence[CapturedCall],
    partition: Sequence[Hashable] | None = None,
    *,
    trained: Collection[Hashable] | None = None,
    exact: bool = True,
) -> list[CallHistory]:
    """The histories of `calls` (in the order they were served), in order of each one's first call.

    `partition` gives one key per call (None: all calls in one); calls of different keys never
    join. `trained` names the partitions whose histories are trainable (None: all). `exact=True`
    refuses a call without its token record (the endpoint always attaches one); `exact=False`
    admits foreign calls, joined by their messages.
    """
    keys: Sequence[Hashable] = [None] * len(calls) if partition is None else partition
    if len(keys) != len(calls):
        raise InvalidFieldError("partition", f"{len(keys)} keys", f"give one key per call ({len(calls)})")
    threads: list[_Thread] = []
    for i, (call, key) in enumerate(zip(calls, keys, strict=True)):
        step = _step(i, call, exact)
        mine = [t for t in reversed(threads) if t.partition == key]
        thread = next((t for t in mine if t.steps[-1].continued_by(step)), None)
        if thread is not None:
            thread.superseded = False
        else:
            thread = next((t for t in mine if t.steps[-1].same_request(step)), None)
            if thread is not None:  # a retry: the earlier call leaves, the retried one takes its place
                threads.append(_Thread(key, [thread.steps.pop()], superseded=True))
            else:
                thread = _Thread(key)
                threads.append(thread)
        thread.steps.append(step)
    threads.sort(key=lambda t: t.steps[0].index)
    return [_call_history(t, trained) for t in threads]


def main_first(histories: Sequence[CallHistory]) -> list[CallHistory]:
    """The main history (the first trainable one) first, then the others in order."""
    main = next((h for h in histories if h.trainable), None)
    return [h for h in histories if h is main] + [h for h in histories if h is not main]


def histories_of(
    calls: Sequence[CapturedCall],
    partition: Sequence[Hashable] | None = None,
    *,
    trained: Collection[Hashable] | None = None,
    exact: bool = True,
) -> list[History]:
    """`join_calls` as `History` objects, the main history first."""
    return [h.history() for h in main_first(join_calls(calls, partition, trained=trained, exact=exact))]


def fill_histories(trajectory: Trajectory, histories: Sequence[CallHistory]) -> Trajectory:
    """Put `histories` on `trajectory`: the main one (the first trainable) as its conversation and
    tools, the others appended to its `additional_histories`; with no trainable history its
    conversation is left as it is. Returns `trajectory`."""
    ordered = main_first(histories)
    main = ordered[0] if ordered and ordered[0].trainable else None
    others = ordered[1:] if main is not None else ordered
    if main is not None:
        trajectory.messages_and_choices = main.items
        trajectory.tools = main.tools
    trajectory.additional_histories = [*trajectory.additional_histories, *(h.history() for h in others)]
    return trajectory


def trajectory_of(histories: Sequence[CallHistory], **fields: Any) -> Trajectory:
    """A Trajectory whose conversation is the main history (the first trainable one), the others
    kept as `additional_histories`; with no trainable history it has no messages of its own.
    `fields` are further Trajectory fields (reward, metadata, ...)."""
    return fill_histories(Trajectory(**fields), histories)


__all__ = [
    "CallHistory",
    "extends",
    "fill_histories",
    "histories_of",
    "join_calls",
    "main_first",
    "trajectory_of",
]
