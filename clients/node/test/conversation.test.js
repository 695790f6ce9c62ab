// webproxy-client's side of a conversation against a fake NATS connection, no server:
// the random Nats-Msg-Id, retrying a publish that is still in process, the origin from
// the publish ack, ignoring live replies of other conversations, reading exactly the
// conversation's own stored subject, and a cancel: what it sends, and asking again
// while the service is busy, as body.get and body.put do.

import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { describe, test } from "node:test";

import { JetStreamApiError } from "@nats-io/jetstream";
import { headers as natsHeaders } from "@nats-io/transport-node";

import {
  BUSY_TRIES,
  BodyError,
  CancelError,
  Client,
  InvalidRequest,
  PUBLISH_TRIES,
  PublishFailed,
  Reply,
  ReplyTimeout,
  isOwnReply,
  newMsgId,
  originOf,
  publishRetrying,
} from "../webproxy-client.js";

const ORIGIN = "WEBPROXY_POOL_DEFAULT:1733025600000123";
const STORED = "webproxy.reply.order-42.WEBPROXY_POOL_DEFAULT.1733025600000123";
const HEX32 = /^[0-9a-f]{32}$/;
// Bounds every fake conversation, so a client that waits for nothing fails.
const TEST_TIMEOUT = { timeout: 10_000 };
const encode = (value) => new TextEncoder().encode(JSON.stringify(value));

function replyPayload(status) {
  return encode({
    v: 1, id: "order-42", outcome: "response", status, headers: {},
    body: `status ${status}`, attempts: 1, duration_ms: 1,
  });
}

function replyMessage(status, origin = ORIGIN) {
  const h = natsHeaders();
  h.set("Webproxy-Outcome", "response");
  if (origin !== null) {
    h.set("Webproxy-Origin", origin);
  }
  return { data: replyPayload(status), headers: h };
}

const ack = (duplicate = false) => ({ stream: "WEBPROXY_POOL_DEFAULT", seq: 1733025600000123, duplicate });
const apiError = (errCode) => ({ error: { code: 503, err_code: errCode, description: `error ${errCode}` } });

/** A subscription whose messages the test pushes. */
class FakeSub {
  #queue = [];
  #waiting = [];
  push(message) {
    const waiter = this.#waiting.shift();
    if (waiter) {
      waiter({ value: message, done: false });
    } else {
      this.#queue.push(message);
    }
  }
  [Symbol.asyncIterator]() {
    return {
      next: () =>
        this.#queue.length > 0
          ? Promise.resolve({ value: this.#queue.shift(), done: false })
          : new Promise((resolve) => this.#waiting.push(resolve)),
    };
  }
  unsubscribe() {}
}

/**
 * Records subscriptions, publishes and lookups. `answers` are what successive
 * publishes get (an ack or an API error); `onPublish(fake)` runs after each stored
 * one; `stored` maps subjects to stored reply payloads.
 */
class FakeNats {
  options = { inboxPrefix: "_INBOX" };
  subscribed = [];
  published = [];
  subscriptionsAtPublish = [];
  lookedUp = [];
  sub = new FakeSub();
  #statusWaiters = [];

  constructor(answers, { onPublish = () => {}, stored = {}, cancels = [], bodies = [] } = {}) {
    this.answers = [...answers];
    // What successive cancels get: an answer, or an Error to throw.
    this.cancels = [...cancels];
    this.cancelled = [];
    // What successive body.get and body.put requests get: a whole message.
    this.bodies = [...bodies];
    this.bodyRequests = [];
    this.onPublish = onPublish;
    this.stored = stored;
  }

  subscribe(subject) {
    this.subscribed.push(subject);
    return this.sub;
  }

  status() {
    return {
      [Symbol.asyncIterator]: () => ({
        next: () => new Promise((resolve) => this.#statusWaiters.push(resolve)),
      }),
    };
  }

  emit(type) {
    for (const waiter of this.#statusWaiters.splice(0)) {
      waiter({ value: { type }, done: false });
    }
  }

  async request(subject, data, opts) {
    if (subject.startsWith("webproxy.request.")) {
      this.subscriptionsAtPublish.push(this.subscribed.length);
      this.published.push({ subject, msgId: opts.headers.get("Nats-Msg-Id") });
      const answer = this.answers.shift();
      if (!answer.error) {
        this.onPublish(this);
      }
      return { data: encode(answer) };
    }
    if (subject.endsWith(".cancel")) {
      this.cancelled.push({ subject, request: JSON.parse(data), at: performance.now() });
      const answer = this.cancels.shift();
      if (answer instanceof Error) {
        throw answer;
      }
      return { data: encode(answer) };
    }
    if (subject.includes(".body.")) {
      this.bodyRequests.push({ subject, request: JSON.parse(data) });
      return this.bodies.shift();
    }
    if (subject === "$JS.API.INFO") {
      return { data: encode({}) };
    }
    const { last_by_subj: wanted } = JSON.parse(new TextDecoder().decode(data));
    if (subject === "$JS.API.STREAM.MSG.GET.WEBPROXY_REPLIES") {
      // The shared stream of webproxy before layout 3, retired and empty here.
      return { data: encode({ error: { code: 404, err_code: 10037, description: "no message found" } }) };
    }
    assert.equal(subject, "$JS.API.STREAM.MSG.GET.WEBPROXY_POOL_DEFAULT_REPLIES");
    this.lookedUp.push(wanted);
    const payload = this.stored[wanted];
    if (!payload) {
      return { data: encode({ error: { code: 404, err_code: 10037, description: "no message found" } }) };
    }
    const message = {
      subject: wanted,
      seq: 1,
      data: Buffer.from(payload).toString("base64"),
      time: new Date().toISOString(),
    };
    return { data: encode({ message }) };
  }
}

describe("a conversation against a fake connection", () => {
  test("msg ids are 32 lowercase hex characters and never repeat", () => {
    const ids = Array.from({ length: 1000 }, newMsgId);
    for (const id of ids) {
      assert.match(id, HEX32);
    }
    assert.equal(new Set(ids).size, ids.length);
  });

  test("the origin is the ack's stream and sequence", () => {
    assert.equal(originOf(ack()), ORIGIN);
  });

  test("only a reply with the own origin counts", () => {
    assert.equal(isOwnReply(replyMessage(200).headers, ORIGIN), true);
    for (const other of ["WEBPROXY_POOL_DEFAULT:1", `${ORIGIN}0`, ""]) {
      assert.equal(isOwnReply(replyMessage(200, other).headers, ORIGIN), false, other);
    }
    assert.equal(isOwnReply(replyMessage(200, null).headers, ORIGIN), false);
    assert.equal(isOwnReply(undefined, ORIGIN), false);
  });

  test("each request publishes with a fresh random msg id, not the envelope id", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([ack(), ack()], { onPublish: (f) => f.sub.push(replyMessage(200)) });
    const client = new Client(fake);
    for (let i = 0; i < 2; i++) {
      await client.request("GET", "http://h/", { id: "order-42", waitMs: 5000 });
    }
    const msgIds = fake.published.map((p) => p.msgId);
    for (const id of msgIds) {
      assert.match(id, HEX32);
    }
    assert.notEqual(msgIds[0], msgIds[1]);
    assert.deepEqual(fake.subscribed, ["webproxy.reply.order-42", "webproxy.reply.order-42"]);
    // Each conversation subscribed before it published.
    assert.deepEqual(fake.subscriptionsAtPublish, [1, 2]);
  });

  test("live replies of other conversations are ignored", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([ack()], {
      onPublish: (f) => {
        f.sub.push(replyMessage(418, "WEBPROXY_POOL_DEFAULT:1"));
        f.sub.push(replyMessage(419, null));
        f.sub.push(replyMessage(200));
      },
    });
    const reply = await new Client(fake).request("GET", "http://h/", { id: "order-42", waitMs: 5000 });
    assert.equal(reply.status, 200);
    assert.equal(reply.origin, ORIGIN);
    assert.deepEqual(fake.lookedUp, []);
  });

  test("a custom replyTo is the only live subject", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([ack()], { onPublish: (f) => f.sub.push(replyMessage(200)) });
    const client = new Client(fake);
    const reply = await client.request("GET", "http://h/", { id: "order-42", replyTo: "app.r.42", waitMs: 5000 });
    assert.equal(reply.status, 200);
    assert.deepEqual(fake.subscribed, ["app.r.42"]);
    assert.deepEqual(fake.lookedUp, []);
    for (const bad of ["app.>", "app.*", "a b", "a..b"]) {
      await assert.rejects(client.request("GET", "http://h/", { replyTo: bad }), InvalidRequest);
    }
  });

  // A caller confined to its own reply space may not read the replies stream: with a
  // replyTo, neither a duplicate ack, nor a reconnect, nor the end of the wait looks
  // there (even where a stored reply would be found).
  test("with a replyTo the stored replies are never read", TEST_TIMEOUT, async () => {
    const replyTo = "callers.a.replies.42";
    const duplicate = new FakeNats([ack(true)], { stored: { [STORED]: replyPayload(201) } });
    await assert.rejects(
      new Client(duplicate).request("GET", "http://h/", { id: "order-42", replyTo, waitMs: 300 }),
      (e) => e instanceof ReplyTimeout && e.origin === ORIGIN && e.replyTo === replyTo && e.message.includes(replyTo),
    );
    const reconnected = new FakeNats([ack()], {
      stored: { [STORED]: replyPayload(202) },
      onPublish: (f) => f.emit("reconnect"),
    });
    await assert.rejects(
      new Client(reconnected).request("GET", "http://h/", { id: "order-42", replyTo, waitMs: 600 }),
      ReplyTimeout,
    );
    for (const fake of [duplicate, reconnected]) {
      assert.deepEqual(fake.subscribed, [replyTo]);
      assert.deepEqual(fake.lookedUp, []);
    }
  });

  test("a publish in process is tried again with the same id", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([apiError(10158), apiError(10158), ack()], {
      onPublish: (f) => f.sub.push(replyMessage(200)),
    });
    const reply = await new Client(fake).request("GET", "http://h/", { id: "order-42", waitMs: 5000 });
    assert.equal(reply.status, 200);
    assert.equal(fake.published.length, 3);
    assert.equal(new Set(fake.published.map((p) => p.msgId)).size, 1);
  });

  test("retries of a publish in process are bounded", TEST_TIMEOUT, async () => {
    const fake = new FakeNats(Array.from({ length: PUBLISH_TRIES }, () => apiError(10158)));
    await assert.rejects(new Client(fake).submit("GET", "http://h/"), PublishFailed);
    assert.equal(fake.published.length, PUBLISH_TRIES);
  });

  test("other publish errors are not retried", TEST_TIMEOUT, async () => {
    for (const error of [new JetStreamApiError(apiError(10071).error), new Error("timeout")]) {
      let calls = 0;
      await assert.rejects(
        publishRetrying("f00d", async () => {
          calls++;
          throw error;
        }),
        error,
      );
      assert.equal(calls, 1);
    }
  });

  test("a duplicate ack reads the own stored subject at once", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([ack(true)], { stored: { [STORED]: replyPayload(201) } });
    const msgId = "f".repeat(32);
    const reply = await new Client(fake).request("GET", "http://h/", { id: "order-42", msgId, waitMs: 600_000 });
    assert.equal(reply.status, 201);
    assert.equal(reply.origin, ORIGIN);
    assert.deepEqual(fake.lookedUp, [STORED]);
    assert.equal(fake.published[0].msgId, msgId);
  });

  test("after a reconnect the own stored subject is read", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([ack()], {
      onPublish: (f) => {
        f.stored[STORED] = replyPayload(202);
        f.emit("reconnect");
      },
    });
    const reply = await new Client(fake).request("GET", "http://h/", { id: "order-42", waitMs: 600_000 });
    assert.equal(reply.status, 202);
    assert.deepEqual(fake.lookedUp, [STORED]);
  });

  test("a timeout reads the stored subject and names the origin", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([ack()]);
    await assert.rejects(
      new Client(fake).request("GET", "http://h/", { id: "order-42", waitMs: 300 }),
      (e) => e instanceof ReplyTimeout && e.id === "order-42" && e.origin === ORIGIN,
    );
    assert.deepEqual(fake.lookedUp, [STORED]);
  });

  test("submit returns the id, origin and msg id", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([ack(), ack()]);
    const submitted = await new Client(fake).submit("GET", "http://h/", { id: "order-42" });
    assert.deepEqual(submitted, { id: "order-42", origin: ORIGIN, msgId: fake.published[0].msgId });
    assert.match(submitted.msgId, HEX32);
    const msgId = "f".repeat(32);
    assert.deepEqual(await new Client(fake).submit("GET", "http://h/", { id: "order-42", msgId }), {
      id: "order-42",
      origin: ORIGIN,
      msgId,
    });
  });

  const MSG_ID = "f".repeat(32);
  const SENT = { id: "order-42", origin: ORIGIN, msg_id: MSG_ID };

  test("a cancel sends the id, origin and msg id and resolves to the state", TEST_TIMEOUT, async () => {
    for (const state of ["recorded", "finished", "unknown"]) {
      const fake = new FakeNats([], { cancels: [{ cancel: state }, { cancel: state }] });
      const client = new Client(fake, { prefix: "acme.webproxy" });
      assert.equal(await client.cancel({ id: "order-42", origin: ORIGIN, msgId: MSG_ID }), state);
      // A Reply of a request made with the client names its conversation too.
      const reply = new Reply(JSON.parse(new TextDecoder().decode(replyPayload(200))), ORIGIN, MSG_ID);
      assert.equal(await client.cancel(reply), state);
      assert.deepEqual(
        fake.cancelled.map(({ subject, request }) => [subject, request]),
        [["acme.webproxy.cancel", SENT], ["acme.webproxy.cancel", SENT]],
      );
    }
  });

  test("a cancel is checked before it is sent", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([]);
    const client = new Client(fake);
    for (const bad of [
      { id: "a.b", origin: ORIGIN, msgId: MSG_ID },
      { id: "order-42", origin: "S:0", msgId: MSG_ID },
      { id: "order-42", origin: ORIGIN, msgId: "a b" },
      { id: "order-42", origin: ORIGIN, msgId: null },
      { id: "order-42", origin: ORIGIN },
      new Reply(JSON.parse(new TextDecoder().decode(replyPayload(200))), ORIGIN),
    ]) {
      await assert.rejects(client.cancel(bad), InvalidRequest, JSON.stringify(bad));
    }
    await assert.rejects(client.cancel(), InvalidRequest);
    assert.deepEqual(fake.cancelled, []);
  });

  test("a busy cancel is asked again with doubling pauses", TEST_TIMEOUT, async () => {
    const busy = { error: { code: "busy", message: "too many cancels at once" } };
    const fake = new FakeNats([], { cancels: [busy, busy, busy, { cancel: "recorded" }] });
    const target = { id: "order-42", origin: ORIGIN, msgId: MSG_ID };
    assert.equal(await new Client(fake).cancel(target), "recorded");
    const times = fake.cancelled.map((c) => c.at);
    const pauses = times.slice(1).map((t, i) => t - times[i]);
    assert.equal(pauses.length, 3);
    // Timers may fire a millisecond early.
    [50, 100, 200].forEach((least, i) => assert.ok(pauses[i] >= least - 2, String(pauses)));

    // BUSY_TRIES in all, then the busy answer is the error.
    const tired = new FakeNats([], { cancels: Array.from({ length: BUSY_TRIES }, () => busy) });
    await assert.rejects(
      new Client(tired).cancel(target),
      (e) => e instanceof CancelError && e.code === "busy" && e.message === "busy: too many cancels at once",
    );
    assert.equal(tired.cancelled.length, 6);
  });

  test("busy body requests are asked again, and the last busy is the error", TEST_TIMEOUT, async () => {
    const body = Buffer.from("a stored body");
    const digest = `SHA-256=${createHash("sha256").update(body).digest("base64url")}=`;
    const busyGet = () => {
      const h = natsHeaders();
      h.set("Webproxy-Body-Error", "busy");
      return { data: encode({ message: "too many body reads at once" }), headers: h };
    };
    const whole = natsHeaders();
    whole.set("Webproxy-Body-Size", String(body.length));
    whole.set("Webproxy-Body-Digest", digest);
    const reply = new Reply({ id: "order-42", outcome: "response" }, ORIGIN, MSG_ID);
    const read = new FakeNats([], { bodies: [busyGet(), busyGet(), { data: body, headers: whole }] });
    assert.deepEqual(await new Client(read).readBody(reply), body);
    assert.deepEqual(read.bodyRequests.map((r) => r.subject), Array(3).fill("webproxy.body.get"));
    const tiredRead = new FakeNats([], { bodies: Array.from({ length: BUSY_TRIES }, busyGet) });
    await assert.rejects(new Client(tiredRead).readBody(reply), (e) => e instanceof BodyError && e.code === "busy");
    assert.equal(tiredRead.bodyRequests.length, 6);

    const busyPut = () => ({ data: encode({ error: { code: "busy", message: "too many uploads at once" } }) });
    const put = new FakeNats([], { bodies: [busyPut(), { data: encode({ size: body.length }) }] });
    const uploaded = await new Client(put).upload(body);
    assert.deepEqual([uploaded.size, uploaded.digest], [body.length, digest]);
    assert.deepEqual(put.bodyRequests.map((r) => r.request.offset), [0, 0]);
    const tiredPut = new FakeNats([], { bodies: Array.from({ length: BUSY_TRIES }, busyPut) });
    await assert.rejects(new Client(tiredPut).upload(body), (e) => e instanceof BodyError && e.code === "busy");
    assert.equal(tiredPut.bodyRequests.length, 6);
  });

  test("other cancel errors reject at once", TEST_TIMEOUT, async () => {
    const target = { id: "order-42", origin: ORIGIN, msgId: MSG_ID };
    for (const code of ["internal", "invalid_request"]) {
      const fake = new FakeNats([], { cancels: [{ error: { code, message: "no" } }] });
      await assert.rejects(new Client(fake).cancel(target), (e) => e instanceof CancelError && e.code === code);
      assert.equal(fake.cancelled.length, 1);
    }
    const unanswered = new FakeNats([], { cancels: [new Error("no responders")] });
    await assert.rejects(new Client(unanswered).cancel(target), (e) => e instanceof CancelError && e.code === "request");
  });

  test("a stored reply is looked up only by a valid origin", TEST_TIMEOUT, async () => {
    const fake = new FakeNats([], { stored: { [STORED]: replyPayload(200) } });
    const client = new Client(fake);
    assert.equal((await client.reply("order-42", ORIGIN)).status, 200);
    assert.equal(await client.reply("order-42", "WEBPROXY_POOL_DEFAULT:1"), null);
    for (const bad of ["", "WEBPROXY_POOL_DEFAULT", "A.B:1", "*:1", ">:1", "S:1:2", "S:-1", "S:x", "S:0", "S:01", undefined]) {
      await assert.rejects(client.reply("order-42", bad), InvalidRequest, String(bad));
    }
    await assert.rejects(client.submit("GET", "http://h/", { msgId: "a b" }), InvalidRequest);
  });
});
