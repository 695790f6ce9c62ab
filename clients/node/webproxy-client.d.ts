// Type declarations of webproxy-client.js, the public API: what a TypeScript caller
// (or an editor) sees. `npm run typecheck` checks them, and test/typed-usage.ts
// against them, with `tsc --noEmit`.

import type { PubAck } from "@nats-io/jetstream";
import type { MsgHdrs, NatsConnection } from "@nats-io/nats-core";

export declare const DEFAULT_PREFIX: "webproxy";
export declare const DEFAULT_POOL: "default";
export declare const DEFAULT_WAIT_MS: number;
export declare const PUBLISH_TRIES: number;
export declare const PUBLISH_RETRY_DELAY_MS: number;
/** How many times in all a cancel answered `busy` is sent. */
export declare const BUSY_TRIES: number;
/** The pause before a cancel's second try, doubling after. */
export declare const BUSY_PAUSE_MS: number;

/** Talking to webproxy failed. An error *outcome* is not one: it is a Reply. */
export declare class WebproxyError extends Error {
  constructor(message?: string, options?: ErrorOptions);
}
/** The id or pool cannot be used; nothing was sent. */
export declare class InvalidRequest extends WebproxyError {}
/** No stream stores the pool's request subject. */
export declare class NoSuchPool extends WebproxyError {}
/** JetStream did not confirm that it stored the request. */
export declare class PublishFailed extends WebproxyError {}
/**
 * No reply came within the wait, and none is stored. The request was stored: read
 * its reply later with `client.reply(e.id, e.origin)`. With a `replyTo` (then
 * `e.replyTo`) the stored replies were not read at all.
 */
export declare class ReplyTimeout extends WebproxyError {
  constructor(id: string, waitMs: number, origin: string, replyTo?: string | null);
  readonly id: string;
  readonly waitMs: number;
  readonly origin: string;
  readonly replyTo: string | null;
}
/** The replies stream could not be read. */
export declare class LookupFailed extends WebproxyError {}
/** A reply that is not a valid reply envelope. */
export declare class BadReply extends WebproxyError {}
/**
 * A stored body could not be read (body.get) or an upload was refused (body.put);
 * `code` is the service's (`not_found`, `expired`, `quota`, ...).
 */
export declare class BodyError extends WebproxyError {
  constructor(code: string, message: string);
  readonly code: string;
}

/**
 * A cancel got no state: the service answered an error (`invalid_request`, `busy`
 * still after the tries, or `internal`: nothing was recorded, ask again), or `request`
 * when it could not be asked.
 */
export declare class CancelError extends WebproxyError {
  constructor(code: string, message: string, options?: ErrorOptions);
  readonly code: string;
}

/**
 * What became of a cancel: `recorded` (its next delivery ends it; its reply says
 * `cancelled`, or is the response of an attempt that finished first), `finished` (it
 * has its final reply, unchanged) or `unknown` (no such conversation, or not the
 * message id it was published with).
 */
export type CancelState = "recorded" | "finished" | "unknown";

/** Where a stored response body is (a reply's `body_object`). */
export interface BodyObject {
  bucket: string;
  name: string;
  size: number;
  /** `SHA-256=` and the SHA-256 in padded base64url. */
  digest: string;
}

/** An uploaded request body, as the envelope's `body_object` names it. */
export interface UploadRef {
  upload: string;
  size: number;
  digest: string;
}

/** An HTTP header's value: one string, or one per repetition of the header. */
export type HeaderValues = string | string[];

/** The protocol's closed set of error codes (schema/reply.schema.json). */
export type ErrorCode =
  | "invalid_request"
  | "denied"
  | "expired"
  | "upstream_error"
  | "retries_exhausted"
  | "transport_error"
  | "response_too_large"
  | "queue_full"
  | "internal"
  | "cancelled";

/** An error outcome's details. */
export interface ErrorInfo {
  code: ErrorCode;
  message: string;
  status?: number;
}

/** A reply envelope as received (schema/reply.schema.json). */
export interface ReplyEnvelope {
  v: number;
  id: string;
  outcome: "response" | "error";
  status?: number;
  headers?: Record<string, HeaderValues>;
  body?: string;
  body_base64?: string;
  body_object?: BodyObject;
  error?: ErrorInfo;
  attempts: number;
  duration_ms: number;
  metadata?: unknown;
}

/** A request envelope as published (schema/request.schema.json). */
export interface RequestEnvelope {
  v: 1;
  id: string;
  method: string;
  url: string;
  headers?: Record<string, HeaderValues>;
  body?: string;
  body_base64?: string;
  reply_to?: string;
  timeout_ms?: number;
  deadline?: string;
  metadata?: unknown;
  large_body?: boolean;
  body_object?: UploadRef;
}

/** The envelope's fields, as `buildEnvelope`, `request` and `submit` take them. */
export interface EnvelopeFields {
  /** The envelope id (default `newId()`): for correlation, need not be secret. */
  id?: string;
  headers?: Record<string, HeaderValues>;
  /** Sent as text when a string, as base64 when bytes. */
  body?: string | Uint8Array;
  /**
   * A subject of the caller's own that gets a copy of the reply. `request` then
   * listens there only and reads no stored reply.
   */
  replyTo?: string;
  timeoutMs?: number;
  /** An RFC 3339 date-time after which the request is not attempted. */
  deadline?: string;
  /** Any JSON, echoed in the reply. */
  metadata?: unknown;
  /** Lets the reply name a stored body above the inline limit (`reply.bodyObject`). */
  largeBody?: boolean;
  /** An uploaded body (what `client.upload` returns), in place of `body`. */
  bodyObject?: UploadRef;
}

export interface SubmitOptions extends EnvelopeFields {
  /** The pool (default `"default"`). */
  pool?: string;
  /** The Nats-Msg-Id of an earlier call, to publish that very message again. */
  msgId?: string;
}

export interface RequestOptions extends SubmitOptions {
  /** How long to wait for the final reply (default 30 000 ms). */
  waitMs?: number;
}

export interface ClientOptions {
  /** The deployment's subject prefix (default `"webproxy"`). */
  prefix?: string;
  /**
   * Publish requests as this caller, on `<prefix>.request.<pool>.<caller>`: the name
   * NATS permissions let the connection publish under, whose reply space the service's
   * `[streams] reply_to_allow` (`{caller}`) gives the requests' `replyTo`.
   */
  caller?: string | null;
}

/**
 * A request JetStream has stored; `origin` is `<STREAM>:<seq>`, `msgId` the
 * Nats-Msg-Id it was published with (the capability `cancel` shows).
 */
export interface Submitted {
  id: string;
  origin: string;
  msgId: string;
}

/** What names a conversation to cancel: a `Submitted`, a `Reply`, or the three by hand. */
export interface CancelTarget {
  id: string;
  origin: string | null;
  msgId: string | null;
}

/**
 * The final reply of a conversation; `raw` is the envelope as received and `origin`
 * the conversation's origin, `<STREAM>:<seq>`.
 */
export declare class Reply {
  constructor(raw: ReplyEnvelope, origin?: string | null, msgId?: string | null);
  readonly raw: ReplyEnvelope;
  readonly origin: string | null;
  /** The Nats-Msg-Id the request was published with: what reading its stored body asks for. */
  msgId: string | null;
  get id(): string;
  get outcome(): "response" | "error";
  /** Whether this is the upstream's HTTP response rather than an error outcome. */
  get ok(): boolean;
  get status(): number | null;
  get headers(): Record<string, HeaderValues>;
  /** The body's bytes, whichever way it travelled. */
  get body(): Buffer;
  get text(): string;
  /** The details of an error outcome, else null. */
  get error(): ErrorInfo | null;
  get attempts(): number;
  get metadata(): unknown;
  /** Where a stored body is, for a request that set `largeBody`; else null. */
  get bodyObject(): BodyObject | null;
}

/** A fresh envelope id; it need not be secret, and anyone may reuse it. */
export declare function newId(): string;
/** A fresh Nats-Msg-Id: 32 lowercase hex characters from the CSPRNG. */
export declare function newMsgId(): string;
/** The origin `<STREAM>:<seq>` of the conversation a JetStream publish ack stored. */
export declare function originOf(ack: Pick<PubAck, "stream" | "seq">): string;
/** Whether a reply message with `headers` answers the conversation `origin`. */
export declare function isOwnReply(headers: MsgHdrs | undefined, origin: string): boolean;
/**
 * Publishes with `publishOnce(msgId)`, and again with the same id while JetStream
 * answers that a message with that id is still in process.
 */
export declare function publishRetrying<T>(
  msgId: string,
  publishOnce: (msgId: string) => Promise<T>,
  options?: { tries?: number; delayMs?: number },
): Promise<T>;
/** The request envelope as it is published. */
export declare function buildEnvelope(
  method: string,
  url: string,
  fields?: EnvelopeFields,
): RequestEnvelope;

/** A webproxy client over one NATS connection. */
export declare class Client {
  constructor(nc: NatsConnection, options?: ClientOptions);
  /**
   * Sends a request and waits up to `waitMs` for its final reply, which may be an
   * error outcome. Without `replyTo` it listens on `<prefix>.reply.<id>` and reads
   * the conversation's stored reply when the live one may have been missed; with
   * `replyTo` it listens there only and reads no stored reply.
   */
  request(method: string, url: string, options?: RequestOptions): Promise<Reply>;
  /** Publishes a request and resolves once JetStream has stored it. */
  submit(method: string, url: string, options?: SubmitOptions): Promise<Submitted>;
  /**
   * Takes back the conversation `{id, origin, msgId}` names (what `submit` returns):
   * `"recorded"`, `"finished"` or `"unknown"`. An answer `busy` is asked again;
   * another error rejects with a CancelError, a missing or invalid field with an
   * InvalidRequest.
   */
  cancel(conversation: CancelTarget): Promise<CancelState>;
  /** The stored final reply of the conversation `origin` with envelope id `id`, or null. */
  reply(id: string, origin: string): Promise<Reply | null>;
  /** The stored body `reply` names, read whole through body.get and checked. */
  readBody(reply: Reply): Promise<Buffer>;
  /** Uploads `data` through body.put; pass the result as `bodyObject`. */
  upload(data: Uint8Array, options?: { pool?: string }): Promise<UploadRef>;
}
