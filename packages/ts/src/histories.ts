/** Captured calls to histories, by the server's one rule (`journeyman.rollout.histories`): a call
 * continues a history when that history's last prompt ids + sampled ids are a prefix of the call's
 * prompt ids. Token ids, not messages: two rollouts of one scenario often write the same text with
 * different ids, and only their ids tell their histories apart. A call that continues nothing but
 * asks exactly what a history's last call asked is a retry: it takes that call's place, and the
 * earlier answer becomes a history of its own, superseded and untrained. */

import { InvalidFieldError } from "./errors.js";
import type { CapturedCall, Choice, History, Message, MessageOrChoice, TokenRecord } from "./types.js";

interface Step {
  call: CapturedCall;
  choice: Choice;
  record: TokenRecord;
}

interface Thread {
  steps: Step[];
  superseded: boolean;
}

/** Whether `seq` starts with `prefix` (equal sequences included). */
export function extendsIds(prefix: readonly number[], seq: readonly number[]): boolean {
  if (seq.length < prefix.length) return false;
  for (let i = 0; i < prefix.length; i++) if (prefix[i] !== seq[i]) return false;
  return true;
}

function sameIds(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && extendsIds(a, b);
}

/** The histories of `calls` (in the order served), each in order of its first call. */
export function joinCalls(calls: readonly CapturedCall[]): History[] {
  const threads: Thread[] = [];
  calls.forEach((call, i) => {
    const choice = call.response?.choices?.[0];
    if (!choice?.journeyman) {
      throw new InvalidFieldError(
        `calls[${i}].response.choices[0].journeyman`,
        null,
        "a call served by the Journeyman endpoint carries its token record",
      );
    }
    const step: Step = { call, choice, record: choice.journeyman };
    const mine = [...threads].reverse();
    let thread = mine.find((t) => {
      const last = t.steps[t.steps.length - 1].record;
      return extendsIds([...last.prompt_token_ids, ...last.token_ids], step.record.prompt_token_ids);
    });
    if (thread) {
      thread.superseded = false;
    } else {
      thread = mine.find((t) =>
        sameIds(t.steps[t.steps.length - 1].record.prompt_token_ids, step.record.prompt_token_ids),
      );
      if (thread) {
        threads.push({ steps: [thread.steps.pop()!], superseded: true });
      } else {
        thread = { steps: [], superseded: false };
        threads.push(thread);
      }
    }
    thread.steps.push(step);
  });
  threads.sort((a, b) => calls.indexOf(a.steps[0].call) - calls.indexOf(b.steps[0].call));
  return threads.map(history);
}

function history(thread: Thread): History {
  const items: MessageOrChoice[] = [];
  let prev: Step | undefined;
  for (const step of thread.steps) {
    const request = step.call.request_messages;
    // a continuing call repeats the history: skip its messages and the answer the choice stands for
    const added = prev === undefined ? request : request.slice(prev.call.request_messages.length + 1);
    items.push(...added.map(openaiMessage), step.choice);
    prev = step;
  }
  return { messages_and_choices: items, tools: thread.steps[0].call.tools ?? null, trainable: !thread.superseded };
}

/** A filed message in the shape OpenAI sends it: tool-call arguments as a JSON string. */
function openaiMessage(m: Message): Message {
  const calls = m.tool_calls as { function: { name: string; arguments: unknown } }[] | undefined;
  if (!calls?.length) return { ...m };
  return {
    ...m,
    tool_calls: calls.map((c) => ({
      ...c,
      function: {
        name: c.function.name,
        arguments: typeof c.function.arguments === "string" ? c.function.arguments : JSON.stringify(c.function.arguments),
      },
    })),
  };
}
