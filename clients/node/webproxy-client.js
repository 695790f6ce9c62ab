// A small client for webproxy on the official NATS JavaScript packages. It gets
// right what every caller must: subscribe before publishing, set Nats-Msg-Id, pick
// the pool subject, fall back to the stored reply, and tell an error outcome from a
// response. The wire protocol is in the repository's README and
// schema/request.schema.json.

import { randomUUID } from "node:crypto";
import { jetstream, jetstreamManager } from "@nats-io/jetstream";

export const DEFAULT_PREFIX = "webproxy";
export const DEFAULT_POOL = "default";
export const DEFAULT_WAIT_MS = 30_000;

const ID = /^[A-Za-z0-9_-]{1,128}$/;
const POOL = /^[a-z0-9_-]{1,32}$/;
// How often a waiting request looks whether the connection was re-made, which is
// when a live reply can have been missed.
const RECONNECT_CHECK_MS = 250;
const TICK = Symbol("tick");

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
/** No reply came within the wait, and none is stored. */
export class ReplyTimeout extends WebproxyError {
  constructor(id, waitMs) {
    super(`no reply to ${id} within ${waitMs} ms, and none is stored`);
    this.id = id;
    this.waitMs = waitMs;
  }
}
/** The replies stream could not be read. */
export class LookupFailed extends WebproxyError {}
/** A reply that is not a valid reply envelope. */
export class BadReply extends WebproxyError {}

/** The final reply of a conversation; `raw` is the envelope as received. */
export class Reply {
  constructor(raw) {
    this.raw = raw;
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
}

/** A fresh conversation id. */
export function newId() {
  return randomUUID().replaceAll("-", "");
}

/**
 * The request envelope as it is published. `body` is sent as text when it is a
 * string and as base64 when it is bytes (a Uint8Array or Buffer); optional fields
 * left undefined are left out.
 */
export function buildEnvelope(method, url, fields = {}) {
  const { id, headers, body, replyTo, timeoutMs, deadline, metadata } = fields;
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
  return envelope;
}

// The id and pool are subject tokens: a '.' or wildcard would subscribe or publish
// to the wrong subjects instead of getting an invalid_request answer.
function check(pattern, what, value) {
  if (typeof value !== "string" || !pattern.test(value)) {
    throw new InvalidRequest(`invalid ${what} ${JSON.stringify(value)}: must match ${pattern}`);
  }
}

function decode(data) {
  let raw;
  try {
    raw = JSON.parse(new TextDecoder().decode(data));
  } catch (e) {
    throw new BadReply(`the reply is not JSON: ${e.message}`, { cause: e });
  }
  if (raw === null || typeof raw !== "object" || !["response", "error"].includes(raw.outcome)) {
    throw new BadReply("the reply is not a reply envelope");
  }
  return new Reply(raw);
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
  #repliesStream;
  #reconnects = 0;

  constructor(nc, { prefix = DEFAULT_PREFIX } = {}) {
    this.#nc = nc;
    this.#js = jetstream(nc);
    this.#prefix = prefix;
    this.#repliesStream = `${prefix.replaceAll(".", "_").toUpperCase()}_REPLIES`;
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
   * error outcome. `fields` are the envelope's (see buildEnvelope). A reply that
   * could have been missed is read from the replies stream: when the id was already
   * stored, after a reconnect, and when the wait runs out.
   */
  async request(method, url, { pool = DEFAULT_POOL, waitMs = DEFAULT_WAIT_MS, ...fields } = {}) {
    const envelope = buildEnvelope(method, url, fields);
    const id = envelope.id;
    check(ID, "id", id);
    const sub = this.#nc.subscribe(`${this.#prefix}.reply.${id}`);
    try {
      let seenReconnects = this.#reconnects;
      const deadline = Date.now() + waitMs;
      const ack = await this.#publish(envelope, pool);
      if (ack.duplicate) {
        const stored = await this.reply(id);
        if (stored) {
          return stored;
        }
      }
      const messages = sub[Symbol.asyncIterator]();
      // One pending read for the whole wait: a read that lost a race to the clock
      // still holds the message it resolves with.
      const next = messages.next();
      for (let remaining = waitMs; remaining > 0; remaining = deadline - Date.now()) {
        const tick = new Promise((resolve) =>
          setTimeout(resolve, Math.min(remaining, RECONNECT_CHECK_MS), TICK),
        );
        const result = await Promise.race([next, tick]);
        if (result !== TICK) {
          if (result.done) {
            break;
          }
          return decode(result.value.data);
        }
        // Subscriptions are replayed as part of reconnecting, so a reply published
        // after this lookup reaches the subscription.
        if (this.#reconnects !== seenReconnects) {
          seenReconnects = this.#reconnects;
          const stored = await this.reply(id);
          if (stored) {
            return stored;
          }
        }
      }
      const stored = await this.reply(id);
      if (!stored) {
        throw new ReplyTimeout(id, waitMs);
      }
      return stored;
    } finally {
      sub.unsubscribe();
    }
  }

  /**
   * Publishes a request and returns its id once JetStream has stored it; read the
   * reply later with `reply`.
   */
  async submit(method, url, { pool = DEFAULT_POOL, ...fields } = {}) {
    const envelope = buildEnvelope(method, url, fields);
    check(ID, "id", envelope.id);
    await this.#publish(envelope, pool);
    return envelope.id;
  }

  /**
   * The stored final reply of conversation `id`, or null if there is none (yet, or
   * any more: replies are kept for the service's reply_max_age).
   */
  async reply(id) {
    check(ID, "id", id);
    let message;
    try {
      this.#jsm ??= await jetstreamManager(this.#nc);
      message = await this.#jsm.streams.getMessage(this.#repliesStream, {
        last_by_subj: `${this.#prefix}.reply.${id}`,
      });
    } catch (e) {
      this.#jsm = undefined;
      throw new LookupFailed(`cannot read the stored reply: ${e.message}`, { cause: e });
    }
    return message ? decode(message.data) : null;
  }

  async #publish(envelope, pool) {
    check(POOL, "pool", pool);
    const subject = `${this.#prefix}.request.${pool}`;
    try {
      // msgID is sent as the Nats-Msg-Id header.
      return await this.#js.publish(subject, JSON.stringify(envelope), { msgID: envelope.id });
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
