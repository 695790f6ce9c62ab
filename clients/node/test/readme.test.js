// The top-level README shows this package's own README example, the one
// client.test.js runs against a live webproxy ("the README example runs"): a change
// to either must be made to both. Needs no server and no dependencies.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { pkg } from "./packed.js";

/** The first fenced `js` block of a Markdown file. */
function jsBlock(path) {
  const blocks = readFileSync(path, "utf8").split("```js\n");
  assert.ok(blocks.length > 1, `${path} has no js block`);
  return blocks[1].split("```")[0];
}

test("the top-level README shows the example that runs", () => {
  assert.equal(jsBlock(`${pkg}../../README.md`), jsBlock(`${pkg}README.md`));
});
