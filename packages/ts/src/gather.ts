/** Run many rollout groups concurrently: at most `concurrency` rollouts at once, the failures
 * counted against `maxExceptions` (a count, or a fraction in (0, 1) of all rollouts). */

import { InvalidFieldError, TooManyExceptionsError } from "./errors.js";
import { type Trajectory, TrajectoryGroup, rolloutException } from "./types.js";

/** One rollout, not yet started: the gather starts it when a slot is free. */
export type Rollout = () => Promise<Trajectory>;

export interface GatherOptions {
  /** Rollouts running at once (default: all). */
  concurrency?: number;
  /** Rollouts that may throw before the gather throws `TooManyExceptionsError` (default 0). */
  maxExceptions?: number;
  /** Told after each rollout: (finished, total). */
  onProgress?: (finished: number, total: number) => void;
}

/** Every rollout of every group, in order; a rollout that throws lands on its group's
 * `exceptions`. Throws `TooManyExceptionsError` (carrying the finished groups) only after every
 * rollout has finished, when more threw than `maxExceptions` allows. Groups left with no
 * trajectory are dropped. */
export async function gatherTrajectoryGroups(groups: Iterable<Rollout[]>, options: GatherOptions = {}): Promise<TrajectoryGroup[]> {
  const maxExceptions = options.maxExceptions ?? 0;
  if (typeof maxExceptions !== "number" || !(maxExceptions >= 0)) {
    throw new InvalidFieldError("maxExceptions", maxExceptions, "must be a count >= 0 or a fraction in (0, 1)");
  }
  const specs = [...groups];
  const jobs = specs.flatMap((rollouts, g) => rollouts.map((rollout, i) => ({ g, i, rollout })));
  const concurrency = options.concurrency ?? jobs.length;
  if (!Number.isInteger(concurrency) || concurrency < 1) {
    throw new InvalidFieldError("concurrency", concurrency, "must be a whole number >= 1");
  }
  const results: (Trajectory | undefined)[][] = specs.map((r) => new Array(r.length));
  const out = specs.map(() => new TrajectoryGroup());
  let next = 0;
  let finished = 0;
  let failed = 0;
  const worker = async (): Promise<void> => {
    while (next < jobs.length) {
      const { g, i, rollout } = jobs[next++];
      try {
        results[g][i] = await rollout();
      } catch (e) {
        failed++;
        out[g].exceptions.push(rolloutException(e));
      }
      options.onProgress?.(++finished, jobs.length);
    }
  };
  await Promise.all(Array.from({ length: Math.min(concurrency, jobs.length) }, worker));
  out.forEach((group, g) => {
    group.trajectories = results[g].filter((t): t is Trajectory => t !== undefined);
  });
  const kept = out.filter((group) => group.trajectories.length > 0);
  const limit = maxExceptions > 0 && maxExceptions < 1 ? maxExceptions * jobs.length : maxExceptions;
  if (failed > limit) {
    const first = out.flatMap((g) => g.exceptions)[0];
    throw new TooManyExceptionsError(failed, jobs.length, maxExceptions, kept, first);
  }
  return kept;
}
