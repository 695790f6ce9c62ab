#!/usr/bin/env bash
# Prints cargo's target directory for this workspace, as cargo itself resolves it
# (CARGO_TARGET_DIR, a `build.target-dir` in a .cargo/config.toml, or <repo>/target),
# so that recipes and scripts run the binaries where cargo built them rather than
# assuming ./target (issue 31, point 8).
#   scripts/target-dir.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
