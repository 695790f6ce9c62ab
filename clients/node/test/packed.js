// The package as a user gets it: `npm pack` of this directory, installed from the
// tarball into a fresh project outside it, beside the NATS packages at the versions
// this package's lockfile has (so npm finds them in its cache). Not a test file:
// the tests that use it are test/*.test.js.

import { execFile } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

export const pkg = fileURLToPath(new URL("../", import.meta.url));
const run = promisify(execFile);
const npm = process.platform === "win32" ? "npm.cmd" : "npm";
// npm pack and install on a loaded 2-core CI machine.
const NPM_TIMEOUT_MS = 120_000;
const NATS_PACKAGES = ["@nats-io/jetstream", "@nats-io/nats-core", "@nats-io/transport-node"];

/**
 * Packs this package and installs the tarball into a new temporary project. Resolves
 * with the project's directory and what `npm pack` reported (its `files`). The caller
 * removes the directory.
 */
export async function installPacked() {
  const project = mkdtempSync(join(tmpdir(), "webproxy-client-packed-"));
  const { stdout } = await run(npm, ["pack", "--json", "--pack-destination", project], {
    cwd: pkg,
    timeout: NPM_TIMEOUT_MS,
  });
  const [packed] = JSON.parse(stdout);
  const lock = JSON.parse(readFileSync(`${pkg}package-lock.json`, "utf8"));
  const dependencies = { "webproxy-client": `file:./${packed.filename}` };
  for (const name of NATS_PACKAGES) {
    dependencies[name] = lock.packages[`node_modules/${name}`].version;
  }
  writeFileSync(
    join(project, "package.json"),
    JSON.stringify({ name: "uses-webproxy-client", private: true, type: "module", dependencies }),
  );
  await run(npm, ["install", "--prefer-offline", "--no-audit", "--no-fund"], {
    cwd: project,
    timeout: NPM_TIMEOUT_MS,
  });
  return { project, packed };
}
