#!/usr/bin/env bash
# `just profile`: the differential profile of issue 33. Records where `webproxy serve`
# (this build, release) and the minimal pipeline (`webproxy-pipeline`) spend their CPU
# at 256 outstanding conversations, each during its own measurement of one bench run,
# with perf (Debian's linux-perf; a software clock, so it works where the VM has no
# hardware counters), and prints per crate and per kind of work the CPU per
# conversation each spends and what webproxy spends beyond the pipeline
# (scripts/profile_summary.py).
#   scripts/profile.sh [SECONDS]   (default 10; the data goes to <target>/profile/)
set -euo pipefail
seconds="${1:-10}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v perf >/dev/null 2>&1 || { echo "perf is not installed (apt-get install linux-perf)" >&2; exit 1; }
# Resolved: the bench starts both servers by their real paths, which pgrep matches below.
target="$(realpath "$(bash scripts/target-dir.sh)")"
out="$target/profile"
mkdir -p "$out"
log="$out/bench.log"
# One round at 256: the warm-up measures each server once (2 s), then the broker-only
# loop and direct calls run, then webproxy and the pipeline in turn, each long enough
# for its recording.
"$target/release/webproxy-bench" --rounds 1 --levels 256 --duration "$((seconds + 4))s" --only main --json "$out/bench.json" >"$log" 2>&1 &
bench=$!
trap 'kill "$bench" 2>/dev/null || true' EXIT

# record NAME PROCESS: waits for the bench's second "measuring NAME at 256" (the first
# is the warm-up), then records PROCESS (a path under the target dir) into NAME.data
# and, at once, the nats-server the line names into NAME-nats.data (no call graphs:
# its self time by function is what the summary reads).
record() {
    local name="$1" process="$2" pid nats line
    for _ in $(seq 1200); do
        [[ "$(grep -c "measuring $name at 256 on pool default" "$log")" -ge 2 ]] && break
        kill -0 "$bench" 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.1
    done
    pid="$(pgrep -f "^$target/release/$process" | head -n1)"
    [[ -n "$pid" ]] || { echo "no $process process found" >&2; exit 1; }
    line="$(grep "measuring $name at 256 on pool default" "$log" | tail -n1)"
    nats="$(sed -E 's/.*\(nats-server ([0-9]+)\).*/\1/' <<<"$line")"
    sleep 1
    perf record -F 499 -e cpu-clock -p "$nats" -o "$out/$name-nats.data" -- sleep "$seconds" >/dev/null 2>&1 &
    local server=$!
    perf record -F 499 -e cpu-clock --call-graph dwarf,16384 -p "$pid" -o "$out/$name.data" -- sleep "$seconds" >&2
    wait "$server"
    perf script -i "$out/$name.data" --no-inline -F comm,tid,ip,sym 2>/dev/null >"$out/$name.script"
    perf script -i "$out/$name-nats.data" -F ip,sym 2>/dev/null >"$out/$name-nats.script"
}
record webproxy "webproxy serve"
record pipeline "webproxy-pipeline"
wait "$bench"
trap - EXIT
grep -E "^(mode|webproxy|pipeline) " "$log" || true
# cost MODE FIELD: a figure of MODE's row at 256, which the samples' shares divide:
# field 9 is the service's CPU per conversation (`svc µs`), 10 its nats-server's.
cost() { awk -v mode="$1" -v field="$2" '$1 == mode && $2 == 256 { print $field; exit }' "$log"; }
python3 scripts/profile_summary.py "$out/webproxy.script" "$(cost webproxy 9)" "$out/pipeline.script" "$(cost pipeline 9)"
python3 scripts/profile_summary.py --nats "$out/webproxy-nats.script" "$(cost webproxy 10)" "$out/pipeline-nats.script" "$(cost pipeline 10)"
