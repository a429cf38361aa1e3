/** RemoteBackend: the Backend protocol as a client of `journeyman serve` (docs/protocol.md).
 *
 * Every call has a timeout. A connection the server refuses or drops is retried with backoff for up
 * to `reconnectMs` (a server being restarted), then `BackendUnavailableError`. Training is safe to
 * retry: each call carries an idempotency key, the server keeps running a step whose client went
 * away, and the client reattaches to it. Calls that are not idempotent (popping captures, logging,
 * deleting checkpoints) are retried only when the request never reached the server. */

import { randomUUID } from "node:crypto";
import { gzipSync } from "node:zlib";

import {
  AuthenticationError,
  BackendUnavailableError,
  InvalidFieldError,
  ProtocolMismatchError,
  RemoteError,
  UnknownModelError,
} from "./errors.js";
import type { CapturedCall, ModelConfig, SFTConfig, TrainConfig, TrainResult } from "./types.js";
import type { Trajectory, TrajectoryGroup } from "./types.js";

/** The Backend protocol version this client speaks (`PROTOCOL_VERSION` on the server). */
export const PROTOCOL_VERSION = 5;
export const PREFIX = "/journeyman/v1";
export const CAPTURE_HEADER = "x-journeyman-capture";

export interface RemoteBackendOptions {
  /** The token `journeyman serve` printed (default: $JOURNEYMAN_TOKEN). */
  token?: string;
  /** The longest one request may take, ms (default 120 s). */
  timeoutMs?: number;
  /** How long to keep retrying a server that does not answer, ms (default 120 s). */
  reconnectMs?: number;
  /** Told of training progress: (done, total). */
  onProgress?: (done: number, total: number) => void;
}

/** Where a model is served: an OpenAI (and Anthropic) compatible base URL, its key, its name. */
export interface Inference {
  /** `http://host:port/v1`: for the OpenAI clients. Anthropic's SDK takes the origin (`url`). */
  baseURL: string;
  /** The server's origin, for clients that add `/v1/...` themselves (Anthropic's). */
  url: string;
  apiKey: string;
  model: string;
}

interface ServerInfo {
  journeyman: string;
  protocol: number;
  models: string[];
}

interface TrainEvent {
  kind: "progress" | "result" | "error";
  done?: number;
  total?: number;
  result?: TrainResult | null;
  error?: { type?: string; message?: string; param?: string | null; value?: string; reason?: string } | null;
}

/** A failure of the transport (no answer), as opposed to an answer that is an error. */
class TransportFailure extends Error {
  constructor(
    readonly sent: boolean,
    cause: unknown,
  ) {
    super(cause instanceof Error ? `${cause.name}: ${cause.message}` : String(cause), { cause });
  }
}

export class RemoteBackend {
  readonly url: string;
  readonly timeoutMs: number;
  readonly reconnectMs: number;
  onProgress?: (done: number, total: number) => void;
  private readonly token: string;
  private checked = false;
  private readonly runDirs = new Map<string, string>();

  constructor(url: string, options: RemoteBackendOptions = {}) {
    if (typeof url !== "string" || !/^https?:\/\//.test(url)) {
      throw new InvalidFieldError("url", url, "use the http(s) URL `journeyman serve` printed");
    }
    const token = options.token ?? process.env.JOURNEYMAN_TOKEN;
    if (!token) {
      throw new InvalidFieldError("token", null, "pass { token } or set $JOURNEYMAN_TOKEN (journeyman serve prints it)");
    }
    this.url = url.replace(/\/+$/, "");
    this.token = token;
    this.timeoutMs = options.timeoutMs ?? 120_000;
    this.reconnectMs = options.reconnectMs ?? 120_000;
    this.onProgress = options.onProgress;
  }

  // -- transport ---------------------------------------------------------------------------------

  private async request(method: string, path: string, body?: unknown, gzip = false): Promise<Response> {
    const headers: Record<string, string> = { authorization: `Bearer ${this.token}` };
    let content: Uint8Array | string | undefined;
    if (body !== undefined) {
      headers["content-type"] = "application/json";
      const json = JSON.stringify(body);
      content = gzip ? gzipSync(json, { level: 5 }) : json;
      if (gzip) headers["content-encoding"] = "gzip";
    }
    try {
      return await fetch(this.url + path, {
        method,
        headers,
        body: content,
        signal: AbortSignal.timeout(this.timeoutMs),
      });
    } catch (e) {
      // fetch says "fetch failed" with the cause; a refused connection never reached the server
      const code = (e as { cause?: { code?: string } }).cause?.code;
      throw new TransportFailure(!(code === "ECONNREFUSED" || code === "ENOTFOUND"), e);
    }
  }

  /** `attempt()` until it gets an answer; transport failures retried with backoff (any failure
   * when `idempotent`, else only those that never reached the server). */
  private async retrying<T>(attempt: () => Promise<T>, idempotent: boolean): Promise<T> {
    const deadline = Date.now() + this.reconnectMs;
    let delay = 200;
    for (;;) {
      try {
        return await attempt();
      } catch (e) {
        if (!(e instanceof TransportFailure) || (e.sent && !idempotent)) {
          if (e instanceof TransportFailure) throw new BackendUnavailableError(`${this.url}: ${e.message}`, { cause: e });
          throw e;
        }
        if (Date.now() + delay > deadline) {
          throw new BackendUnavailableError(
            `${this.url} did not answer for ${Math.round(this.reconnectMs / 1000)} s (${e.message}); ` +
              "is `journeyman serve` running there?",
            { cause: e },
          );
        }
        await new Promise((r) => setTimeout(r, delay));
        delay = Math.min(delay * 2, 5000);
      }
    }
  }

  private async raiseFor(r: Response): Promise<void> {
    if (r.status < 400) return;
    const text = await r.text();
    let err: Record<string, unknown> = {};
    try {
      err = (JSON.parse(text) as { error?: Record<string, unknown> }).error ?? {};
    } catch {
      err = { message: text.slice(0, 500) };
    }
    const message = String(err.message ?? "");
    if (r.status === 401) {
      throw new AuthenticationError(`${this.url} refused the token (401): use the token \`journeyman serve\` printed`);
    }
    if (r.status === 404 && err.type === "model_not_found") {
      throw new UnknownModelError(String(err.model ?? "?"), (err.served as string[] | undefined) ?? []);
    }
    if (r.status === 400 || r.status === 413) {
      throw new InvalidFieldError(String(err.param ?? "body"), err.value ?? "...", String(err.reason ?? message));
    }
    throw new RemoteError(String(err.type ?? `HTTP ${r.status}`), message);
  }

  private async json<T>(method: string, path: string, body?: unknown, opts: { idempotent: boolean; gzip?: boolean } = { idempotent: true }): Promise<T> {
    if (!this.checked) await this.info();
    const r = await this.retrying(() => this.request(method, path, body, opts.gzip), opts.idempotent);
    await this.raiseFor(r);
    return (await r.json()) as T;
  }

  /** The server's version, protocol and models; refuses a protocol this client does not speak. */
  async info(): Promise<ServerInfo> {
    const r = await this.retrying(() => this.request("GET", `${PREFIX}/info`), true);
    await this.raiseFor(r);
    const info = (await r.json()) as ServerInfo;
    if (info.protocol !== PROTOCOL_VERSION) {
      throw new ProtocolMismatchError(
        `${this.url} speaks Backend protocol ${info.protocol} (journeyman ${info.journeyman}); ` +
          `this client speaks ${PROTOCOL_VERSION}: use the client release that matches the server`,
      );
    }
    this.checked = true;
    return info;
  }

  // -- the Backend protocol ----------------------------------------------------------------------

  async register(model: ModelConfig): Promise<void> {
    const { name, project, base_model, lora, max_tokens, chat_format } = model;
    const config = Object.fromEntries(
      Object.entries({ name, project, base_model, lora, max_tokens, chat_format }).filter(([, v]) => v !== undefined),
    );
    const registered = await this.json<{ run_dir: string }>("POST", `${PREFIX}/register`, { model: config });
    this.runDirs.set(model.name, registered.run_dir);
  }

  inference(modelName: string): Inference {
    return { baseURL: `${this.url}/v1`, url: this.url, apiKey: this.token, model: modelName };
  }

  runDir(modelName: string): string {
    const dir = this.runDirs.get(modelName);
    if (dir === undefined) throw new UnknownModelError(modelName, [...this.runDirs.keys()]);
    return dir;
  }

  getStep(modelName: string): Promise<number> {
    return this.json<number>("GET", `${PREFIX}/models/${encodeURIComponent(modelName)}/step`);
  }

  train(modelName: string, groups: TrajectoryGroup[], config?: TrainConfig, idempotencyKey?: string): Promise<TrainResult> {
    return this.follow(modelName, "train", { groups, config: config ?? null, idempotency_key: idempotencyKey ?? randomUUID().replaceAll("-", "") });
  }

  trainSft(
    modelName: string,
    items: (Trajectory | TrajectoryGroup)[],
    config?: SFTConfig,
    idempotencyKey?: string,
  ): Promise<TrainResult> {
    const trajectories = items.filter((t) => "messages_and_choices" in t);
    const groups = items.filter((g) => "trajectories" in g);
    return this.follow(modelName, "train_sft", {
      trajectories,
      groups,
      config: config ?? null,
      idempotency_key: idempotencyKey ?? randomUUID().replaceAll("-", ""),
    });
  }

  log(modelName: string, groups?: TrajectoryGroup[] | null, split = "val", metrics?: Record<string, number>): Promise<Record<string, number>> {
    return this.json("POST", `${PREFIX}/models/${encodeURIComponent(modelName)}/log`, { groups: groups ?? null, split, metrics: metrics ?? null }, { idempotent: false, gzip: true });
  }

  history(modelName: string): Promise<Record<string, unknown>[]> {
    return this.json("GET", `${PREFIX}/models/${encodeURIComponent(modelName)}/history`);
  }

  popCaptures(modelName: string, captureIds: string[]): Promise<Record<string, CapturedCall[]>> {
    return this.json("POST", `${PREFIX}/models/${encodeURIComponent(modelName)}/captures`, { capture_ids: captureIds }, { idempotent: false });
  }

  async serveStep(modelName: string, step: number): Promise<void> {
    await this.json("POST", `${PREFIX}/models/${encodeURIComponent(modelName)}/serve_step`, { step });
  }

  deleteCheckpoints(modelName: string, bestCheckpointMetric = "val/reward"): Promise<number[]> {
    return this.json("POST", `${PREFIX}/models/${encodeURIComponent(modelName)}/delete_checkpoints`, { best_checkpoint_metric: bestCheckpointMetric }, { idempotent: false });
  }

  /** POST a training call and follow its event stream to the result. A dropped connection or a
   * server restart is retried with the same body, and so the same idempotency key: the client
   * reattaches to the step, which happens once. */
  private async follow(modelName: string, route: string, body: Record<string, unknown>): Promise<TrainResult> {
    if (!this.checked) await this.info();
    const path = `${PREFIX}/models/${encodeURIComponent(modelName)}/${route}`;
    const attempt = async (): Promise<TrainResult> => {
      // the server sends a line at least every 15 s while a step runs: a silent minute is a dead link
      const r = await this.streamRequest(path, body);
      await this.raiseFor(r);
      const reader = r.body!.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const read = await this.withIdleTimeout(reader.read(), 60_000).catch((e: unknown) => {
          throw new TransportFailure(true, e);
        });
        if (read.done) break;
        buffer += read.value;
        let newline: number;
        while ((newline = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, newline).trim();
          buffer = buffer.slice(newline + 1);
          if (!line) continue;
          const event = JSON.parse(line) as TrainEvent;
          if (event.kind === "progress") {
            this.onProgress?.(event.done ?? 0, event.total ?? 0);
          } else if (event.kind === "result" && event.result) {
            await reader.cancel().catch(() => undefined);
            return event.result;
          } else {
            const err = event.error ?? {};
            if (err.param != null) throw new InvalidFieldError(String(err.param), err.value ?? "...", String(err.reason ?? err.message));
            throw new RemoteError(String(err.type ?? "error"), String(err.message ?? ""));
          }
        }
      }
      throw new TransportFailure(true, new Error("the train stream ended before its result"));
    };
    return this.retrying(attempt, true);
  }

  private async streamRequest(path: string, body: unknown): Promise<Response> {
    const content = gzipSync(JSON.stringify(body), { level: 5 });
    try {
      return await fetch(this.url + path, {
        method: "POST",
        headers: { authorization: `Bearer ${this.token}`, "content-type": "application/json", "content-encoding": "gzip" },
        body: content,
      });
    } catch (e) {
      throw new TransportFailure(true, e);
    }
  }

  private withIdleTimeout<T>(promise: Promise<T>, ms: number): Promise<T> {
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`no line from the train stream for ${ms / 1000} s`)), ms);
    });
    return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
  }
}
