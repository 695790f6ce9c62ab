#!/usr/bin/env bash
# Runs the fault matrix's cells (`just test-faults`), two at a time, and then each cell
# that failed once more, alone. A cell that passes alone is printed as FLAKY, loudly, and
# does not fail the run; one that fails again does. Why: a few cells (api_down_config,
# api_down_paused, leader_config) fail about once in four full runs under two-at-a-time
# load, which would keep every change from landing; the retry keeps them visible
# (their names, here and in CI's log) without that. Expects nats-server on PATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# shellcheck disable=SC2046 # one argument per cell
if cargo test -p webproxy-tests --test matrix -- --ignored --exact --test-threads 2 \
    $(python3 scripts/fault_matrix.py --matrix) 2>&1 | tee "$log"; then
    exit 0
fi
mapfile -t failed < <(sed -n 's/^test \([a-z0-9_]*\) \.\.\. FAILED$/\1/p' "$log")
if [[ ${#failed[@]} -eq 0 ]]; then
    echo "the matrix failed without a failed cell to retry" >&2
    exit 1
fi
echo "retrying alone the cells that failed: ${failed[*]}" >&2
cargo test -p webproxy-tests --test matrix -- --ignored --exact --test-threads 1 "${failed[@]}"
for cell in "${failed[@]}"; do
    echo "FLAKY: matrix cell $cell failed beside another cell and passed alone" >&2
done
