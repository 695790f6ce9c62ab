#!/usr/bin/env bash
# `just profile`: records where `webproxy serve` (this build, release) spends its CPU
# at 256 outstanding conversations, with perf (Debian's linux-perf; a software clock,
# so it works where the VM has no hardware counters), and summarizes the samples by
# crate and by the work they belong to (scripts/profile_summary.py).
#   scripts/profile.sh [SECONDS]   (default 10; the data goes to <target>/profile/)
set -euo pipefail
seconds="${1:-10}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v perf >/dev/null 2>&1 || { echo "perf is not installed (apt-get install linux-perf)" >&2; exit 1; }
# Resolved: the bench starts the service by its real path, which pgrep matches below.
target="$(realpath "$(bash scripts/target-dir.sh)")"
out="$target/profile"
mkdir -p "$out"
log="$out/bench.log"
# The bench measures the broker-only loop and direct calls first; the service's own
# 256-outstanding run lasts long enough for the recording.
"$target/release/webproxy-bench" --levels 256 --duration "$((seconds + 4))s" --json "$out/bench.json" >"$log" 2>&1 &
bench=$!
trap 'kill "$bench" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    grep -q "measuring webproxy at 256 on pool default" "$log" && break
    kill -0 "$bench" 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.1
done
pid="$(pgrep -f "^$target/release/webproxy serve" | head -n1)"
[[ -n "$pid" ]] || { echo "no webproxy serve process found" >&2; exit 1; }
sleep 1
perf record -F 499 -e cpu-clock --call-graph dwarf,16384 -p "$pid" -o "$out/perf.data" -- sleep "$seconds" >&2
wait "$bench"
trap - EXIT
grep -E "^(mode|webproxy) " "$log" || true
perf script -i "$out/perf.data" --no-inline -F comm,tid,ip,sym 2>/dev/null >"$out/perf.script"
python3 scripts/profile_summary.py "$out/perf.script"
