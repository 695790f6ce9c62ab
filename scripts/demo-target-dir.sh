#!/usr/bin/env bash
# `just demo` with CARGO_TARGET_DIR set (issue 31, point 8): recipes and scripts must
# run the binaries where cargo put them, not ./target. Runs the demo from a tree with
# no ./target at all (symlinks to every other entry of the repository), with
# CARGO_TARGET_DIR naming the real target dir through a symlink: cargo finds its
# builds fresh there, so nothing is rebuilt, and a recipe that still runs
# target/debug/webproxy fails. `just test` runs the demo this way.
#   scripts/demo-target-dir.sh   (just and nats-server >= 2.11 as for `just demo`)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="$(bash "$repo/scripts/target-dir.sh")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tree="$work/tree"
mkdir "$tree"
# Not ./target, nor local state: the virtualenvs and nats-server data stay where they are.
while IFS= read -r -d '' entry; do
    name="$(basename "$entry")"
    case "$name" in
        target | .git | .nats | .venv | .venv-clients) continue ;;
    esac
    ln -s "$entry" "$tree/$name"
done < <(find "$repo" -mindepth 1 -maxdepth 1 -print0)
ln -s "$target" "$work/target-link"
cd "$tree"
CARGO_TARGET_DIR="$work/target-link" just --justfile "$tree/justfile" --working-directory "$tree" demo
