// webproxy-client against the published schema and a live webproxy on a real
// nats-server (started by clients/live_env.py): what it sends, a response, a denied
// request, an error outcome, a reply fetched after it was stored, conversations that
// share an envelope id: each gets its own reply, live and stored, also after a
// reconnect, and cancels: of a conversation in flight, with a wrong message id, of a
// finished one.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { createHash } from "node:crypto";
import { readFileSync, rmSync, writeFileSync } from "node:fs";
import net from "node:net";
import { promisify } from "node:util";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";

import { Ajv2020 } from "ajv/dist/2020.js";
import addFormats from "ajv-formats";
import { connect, headers as natsHeaders } from "@nats-io/transport-node";
import { jetstreamManager } from "@nats-io/jetstream";

import { Client, InvalidRequest, NoSuchPool, buildEnvelope, newId, newMsgId } from "../webproxy-client.js";
import { startLiveEnv, stopLiveEnv } from "./live-env.js";
import { installPacked, pkg } from "./packed.js";

const repo = fileURLToPath(new URL("../../../", import.meta.url));
const execFileAsync = promisify(execFile);
// Generous for a loaded 2-core CI machine; a healthy run takes well under a second.
const REPLY_WAIT_MS = 20_000;
// Bounds every live test, so a client that waits for nothing fails instead of hanging.
const TEST_TIMEOUT = { timeout: 60_000 };
const HEX32 = /^[0-9a-f]{32}$/;

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

/** Resolves once `check()` is truthy, polling; rejects after REPLY_WAIT_MS. */
async function waitUntil(what, check) {
  for (const start = Date.now(); Date.now() - start < REPLY_WAIT_MS; await sleep(20)) {
    if (await check()) {
      return;
    }
  }
  throw new Error(`timed out after ${REPLY_WAIT_MS} ms waiting for ${what}`);
}

/**
 * A TCP relay on 127.0.0.1 in front of the live nats-server. Cutting it drops every
 * connection through it and refuses new ones until it is healed: one caller's network
 * going away while the server and everyone else stay up.
 */
class Relay {
  #server;
  #sockets = new Set();
  #cut = false;

  constructor(targetPort) {
    this.targetPort = targetPort;
  }

  async start() {
    this.#server = net.createServer((inbound) => {
      if (this.#cut) {
        inbound.destroy();
        return;
      }
      const outbound = net.connect(this.targetPort, "127.0.0.1");
      for (const [socket, other] of [[inbound, outbound], [outbound, inbound]]) {
        this.#sockets.add(socket);
        socket.on("error", () => {});
        socket.on("close", () => {
          this.#sockets.delete(socket);
          other.destroy();
        });
        socket.pipe(other);
      }
    });
    await new Promise((resolve) => this.#server.listen(0, "127.0.0.1", resolve));
    return `nats://127.0.0.1:${this.#server.address().port}`;
  }

  cut() {
    this.#cut = true;
    for (const socket of this.#sockets) {
      socket.destroy();
    }
  }

  heal() {
    this.#cut = false;
  }

  close() {
    this.cut();
    this.#server?.close();
  }
}

describe("against a live webproxy", () => {
  let live;
  let env;
  let nc;
  let watcher;
  let client;
  // What reached the default pool's subject, by Nats-Msg-Id, and the envelope ids the
  // tests sent there.
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
        arrived.set(m.headers?.get("Nats-Msg-Id"), m.json());
      }
    })();
    await watcher.flush();
    client = new Client(nc);
  });

  after(async () => {
    await nc?.close();
    await watcher?.close();
    await stopLiveEnv(live);
  });

  const url = (path) => `${env.upstream_url}${path}`;
  // How many requests the upstream has had on `path`.
  const hits = async (path) =>
    Number(await (await fetch(url(`/_hits?path=${encodeURIComponent(path)}`))).text());
  // How many requests to a `/hold/<ms>` path the caller hung up on while held.
  const dropped = async (path) =>
    Number(await (await fetch(url(`/_dropped?path=${encodeURIComponent(path)}`))).text());
  // The conversation's stored reply, once there is one (within REPLY_WAIT_MS).
  const storedReply = async ({ id, origin }) => {
    for (const start = Date.now(); Date.now() - start < REPLY_WAIT_MS; await sleep(20)) {
      const stored = await client.reply(id, origin);
      if (stored) {
        return stored;
      }
    }
    throw new Error(`no reply to ${id} (origin ${origin}) stored within ${REPLY_WAIT_MS} ms`);
  };
  const storedReplies = async () => {
    const jsm = await jetstreamManager(nc);
    return (await jsm.streams.info("WEBPROXY_POOL_DEFAULT_REPLIES")).state.messages;
  };

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
    const msgId = newMsgId();
    const { id, origin } = await client.submit("GET", url("/stored"), { msgId });
    published.push(id);
    assert.match(origin, /^WEBPROXY_POOL_DEFAULT:[0-9]+$/);
    assert.equal(await client.reply(newId(), origin), null);
    let stored = null;
    for (const start = Date.now(); !stored && Date.now() - start < REPLY_WAIT_MS; ) {
      stored = await client.reply(id, origin);
      if (!stored) {
        await sleep(50);
      }
    }
    assert.ok(stored, `no reply to ${id} stored within ${REPLY_WAIT_MS} ms`);
    assertValid(validReply, stored.raw);
    assert.equal(stored.id, id);
    assert.equal(stored.origin, origin);
    assert.equal(stored.text, "path /stored");

    // The very same message published again (its Nats-Msg-Id, as after a crash): a
    // duplicate of the same conversation that no live reply follows, answered from its
    // stored subject at once rather than after the wait.
    const again = await Promise.race([
      client.request("GET", url("/stored"), { id, msgId, waitMs: 600_000 }),
      sleep(REPLY_WAIT_MS, null, { ref: false }),
    ]);
    assert.ok(again, "the stored reply at once, not after the wait");
    assert.deepEqual(again.raw, stored.raw);
    assert.equal(again.origin, origin);
  });

  test("two conversations with one id each get their own reply", TEST_TIMEOUT, async () => {
    const id = newId();
    const first = await client.request("GET", url("/one"), { id, waitMs: REPLY_WAIT_MS });
    const second = await client.request("GET", url("/two"), { id, waitMs: REPLY_WAIT_MS });
    published.push(id);
    assert.deepEqual([first.id, first.text], [id, "path /one"]);
    assert.deepEqual([second.id, second.text], [id, "path /two"]);
    assert.notEqual(first.origin, second.origin);
    assert.equal((await client.reply(id, first.origin)).text, "path /one");
    assert.equal((await client.reply(id, second.origin)).text, "path /two");
  });

  test("a live reply with another origin is ignored", TEST_TIMEOUT, async () => {
    const id = newId();
    const inFlight = client.request("GET", url("/delay/1000"), { id, waitMs: 600_000 });
    // Awaited below; a failure before that must not be an unhandled rejection.
    inFlight.catch(() => {});
    published.push(id);
    await waitUntil("the upstream call", async () => (await hits("/delay/1000")) === 1);
    const forged = JSON.stringify({
      v: 1, id, outcome: "response", status: 418, headers: {}, body: "forged",
      attempts: 1, duration_ms: 1,
    });
    for (const origin of ["WEBPROXY_POOL_DEFAULT:1", null]) {
      const h = natsHeaders();
      h.set("Webproxy-Outcome", "response");
      if (origin) {
        h.set("Webproxy-Origin", origin);
      }
      nc.publish(`webproxy.reply.${id}`, forged, { headers: h });
    }
    await nc.flush();
    const reply = await inFlight;
    assert.deepEqual([reply.status, reply.text], [200, "path /delay/1000"]);
    assert.notEqual(reply.origin, "WEBPROXY_POOL_DEFAULT:1");
  });

  // The caller's connection drops while its request is in flight, and the reply is
  // published while it is away. Meanwhile another conversation reuses the id and is
  // answered, so the newest stored reply for the id is not this caller's. Once
  // reconnected, the client reads exactly its own stored subject.
  test("a reply missed while disconnected is read from its own stored subject", TEST_TIMEOUT, async () => {
    const relay = new Relay(Number(new URL(env.nats_url).port));
    const relayed = await connect({
      servers: await relay.start(),
      reconnectTimeWait: 100,
      maxReconnectAttempts: -1,
    });
    try {
      const id = newId();
      const before = await storedReplies();
      let settled = false;
      const inFlight = new Client(relayed)
        .request("GET", url("/delay/1500"), { id, waitMs: 600_000 })
        .finally(() => {
          settled = true;
        });
      // Awaited below; a failure before that must not be an unhandled rejection.
      inFlight.catch(() => {});
      await waitUntil("the upstream call", async () => (await hits("/delay/1500")) === 1);
      relay.cut();
      await waitUntil("the reply stored while cut off", async () => (await storedReplies()) === before + 1);
      const other = await client.request("GET", url("/other"), { id, waitMs: REPLY_WAIT_MS });
      published.push(id);
      assert.equal(other.text, "path /other");
      assert.equal(await storedReplies(), before + 2);
      assert.equal(settled, false, "a reply arrived while cut off");
      relay.heal();
      const reply = await Promise.race([
        inFlight,
        sleep(REPLY_WAIT_MS, null, { ref: false }),
      ]);
      assert.ok(reply, "the stored reply soon after reconnecting, not after the wait");
      assert.deepEqual([reply.id, reply.text], [id, "path /delay/1500"]);
      assert.notEqual(reply.origin, other.origin);
    } finally {
      relay.close();
      await relayed.close();
    }
  });

  test("a large body each way (issue 34)", TEST_TIMEOUT, async () => {
    // A response above the inline limit comes back stored, named by bodyObject, and
    // reads back whole through body.get with the request's message id.
    const size = 2_000_000;
    const reply = await client.request("GET", url(`/bytes/${size}`), {
      largeBody: true,
      waitMs: REPLY_WAIT_MS,
    });
    published.push(reply.id);
    assertValid(validReply, reply.raw);
    assert.equal(reply.ok, true, JSON.stringify(reply.raw));
    assert.equal(reply.bodyObject.size, size);
    const body = await client.readBody(reply);
    assert.equal(body.length, size);
    assert.equal(
      createHash("sha256").update(body).digest("base64url") + "=",
      reply.bodyObject.digest.slice("SHA-256=".length),
    );
    // A request body uploaded through body.put arrives upstream whole.
    const data = Buffer.alloc(3_000_000, 7);
    const uploaded = await client.upload(data);
    assert.equal(uploaded.size, data.length);
    const echoed = await client.request("POST", url("/echo"), {
      bodyObject: uploaded,
      waitMs: REPLY_WAIT_MS,
    });
    published.push(echoed.id);
    const echo = JSON.parse(echoed.text);
    assert.equal(echo.body_len, data.length);
    assert.equal(echo.body_sha256, createHash("sha256").update(data).digest("hex"));
  });

  // Issue 35: a conversation whose upstream holds the request is cancelled by its
  // publisher: the cancel is recorded, the upstream sees the HTTP request dropped long
  // before it would answer, and the one reply says cancelled, with the attempt made.
  test("a cancel drops the attempt in flight", TEST_TIMEOUT, async () => {
    const submitted = await client.submit("GET", url("/hold/10000"));
    published.push(submitted.id);
    assert.match(submitted.msgId, HEX32);
    await waitUntil("the upstream call", async () => (await hits("/hold/10000")) === 1);
    assert.equal(await client.cancel(submitted), "recorded");
    // Within REPLY_WAIT_MS, under the 10 s the upstream holds it: not waited for.
    await waitUntil("the held request dropped", async () => (await dropped("/hold/10000")) === 1);
    const reply = await storedReply(submitted);
    assertValid(validReply, reply.raw);
    assert.equal(reply.ok, false, JSON.stringify(reply.raw));
    assert.equal(reply.error?.code, "cancelled", JSON.stringify(reply.raw));
    assert.equal(reply.attempts, 1);
    // Its one reply stands: a second cancel finds it finished.
    assert.equal(await client.cancel(submitted), "finished");
    assert.equal(await hits("/hold/10000"), 1);
  });

  // The message id is the capability: anyone else's cancel of a conversation in
  // flight, or of an origin that names none, answers unknown, and the conversation goes
  // on to its response.
  test("a cancel with another msg id is unknown and changes nothing", TEST_TIMEOUT, async () => {
    const submitted = await client.submit("GET", url("/delay/2000"));
    published.push(submitted.id);
    await waitUntil("the upstream call", async () => (await hits("/delay/2000")) === 1);
    assert.equal(await client.cancel({ ...submitted, msgId: newMsgId() }), "unknown");
    assert.equal(await client.cancel({ ...submitted, origin: "WEBPROXY_POOL_DEFAULT:1" }), "unknown");
    const reply = await storedReply(submitted);
    assert.deepEqual([reply.status, reply.text], [200, "path /delay/2000"], JSON.stringify(reply.raw));
  });

  test("a cancel of a finished conversation leaves its reply", TEST_TIMEOUT, async () => {
    const submitted = await client.submit("GET", url("/finished"));
    published.push(submitted.id);
    const stored = await storedReply(submitted);
    assert.equal(await client.cancel(submitted), "finished");
    const later = await client.reply(submitted.id, submitted.origin);
    assert.deepEqual(later.raw, stored.raw);
    assert.equal(later.text, "path /finished");
    // What request returns names its conversation too.
    const reply = await client.request("GET", url("/finished"), { waitMs: REPLY_WAIT_MS });
    published.push(reply.id);
    assert.equal(await client.cancel(reply), "finished");
  });

  test("errors are typed", TEST_TIMEOUT, async () => {
    await assert.rejects(client.submit("GET", url("/x"), { pool: "nope" }), NoSuchPool);
    for (const bad of ["a.>", ">", "a b", ""]) {
      await assert.rejects(client.request("GET", url("/x"), { id: bad }), InvalidRequest);
      await assert.rejects(client.reply(bad), InvalidRequest);
    }
  });

  test("everything sent is valid and carries a fresh random Nats-Msg-Id", TEST_TIMEOUT, async () => {
    assert.ok(published.length >= 5, `only ${published.length} requests sent`);
    const arrivedIds = () => new Set([...arrived.values()].map((envelope) => envelope.id));
    for (const start = Date.now(); Date.now() - start < REPLY_WAIT_MS; await sleep(20)) {
      if (published.every((id) => arrivedIds().has(id))) {
        break;
      }
    }
    const ids = arrivedIds();
    for (const id of published) {
      assert.ok(ids.has(id), `${id} never arrived`);
    }
    // Every publish its own random id, never the envelope id: the two conversations
    // that shared an envelope id arrived as two messages.
    for (const [msgId, envelope] of arrived) {
      assertValid(validRequest, envelope);
      assert.match(msgId ?? "", HEX32);
      assert.notEqual(msgId, envelope.id);
    }
    assert.ok(arrived.size > published.length, `${arrived.size} messages for ${published.length} ids`);
  });

  test("the README example runs", TEST_TIMEOUT, async () => {
    const readme = readFileSync(`${pkg}README.md`, "utf8");
    let code = readme.split("```js\n")[1].split("```")[0];
    // The example's addresses, pointed at the live service and upstream instead.
    for (const placeholder of ["nats://127.0.0.1:4222", "https://example.com/"]) {
      assert.ok(code.includes(placeholder), placeholder);
    }
    code = code.replace("nats://127.0.0.1:4222", env.nats_url).replace("https://example.com/", url("/readme"));
    // In a project of its own with the package installed from its tarball, as a user
    // runs it: `import ... from "webproxy-client"` resolves to the installed copy.
    const { project } = await installPacked();
    try {
      writeFileSync(`${project}/example.mjs`, code);
      const { stdout } = await execFileAsync(process.execPath, [`${project}/example.mjs`], {
        cwd: project,
        timeout: REPLY_WAIT_MS,
      });
      assert.equal(stdout, "200 path /readme\n");
    } finally {
      rmSync(project, { recursive: true, force: true });
    }
  });
});
