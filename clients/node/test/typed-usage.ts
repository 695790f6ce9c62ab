// How a TypeScript caller uses webproxy-client, imported by its package name: checked
// by `npm run typecheck` (tsc --noEmit) against webproxy-client.d.ts, never run.
// `misuses` holds calls the declarations must refuse, each marked as an expected
// error: tsc fails if one of them is accepted.

import { connect } from "@nats-io/transport-node";
import {
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

export function misuses(client: Client, reply: Reply): void {
  // @ts-expect-error status is a number or null, not a string
  const status: string = reply.status;
  // @ts-expect-error waitMs is a number
  void client.request("GET", "http://h/", { waitMs: "10s" });
  // @ts-expect-error there is no such option
  void client.submit("GET", "http://h/", { reply_to: "app.r.1" });
  // @ts-expect-error a Client needs a NATS connection
  void new Client();
  void status;
}
