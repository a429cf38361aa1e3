/** TrainableModel, the handle on a policy the server serves and trains, and Episode, one run of
 * an agent captured into a Trajectory. */

import { randomUUID } from "node:crypto";

import { CAPTURE_HEADER, type Inference, type RemoteBackend } from "./backend.js";
import { JourneymanError } from "./errors.js";
import { joinCalls } from "./histories.js";
import {
  type CapturedCall,
  type ModelConfig,
  type SFTConfig,
  type TrainConfig,
  type TrainResult,
  Trajectory,
  type TrajectoryGroup,
  rolloutException,
} from "./types.js";

export class TrainableModel implements ModelConfig {
  [key: string]: unknown;
  name: string;
  project: string;
  base_model?: string;
  lora?: Record<string, unknown>;
  max_tokens?: number;
  private _backend?: RemoteBackend;

  constructor(config: ModelConfig) {
    this.name = config.name;
    this.project = config.project;
    Object.assign(this, config);
  }

  /** Load (or resume) this model on `backend` and start serving it. */
  async register(backend: RemoteBackend): Promise<void> {
    await backend.register(this.config());
    this._backend = backend;
  }

  get backend(): RemoteBackend {
    if (!this._backend) {
      throw new JourneymanError(`model ${JSON.stringify(this.name)} is not registered: call \`await model.register(backend)\` first`);
    }
    return this._backend;
  }

  /** Base URL, key and model name for any OpenAI- or Anthropic-compatible client. */
  inference(): Inference {
    return this.backend.inference(this.name);
  }

  /** A new episode of this model (see `Episode`). */
  episode(): Episode {
    return new Episode(this);
  }

  getStep(): Promise<number> {
    return this.backend.getStep(this.name);
  }

  /** One GRPO-family step on `groups`; afterwards the endpoint serves the new step. */
  train(groups: TrajectoryGroup[], config?: TrainConfig, options: { idempotencyKey?: string } = {}): Promise<TrainResult> {
    return this.backend.train(this.name, groups, config, options.idempotencyKey);
  }

  /** Supervised fine-tuning on good trajectories (a warm start before RL), one step of this run. */
  trainSft(items: (Trajectory | TrajectoryGroup)[], config?: SFTConfig, options: { idempotencyKey?: string } = {}): Promise<TrainResult> {
    return this.backend.trainSft(this.name, items, config, options.idempotencyKey);
  }

  /** Record an evaluation (`split` "val": the history row gets `val/reward`) and extra metrics. */
  log(groups?: TrajectoryGroup[] | null, options: { split?: string; metrics?: Record<string, number> } = {}): Promise<Record<string, number>> {
    return this.backend.log(this.name, groups, options.split ?? "val", options.metrics);
  }

  history(): Promise<Record<string, unknown>[]> {
    return this.backend.history(this.name);
  }

  /** Serve checkpoint `step` (0 = the base model); serve the latest again before training. */
  serveStep(step: number): Promise<void> {
    return this.backend.serveStep(this.name, step);
  }

  /** Keep the best checkpoint by `bestCheckpointMetric` and the latest; the steps deleted. */
  deleteCheckpoints(bestCheckpointMetric = "val/reward"): Promise<number[]> {
    return this.backend.deleteCheckpoints(this.name, bestCheckpointMetric);
  }

  popCaptures(captureIds: string[]): Promise<Record<string, CapturedCall[]>> {
    return this.backend.popCaptures(this.name, captureIds);
  }

  get runDir(): string {
    return this.backend.runDir(this.name);
  }

  config(): ModelConfig {
    const { _backend, ...rest } = this as Record<string, unknown>;
    void _backend;
    return rest as unknown as ModelConfig;
  }

  toJSON(): ModelConfig {
    return this.config();
  }
}

/** One run of an agent, and the Trajectory it becomes.
 *
 * Every request the agent's client makes through `episode.fetch` (or with `episode.headers`) is
 * marked with this episode's capture id, and the server files the completions it serves under it;
 * `finish()` takes them off the server in one call and joins them (by token ids) into the
 * trajectory. No client is patched: pass the fetch or the headers to its constructor.
 *
 *     const episode = model.episode();
 *     const client = new OpenAI({ baseURL, apiKey, fetch: episode.fetch });
 *     ...run the agent...
 *     const trajectory = await episode.finish();
 *     trajectory.reward = score(answer);
 */
export class Episode {
  readonly id = randomUUID().replaceAll("-", "");
  readonly trajectory: Trajectory;
  private popped?: CapturedCall[];

  constructor(
    readonly model: TrainableModel,
    trajectory?: Trajectory,
  ) {
    this.trajectory = trajectory ?? new Trajectory();
  }

  /** The header that files a request under this episode: `{"x-journeyman-capture": id}`. */
  get headers(): Record<string, string> {
    return { [CAPTURE_HEADER]: this.id };
  }

  /** A `fetch` that adds this episode's header to every request (for any client's `fetch` option). */
  readonly fetch: typeof globalThis.fetch = (input, init) => {
    const headers = new Headers(init?.headers ?? (input instanceof Request ? input.headers : undefined));
    headers.set(CAPTURE_HEADER, this.id);
    return globalThis.fetch(input, { ...init, headers });
  };

  /** The calls the server filed for this episode, taken off it on the first call, in order. */
  async calls(): Promise<CapturedCall[]> {
    if (this.popped === undefined) {
      const filed = await this.model.popCaptures([this.id]);
      this.popped ??= filed[this.id] ?? [];
    }
    return this.popped;
  }

  /** Pop the calls, join them into histories by token ids, and put them on the trajectory: the
   * first trainable one as its conversation, the others in `additional_histories`. */
  async finish(): Promise<Trajectory> {
    const histories = joinCalls(await this.calls());
    const main = histories.find((h) => h.trainable);
    if (main) {
      this.trajectory.messages_and_choices = main.messages_and_choices;
      this.trajectory.tools = main.tools;
    }
    this.trajectory.additional_histories.push(...histories.filter((h) => h !== main));
    this.trajectory.metrics.errored ??= false;
    return this.trajectory;
  }

  /** Run `agent` in this episode (it gets the episode to build its clients with) and return the
   * trajectory; a run that throws is kept, with its error set and reward `errorReward`, unless
   * `onError` is "raise". */
  async run(
    agent: (episode: Episode) => Promise<number | void>,
    options: { onError?: "score" | "raise"; errorReward?: number } = {},
  ): Promise<Trajectory> {
    let reward: number | void;
    try {
      reward = await agent(this);
    } catch (e) {
      await this.calls(); // free what the server filed for it
      if (options.onError === "raise") throw e;
      await this.finish();
      this.trajectory.error = rolloutException(e);
      this.trajectory.reward = options.errorReward ?? 0;
      this.trajectory.metrics.errored = true;
      return this.trajectory;
    }
    await this.finish();
    if (typeof reward === "number") this.trajectory.reward = reward;
    return this.trajectory;
  }
}
