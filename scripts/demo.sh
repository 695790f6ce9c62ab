#!/usr/bin/env bash
# The README's loopback quickstart, run end to end (`just demo`; `just test` runs it):
# a nats-server, the local echo upstream and `webproxy serve --config
# config/webproxy.toml`, all on 127.0.0.1 and on free ports, then the quickstart's
# `webproxy send` calls, each checked. Nothing leaves loopback, so it needs no internet.
# Usage: scripts/demo.sh WEBPROXY_BINARY (nats-server >= 2.11 on PATH).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
webproxy="${1:?usage: scripts/demo.sh WEBPROXY_BINARY}"
work="$(mktemp -d)"
pids=()
stop() {
    local status=$?
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    if [[ $status -ne 0 ]]; then
        for log in "$work"/*.log; do
            echo "--- $log" >&2
            tail -n 30 "$log" >&2
        done
    fi
    rm -rf "$work"
}
trap stop EXIT

# free_port
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

# Up to 20 s (a first start creates the streams) for `check` to succeed.
wait_until() {
    local what="$1"
    shift
    for _ in $(seq 200); do
        if "$@" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    echo "demo: $what did not happen within 20 s" >&2
    return 1
}

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

nats_port="$(free_port)"
health_port="$(free_port)"
nats_url="nats://127.0.0.1:$nats_port"

nats-server -js -sd "$work/nats" -a 127.0.0.1 -p "$nats_port" >"$work/nats-server.log" 2>&1 &
pids+=($!)
wait_until "nats-server listening on $nats_port" listening "$nats_port"

python3 scripts/echo_upstream.py --port 0 >"$work/echo.out" 2>"$work/echo.log" &
pids+=($!)
wait_until "the echo upstream to listen" grep -q '^listening on ' "$work/echo.out"
echo_port="$(sed -n 's/^listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$work/echo.out")"

WEBPROXY_NATS__URL="$nats_url" WEBPROXY_HTTP__LISTEN="127.0.0.1:$health_port" \
    "$webproxy" serve --config config/webproxy.toml >"$work/serve.log" 2>&1 &
pids+=($!)
wait_until "webproxy to be ready" curl -fsS -o /dev/null "http://127.0.0.1:$health_port/readyz"
echo "demo: nats-server on $nats_url, echo upstream on 127.0.0.1:$echo_port, webproxy ready" >&2

# One quickstart step: prints the command, runs it, keeps its output in $reply and its
# exit status in $status.
step() {
    python3 -c 'import shlex, sys; print("$ webproxy send --json", shlex.join(sys.argv[1:]))' "$@" >&2
    set +e
    reply="$("$webproxy" send --json --config config/webproxy.toml -s "$nats_url" "$@")"
    status=$?
    set -e
    echo "$reply" >&2
}

# `check WHAT PYTHON-EXPRESSION`: the expression holds of the reply (`r`, parsed JSON;
# the echo's own answer, `echo`, when the body is JSON).
check() {
    REPLY_JSON="$reply" python3 -c '
import json, os, sys
r = json.loads(os.environ["REPLY_JSON"])
try:
    echo = json.loads(r.get("body") or "null")
except ValueError:
    echo = None
sys.exit(0 if eval(sys.argv[1]) else 1)
' "$2" || {
        echo "demo: expected $1" >&2
        exit 1
    }
}

step GET "http://127.0.0.1:$echo_port/hello?from=webproxy"
[[ $status -eq 0 ]] || { echo "demo: send exited $status" >&2; exit 1; }
check "a 200 echoing the query" 'r["outcome"] == "response" and r["status"] == 200 and echo["query"] == {"from": "webproxy"}'

step -H 'Content-Type: application/json' -d '{"order": 42}' POST "http://127.0.0.1:$echo_port/orders"
[[ $status -eq 0 ]] || { echo "demo: send exited $status" >&2; exit 1; }
check "the POST body echoed" 'r["status"] == 200 and echo["method"] == "POST" and json.loads(echo["body"]) == {"order": 42}'

# Not 127.0.0.1, so the rule local-echo does not match and no-plain-http denies it:
# nothing is sent, and send exits non-zero on the error outcome.
step GET "http://localhost:$echo_port/"
[[ $status -ne 0 ]] || { echo "demo: a denied request exited 0" >&2; exit 1; }
check "a denial by the rule no-plain-http" 'r["outcome"] == "error" and r["error"]["code"] == "denied"'

echo "demo: every step answered as the README says" >&2
