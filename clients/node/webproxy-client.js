// A small client for webproxy on the official NATS JavaScript packages. It gets
// right what every caller must: subscribe before publishing, publish with a fresh
// random Nats-Msg-Id, pick the pool subject, keep only the reply of its own
// conversation (its origin, <STREAM>:<seq> from the publish ack), fall back to its
// own stored reply (unless it listens on a replyTo of its own), and tell an error
// outcome from a response. The wire protocol is in the repository's docs/protocol.md
// and schema/request.schema.json. Its types are in webproxy-client.d.ts.

import { createHash, randomBytes, randomUUID } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import { JetStreamApiError, jetstream, jetstreamManager } from "@nats-io/jetstream";

export const DEFAULT_PREFIX = "webproxy";
export const DEFAULT_POOL = "default";
export const DEFAULT_WAIT_MS = 30_000;

const ID = /^[A-Za-z0-9_-]{1,128}$/;
const POOL = /^[a-z0-9_-]{1,32}$/;
const CALLER = /^[A-Za-z0-9_-]{1,64}$/;
// A conversation's origin: its pool stream (one subject token) and stream sequence.
const ORIGIN = /^[A-Za-z0-9_-]{1,255}:[1-9][0-9]{0,19}$/;
// A literal subject: non-empty tokens, no wildcards, no white space.
const SUBJECT = /^[^\s.*>]+(\.[^\s.*>]+)*$/;
// A Nats-Msg-Id set by the caller: printable, no white space.
const MSG_ID = /^[!-~]{1,128}$/;
const ORIGIN_HEADER = "Webproxy-Origin";
// JetStream's "duplicate message id is in process": an earlier publish with the same
// id is not stored yet. Tried again with the same id, this many times in all, this
// many milliseconds apart.
const IN_PROCESS = 10158;
// JetStream's "stream not found".
const STREAM_NOT_FOUND = 10059;
export const PUBLISH_TRIES = 10;
export const PUBLISH_RETRY_DELAY_MS = 50;
// How often a waiting request looks whether the connection was re-made, which is
// when a live reply can have been missed.
const RECONNECT_CHECK_MS = 250;
const TICK = Symbol("tick");
// How many times in all a cancel, body.get or body.put answered `busy` is sent (the
// service answers a fixed number at once), and the pause before the second, doubling
// after: 50 ms to 800 ms, 1.55 s in all, as the Rust client does.
export const BUSY_TRIES = 6;
export const BUSY_PAUSE_MS = 50;
// How long one cancel (or body) request waits for its answer.
const ANSWER_TIMEOUT_MS = 10_000;
const CANCEL_STATES = ["recorded", "finished", "unknown"];

/** Talking to webproxy failed. An error *outcome* is not one: it is a Reply. */
export class WebproxyError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = new.target.name;
  }
}
/** The id or pool cannot be used; nothing was sent. */
export class InvalidRequest extends WebproxyError {}
/** No stream stores the pool's request subject. */
export class NoSuchPool extends WebproxyError {}
/** JetStream did not confirm that it stored the request. */
export class PublishFailed extends WebproxyError {}
/**
 * No reply came within the wait, and none is stored. The request was stored: read
 * its reply later with `client.reply(e.id, e.origin)`. With a `replyTo` (then
 * `e.replyTo`) the stored replies were not read: a caller confined to its own reply
 * space may not read them, and captures the copies to its replyTo in a stream of its
 * own instead.
 */
export class ReplyTimeout extends WebproxyError {
  constructor(id, waitMs, origin, replyTo = null) {
    super(
      replyTo === null
        ? `no reply to ${id} (origin ${origin}) within ${waitMs} ms, and none is stored`
        : `no reply to ${id} (origin ${origin}) on ${replyTo} within ${waitMs} ms ` +
            "(the stored replies are not read for a replyTo)",
    );
    this.id = id;
    this.waitMs = waitMs;
    this.origin = origin;
    this.replyTo = replyTo;
  }
}
/** The replies stream could not be read. */
export class LookupFailed extends WebproxyError {}
/** A reply that is not a valid reply envelope. */
export class BadReply extends WebproxyError {}

/**
 * A stored body could not be read (body.get) or an upload was refused (body.put);
 * `code` is the service's (`not_found`, `expired`, `quota`, ...).
 */
export class BodyError extends WebproxyError {
  constructor(code, message) {
    super(`${code}: ${message}`);
    this.code = code;
  }
}

/**
 * A cancel got no state: the service answered an error (`invalid_request`, `busy`
 * still after the tries, or `internal`: nothing was recorded, ask again), or `request`
 * when it could not be asked. Nothing is said of the conversation.
 */
export class CancelError extends WebproxyError {
  constructor(code, message, options) {
    super(`${code}: ${message}`, options);
    this.code = code;
  }
}

// How much of a body one body.put message carries: about 350 KB in base64, well within
// the default 1 MiB max_payload.
const UPLOAD_CHUNK = 256 * 1024;

function digestOf(bytes) {
  return `SHA-256=${createHash("sha256").update(bytes).digest("base64url")}=`;
}

/** Whether a JSON answer (cancel, body.put) is the error `busy`. */
function busyInJson(answer) {
  try {
    return JSON.parse(new TextDecoder().decode(answer.data))?.error?.code === "busy";
  } catch {
    return false;
  }
}

/** Whether a body.get answer is the error `busy` (its errors are headers). */
function busyInHeader(answer) {
  return answer.headers?.get("Webproxy-Body-Error") === "busy";
}

/**
 * The final reply of a conversation; `raw` is the envelope as received and `origin`
 * the conversation's origin, `<STREAM>:<seq>`.
 */
export class Reply {
  constructor(raw, origin = null, msgId = null) {
    this.raw = raw;
    this.origin = origin;
    /** The Nats-Msg-Id the request was published with: what reading its stored body asks for. */
    this.msgId = msgId;
  }
  get id() {
    return this.raw.id;
  }
  get outcome() {
    return this.raw.outcome;
  }
  /** Whether this is the upstream's HTTP response rather than an error outcome. */
  get ok() {
    return this.raw.outcome === "response";
  }
  get status() {
    return this.raw.status ?? null;
  }
  get headers() {
    return this.raw.headers ?? {};
  }
  /** The body's bytes, whichever way it travelled. */
  get body() {
    if (this.raw.body_base64 !== undefined) {
      return Buffer.from(this.raw.body_base64, "base64");
    }
    return Buffer.from(this.raw.body ?? "", "utf8");
  }
  get text() {
    return this.body.toString("utf8");
  }
  /** `{code, message, status?}` on an error outcome, else null. */
  get error() {
    return this.raw.error ?? null;
  }
  get attempts() {
    return this.raw.attempts;
  }
  get metadata() {
    return this.raw.metadata;
  }
  /**
   * Where a stored body is (`{bucket, name, size, digest}`), for a request that set
   * `largeBody` and got one above the inline limit; read it with `client.readBody(reply)`.
   */
  get bodyObject() {
    return this.raw.body_object ?? null;
  }
}

/**
 * A fresh envelope id. It correlates the reply with the request and names the live
 * reply subject; it need not be secret, and anyone may reuse it.
 */
export function newId() {
  return randomUUID().replaceAll("-", "");
}

/**
 * A fresh Nats-Msg-Id: 32 lowercase hex characters (128 bits from the operating
 * system's CSPRNG), so no other caller can guess it and pre-empt the publish.
 */
export function newMsgId() {
  return randomBytes(16).toString("hex");
}

/** The origin `<STREAM>:<seq>` of the conversation a JetStream publish ack stored. */
export function originOf(ack) {
  return `${ack.stream}:${ack.seq}`;
}

/**
 * Whether a reply message with `headers` (a MsgHdrs, or undefined) answers the
 * conversation `origin`. Anyone may reuse an id: a reply with another origin, or
 * none, is not this conversation's.
 */
export function isOwnReply(headers, origin) {
  return headers?.get(ORIGIN_HEADER) === origin;
}

/**
 * Publishes with `publishOnce(msgId)`, and again with the same id while JetStream
 * answers that a message with that id is still in process (err_code 10158), up to
 * `tries` in all, `delayMs` apart.
 */
export async function publishRetrying(
  msgId,
  publishOnce,
  { tries = PUBLISH_TRIES, delayMs = PUBLISH_RETRY_DELAY_MS } = {},
) {
  for (let attempt = 1; ; attempt++) {
    try {
      return await publishOnce(msgId);
    } catch (e) {
      if (attempt < tries && e instanceof JetStreamApiError && e.code === IN_PROCESS) {
        await sleep(delayMs);
        continue;
      }
      throw e;
    }
  }
}

function ownMsgId(msgId) {
  if (msgId === undefined) {
    return newMsgId();
  }
  check(MSG_ID, "msgId", msgId);
  return msgId;
}

/**
 * The request envelope as it is published. `body` is sent as text when it is a
 * string and as base64 when it is bytes (a Uint8Array or Buffer); optional fields
 * left undefined are left out.
 */
export function buildEnvelope(method, url, fields = {}) {
  const { id, headers, body, replyTo, timeoutMs, deadline, metadata, largeBody, bodyObject } =
    fields;
  const envelope = { v: 1, id: id ?? newId(), method, url };
  if (headers && Object.keys(headers).length > 0) {
    envelope.headers = headers;
  }
  if (body instanceof Uint8Array) {
    envelope.body_base64 = Buffer.from(body).toString("base64");
  } else if (body !== undefined) {
    envelope.body = body;
  }
  const optional = { reply_to: replyTo, timeout_ms: timeoutMs, deadline, metadata };
  for (const [name, value] of Object.entries(optional)) {
    if (value !== undefined) {
      envelope[name] = value;
    }
  }
  if (largeBody) {
    envelope.large_body = true;
  }
  if (bodyObject !== undefined) {
    envelope.body_object = bodyObject;
  }
  return envelope;
}

// The id and pool are subject tokens: a '.' or wildcard would subscribe or publish
// to the wrong subjects instead of getting an invalid_request answer.
function check(pattern, what, value) {
  if (typeof value !== "string" || !pattern.test(value)) {
    throw new InvalidRequest(`invalid ${what} ${JSON.stringify(value)}: must match ${pattern}`);
  }
}

function decode(data, origin, msgId = null) {
  let raw;
  try {
    raw = JSON.parse(new TextDecoder().decode(data));
  } catch (e) {
    throw new BadReply(`the reply is not JSON: ${e.message}`, { cause: e });
  }
  if (raw === null || typeof raw !== "object" || !["response", "error"].includes(raw.outcome)) {
    throw new BadReply("the reply is not a reply envelope");
  }
  return new Reply(raw, origin, msgId);
}

function isNoResponders(error) {
  for (let e = error; e; e = e.cause) {
    if (e.name === "NoRespondersError" || /no responders/i.test(e.message ?? "")) {
      return true;
    }
  }
  return false;
}

/** A webproxy client over one NATS connection. */
export class Client {
  #nc;
  #js;
  #jsm;
  #prefix;
  #caller;
  #retiredRepliesStream;
  #reconnects = 0;

  constructor(nc, { prefix = DEFAULT_PREFIX, caller = null } = {}) {
    if (caller !== null) {
      check(CALLER, "caller", caller);
    }
    this.#nc = nc;
    this.#js = jetstream(nc);
    this.#prefix = prefix;
    this.#caller = caller;
    // The shared replies stream of webproxy before its stream layout 3, retired at the
    // upgrade: it holds the replies stored before it until they age out.
    this.#retiredRepliesStream = `${prefix.replaceAll(".", "_").toUpperCase()}_REPLIES`;
    // Ends by itself when the connection closes.
    (async () => {
      for await (const status of nc.status()) {
        if (status.type === "reconnect") {
          this.#reconnects++;
        }
      }
    })().catch(() => {});
  }

  /**
   * Sends a request and waits up to `waitMs` for its final reply, which may be an
   * error outcome. `fields` are the envelope's (see buildEnvelope).
   *
   * The live subscription is made before publishing, and only a live reply whose
   * `Webproxy-Origin` is this conversation's counts. Without `replyTo` it listens on
   * `<prefix>.reply.<id>`, and a reply that could have been missed is read from this
   * conversation's own stored subject: on a duplicate publish ack, after a
   * reconnect, and when the wait runs out. With `replyTo` it listens there only and
   * reads no stored reply: a caller confined to its own reply space may neither
   * subscribe to `<prefix>.reply.>` nor read the replies stream, so it captures the
   * copies to its replyTo in a stream of its own if it must survive a reconnect.
   *
   * Every call is a new conversation with a fresh random Nats-Msg-Id. Pass the
   * `msgId` of an earlier call only to publish that very message again (after a
   * crash, within the duplicate window): the same conversation answers.
   */
  async request(
    method,
    url,
    { pool = DEFAULT_POOL, waitMs = DEFAULT_WAIT_MS, msgId, ...fields } = {},
  ) {
    const envelope = buildEnvelope(method, url, fields);
    const id = envelope.id;
    check(ID, "id", id);
    const replyTo = envelope.reply_to ?? null;
    const live = replyTo ?? `${this.#prefix}.reply.${id}`;
    check(SUBJECT, "replyTo", live);
    // Only a caller that listens on the service's own reply subjects reads the store.
    const lookups = replyTo === null;
    const publishId = ownMsgId(msgId);
    const sub = this.#nc.subscribe(live);
    try {
      let seenReconnects = this.#reconnects;
      const deadline = Date.now() + waitMs;
      const ack = await this.#publish(envelope, pool, publishId);
      const origin = originOf(ack);
      if (ack.duplicate && lookups) {
        const stored = await this.reply(id, origin);
        if (stored) {
          stored.msgId = publishId;
          return stored;
        }
      }
      const messages = sub[Symbol.asyncIterator]();
      // One pending read at a time: a read that lost a race to the clock still holds
      // the message it resolves with.
      let next = messages.next();
      for (let remaining = waitMs; remaining > 0; remaining = deadline - Date.now()) {
        let timer;
        const tick = new Promise((resolve) => {
          timer = setTimeout(resolve, Math.min(remaining, RECONNECT_CHECK_MS), TICK);
        });
        const result = await Promise.race([next, tick]);
        clearTimeout(timer);
        if (result !== TICK) {
          if (result.done) {
            break;
          }
          if (isOwnReply(result.value.headers, origin)) {
            return decode(result.value.data, origin, publishId);
          }
          // Another conversation that uses the same id (or subject).
          next = messages.next();
        }
        // Subscriptions are replayed as part of reconnecting, so a reply published
        // after this lookup reaches the subscription.
        if (lookups && this.#reconnects !== seenReconnects) {
          seenReconnects = this.#reconnects;
          const stored = await this.reply(id, origin);
          if (stored) {
            stored.msgId = publishId;
            return stored;
          }
        }
      }
      if (!lookups) {
        throw new ReplyTimeout(id, waitMs, origin, replyTo);
      }
      const stored = await this.reply(id, origin);
      if (!stored) {
        throw new ReplyTimeout(id, waitMs, origin);
      }
      stored.msgId = publishId;
      return stored;
    } finally {
      sub.unsubscribe();
    }
  }

  /**
   * Publishes a request and returns `{id, origin, msgId}` once JetStream has stored
   * it; read the reply later with `reply(id, origin)`, take it back with
   * `cancel(submitted)`. `msgId` is the Nats-Msg-Id it was published with: the
   * capability to cancel it, for its publisher alone.
   */
  async submit(method, url, { pool = DEFAULT_POOL, msgId, ...fields } = {}) {
    const envelope = buildEnvelope(method, url, fields);
    check(ID, "id", envelope.id);
    const publishId = ownMsgId(msgId);
    const ack = await this.#publish(envelope, pool, publishId);
    return { id: envelope.id, origin: originOf(ack), msgId: publishId };
  }

  /**
   * Takes back the conversation `{id, origin, msgId}` names (what `submit` returns,
   * or a Reply), through `<prefix>.cancel`; the message id is the capability, so only
   * its publisher can. Resolves to `"recorded"`: its next delivery ends it and an
   * attempt in flight is dropped; its reply says `cancelled` (or is the response of an
   * attempt that finished first), and it still arrives as its reply. `"finished"`: it
   * has its final reply, unchanged. `"unknown"`: no such conversation, or not this
   * message id. An answer `busy` is asked again (6 tries in all, 50 ms apart,
   * doubling); any other error rejects with a CancelError.
   */
  async cancel({ id, origin, msgId } = {}) {
    check(ID, "id", id);
    check(ORIGIN, "origin", origin);
    check(MSG_ID, "msgId", msgId);
    const payload = JSON.stringify({ id, origin, msg_id: msgId });
    let answer;
    try {
      answer = await this.#askWhileBusy(`${this.#prefix}.cancel`, payload, busyInJson);
    } catch (e) {
      throw new CancelError("request", `cancel was not answered: ${e.message}`, { cause: e });
    }
    let answered;
    try {
      answered = JSON.parse(new TextDecoder().decode(answer.data));
    } catch (e) {
      throw new CancelError("internal", `the cancel answer is not JSON: ${e.message}`, { cause: e });
    }
    if (CANCEL_STATES.includes(answered?.cancel)) {
      return answered.cancel;
    }
    const error = answered?.error;
    if (error === null || typeof error !== "object") {
      throw new CancelError("internal", "the cancel answer has neither a state nor an error");
    }
    throw new CancelError(String(error.code), String(error.message ?? ""));
  }

  /**
   * The stored final reply of the conversation `origin` with envelope id `id`, or
   * null if there is none (yet, or any more: replies are kept for the service's
   * reply_max_age). Another conversation's reply for the same id is never it: the
   * lookup reads exactly `<prefix>.reply.<id>.<STREAM>.<seq>`, in the replies stream
   * of the origin's pool stream, `<STREAM>_REPLIES`, and, when that has none, in the
   * shared stream `<PREFIX>_REPLIES` that webproxy retired when it gave each pool its
   * own (replies stored before that upgrade). It needs read access to those streams,
   * which an isolated caller (one confined to its own replyTo subjects) does not have.
   */
  async reply(id, origin) {
    check(ID, "id", id);
    check(ORIGIN, "origin", origin);
    const [stream, seq] = origin.split(":");
    const subject = `${this.#prefix}.reply.${id}.${stream}.${seq}`;
    for (const replies of [`${stream}_REPLIES`, this.#retiredRepliesStream]) {
      const message = await this.#last(replies, subject);
      if (message) {
        return decode(message.data, origin);
      }
    }
    return null;
  }

  /**
   * The stored body a reply names (`reply.bodyObject`), read whole through
   * `<prefix>.body.get` (which callers without read access to the stores may use too)
   * with the message id the request was published with, chunk by chunk, and checked
   * against its size and digest. A Buffer. A chunk answered `busy` is asked again, as
   * a cancel is.
   */
  async readBody(reply) {
    if (!reply.origin || !reply.msgId) {
      throw new InvalidRequest("readBody needs the reply of a request made with this client");
    }
    const request = { id: reply.id, origin: reply.origin, msg_id: reply.msgId };
    const chunks = [];
    let headers;
    for (;;) {
      let answer;
      try {
        answer = await this.#askWhileBusy(`${this.#prefix}.body.get`, JSON.stringify(request), busyInHeader);
      } catch (e) {
        throw new BodyError("request", `body.get was not answered: ${e.message}`);
      }
      headers = answer.headers;
      const code = headers?.get("Webproxy-Body-Error");
      if (code) {
        const message = JSON.parse(new TextDecoder().decode(answer.data) || "{}").message ?? "";
        throw new BodyError(code, message);
      }
      chunks.push(Buffer.from(answer.data));
      const cursor = headers?.get("Webproxy-Body-Cursor");
      if (!cursor) {
        break;
      }
      request.cursor = cursor;
    }
    const body = Buffer.concat(chunks);
    const digest = digestOf(body);
    if (
      headers?.get("Webproxy-Body-Size") !== String(body.length) ||
      headers?.get("Webproxy-Body-Digest") !== digest
    ) {
      throw new BodyError("digest", `read ${body.length} bytes with ${digest}; the store says otherwise`);
    }
    return body;
  }

  /**
   * Uploads `data` for a request to `pool` through `<prefix>.body.put.<pool>` (under
   * this client's caller name, if it has one), 256 KiB per message, resuming where the
   * service says the upload ends; a piece answered `busy` is sent again, as a cancel
   * is. Pass the result as the envelope's `bodyObject`.
   */
  async upload(data, { pool = DEFAULT_POOL } = {}) {
    check(POOL, "pool", pool);
    const subject =
      this.#caller === null ? `${this.#prefix}.body.put.${pool}` : `${this.#prefix}.body.put.${pool}.${this.#caller}`;
    const bytes = Buffer.from(data);
    const name = newMsgId();
    let offset = 0;
    while (offset < bytes.length) {
      const put = {
        upload: name,
        offset,
        data_base64: bytes.subarray(offset, offset + UPLOAD_CHUNK).toString("base64"),
      };
      let answer;
      try {
        answer = await this.#askWhileBusy(subject, JSON.stringify(put), busyInJson);
      } catch (e) {
        throw new BodyError("request", `body.put was not answered: ${e.message}`);
      }
      const answered = JSON.parse(new TextDecoder().decode(answer.data));
      if (answered.error && !(answered.error.code === "offset" && answered.size !== undefined)) {
        throw new BodyError(answered.error.code, answered.error.message);
      }
      offset = answered.size;
    }
    return { upload: name, size: bytes.length, digest: digestOf(bytes) };
  }

  /** Sends `payload` to `subject` and resolves to the answer, asking again while
   * `busy(answer)` says the service was busy, up to BUSY_TRIES times in all, with
   * doubling pauses; the last answer is the result, busy or not. */
  async #askWhileBusy(subject, payload, busy) {
    for (let attempt = 1, pauseMs = BUSY_PAUSE_MS; ; attempt++, pauseMs *= 2) {
      const answer = await this.#nc.request(subject, payload, { timeout: ANSWER_TIMEOUT_MS });
      if (attempt === BUSY_TRIES || !busy(answer)) {
        return answer;
      }
      await sleep(pauseMs);
    }
  }

  /** The last message on `subject` in `stream`; null when there is none, or no such
   * stream (the retired shared one, once deleted). */
  async #last(stream, subject) {
    try {
      this.#jsm ??= await jetstreamManager(this.#nc);
      return await this.#jsm.streams.getMessage(stream, { last_by_subj: subject });
    } catch (e) {
      if (e?.code === STREAM_NOT_FOUND || e?.name === "StreamNotFoundError") {
        return null;
      }
      this.#jsm = undefined;
      throw new LookupFailed(`cannot read the stored reply: ${e.message}`, { cause: e });
    }
  }

  async #publish(envelope, pool, msgId) {
    check(POOL, "pool", pool);
    const subject =
      this.#caller === null ? `${this.#prefix}.request.${pool}` : `${this.#prefix}.request.${pool}.${this.#caller}`;
    const payload = JSON.stringify(envelope);
    try {
      // msgID is sent as the Nats-Msg-Id header.
      return await publishRetrying(msgId, (id) => this.#js.publish(subject, payload, { msgID: id }));
    } catch (e) {
      if (isNoResponders(e)) {
        throw new NoSuchPool(`no pool ${JSON.stringify(pool)} exists (nothing stores ${subject})`, {
          cause: e,
        });
      }
      throw new PublishFailed(`the request was not stored: ${e.message}`, { cause: e });
    }
  }
}
