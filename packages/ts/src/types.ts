/** The data that crosses the wire, as `docs/protocol.md` (and the server's OpenAPI document) has it. */

/** The token record the server attaches to each completion (`journeyman` on a chat choice). */
export interface TokenRecord {
  prompt_token_ids: number[];
  token_ids: number[];
  logprobs: number[];
  model: string;
  step: number;
  finish_reason: "stop" | "length" | "tool_calls";
  spliced_turns: number;
}

/** An OpenAI chat message (plain object). */
export type Message = Record<string, unknown> & { role: string };

/** A chat-completion choice as the server sent it: its message, finish reason and record. */
export interface Choice {
  index: number;
  message: Message;
  finish_reason: string;
  journeyman: TokenRecord;
  [key: string]: unknown;
}

export type MessageOrChoice = Message | Choice;

/** One served call, as the server filed it under a capture id. */
export interface CapturedCall {
  request_messages: Message[];
  tools?: Record<string, unknown>[] | null;
  response: { choices: Choice[]; [key: string]: unknown };
  response_id?: string | null;
}

export interface History {
  messages_and_choices: MessageOrChoice[];
  tools: Record<string, unknown>[] | null;
  trainable: boolean;
}

/** What a rollout that threw leaves on its group. */
export interface RolloutException {
  type: string;
  message: string;
  traceback: string;
}

/** The model to register: `name` and `project`, the rest as the server defaults them. */
export interface ModelConfig {
  name: string;
  project: string;
  base_model?: string;
  lora?: Record<string, unknown>;
  max_tokens?: number;
  [key: string]: unknown;
}

/** GRPO settings (`TrainConfig` on the server), snake_case as they travel. */
export interface TrainConfig {
  learning_rate?: number;
  loss?: string;
  kl_coef?: number;
  /** A step with no learning signal: "skip" (the result says so and why) or "error". */
  on_no_signal?: "skip" | "error";
  [key: string]: unknown;
}

export interface SFTConfig {
  learning_rate?: number;
  epochs?: number;
  [key: string]: unknown;
}

export interface TrainResult {
  step: number;
  metrics: Record<string, number>;
  /** No group carried a learning signal: nothing trained, `step` unchanged. */
  skipped: boolean;
  /** Why the step was skipped, and what to change (null when it trained). */
  skip_reason?: string | null;
}

/** One run of an agent: its conversation (messages and recorded choices), tools, reward. */
export class Trajectory {
  messages_and_choices: MessageOrChoice[];
  tools: Record<string, unknown>[] | null;
  trainable = true;
  reward: number;
  metrics: Record<string, number | boolean>;
  metadata: Record<string, unknown>;
  logs: string[] = [];
  additional_histories: History[];
  error: RolloutException | null = null;

  constructor(init: Partial<Omit<Trajectory, "records" | "messages" | "toJSON">> = {}) {
    this.messages_and_choices = init.messages_and_choices ?? [];
    this.tools = init.tools ?? null;
    this.reward = init.reward ?? 0;
    this.metrics = init.metrics ?? {};
    this.metadata = init.metadata ?? {};
    this.additional_histories = init.additional_histories ?? [];
    if (init.trainable !== undefined) this.trainable = init.trainable;
    if (init.logs !== undefined) this.logs = init.logs;
    if (init.error !== undefined) this.error = init.error;
  }

  /** The token records of its choices, in order. */
  records(): TokenRecord[] {
    return this.messages_and_choices.filter(isChoice).map((c) => c.journeyman);
  }

  /** Its conversation as plain chat messages (a choice as its assistant message). */
  messages(): Message[] {
    return this.messages_and_choices.map((m) => (isChoice(m) ? { ...m.message, role: "assistant" } : m));
  }

  toJSON(): Record<string, unknown> {
    return {
      messages_and_choices: this.messages_and_choices,
      tools: this.tools,
      trainable: this.trainable,
      reward: this.reward,
      metrics: this.metrics,
      metadata: this.metadata,
      logs: this.logs,
      additional_histories: this.additional_histories,
      error: this.error,
    };
  }
}

/** Runs of the same task, whose rewards are compared. */
export class TrajectoryGroup {
  trajectories: Trajectory[];
  exceptions: RolloutException[];
  metadata: Record<string, unknown>;

  constructor(
    trajectories: Trajectory[] = [],
    init: { exceptions?: RolloutException[]; metadata?: Record<string, unknown> } = {},
  ) {
    this.trajectories = trajectories;
    this.exceptions = init.exceptions ?? [];
    this.metadata = init.metadata ?? {};
  }

  rewards(): number[] {
    return this.trajectories.map((t) => t.reward);
  }

  toJSON(): Record<string, unknown> {
    return { trajectories: this.trajectories, exceptions: this.exceptions, metadata: this.metadata };
  }
}

export function isChoice(item: MessageOrChoice): item is Choice {
  return typeof item === "object" && item !== null && "journeyman" in item && "message" in item;
}

export function rolloutException(error: unknown): RolloutException {
  const e = error instanceof Error ? error : new Error(String(error));
  return { type: e.name, message: e.message, traceback: e.stack ?? "" };
}
