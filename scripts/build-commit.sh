#!/usr/bin/env bash
# Builds the `webproxy` binary of an older commit once, into <target>/<dir>/<commit>/
# (its own source tree and target dir; the cargo registry is shared), and prints the
# binary's path as the last line on stdout. Diagnostics go to stderr.
#   scripts/build-commit.sh COMMIT debug|release DIR
# `just test-upgrade` builds the previous stream layout's version with it (debug), and
# `just bench-reference` the performance reference (release).
set -euo pipefail

commit="$1"
profile="$2"
dir="$3"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="$(realpath -m "$(bash "$repo/scripts/target-dir.sh")")"
root="$target/$dir/$commit"
case "$profile" in
    debug) flags=() ;;
    release) flags=(--release) ;;
    *) echo "profile must be debug or release, not $profile" >&2; exit 2 ;;
esac
binary="$root/target/$profile/webproxy"
if [[ -x "$binary" ]]; then
    echo "using the $profile binary of $commit: $binary" >&2
else
    # A cold build takes several minutes on 2 cores.
    echo "building the $profile binary of $commit into $root" >&2
    rm -rf "$root/src" && mkdir -p "$root/src"
    git -C "$repo" archive "$commit" | tar -x -C "$root/src"
    # Without debug info, which no test of an old version reads: a faster build and link
    # (CI builds two old versions). Each commit needs a target dir of its own: cargo
    # names a workspace crate's build by its path inside the workspace, the same in
    # every commit, so one shared dir would link one commit's crate into another's.
    (cd "$root/src" && CARGO_TARGET_DIR="$root/target" CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_RELEASE_DEBUG=0 \
        cargo build --locked "${flags[@]}" -p webproxy --bin webproxy >&2)
fi
echo "$binary"
