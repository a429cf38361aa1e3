/** Journeyman from TypeScript: run agents in Node against `journeyman serve`, capture their runs
 * token-exactly (any client: the `openai` package, the Vercel AI SDK, LangChain.js, Anthropic's SDK),
 * score them, and train the model with RL. The wire protocol: docs/protocol.md. */

export { CAPTURE_HEADER, PREFIX, PROTOCOL_VERSION, RemoteBackend } from "./backend.js";
export type { Inference, RemoteBackendOptions } from "./backend.js";
export {
  AuthenticationError,
  BackendUnavailableError,
  InvalidFieldError,
  JourneymanError,
  ProtocolMismatchError,
  RemoteError,
  TooManyExceptionsError,
  UnknownModelError,
} from "./errors.js";
export { gatherTrajectoryGroups } from "./gather.js";
export type { GatherOptions, Rollout } from "./gather.js";
export { extendsIds, joinCalls } from "./histories.js";
export { Episode, TrainableModel } from "./model.js";
export { Trajectory, TrajectoryGroup, isChoice } from "./types.js";
export type {
  CapturedCall,
  Choice,
  History,
  Message,
  MessageOrChoice,
  ModelConfig,
  RolloutException,
  SFTConfig,
  TokenRecord,
  TrainConfig,
  TrainResult,
} from "./types.js";

import { RemoteBackend, type RemoteBackendOptions } from "./backend.js";

/** A RemoteBackend for the server at `url` (checked: its protocol must be this client's). */
export async function connect(url: string, options: RemoteBackendOptions = {}): Promise<RemoteBackend> {
  const backend = new RemoteBackend(url, options);
  await backend.info();
  return backend;
}
