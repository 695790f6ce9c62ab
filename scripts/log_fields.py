#!/usr/bin/env python3
"""Finds Rust `Debug` formatting in log lines: what an operator reads should be Display.

In every `info!`, `warn!`, `error!`, `debug!` and `trace!` invocation (tracing's
macros, qualified or not) of the workspace's crates' sources (crates/*/src, test
code left out: items under `#[cfg(test)]` and the module files they declare), it
reports a field recorded with Debug (`?value`, `name = ?value`) and a `{:?}`-style
placeholder (`{:?}`, `{x:?}`, `{:#?}`) in the message. Write a field with `%` or as a
plain value, durations with humantime, lists joined with ", ", errors with `%e`.

Exit status: 1 when one is found; 2 on a usage error. Standard library only.

    python3 scripts/log_fields.py [ROOT]
    python3 scripts/log_fields.py --self-test
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from module_cycles import lex, workspace_arguments, workspace_of, write_tree

MACRO = re.compile(r"\b(?:info|warn|error|debug|trace)!\s*\(")
# A tracing field's Debug sigil: `?` that starts a field or a field's value. The try
# operator follows an expression (an identifier, `)` or `]`), never these.
DEBUG_FIELD = re.compile(r"(?<=[(,=\s])\?\s*[A-Za-z_&*]")
PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
CFG_TEST = re.compile(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")
MOD_DECL = re.compile(r"\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;")


def matching(code: str, open_at: int) -> int:
    """Where the bracket opened at `open_at` closes (the end of `code` if it does not)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(open_at, len(code)):
        c = code[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
    return len(code)


def field_text(code: str, start: int, end: int) -> str:
    """The field that starts at `start`: up to the next comma outside brackets."""
    i = start
    while i < end and code[i] != ",":
        i = matching(code, i) + 1 if code[i] in "([{" else i + 1
    return " ".join(code[start:min(i, end)].split())


def test_code(code: str) -> tuple[list[tuple[int, int]], list[str]]:
    """The spans of the items under `#[cfg(test)]`, and the modules they declare in
    files of their own (`#[cfg(test)] mod tests;`)."""
    spans, modules = [], []
    for m in CFG_TEST.finditer(code):
        if decl := MOD_DECL.match(code, m.end()):
            modules.append(decl.group(1))
            spans.append((m.start(), decl.end()))
            continue
        brace, semi = code.find("{", m.end()), code.find(";", m.end())
        if brace < 0 or 0 <= semi < brace:
            spans.append((m.start(), len(code) if semi < 0 else semi))
        else:
            spans.append((m.start(), matching(code, brace)))
    return spans, modules


def findings(source: str) -> tuple[list[tuple[int, str]], list[str]]:
    """Each Debug formatting in a log line of `source` outside test code, as (line,
    what), and the modules that `source` declares as test code in files of their own."""
    code, strings = lex(source)
    tests, modules = test_code(code)
    line_of = lambda at: source.count("\n", 0, at) + 1  # noqa: E731
    found = []
    for m in MACRO.finditer(code):
        if any(start <= m.start() < end for start, end in tests):
            continue
        start, end = m.end() - 1, matching(code, m.end() - 1)
        for field in DEBUG_FIELD.finditer(code, start, end):
            written = field_text(code, field.start(), end)
            found.append((line_of(field.start()), f"a Debug field `{written}`"))
        for s, e in strings:
            if start < s < end:
                for p in PLACEHOLDER.finditer(source, s, e):
                    spec = p.group(1)
                    if spec is not None and ":" in spec and spec.endswith("?"):
                        found.append((line_of(p.start()), f"a Debug placeholder `{p.group(0)}`"))
    return sorted(found), modules


def module_file(declaring: Path, module: str) -> list[Path]:
    """Where `mod module;` declared in `declaring` may be."""
    directory = declaring.parent
    if declaring.name not in ("lib.rs", "main.rs", "mod.rs"):
        directory = directory / declaring.stem
    return [directory / f"{module}.rs", directory / module / "mod.rs"]


def check(workspace: Path) -> list[str]:
    """Every finding under crates/*/src of `workspace`, as `path:line: what`."""
    files = sorted(workspace.glob("crates/*/src/**/*.rs"))
    results, skipped = {}, set()
    for path in files:
        found, modules = findings(path.read_text(encoding="utf-8"))
        results[path] = found
        for module in modules:
            for candidate in module_file(path, module):
                skipped.add(candidate)
                # A test module's own submodules are test code too.
                skipped.update(candidate.parent.glob(f"{candidate.stem}/**/*.rs"))
    return [
        f"{path.relative_to(workspace)}:{line}: {what}"
        for path in files
        if path not in skipped
        for line, what in results[path]
    ]


SELF_TEST = {
    "crates/a/src/lib.rs": """//! a
mod tests_only;
#[cfg(test)]
mod tests;
fn f(grace: Duration, e: Error, items: &[u8]) -> Result<(), Error> {
    info!(in_flight, grace = ?grace, "draining");
    warn!(pool, ?e, "failed");
    tracing::debug!("items {:?} and {items:#?}", items, "x");
    error!(error = %e, count = f()?, "fine: {{:?}} is no placeholder, {} is not Debug", g()?);
    let s = format!("{:?}", grace); // not a log line
    // warn!(?commented, "out");
    trace!("a question? {x} {y:>4}");
    let c = '(';
    info!(
        pools = ?retained.iter().collect::<Vec<_>>(),
        "serving {c}"
    );
    Ok(())
}
#[cfg(test)]
fn helper() { warn!(?x, "test code"); }
""",
    "crates/a/src/tests.rs": """//! tests
fn t() { warn!(?y, "{:?}", z); }
""",
    "crates/a/src/tests_only.rs": """//! kept
#[cfg(test)]
mod inner {
    fn t() { warn!(?y, "{:?}", z); }
}
fn u() { debug!(r#"raw {:?}"#, v); }
""",
}

SELF_TEST_WANT = [
    "crates/a/src/lib.rs:6: a Debug field `?grace`",
    "crates/a/src/lib.rs:7: a Debug field `?e`",
    "crates/a/src/lib.rs:8: a Debug placeholder `{:?}`",
    "crates/a/src/lib.rs:8: a Debug placeholder `{items:#?}`",
    "crates/a/src/lib.rs:15: a Debug field `?retained.iter().collect::<Vec<_>>()`",
    "crates/a/src/tests_only.rs:6: a Debug placeholder `{:?}`",
]


def self_test() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_tree(Path(tmp), SELF_TEST)
        got = check(Path(tmp))
    if got != SELF_TEST_WANT:
        print("log_fields self-test failed:", file=sys.stderr)
        print(" got:\n  " + "\n  ".join(got), file=sys.stderr)
        print(" want:\n  " + "\n  ".join(SELF_TEST_WANT), file=sys.stderr)
        return 1
    print("log_fields: self-test passed")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workspace_arguments(parser)
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    workspace = workspace_of("log_fields", args.root)
    if workspace is None:
        return 2
    found = check(workspace)
    for line in found:
        print(line)
    if found:
        print(
            f"log_fields: {len(found)} Debug formatting(s) in log lines; write Display "
            "(`%value`, humantime for durations, lists joined with \", \")"
        )
        return 1
    print("log_fields: no Debug formatting in log lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
