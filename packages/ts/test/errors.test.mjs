// The named errors a Node caller can tell apart, each from a real server answer or a real socket.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { test } from "node:test";

import { AuthenticationError, BackendUnavailableError, InvalidFieldError, ProtocolMismatchError, RemoteBackend, connect } from "../dist/index.js";

const URL = process.env.JOURNEYMAN_URL;
const SERVER = URL ? {} : { skip: "needs a running `journeyman serve`: set JOURNEYMAN_URL and JOURNEYMAN_TOKEN" };

test("a wrong token is an AuthenticationError", SERVER, async () => {
  await assert.rejects(connect(URL, { token: "not-the-token" }), AuthenticationError);
});

test("no server is a BackendUnavailableError after the reconnect window", async () => {
  const server = createServer().listen(0, "127.0.0.1");
  await new Promise((r) => server.once("listening", r));
  const { port } = server.address();
  server.close();
  await assert.rejects(connect(`http://127.0.0.1:${port}`, { token: "t", reconnectMs: 300 }), BackendUnavailableError);
});

test("a server of another protocol version is a ProtocolMismatchError", async () => {
  // a server of a future release: it answers `info` with its protocol, as `journeyman serve` does
  const server = createServer((_, res) => res.end(JSON.stringify({ journeyman: "9.0.0", protocol: 99, models: [] })));
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  try {
    await assert.rejects(connect(`http://127.0.0.1:${server.address().port}`, { token: "t" }), ProtocolMismatchError);
  } finally {
    server.close();
  }
});

test("bad arguments are InvalidFieldErrors naming the field", () => {
  assert.throws(() => new RemoteBackend("gpu-box:7800", { token: "t" }), (e) => e instanceof InvalidFieldError && e.field === "url");
});
