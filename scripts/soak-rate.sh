#!/usr/bin/env bash
# Issue 29, table item 11: `flow::a_rate_of_200_per_second_holds_across_three_instances`
# RUNS times in a row (default 20), stopping at the first failure, while the rest of
# the webproxy-tests suite runs beside it in a loop, so that the rate is measured on a
# loaded machine (an idle one hid the failure). Prints each run's own figures (its
# busiest 1 s window by the service's start stamps, which it asserts, and by the
# upstream's arrival stamps, and how long the batch took), then the busiest of all.
#
# Usage: bash scripts/soak-rate.sh [RUNS]   (nats-server >= 2.11 first on PATH;
# `just soak-rate` sets that up). The background suite's output goes to
# <target>/soak-rate/suite.log; its own failures are load, not this soak's verdict.
set -euo pipefail

runs="${1:-20}"
test_name="a_rate_of_200_per_second_holds_across_three_instances"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
target="$(bash scripts/target-dir.sh)"
logs="$target/soak-rate"
mkdir -p "$logs"

started=$SECONDS

# Built once: the binaries the tests spawn, and every test target of webproxy-tests
# (the background loop then finds them fresh and only runs them).
cargo build --workspace --bins
cargo test -p webproxy-tests --no-run
# The flow test's executable, run directly: no cargo between runs, and no wait for
# the build directory's lock while the background loop's cargo holds it.
flow_bin="$(cargo test -p webproxy-tests --test flow --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message["target"]["name"] == "flow" and message.get("executable"):
        print(message["executable"])')"
[[ -x "$flow_bin" ]] || {
    echo "cannot find the flow test executable" >&2
    exit 1
}
# startup.rs runs the service against a nats-server too old for it, as `just test` does.
WEBPROXY_OLD_NATS_SERVER="$(bash scripts/ensure-old-nats-server.sh | tail -n1)"
export WEBPROXY_OLD_NATS_SERVER

# Every test process's tempdirs (nats-server stores, service configs) go in one
# directory of the soak's: a test killed when the soak ends cannot remove its own.
tmp="$(mktemp -d "${TMPDIR:-/tmp}/soak-rate.XXXXXX")"
suite_pid=""
run_pid=""

# stop_group: ends the process group led by its argument (cargo, test binaries,
# nats-servers, webproxy instances).
# shellcheck source=scripts/lib.sh
source "$repo/scripts/lib.sh"

# On any exit (the last run, a failure, Ctrl-C): the run in progress, then the
# background loop, then their tempdirs.
stop_all() {
    if [[ -n "$run_pid" ]]; then
        stop_group "$run_pid"
    fi
    if [[ -n "$suite_pid" ]]; then
        stop_group "$suite_pid"
    fi
    rm -rf "$tmp"
}
trap stop_all EXIT
# Ctrl-C or TERM become a normal exit, so the EXIT trap always runs.
trap 'exit 130' INT TERM

# Both the loop and each run get a process group of their own from setsid (this script
# runs without job control, so neither is a group leader and setsid needs no fork: the
# pid is the group's id), and the script waits with `wait`, which a signal interrupts.
mkdir "$tmp/suite" "$tmp/runs"
TMPDIR="$tmp/suite" setsid bash -c '
    round=0
    while true; do
        round=$((round + 1))
        echo "=== suite round $round ($(date +%T))"
        cargo test -p webproxy-tests -- --skip "$1" || echo "=== suite round $round failed (load only)"
    done' soak-suite "$test_name" >"$logs/suite.log" 2>&1 &
suite_pid=$!
echo "the rest of the suite runs beside it (pid $suite_pid, log $logs/suite.log)" >&2

busiest_of_all=0
arrivals_of_all=0
for run in $(seq "$runs"); do
    # cargo test runs a test binary from its package's directory.
    (cd tests && TMPDIR="$tmp/runs" exec setsid "$flow_bin" --exact "$test_name" --nocapture) >"$logs/run.log" 2>&1 &
    run_pid=$!
    status=0
    wait "$run_pid" || status=$?
    run_pid=""
    if ((status != 0)); then
        cat "$logs/run.log"
        echo "run $run/$runs FAILED (after $((SECONDS - started)) s; log $logs/run.log)" >&2
        exit 1
    fi
    figures="$(grep '^rate 200/s:' "$logs/run.log")"
    echo "run $run/$runs: $figures"
    busiest="$(sed -n 's/.*busiest 1 s window \([0-9]*\) calls.*/\1/p' <<<"$figures")"
    if ((busiest > busiest_of_all)); then
        busiest_of_all=$busiest
    fi
    arrivals="$(sed -n 's/.* \([0-9]*\) as this process stamped.*/\1/p' <<<"$figures")"
    if ((arrivals > arrivals_of_all)); then
        arrivals_of_all=$arrivals
    fi
done
echo "$runs/$runs passed; busiest 1 s window of all: $busiest_of_all calls as started, $arrivals_of_all by arrival stamps; $((SECONDS - started)) s in all"
