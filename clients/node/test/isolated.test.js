// webproxy-client as an isolated caller, under deploy/nats/authorization.conf's
// permissions (clients/live_env.py --isolated): caller_a may subscribe only to its own
// space `callers.a.>` and may not read the stored replies. With a replyTo there, the
// client listens on it only and never reads the replies stream: its reply arrives, a
// wait that runs out is a ReplyTimeout naming the replyTo (not a refused lookup), and
// the server reports no permission violation, which it does for a subscription
// outside the space.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";

import { connect } from "@nats-io/transport-node";

import { Client, ReplyTimeout, newId } from "../webproxy-client.js";
import { startLiveEnv, stopLiveEnv } from "./live-env.js";

const REPLY_WAIT_MS = 20_000;
const TEST_TIMEOUT = { timeout: 60_000 };

describe("an isolated caller", () => {
  let live;
  let env;

  before(async () => {
    live = startLiveEnv({ isolated: true });
    env = await live.ready;
  });

  after(async () => {
    await stopLiveEnv(live);
  });

  test("listens on its replyTo only", TEST_TIMEOUT, async () => {
    const nc = await connect({
      servers: env.nats_url,
      user: "caller_a",
      pass: env.passwords.caller_a,
      // JetStream publish acks come to the inbox: it must be in the caller's space.
      inboxPrefix: "callers.a._INBOX",
    });
    const reported = [];
    (async () => {
      for await (const status of nc.status()) {
        if (status.type === "error") {
          reported.push(String(status.error?.message ?? status.error));
        }
      }
    })().catch(() => {});
    try {
      // caller_a may publish requests only under its own caller name.
      const client = new Client(nc, { caller: "a" });
      const id = newId();
      const reply = await client.request("GET", `${env.upstream_url}/isolated`, {
        id,
        replyTo: `callers.a.replies.${id}`,
        waitMs: REPLY_WAIT_MS,
      });
      assert.equal(reply.id, id);
      assert.equal(reply.text, "path /isolated");

      const slow = newId();
      await assert.rejects(
        client.request("GET", `${env.upstream_url}/delay/3000`, {
          id: slow,
          replyTo: `callers.a.replies.${slow}`,
          waitMs: 300,
        }),
        (e) => e instanceof ReplyTimeout && e.replyTo === `callers.a.replies.${slow}`,
      );
      await nc.flush();
      assert.deepEqual(reported, []);

      // The control: what the client must not do is reported here.
      nc.subscribe(`webproxy.reply.${id}`);
      await nc.flush();
      for (const start = Date.now(); reported.length === 0 && Date.now() - start < REPLY_WAIT_MS; ) {
        await sleep(20);
      }
      assert.equal(reported.length, 1, reported.join("\n"));
      assert.match(reported[0], new RegExp(`webproxy\\.reply\\.${id}`));
    } finally {
      await nc.close();
    }
  });
});
