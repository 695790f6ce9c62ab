#!/usr/bin/env python3
"""Finds import cycles between the modules of each Rust crate in the workspace.

Every crate root (src/lib.rs, src/main.rs, src/bin/*.rs, and tests/, benches/ and
examples/ targets) is followed through its `mod` declarations. Every `crate::`,
`super::` and `self::` path in a module (in `use` trees and in expressions) is
resolved to the module it names, following `pub use` re-exports. A reference from
module a::x::... to a::y::... is an edge x -> y among the children of `a`; references
to an ancestor or a descendant are not (a parent and its children may use each
other). A cycle is a strongly connected set of sibling modules.

References made only by test code (a module declared under `#[cfg(test)]`) are left
out unless --include-tests is given.

Exit status: 1 when a cycle is found, unless --report is given (then always 0);
2 on a usage error. Standard library only.

    python3 scripts/module_cycles.py [--report] [--include-tests] [--verbose] [ROOT]
    python3 scripts/module_cycles.py --self-test
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

SKIP_DIRS = {"target", "fuzz", ".git", "node_modules", ".venv", ".venv-clients"}


# ---------------------------------------------------------------- lexing


_RAW_STRING = re.compile(r'b?r(#*)"')
_CHAR = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]*\}|x[0-9a-fA-F]{2}|.)|[^'\\\n])'")


def lex(source: str) -> tuple[str, list[tuple[int, int]]]:
    """`source` with comments, string and char literals blanked (newlines kept), and
    where each string literal's text is (its quotes included). Shared with
    scripts/log_fields.py."""
    out: list[str] = []
    strings: list[tuple[int, int]] = []
    i, n = 0, len(source)

    def blank(text: str) -> str:
        return re.sub(r"[^\n]", " ", text)

    while i < n:
        c = source[i]
        if source.startswith("//", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
        elif source.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if source.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif source.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
        elif (m := _RAW_STRING.match(source, i)) and (
            i == 0 or not (source[i - 1].isalnum() or source[i - 1] == "_")
        ):
            end = source.find('"' + m.group(1), m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            strings.append((i, j))
        elif c == '"':
            j = i + 1
            while j < n and source[j] != '"':
                j += 2 if source[j] == "\\" else 1
            j += 1
            strings.append((i, j))
        elif c == "'" and (m := _CHAR.match(source, i)):
            j = m.end()
        else:
            out.append(c)
            i += 1
            continue
        out.append(blank(source[i:j]))
        i = j
    return "".join(out), strings


def strip(source: str) -> str:
    """`source` with comments, string and char literals blanked (newlines kept)."""
    return lex(source)[0]


TOKEN = re.compile(r"\$?[A-Za-z_][A-Za-z0-9_]*|::|[{}(),*;]|\S")


@dataclass
class Tok:
    text: str
    pos: int
    line: int


def tokens(text: str) -> list[Tok]:
    toks, line, last = [], 1, 0
    for m in TOKEN.finditer(text):
        line += text.count("\n", last, m.start())
        last = m.start()
        toks.append(Tok(m.group(0), m.start(), line))
    return toks


MOD_DECL = re.compile(
    r"((?:#\s*\[(?:[^\[\]]|\[[^\[\]]*\])*\]\s*)*)"
    r"(?:pub\s*(?:\([^)]*\))?\s*)?\bmod\s+([A-Za-z_][A-Za-z0-9_]*)\s*([;{])"
)
CFG_TEST = re.compile(r"cfg\s*\(\s*test\s*\)")
PATH_ATTR = re.compile(r'#\s*\[\s*path\s*=\s*"([^"]+)"\s*\]')


# ---------------------------------------------------------------- crate model


@dataclass
class Ref:
    source: tuple[str, ...]
    path: tuple[str, ...]
    line: int
    test: bool


@dataclass
class Crate:
    name: str
    root: Path
    modules: dict[tuple[str, ...], bool] = field(default_factory=dict)  # path -> test-only
    files: dict[tuple[str, ...], Path] = field(default_factory=dict)
    refs: list[tuple[Path, Ref]] = field(default_factory=list)
    reexports: dict[tuple[str, ...], dict[str, tuple[str, ...]]] = field(
        default_factory=lambda: defaultdict(dict)
    )


def parse_use_tree(toks: list[Tok], i: int, prefix: tuple[str, ...]):
    """Parses a path or use tree starting at toks[i]; returns (paths, next index)."""
    paths: list[tuple[str, ...]] = []
    path = list(prefix)
    while i < len(toks):
        t = toks[i].text
        if t == "{":
            i += 1
            while i < len(toks) and toks[i].text != "}":
                sub, i = parse_use_tree(toks, i, tuple(path))
                paths.extend(sub)
                if i < len(toks) and toks[i].text == ",":
                    i += 1
            return paths, i + 1
        if t == "*":
            paths.append(tuple(path))
            return paths, i + 1
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t):
            if t != "self":
                path.append(t)
            i += 1
            if i < len(toks) and toks[i].text == "::":
                i += 1
                continue
            # `as name`, generics, a call: the path ends here.
            if i < len(toks) and toks[i].text == "as":
                i += 2
            paths.append(tuple(path))
            return paths, i
        break
    paths.append(tuple(path))
    return paths, i


def scan_file(crate: Crate, file: Path, module: tuple[str, ...], test: bool, pending: list):
    text = strip(file.read_text(encoding="utf-8"))
    decls = {m.start(2): m for m in MOD_DECL.finditer(text)}
    toks = tokens(text)
    # Inline modules: (path, depth at which the block opened, test-only).
    stack: list[tuple[tuple[str, ...], int, bool]] = [(module, 0, test)]
    depth = 0
    i = 0
    while i < len(toks):
        tok = toks[i]
        cur, _, cur_test = stack[-1]
        if tok.text == "{":
            depth += 1
        elif tok.text == "}":
            depth -= 1
            if len(stack) > 1 and depth < stack[-1][1]:
                stack.pop()
        elif tok.text == "mod" and i + 1 < len(toks) and toks[i + 1].pos in decls:
            m = decls[toks[i + 1].pos]
            name, kind = m.group(2), m.group(3)
            is_test = cur_test or bool(CFG_TEST.search(m.group(1)))
            child = cur + (name,)
            crate.modules[child] = is_test
            if kind == "{":
                depth += 1
                stack.append((child, depth, is_test))
                i += 3
                continue
            attr = PATH_ATTR.search(m.group(1))
            pending.append((file, cur, name, is_test, attr.group(1) if attr else None))
        elif tok.text in ("crate", "super", "self") and (
            i + 1 < len(toks) and toks[i + 1].text == "::"
        ):
            prev = toks[i - 1].text if i else ""
            if prev in ("::", "$"):  # part of a longer path, or `$crate`
                i += 1
                continue
            base = list(cur)
            j = i
            while j + 1 < len(toks) and toks[j].text in ("crate", "super", "self") and toks[
                j + 1
            ].text == "::":
                word = toks[j].text
                if word == "crate":
                    base = []
                elif word == "super":
                    base = base[:-1]
                j += 2
            paths, end = parse_use_tree(toks, j, tuple(base))
            is_use = any(toks[k].text == "use" for k in range(max(0, i - 3), i))
            for p in paths:
                crate.refs.append((file, Ref(cur, p, tok.line, cur_test)))
            if is_use and prev != "::":
                record_reexports(crate, toks, i, cur, paths)
            i = max(end, i + 1)
            continue
        i += 1
    # Relative `pub use child::{...}` (no crate/super/self): re-exports of children.
    for m in re.finditer(r"\bpub\s+use\s+([A-Za-z_][A-Za-z0-9_]*)\s*::", text):
        start = next(k for k, t in enumerate(toks) if t.pos == m.start(1))
        paths, _ = parse_use_tree(toks, start, module)
        for p in paths:
            if p:
                crate.reexports[module][p[-1]] = p


def record_reexports(crate, toks, i, cur, paths):
    k = i - 1
    while k >= 0 and toks[k].text != "use":
        k -= 1
    if k >= 0 and any(toks[x].text == "pub" for x in range(max(0, k - 4), k)):
        for p in paths:
            if p:
                crate.reexports[cur][p[-1]] = p


def module_file(directory: Path, name: str) -> Path | None:
    for candidate in (directory / f"{name}.rs", directory / name / "mod.rs"):
        if candidate.is_file():
            return candidate
    return None


def child_dir(file: Path) -> Path:
    if file.name in ("mod.rs", "lib.rs", "main.rs") or file.parent.name in (
        "bin",
        "tests",
        "benches",
        "examples",
    ):
        return file.parent
    return file.parent / file.stem


def load_crate(name: str, root: Path) -> Crate:
    crate = Crate(name, root)
    crate.modules[()] = False
    crate.files[()] = root
    pending: list = []
    scan_file(crate, root, (), False, pending)
    while pending:
        parent_file, parent, child, test, path_attr = pending.pop()
        if path_attr:
            file = parent_file.parent / path_attr
        else:
            file = module_file(child_dir(parent_file), child)
        if file is None or not file.is_file():
            continue
        crate.files[parent + (child,)] = file
        scan_file(crate, file, parent + (child,), test, pending)
    return crate


def resolve(crate: Crate, path: tuple[str, ...], hops: int = 0) -> tuple[str, ...]:
    """The deepest module that `path` names (through re-exports)."""
    best: tuple[str, ...] = ()
    for k in range(len(path) + 1):
        if path[:k] in crate.modules:
            best = path[:k]
        else:
            break
    rest = path[len(best) :]
    if rest and hops < 8:
        target = crate.reexports.get(best, {}).get(rest[0])
        if target and target != path:
            return resolve(crate, target + rest[1:], hops + 1)
    return best


# ---------------------------------------------------------------- graph


def edges_of(crate: Crate, include_tests: bool):
    """{parent: {(a, b): [where, ...]}} among siblings of each parent module."""
    edges: dict = defaultdict(lambda: defaultdict(list))
    for file, ref in crate.refs:
        if ref.test and not include_tests:
            continue
        target = resolve(crate, ref.path)
        src = ref.source
        common = 0
        while common < min(len(src), len(target)) and src[common] == target[common]:
            common += 1
        if common == len(src) or common == len(target):
            continue  # an ancestor or a descendant
        parent = src[:common]
        edges[parent][(src[common], target[common])].append(f"{file}:{ref.line}")
    return edges


def strongly_connected(nodes, succ) -> list[list[str]]:
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def shortest_cycle(comp: list[str], succ) -> list[str]:
    """One shortest cycle through the component's first member, for reading."""
    start = comp[0]
    members = set(comp)
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(succ.get(v, ())):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def elementary_cycles(comp: list[str], succ, limit: int = 50) -> list[list[str]]:
    """The component's simple cycles (at most `limit`), each from its least member."""
    members = sorted(comp)
    out: list[list[str]] = []

    def walk(start, v, path, seen):
        for w in sorted(succ.get(v, ())):
            if len(out) >= limit:
                return
            if w == start:
                out.append(path + [start])
            elif w in comp and w > start and w not in seen:
                walk(start, w, path + [w], seen | {w})

    for start in members:
        walk(start, start, [start], {start})
    return out


def cycles_of(crate: Crate, include_tests: bool):
    found = []
    for parent, pairs in sorted(edges_of(crate, include_tests).items()):
        succ = defaultdict(set)
        for a, b in pairs:
            succ[a].add(b)
        nodes = {a for a, _ in pairs} | {b for _, b in pairs}
        for comp in strongly_connected(nodes, succ):
            inside = {
                (a, b): where
                for (a, b), where in sorted(pairs.items())
                if a in comp and b in comp
            }
            found.append((parent, comp, shortest_cycle(comp, succ), inside, succ))
    return found


# ---------------------------------------------------------------- workspace


def crate_roots(workspace: Path):
    for manifest in sorted(workspace.rglob("Cargo.toml")):
        rel = manifest.relative_to(workspace)
        if any(part in SKIP_DIRS for part in rel.parts):
            continue
        base = manifest.parent
        text = manifest.read_text(encoding="utf-8")
        if "[package]" not in text:
            continue
        m = re.search(r'^\s*name\s*=\s*"([^"]+)"', text, re.M)
        package = m.group(1) if m else base.name
        roots = []
        for rel_root in ("src/lib.rs", "src/main.rs"):
            if (base / rel_root).is_file():
                roots.append(base / rel_root)
        for sub in ("src/bin", "tests", "benches", "examples"):
            directory = base / sub
            if directory.is_dir():
                roots.extend(sorted(directory.glob("*.rs")))
                roots.extend(sorted(directory.glob("*/main.rs")))
        for root in roots:
            label = package if root.parent == base / "src" else f"{package} {root.relative_to(base)}"
            yield label, root


SELF_TEST = {
    "Cargo.toml": '[workspace]\nmembers = ["a"]\n',
    "a/Cargo.toml": '[package]\nname = "a"\n',
    "a/src/lib.rs": "pub mod x;\npub mod y;\npub mod z;\npub mod w;\npub use z::Zed;\n"
    "#[cfg(test)]\nmod t;\n",
    # x -> y through a use tree, and through a re-export of the root: z.
    "a/src/x.rs": "//! x\nuse crate::{y::Y, Zed};\npub struct X;\nfn f() { let _ = Zed; }\n",
    # y -> x through an expression path: the cycle x, y.
    "a/src/y.rs": "//! y\npub struct Y;\nfn g() -> crate::x::X { crate::x::X }\n",
    # Comments, strings and `$crate` name no module; a test module's use is left out.
    "a/src/z.rs": "//! z: crate::w::W\npub struct Zed;\nconst S: &str = \"crate::w\";\n"
    "macro_rules! m { () => { $crate::w::W } }\n"
    "#[cfg(test)]\nmod tests { use crate::w::W; use super::Zed; }\n",
    # w -> z only in test code: no cycle unless tests are included.
    "a/src/w/mod.rs": "//! w\nmod p;\nmod q;\npub struct W;\nuse p::P;\n",
    # p and q use their parent's item (not an edge) and each other (a cycle in w).
    "a/src/w/p.rs": "//! p\nuse super::{W, q::Q};\npub struct P;\n",
    "a/src/w/q.rs": "//! q\nuse super::super::w::p::P;\npub struct Q;\nfn h(_: P) {}\n",
    "a/src/t.rs": "//! t\nuse crate::z::Zed;\nuse crate::w::W;\n",
}


def write_tree(root: Path, files: dict[str, str]) -> None:
    """Writes `files` (a path relative to `root`, its text): a self-test's workspace.
    Shared with scripts/log_fields.py."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def workspace_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every checker takes: --self-test and the workspace. Shared with
    scripts/log_fields.py."""
    parser.add_argument("--self-test", action="store_true", help="check the checker and exit")
    parser.add_argument("root", nargs="?", default=".", help="the workspace (default: .)")


def workspace_of(name: str, root: str) -> Path | None:
    """`root` resolved, or None (said on stderr) when it holds no Cargo.toml."""
    workspace = Path(root).resolve()
    if not (workspace / "Cargo.toml").is_file():
        print(f"{name}: no Cargo.toml in {workspace}", file=sys.stderr)
        return None
    return workspace


def self_test() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_tree(root, SELF_TEST)
        crate = load_crate("a", root / "a/src/lib.rs")
        got = {(parent, tuple(comp)) for parent, comp, *_ in cycles_of(crate, False)}
        want = {((), ("x", "y")), (("w",), ("p", "q"))}
        edges = {
            (parent, pair) for parent, pairs in edges_of(crate, False).items() for pair in pairs
        }
        want_edges = {((), ("x", "y")), ((), ("x", "z")), ((), ("y", "x"))}
        want_edges |= {(("w",), ("p", "q")), (("w",), ("q", "p"))}
        with_tests = {
            (parent, pair) for parent, pairs in edges_of(crate, True).items() for pair in pairs
        }
        extra = with_tests - edges
        ok = got == want and edges == want_edges and extra == {
            ((), ("z", "w")),
            ((), ("t", "z")),
            ((), ("t", "w")),
        }
        if not ok:
            print(f"module_cycles self-test failed:\n cycles {got}\n edges {edges}\n test edges {extra}")
            return 1
    print("module_cycles: self-test passed")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="list cycles but exit 0")
    parser.add_argument(
        "--include-tests", action="store_true", help="count references made by test code"
    )
    parser.add_argument("--verbose", action="store_true", help="name where each edge is made")
    workspace_arguments(parser)
    args = parser.parse_args(argv)
    if args.self_test:
        return self_test()
    workspace = workspace_of("module_cycles", args.root)
    if workspace is None:
        return 2

    total, crates = 0, 0
    for label, root in crate_roots(workspace):
        crates += 1
        crate = load_crate(label, root)
        for parent, comp, cycle, inside, succ in cycles_of(crate, args.include_tests):
            total += 1
            where = "::".join(("crate",) + parent)
            print(f"{label}: modules of {where} form a cycle: {', '.join(comp)}")
            print(f"  e.g. {' -> '.join(cycle)}")
            for (a, b), refs in inside.items():
                shown = refs if args.verbose else refs[:1]
                more = "" if args.verbose or len(refs) == 1 else f" (+{len(refs) - 1} more)"
                rel = [str(Path(r).relative_to(workspace)) if r.startswith("/") else r for r in shown]
                print(f"    {a} -> {b}: {', '.join(rel)}{more}")
            if args.verbose:
                print("  simple cycles:")
                for simple in elementary_cycles(comp, succ):
                    print(f"    {' -> '.join(simple)}")
    scope = "with test code" if args.include_tests else "outside test code"
    if total:
        print(f"module_cycles: {total} cycle(s) in {crates} crate target(s), {scope}")
        if args.report:
            print("module_cycles: --report: not failing")
            return 0
        return 1
    print(f"module_cycles: no cycle in {crates} crate target(s), {scope}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
