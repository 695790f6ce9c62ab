// webproxy-client against the published schema and a live webproxy on a real
// nats-server (started by clients/live_env.py): what it sends, a response, a denied
// request, an error outcome, and a reply fetched after it was stored.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { execFile } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { promisify } from "node:util";
import { createInterface } from "node:readline";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";

import { Ajv2020 } from "ajv/dist/2020.js";
import addFormats from "ajv-formats";
import { connect } from "@nats-io/transport-node";

import { Client, InvalidRequest, NoSuchPool, buildEnvelope, newId } from "../webproxy-client.js";

const repo = fileURLToPath(new URL("../../../", import.meta.url));
const pkg = fileURLToPath(new URL("../", import.meta.url));
const execFileAsync = promisify(execFile);
// Generous for a loaded 2-core CI machine; a healthy run takes well under a second.
const REPLY_WAIT_MS = 20_000;
const START_TIMEOUT_MS = 60_000;
// Bounds every live test, so a client that waits for nothing fails instead of hanging.
const TEST_TIMEOUT = { timeout: 60_000 };

const load = (name) => JSON.parse(readFileSync(`${repo}schema/${name}`, "utf8"));
const ajv = new Ajv2020({ allErrors: true, strict: false });
addFormats(ajv);
const validRequest = ajv.compile(load("request.schema.json"));
const validReply = ajv.compile(load("reply.schema.json"));

function assertValid(validate, instance) {
  assert.ok(validate(instance), `${JSON.stringify(instance)}: ${ajv.errorsText(validate.errors)}`);
}

describe("envelopes against request.schema.json", () => {
  const envelopes = [
    buildEnvelope("GET", "http://127.0.0.1:8080/x"),
    buildEnvelope("post", "https://api.example.com/orders?x=1", {
      id: "order-42",
      headers: { "Content-Type": "application/json", "X-Multi": ["a", "b"] },
      body: '{"qty": 1}',
      replyTo: "app.replies.42",
      timeoutMs: 5000,
      deadline: "2026-11-30T12:00:00Z",
      metadata: { order: 42 },
    }),
    buildEnvelope("PUT", "http://h/", { body: new Uint8Array([0, 1, 255]) }),
    buildEnvelope("DELETE", "http://h/", { body: "" }),
  ];
  for (const envelope of envelopes) {
    test(`built ${envelope.method} ${envelope.url} is valid`, () => {
      assertValid(validRequest, envelope);
    });
  }

  test("bytes travel as base64 and strings as text", () => {
    assert.equal(buildEnvelope("PUT", "http://h/", { body: Buffer.from([0, 1, 255]) }).body_base64, "AAH/");
    assert.equal(buildEnvelope("PUT", "http://h/", { body: "grüße" }).body, "grüße");
    assert.equal("body" in buildEnvelope("GET", "http://h/"), false);
  });

  test("the schema agrees with the service on the examples", () => {
    const examples = load("examples.json");
    for (const envelope of examples.valid) {
      assertValid(validRequest, envelope);
    }
    for (const { envelope, why } of examples.invalid) {
      assert.equal(validRequest(envelope), false, `${why}: ${JSON.stringify(envelope)}`);
    }
  });
});

/** Starts clients/live_env.py and resolves with what it prints once ready. */
function startLiveEnv() {
  const child = spawn("python3", [`${repo}clients/live_env.py`], {
    stdio: ["pipe", "pipe", "inherit"],
  });
  const ready = new Promise((resolve, reject) => {
    const lines = createInterface({ input: child.stdout });
    lines.once("line", (line) => resolve(JSON.parse(line)));
    child.once("exit", (code) => reject(new Error(`live_env.py exited with ${code}`)));
    setTimeout(() => reject(new Error("live_env.py not ready in time")), START_TIMEOUT_MS).unref();
  });
  return { child, ready };
}

describe("against a live webproxy", () => {
  let live;
  let env;
  let nc;
  let watcher;
  let client;
  // What reached the default pool's subject, by id, and the ids the tests sent there.
  const arrived = new Map();
  const published = [];

  before(async () => {
    live = startLiveEnv();
    env = await live.ready;
    nc = await connect({ servers: env.nats_url });
    watcher = await connect({ servers: env.nats_url });
    // A core subscription sees what JetStream stores: the bytes the client sent.
    const sub = watcher.subscribe("webproxy.request.default");
    (async () => {
      for await (const m of sub) {
        const envelope = m.json();
        arrived.set(envelope.id, { envelope, msgId: m.headers?.get("Nats-Msg-Id") });
      }
    })();
    await watcher.flush();
    client = new Client(nc);
  });

  after(async () => {
    await nc?.close();
    await watcher?.close();
    if (live) {
      // Closing stdin tells live_env.py to stop everything it started.
      live.child.stdin.end();
      await new Promise((resolve) => live.child.once("exit", resolve));
    }
  });

  const url = (path) => `${env.upstream_url}${path}`;

  test("a response", TEST_TIMEOUT, async () => {
    const reply = await client.request("POST", url("/echo?q=1"), {
      headers: { "X-Multi": ["a", "b"] },
      body: "hello",
      metadata: { order: 42 },
      waitMs: REPLY_WAIT_MS,
    });
    published.push(reply.id);
    assertValid(validReply, reply.raw);
    assert.equal(reply.ok, true);
    assert.equal(reply.error, null);
    assert.equal(reply.status, 200);
    assert.equal(reply.attempts, 1);
    assert.deepEqual(reply.metadata, { order: 42 });
    const echo = JSON.parse(reply.text);
    assert.equal(echo.method, "POST");
    assert.equal(echo.path, "/echo?q=1");
    assert.equal(echo.body, "hello");
    assert.deepEqual(echo.headers["x-multi"], ["a", "b"]);

    const binary = await client.request("PUT", url("/echo"), {
      body: new Uint8Array([0, 1, 255]),
      waitMs: REPLY_WAIT_MS,
    });
    published.push(binary.id);
    assert.equal(JSON.parse(binary.text).body_len, 3);
  });

  test("a denied request is an error outcome", TEST_TIMEOUT, async () => {
    const reply = await client.request("GET", url("/forbidden/x"), { waitMs: REPLY_WAIT_MS });
    published.push(reply.id);
    assertValid(validReply, reply.raw);
    assert.equal(reply.ok, false);
    assert.equal(reply.status, null);
    assert.equal(reply.error.code, "denied");
    assert.match(reply.error.message, /forbidden/);
    assert.equal(reply.attempts, 0);
  });

  test("a refused connection is an error outcome", TEST_TIMEOUT, async () => {
    const reply = await client.request("GET", `${env.closed_url}/x`, { waitMs: REPLY_WAIT_MS });
    published.push(reply.id);
    assertValid(validReply, reply.raw);
    assert.equal(reply.outcome, "error");
    assert.equal(reply.error.code, "retries_exhausted");
    assert.equal(reply.attempts, 1);
  });

  test("a reply fetched after it was stored", TEST_TIMEOUT, async () => {
    const id = await client.submit("GET", url("/stored"));
    published.push(id);
    assert.equal(await client.reply(newId()), null);
    let stored = null;
    for (const start = Date.now(); !stored && Date.now() - start < REPLY_WAIT_MS; ) {
      stored = await client.reply(id);
      if (!stored) {
        await sleep(50);
      }
    }
    assert.ok(stored, `no reply to ${id} stored within ${REPLY_WAIT_MS} ms`);
    assertValid(validReply, stored.raw);
    assert.equal(stored.id, id);
    assert.equal(stored.text, "path /stored");

    // Asking again with the answered id: a duplicate publish that no live reply
    // follows, answered from the stream at once rather than after the wait.
    const again = await Promise.race([
      client.request("GET", url("/stored"), { id, waitMs: 600_000 }),
      sleep(REPLY_WAIT_MS, null, { ref: false }),
    ]);
    assert.ok(again, "the stored reply at once, not after the wait");
    assert.deepEqual(again.raw, stored.raw);
  });

  test("errors are typed", TEST_TIMEOUT, async () => {
    await assert.rejects(client.submit("GET", url("/x"), { pool: "nope" }), NoSuchPool);
    for (const bad of ["a.>", ">", "a b", ""]) {
      await assert.rejects(client.request("GET", url("/x"), { id: bad }), InvalidRequest);
      await assert.rejects(client.reply(bad), InvalidRequest);
    }
  });

  test("everything sent is valid and carries its id as Nats-Msg-Id", TEST_TIMEOUT, async () => {
    assert.ok(published.length >= 5, `only ${published.length} requests sent`);
    for (const start = Date.now(); Date.now() - start < REPLY_WAIT_MS; await sleep(20)) {
      if (published.every((id) => arrived.has(id))) {
        break;
      }
    }
    for (const id of published) {
      assert.ok(arrived.has(id), `${id} never arrived`);
      const { envelope, msgId } = arrived.get(id);
      assertValid(validRequest, envelope);
      assert.equal(msgId, id);
    }
  });

  test("the README example runs", TEST_TIMEOUT, async () => {
    const readme = readFileSync(`${pkg}README.md`, "utf8");
    let code = readme.split("```js\n")[1].split("```")[0];
    // The example's addresses, pointed at the live service and upstream instead.
    for (const placeholder of ["nats://127.0.0.1:4222", "https://example.com/"]) {
      assert.ok(code.includes(placeholder), placeholder);
    }
    code = code.replace("nats://127.0.0.1:4222", env.nats_url).replace("https://example.com/", url("/readme"));
    // Inside the package, so that `import ... from "webproxy-client"` resolves to it.
    const dir = mkdtempSync(`${pkg}.tmp-`);
    try {
      writeFileSync(`${dir}/example.mjs`, code);
      const { stdout } = await execFileAsync(process.execPath, [`${dir}/example.mjs`], {
        timeout: REPLY_WAIT_MS,
      });
      assert.equal(stdout, "200 path /readme\n");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
