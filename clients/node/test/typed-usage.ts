// How a TypeScript caller uses webproxy-client, imported by its package name: checked
// by `npm run typecheck` (tsc --noEmit) against webproxy-client.d.ts, never run.
// `misuses` holds calls the declarations must refuse, each marked as an expected
// error: tsc fails if one of them is accepted.

import { connect } from "@nats-io/transport-node";
import {
  CancelError,
  type CancelState,
  Client,
  type ErrorInfo,
  InvalidRequest,
  type Reply,
  ReplyTimeout,
  type Submitted,
  WebproxyError,
  buildEnvelope,
  newMsgId,
} from "webproxy-client";

export async function fetchOrder(url: string): Promise<[number, string]> {
  const nc = await connect({ servers: "nats://127.0.0.1:4222" });
  const client = new Client(nc, { prefix: "webproxy" });
  try {
    const reply: Reply = await client.request("POST", url, {
      pool: "default",
      waitMs: 10_000,
      headers: { Accept: "application/json", "X-Multi": ["a", "b"] },
      body: new Uint8Array([0, 1]),
      metadata: { order: 42 },
    });
    const error: ErrorInfo | null = reply.error;
    if (error !== null) {
      return [error.status ?? 0, `${error.code}: ${error.message}`];
    }
    return [reply.status ?? 0, reply.text];
  } catch (e) {
    if (e instanceof ReplyTimeout) {
      const later: Reply | null = await client.reply(e.id, e.origin);
      return [0, later?.text ?? ""];
    }
    if (e instanceof InvalidRequest || e instanceof WebproxyError) {
      return [0, e.message];
    }
    throw e;
  } finally {
    await nc.close();
  }
}

export async function submitTo(client: Client, replyTo: string): Promise<string> {
  const submitted: Submitted = await client.submit("GET", "http://127.0.0.1/", {
    replyTo,
    msgId: newMsgId(),
  });
  const envelope = buildEnvelope("GET", "http://127.0.0.1/", { replyTo });
  return `${submitted.id} ${submitted.origin} ${envelope.reply_to ?? ""}`;
}

export async function takeBack(client: Client, url: string): Promise<string> {
  const submitted: Submitted = await client.submit("GET", url);
  const msgId: string = submitted.msgId;
  try {
    const state: CancelState = await client.cancel(submitted);
    const byHand: CancelState = await client.cancel({ id: submitted.id, origin: submitted.origin, msgId });
    return `${state} ${byHand}`;
  } catch (e) {
    if (e instanceof CancelError) {
      return e.code;
    }
    throw e;
  }
}

export async function misuses(client: Client, reply: Reply): Promise<void> {
  // @ts-expect-error status is a number or null, not a string
  const status: string = reply.status;
  // @ts-expect-error waitMs is a number
  void client.request("GET", "http://h/", { waitMs: "10s" });
  // @ts-expect-error there is no such option
  void client.submit("GET", "http://h/", { reply_to: "app.r.1" });
  // @ts-expect-error a Client needs a NATS connection
  void new Client();
  // @ts-expect-error cancel needs the message id too
  void client.cancel({ id: "x", origin: "S:1" });
  // @ts-expect-error a cancel state is one of three strings
  const state: "cancelled" = await client.cancel(reply);
  void status;
  void state;
}
