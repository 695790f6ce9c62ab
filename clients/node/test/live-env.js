// clients/live_env.py as a child process, for the live tests: it prints what it
// started as one JSON line once the service is ready, and stops everything when its
// stdin closes. Not a test file: the tests that use it are test/*.test.js.

import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const repo = fileURLToPath(new URL("../../../", import.meta.url));
// A cold start on a loaded 2-core CI machine.
const START_TIMEOUT_MS = 60_000;

/**
 * Starts clients/live_env.py (with `--isolated`: under deploy/nats/authorization.conf's
 * accounts and users) and returns the child and a promise of what it prints.
 */
export function startLiveEnv({ isolated = false } = {}) {
  const args = [`${repo}clients/live_env.py`, ...(isolated ? ["--isolated"] : [])];
  const child = spawn("python3", args, { stdio: ["pipe", "pipe", "inherit"] });
  const ready = new Promise((resolve, reject) => {
    const lines = createInterface({ input: child.stdout });
    lines.once("line", (line) => resolve(JSON.parse(line)));
    child.once("exit", (code) => reject(new Error(`live_env.py exited with ${code}`)));
    setTimeout(() => reject(new Error("live_env.py not ready in time")), START_TIMEOUT_MS).unref();
  });
  return { child, ready };
}

/** Stops what `startLiveEnv` started, if it did. */
export async function stopLiveEnv(live) {
  if (live) {
    // Closing stdin tells live_env.py to stop everything it started.
    live.child.stdin.end();
    await new Promise((resolve) => live.child.once("exit", resolve));
  }
}
