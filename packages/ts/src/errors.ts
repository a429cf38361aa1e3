/** Named errors, one for each of the Python client's (`journeyman.errors`), so a caller can tell
 * a wrong token from a missing model from a server that is down. */

/** Base class of every error this package throws on purpose. */
export class JourneymanError extends Error {
  override name = "JourneymanError";
}

/** A value given by the user (or refused by the server) is not acceptable: `field`, `value`, `reason`. */
export class InvalidFieldError extends JourneymanError {
  override name = "InvalidFieldError";
  constructor(
    readonly field: string,
    readonly value: unknown,
    readonly reason: string,
  ) {
    super(`${field}=${show(value)}: ${reason}`);
  }
}

/** The server refused the token (401). */
export class AuthenticationError extends JourneymanError {
  override name = "AuthenticationError";
}

/** A request named a model the server does not serve (404). */
export class UnknownModelError extends JourneymanError {
  override name = "UnknownModelError";
  constructor(
    readonly model: string,
    readonly served: string[],
  ) {
    super(`model=${JSON.stringify(model)} is not served here; served models: ${served.join(", ") || "(none)"}`);
  }
}

/** Client and server speak different versions of the Backend protocol. */
export class ProtocolMismatchError extends JourneymanError {
  override name = "ProtocolMismatchError";
}

/** The server did not answer within the client's retries (down, restarting, or unreachable). */
export class BackendUnavailableError extends JourneymanError {
  override name = "BackendUnavailableError";
}

/** The server failed a request; `type` names the server-side error. */
export class RemoteError extends JourneymanError {
  override name = "RemoteError";
  constructor(
    readonly type: string,
    message: string,
  ) {
    super(`${type}: ${message}`);
  }
}

/** More rollouts threw than `maxExceptions` allows; the groups gathered are on `.groups`. */
export class TooManyExceptionsError extends JourneymanError {
  override name = "TooManyExceptionsError";
  constructor(
    readonly failed: number,
    readonly total: number,
    readonly limit: number,
    readonly groups: unknown[],
    first?: { type: string; message: string },
  ) {
    super(
      `maxExceptions=${limit}: ${failed} of ${total} rollouts threw` +
        (first ? ` (the first: ${first.type}: ${first.message})` : "") +
        `; the ${groups.length} groups finished so far are on this error's .groups`,
    );
  }
}

function show(value: unknown): string {
  let text: string;
  try {
    text = typeof value === "string" ? JSON.stringify(value) : (JSON.stringify(value) ?? String(value));
  } catch {
    text = String(value);
  }
  return text.length > 200 ? `${text.slice(0, 200)}...` : text;
}
