// A Vercel AI SDK agent with a tool, trained end to end from Node against `journeyman serve`.
//
// The task is the one `./dev demo` trains in Python (packages/core/src/journeyman/app/tasks.py):
// asked about a topic, answer in one short sentence. Here the agent first looks the topic up with
// a tool (the first step is forced, under the grammar), then answers. Reward = 0.5 if it looked up
// the topic it was asked about (the base SmolLM2-135M mostly looks up "lookup" or a near miss, then
// echoes the tool's result) + 0.5 x on topic (the answer names it) x brevity (1 - answer tokens /
// max tokens). GRPO teaches it to call the tool right first. Train and held-out topics are disjoint.
//
//     journeyman serve --port 7800 --path ./runs          # prints $JOURNEYMAN_TOKEN
//     cd examples/ts && npm ci && npm run build
//     JOURNEYMAN_URL=http://127.0.0.1:7800 JOURNEYMAN_TOKEN=... npm start [-- --steps 3 --learning-rate 8e-4]
//
// It prints the held-out reward before and after training with standard errors, and a paired
// sign test over the held-out prompts.

import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, stepCountIs, tool } from "ai";
import {
  type Rollout,
  TrainableModel,
  type Trajectory,
  connect,
  gatherTrajectoryGroups,
} from "journeyman-rl";
import { parseArgs } from "node:util";
import { z } from "zod";

const TOPICS = [
  "apple", "bicycle", "camera", "desert", "elephant", "forest", "guitar", "harbor", "island", "jungle",
  "kettle", "lantern", "mountain", "notebook", "ocean", "piano", "quilt", "river", "satellite", "telescope",
  "umbrella", "volcano", "window", "yacht", "zebra", "bridge", "castle", "dolphin", "engine", "feather",
  "garden", "hammer", "igloo", "jacket", "kite", "ladder", "magnet", "needle", "orchestra", "pencil",
  "rainbow", "saddle", "tractor", "violin", "wallet", "anchor", "balloon", "candle", "diamond", "eagle",
  "fountain", "glacier", "helmet", "insect", "jellyfish", "kangaroo", "lemon", "mirror", "nest", "owl",
];
const TEMPLATES = ["What is a {t}?", "Tell me about the {t}.", "Describe a {t}.", "What is a {t} used for?"];
const SYSTEM = "Look the topic up with the lookup tool, then answer in one short sentence.";

interface Scenario {
  topic: string;
  prompt: string;
}

/** Deterministic scenarios of a split ("train" or "val": disjoint topics). */
function scenarios(split: "train" | "val", n: number, seed: number): Scenario[] {
  let state = seed * 7919 + (split === "train" ? 1 : 2);
  const next = () => (state = (state * 1103515245 + 12345) % 2147483648) / 2147483648;
  const cut = Math.floor((TOPICS.length * 2) / 3);
  const topics = split === "train" ? TOPICS.slice(0, cut) : TOPICS.slice(cut);
  return Array.from({ length: n }, () => {
    const t = topics[Math.floor(next() * topics.length)];
    return { topic: t, prompt: TEMPLATES[Math.floor(next() * TEMPLATES.length)].replace("{t}", t) };
  });
}

const { values: args } = parseArgs({
  options: {
    steps: { type: "string", default: "10" },
    "group-size": { type: "string", default: "4" },
    "prompts-per-step": { type: "string", default: "8" },
    "eval-prompts": { type: "string", default: "32" },
    "max-tokens": { type: "string", default: "48" }, // the forced lookup call must fit (~25 tokens)
    "learning-rate": { type: "string", default: "2e-4" },
    name: { type: "string", default: `ts-agent-${Date.now()}` },
  },
});
const maxTokens = Number(args["max-tokens"]);

const backend = await connect(process.env.JOURNEYMAN_URL ?? "http://127.0.0.1:7800", {
  token: process.env.JOURNEYMAN_TOKEN,
});
const model = new TrainableModel({ name: args.name!, project: "ts-example" });
await model.register(backend);

/** One run of the agent on `scenario`: a forced lookup, then the answer; scored on the answer. */
async function rollout(scenario: Scenario, temperature: number): Promise<Trajectory> {
  const episode = model.episode();
  let lookedUp: string | undefined; // what the agent asked the tool for
  const { baseURL, apiKey } = model.inference();
  const provider = createOpenAICompatible({ name: "journeyman", baseURL, apiKey, fetch: episode.fetch });
  // a call cut at the token limit is no call: the AI SDK throws, and the run scores 0 (and trains)
  const result = await generateText({
    model: provider(model.name),
    system: SYSTEM,
    prompt: scenario.prompt,
    temperature,
    maxOutputTokens: maxTokens,
    tools: {
      lookup: tool({
        description: "Look a topic up",
        inputSchema: z.object({ topic: z.string() }),
        execute: async ({ topic }) => {
          lookedUp = topic;
          return `${topic}: see an encyclopedia entry for "${topic}".`;
        },
      }),
    },
    prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "none" }),
    stopWhen: stepCountIs(2),
  }).catch(() => ({ text: "" }));
  const trajectory = await episode.finish();
  const answerTokens = trajectory.records().at(-1)?.token_ids.length ?? maxTokens;
  const onTopic = result.text.toLowerCase().includes(scenario.topic);
  const rightLookup = lookedUp?.trim().toLowerCase() === scenario.topic;
  trajectory.reward = 0.5 * Number(rightLookup) + (onTopic ? 0.5 * Math.max(0, 1 - answerTokens / maxTokens) : 0);
  trajectory.metrics = { answer_tokens: answerTokens, on_topic: onTopic, right_lookup: rightLookup };
  return trajectory;
}

/** Held-out reward (greedy, one run per prompt): the rewards, their mean and standard error. */
async function evaluate(prompts: Scenario[]): Promise<{ rewards: number[]; mean: number; sem: number }> {
  const groups = await gatherTrajectoryGroups(
    prompts.map((s) => [() => rollout(s, 0)]),
    { concurrency: 8 },
  );
  await model.log(groups, { split: "val" });
  const rewards = groups.map((g) => g.trajectories[0].reward);
  const mean = rewards.reduce((a, b) => a + b, 0) / rewards.length;
  const variance = rewards.reduce((a, r) => a + (r - mean) ** 2, 0) / Math.max(1, rewards.length - 1);
  return { rewards, mean, sem: Math.sqrt(variance / rewards.length) };
}

/** Two-sided sign test p-value for paired before/after scores (ties dropped). */
function signTest(before: number[], after: number[]): number {
  const wins = before.filter((b, i) => after[i] > b).length;
  const losses = before.filter((b, i) => after[i] < b).length;
  const n = wins + losses;
  let tail = 0;
  for (let k = 0; k <= Math.min(wins, losses); k++) tail += binomial(n, k) / 2 ** n;
  return Math.min(1, 2 * tail);
}

function binomial(n: number, k: number): number {
  let c = 1;
  for (let i = 1; i <= k; i++) c = (c * (n - k + i)) / i;
  return c;
}

const held = scenarios("val", Number(args["eval-prompts"]), 0);
const before = await evaluate(held);
console.log(`held-out reward before: ${before.mean.toFixed(3)} ± ${before.sem.toFixed(3)}`);
const steps = Number(args.steps);
const perStep = Number(args["prompts-per-step"]);
const train = scenarios("train", perStep * steps, 1);
for (let step = 0; step < steps; step++) {
  const batch = train.slice(step * perStep, (step + 1) * perStep);
  const groups = await gatherTrajectoryGroups(
    batch.map((s): Rollout[] => Array.from({ length: Number(args["group-size"]) }, () => () => rollout(s, 1))),
    { concurrency: 16, maxExceptions: 0.1 },
  );
  const result = await model.train(groups, { learning_rate: Number(args["learning-rate"]) });
  const mean = groups.flatMap((g) => g.rewards()).reduce((a, b, _, all) => a + b / all.length, 0);
  console.log(`step ${result.step}: train reward ${mean.toFixed(3)}${result.skipped ? " (skipped)" : ""}`);
}
const after = await evaluate(held);
const se = Math.hypot(before.sem, after.sem);
const gain = se > 0 ? ((after.mean - before.mean) / se).toFixed(1) : "n/a (no spread)";
console.log(`held-out reward after:  ${after.mean.toFixed(3)} ± ${after.sem.toFixed(3)}`);
console.log(
  `gain: ${(after.mean - before.mean).toFixed(3)} = ${gain} standard errors; ` +
    `paired sign test p = ${signTest(before.rewards, after.rewards).toPrecision(2)}`,
);
