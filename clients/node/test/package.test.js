// webproxy-client as published: `npm pack` ships the module, its declarations and
// the package metadata only; installed from the tarball into a project of its own,
// it is imported by its name, exports what webproxy-client.d.ts declares, and a
// typed caller type-checks against it there (tsc --noEmit, with the declarations the
// tarball carries).

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { copyFileSync, readFileSync, realpathSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { promisify } from "node:util";

import { installPacked, pkg } from "./packed.js";

const run = promisify(execFile);
const TEST_TIMEOUT = { timeout: 180_000 };

/** The names webproxy-client.d.ts declares as exported values. */
function declaredValues() {
  const declarations = readFileSync(`${pkg}webproxy-client.d.ts`, "utf8");
  const names = [...declarations.matchAll(/^export declare (?:const|class|function) (\w+)/gm)];
  return names.map((m) => m[1]).sort();
}

describe("the packed package", TEST_TIMEOUT, () => {
  let project;
  let packed;

  before(async () => {
    ({ project, packed } = await installPacked());
  });

  after(() => {
    if (project) {
      rmSync(project, { recursive: true, force: true });
    }
  });

  test("ships the module, its declarations and its metadata, nothing else", () => {
    const files = packed.files.map((f) => f.path).sort();
    assert.deepEqual(files, ["README.md", "package.json", "webproxy-client.d.ts", "webproxy-client.js"]);
    assert.equal(packed.name, "webproxy-client");
  });

  test("is imported by its name from the project and exports what it declares", async () => {
    const script = `
      import * as client from "webproxy-client";
      import { fileURLToPath } from "node:url";
      console.log(JSON.stringify({
        names: Object.keys(client).sort(),
        at: fileURLToPath(import.meta.resolve("webproxy-client")),
      }));
    `;
    const { stdout } = await run(process.execPath, ["--input-type=module", "-e", script], {
      cwd: project,
    });
    const { names, at } = JSON.parse(stdout);
    assert.equal(realpathSync(at), realpathSync(join(project, "node_modules/webproxy-client/webproxy-client.js")));
    assert.deepEqual(names, declaredValues());
  });

  test("a typed caller type-checks against the installed declarations", async () => {
    copyFileSync(`${pkg}test/typed-usage.ts`, join(project, "typed-usage.ts"));
    const tsconfig = JSON.parse(
      readFileSync(`${pkg}tsconfig.json`, "utf8").replace(/^\s*\/\/.*$/gm, ""),
    );
    tsconfig.compilerOptions.typeRoots = [`${pkg}node_modules/@types`];
    tsconfig.files = ["typed-usage.ts"];
    writeFileSync(join(project, "tsconfig.json"), JSON.stringify(tsconfig));
    const tsc = `${pkg}node_modules/typescript/bin/tsc`;
    const result = await run(process.execPath, [tsc, "--noEmit", "-p", project], { cwd: project }).catch(
      (e) => e,
    );
    assert.equal(result.code ?? 0, 0, `${result.stdout}${result.stderr}`);
  });
});
