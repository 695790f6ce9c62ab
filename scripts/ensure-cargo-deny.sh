#!/usr/bin/env bash
# Prints, as the last line on stdout, a directory to put first on PATH so that
# `cargo deny` is available: the one already on PATH, or cargo-deny built once into the
# project-local `.tools/` (a few minutes of compiling, from crates.io with --locked).
# Diagnostics go to stderr so callers can take `| tail -n1`.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="$repo/.tools/cargo-deny"
# The version deny.toml is written for.
version="0.20.2"

if found="$(command -v cargo-deny)"; then
    echo "using $("$found" --version) from $found" >&2
    dirname "$found"
    exit 0
fi
if ! [[ -x "$root/bin/cargo-deny" ]]; then
    echo "no cargo-deny on PATH; building cargo-deny $version into $root" >&2
    cargo install --quiet --locked --version "$version" --root "$root" cargo-deny >&2
fi
echo "using $("$root/bin/cargo-deny" --version) from $root/bin" >&2
echo "$root/bin"
