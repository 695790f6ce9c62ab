#!/usr/bin/env bash
# Builds the `webproxy` binary of an older commit once, into <target>/<dir>/<commit>/
# (its own source tree and binary), and prints the binary's path as the last line on
# stdout. Diagnostics go to stderr. The commits built into one <dir> share a target dir,
# <target>/<dir>/target: the crates they have in common compile once, so a second old
# version (`just test-upgrade` builds two) costs minutes less than a cold build.
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
binary="$root/webproxy"
if [[ -x "$binary" ]]; then
    echo "using the $profile binary of $commit: $binary" >&2
else
    # A cold build takes several minutes on 2 cores.
    echo "building the $profile binary of $commit into $root" >&2
    rm -rf "$root/src" && mkdir -p "$root/src"
    git -C "$repo" archive "$commit" | tar -x -C "$root/src"
    shared="$target/$dir/target"
    (cd "$root/src" && CARGO_TARGET_DIR="$shared" cargo build --locked "${flags[@]}" -p webproxy --bin webproxy >&2)
    # Copied out at once: the next commit's build writes the same path in the shared dir.
    cp "$shared/$profile/webproxy" "$binary"
fi
echo "$binary"
