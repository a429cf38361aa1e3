// Drives a real `journeyman serve` (its URL and token in $JOURNEYMAN_URL / $JOURNEYMAN_TOKEN; the
// pytest test tests/test_typescript.py starts it) with the clients Node agents use: the `openai`
// package, the Vercel AI SDK's tool loop, LangChain.js and Anthropic's SDK, each through an
// episode's `fetch` (no patching). Their runs become token-exact trajectories that train a step.
import assert from "node:assert/strict";
import { before, test } from "node:test";

import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import Anthropic from "@anthropic-ai/sdk";
import { ChatOpenAI } from "@langchain/openai";
import { generateText, stepCountIs, tool } from "ai";
import OpenAI from "openai";
import { z } from "zod";

import {
  InvalidFieldError,
  TooManyExceptionsError,
  TrainableModel,
  TrajectoryGroup,
  UnknownModelError,
  connect,
  extendsIds,
  gatherTrajectoryGroups,
} from "../dist/index.js";

const URL = process.env.JOURNEYMAN_URL;
const TOKEN = process.env.JOURNEYMAN_TOKEN;
// Without a server these tests are skipped, saying what to start: `npm test` still runs the rest.
const SERVER = URL ? {} : { skip: "needs a running `journeyman serve`: set JOURNEYMAN_URL and JOURNEYMAN_TOKEN" };
const WEATHER = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather for a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};
const ASK = [
  { role: "system", content: "You answer weather questions. Always call get_weather first." },
  { role: "user", content: "What's the weather in Paris?" },
];

let model;
const trajectories = [];

/** The records of a trajectory continue each other: one token sequence, no re-tokenisation. */
function assertTokenExact(trajectory, calls) {
  const records = trajectory.records();
  assert.equal(records.length, calls, JSON.stringify(trajectory.messages()));
  for (let k = 1; k < records.length; k++) {
    const done = [...records[k - 1].prompt_token_ids, ...records[k - 1].token_ids];
    assert.ok(extendsIds(done, records[k].prompt_token_ids), `call ${k} does not continue call ${k - 1}`);
    assert.ok(records[k].spliced_turns >= 1);
  }
  for (const r of records) assert.equal(r.logprobs.length, r.token_ids.length);
}

before(async () => {
  if (!URL) return;
  const backend = await connect(URL, { token: TOKEN });
  model = new TrainableModel({ name: `ts-${process.pid}`, project: "ts", max_tokens: 24 });
  await model.register(backend);
  assert.equal(await model.getStep(), 0);
});

test("the openai client's tool loop becomes one token-exact trajectory", SERVER, async () => {
  const episode = model.episode();
  const { baseURL, apiKey } = model.inference();
  const client = new OpenAI({ baseURL, apiKey, fetch: episode.fetch });
  const first = await client.chat.completions.create({
    model: model.name, messages: ASK, tools: [WEATHER], tool_choice: "required", max_tokens: 40, seed: 7,
  });
  const call = first.choices[0].message.tool_calls[0];
  assert.equal(call.function.name, "get_weather");
  const messages = [...ASK, first.choices[0].message, { role: "tool", tool_call_id: call.id, content: "21C, sunny" }];
  let streamed = "";
  for await (const chunk of await client.chat.completions.create({ model: model.name, messages, tools: [WEATHER], max_tokens: 12, stream: true })) {
    streamed += chunk.choices[0]?.delta?.content ?? "";
  }
  const trajectory = await episode.finish();
  assertTokenExact(trajectory, 2);
  assert.equal(trajectory.messages().at(-1).content, streamed);
  trajectory.reward = 1;
  trajectories.push(trajectory);
});

test("the Vercel AI SDK's tool loop (generateText, a zod tool) is captured", SERVER, async () => {
  const episode = model.episode();
  const { baseURL, apiKey } = model.inference();
  const provider = createOpenAICompatible({ name: "journeyman", baseURL, apiKey, fetch: episode.fetch });
  const seen = [];
  const result = await generateText({
    model: provider(model.name),
    system: ASK[0].content,
    prompt: ASK[1].content,
    maxOutputTokens: 40,
    tools: {
      get_weather: tool({
        description: "Current weather for a city",
        inputSchema: z.object({ city: z.string() }),
        execute: async ({ city }) => {
          seen.push(city);
          return `21C and sunny in ${city}`;
        },
      }),
    },
    // a 135M model calls a tool when made to: the first step is forced (under the grammar)
    prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "none" }),
    stopWhen: stepCountIs(2),
  });
  assert.equal(seen.length, 1);
  assert.equal(result.steps.length, 2);
  const trajectory = await episode.finish();
  assertTokenExact(trajectory, 2);
  trajectory.reward = 0;
  trajectories.push(trajectory);
});

test("LangChain.js's ChatOpenAI is captured through its configuration's fetch", SERVER, async () => {
  const episode = model.episode();
  const { baseURL, apiKey } = model.inference();
  const chat = new ChatOpenAI({ model: model.name, apiKey, maxTokens: 10, configuration: { baseURL, fetch: episode.fetch } });
  const answer = await chat.invoke([["human", "Name a colour."]]);
  const trajectory = await episode.finish();
  assertTokenExact(trajectory, 1);
  assert.equal(trajectory.messages().at(-1).content, answer.content);
  trajectory.reward = 0.5;
  trajectories.push(trajectory);
});

test("Anthropic's SDK on /v1/messages: a tool_use round trip, streamed, token-exact", SERVER, async () => {
  const episode = model.episode();
  const { url, apiKey } = model.inference();
  const client = new Anthropic({ baseURL: url, apiKey, fetch: episode.fetch });
  const tools = [{ name: "get_weather", description: "Current weather for a city", input_schema: WEATHER.function.parameters }];
  const ask = [{ role: "user", content: "What's the weather in Paris?" }];
  const first = await client.messages.create({
    model: model.name, max_tokens: 40, system: ASK[0].content, messages: ask, tools, tool_choice: { type: "tool", name: "get_weather" },
  });
  const use = first.content.find((b) => b.type === "tool_use");
  assert.equal(first.stop_reason, "tool_use");
  assert.equal(typeof use.input.city, "string");
  const stream = client.messages.stream({
    model: model.name,
    max_tokens: 12,
    system: ASK[0].content,
    tools,
    messages: [...ask, { role: "assistant", content: first.content }, { role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: "21C, sunny" }] }],
  });
  const kinds = [];
  stream.on("streamEvent", (event) => kinds.push(event.type));
  const second = await stream.finalMessage();
  assert.equal(kinds[0], "message_start");
  assert.deepEqual(kinds.slice(-2), ["message_delta", "message_stop"]);
  const trajectory = await episode.finish();
  assertTokenExact(trajectory, 2);
  assert.equal(trajectory.messages().at(-1).content, second.content.filter((b) => b.type === "text").map((b) => b.text).join(""));
  trajectory.reward = 0.25;
  trajectories.push(trajectory);
});

test("gather runs rollouts with a concurrency limit and counts the ones that throw", SERVER, async () => {
  let running = 0;
  let most = 0;
  const rollout = (fail) => async () => {
    running++;
    most = Math.max(most, running);
    try {
      const episode = model.episode();
      const { baseURL, apiKey } = model.inference();
      const client = new OpenAI({ baseURL, apiKey, fetch: episode.fetch });
      await client.chat.completions.create({ model: model.name, messages: [{ role: "user", content: "Say hi." }], max_tokens: 3 });
      if (fail) throw new Error("the agent's tool broke");
      const trajectory = await episode.finish();
      trajectory.reward = 1;
      return trajectory;
    } finally {
      running--;
    }
  };
  const groups = await gatherTrajectoryGroups([[rollout(false), rollout(true)], [rollout(false)]], { concurrency: 2, maxExceptions: 1 });
  assert.equal(most, 2);
  assert.deepEqual(groups.map((g) => g.trajectories.length), [1, 1]);
  assert.equal(groups[0].exceptions[0].message, "the agent's tool broke");
  await assert.rejects(
    gatherTrajectoryGroups([[rollout(true), rollout(false)]], { maxExceptions: 0 }),
    (e) => e instanceof TooManyExceptionsError && e.groups.length === 1,
  );
});

test("the runs train a step; log, history, serveStep, trainSft, deleteCheckpoints", SERVER, async () => {
  const result = await model.train([new TrajectoryGroup(trajectories)], { learning_rate: 1e-4 });
  assert.equal(result.step, 1);
  assert.equal(result.skipped, false);
  assert.equal(await model.getStep(), 1);
  const logged = await model.log([new TrajectoryGroup(trajectories)], { split: "val" });
  assert.ok("reward" in logged);
  const history = await model.history();
  assert.ok(history.some((row) => row.split === "val" && "val/reward" in row));
  await model.serveStep(0);
  assert.equal(await model.getStep(), 0);
  await model.serveStep(1);
  const sft = await model.trainSft([trajectories[0]], { learning_rate: 1e-4 });
  assert.equal(sft.step, 2);
  assert.ok(Array.isArray(await model.deleteCheckpoints("val/reward")));
  await assert.rejects(model.train([new TrajectoryGroup(trajectories)], { learning_rate: -1 }), (e) => e instanceof InvalidFieldError && e.field.startsWith("config.learning_rate"));
  await assert.rejects(model.backend.getStep("not-registered"), UnknownModelError);
});
