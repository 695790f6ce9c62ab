#!/usr/bin/env bash
# README.md's "Run it yourself" section, run as a newcomer runs it (`just readme`;
# `just test` runs it), so that it cannot drift from the code (issue 31, point 2):
# the section's fenced `sh` blocks, in order, in one shell with `set -euo pipefail`,
# from an empty temporary directory, with PATH holding only the webproxy binary, a
# nats-server and the system's tools (/usr/bin, /bin). Then every line of the
# section's `text` blocks (the output it shows) must be a line of what the blocks
# printed, the sequence of an origin (`WEBPROXY_POOL_DEFAULT:<seq>`) aside.
#
# Ports: the blocks take theirs from NATS_PORT, UPSTREAM_PORT and HEALTH_PORT, which
# they default to fixed ones (4222, 8000, 9090) for a reader; this script sets each to
# a free port, so the run never meets a server that someone else (`just run`, another
# test) started. Everything the blocks start runs in a process group of its own, which
# is stopped on exit, whatever happened.
# Usage: scripts/readme-run.sh WEBPROXY_BINARY   (nats-server >= 2.11 on PATH)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readme="${README:-$repo/README.md}"
webproxy="$(realpath "${1:?usage: scripts/readme-run.sh WEBPROXY_BINARY}")"
[[ -x "$webproxy" ]] || { echo "readme-run: $webproxy is not an executable" >&2; exit 1; }
nats_server="$(command -v nats-server)" || { echo "readme-run: no nats-server on PATH" >&2; exit 1; }
# The longest the blocks may run: starting nats-server and webproxy (whose first start
# creates the streams) and a few sends take seconds; a hang fails instead of waiting.
run_limit=120

# free_port, stop_group
# shellcheck source=scripts/lib.sh
source "$repo/scripts/lib.sh"

work="$(mktemp -d)"
group=""
stop() {
    local status=$?
    if [[ -n "$group" ]]; then
        stop_group "$group"
    fi
    if [[ $status -ne 0 ]]; then
        for log in "$work"/run/*.log "$work"/run/*/*.log; do
            [[ -f "$log" ]] || continue
            echo "--- $log" >&2
            tail -n 30 "$log" >&2
        done
    fi
    rm -rf "$work"
}
trap stop EXIT

# The section's blocks: the script the `sh` ones make, and the lines the `text` ones show.
python3 - "$readme" "$work/blocks.sh" "$work/expected" <<'EOF'
import re, sys
readme, script, expected = sys.argv[1:]
lines = open(readme).read().split("\n")
try:
    start = lines.index("## Run it yourself")
except ValueError:
    sys.exit(f"readme-run: {readme} has no '## Run it yourself' heading")
end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
blocks = {"sh": [], "text": []}
fence = None
for line in lines[start + 1:end]:
    if fence is None:
        m = re.match(r"^```(\w*)$", line)
        if m:
            fence = m.group(1)
            blocks.setdefault(fence, []).append([])
    elif line == "```":
        fence = None
    else:
        blocks[fence][-1].append(line)
if fence is not None:
    sys.exit("readme-run: a fenced block in 'Run it yourself' is not closed")
if not blocks["sh"] or not blocks["text"]:
    sys.exit("readme-run: 'Run it yourself' needs its sh blocks and the text block of their output")
with open(script, "w") as f:
    f.write("set -euo pipefail\n")
    for n, block in enumerate(blocks["sh"], 1):
        f.write(f"# block {n}\n" + "\n".join(block) + "\n")
with open(expected, "w") as f:
    f.write("\n".join(line for block in blocks["text"] for line in block if line.strip()) + "\n")
EOF

# PATH: the binary and the nats-server alone, beside the system's tools.
mkdir "$work/bin" "$work/run" "$work/home"
ln -s "$webproxy" "$work/bin/webproxy"
ln -s "$nats_server" "$work/bin/nats-server"

nats_port="$(free_port)"
upstream_port="$(free_port)"
health_port="$(free_port)"
echo "readme-run: README's 'Run it yourself' in $work/run (NATS $nats_port, upstream $upstream_port, health $health_port)" >&2

# setsid: the blocks and whatever they start in the background form one process group
# (this script's background job is no group leader, so setsid makes the new session
# in place: its pid is the group's id), which `stop` ends.
cd "$work/run"
env -i HOME="$work/home" PATH="$work/bin:/usr/bin:/bin" LANG=C.UTF-8 \
    NATS_PORT="$nats_port" UPSTREAM_PORT="$upstream_port" HEALTH_PORT="$health_port" \
    setsid timeout "$run_limit" bash "$work/blocks.sh" >"$work/output" 2>&1 &
group=$!
set +e
wait "$group"
status=$?
set -e
cat "$work/output" >&2
if [[ $status -eq 124 ]]; then
    echo "readme-run: the blocks did not finish within $run_limit s" >&2
    exit 1
elif [[ $status -ne 0 ]]; then
    echo "readme-run: the blocks failed (exit $status)" >&2
    exit 1
fi

python3 - "$work/expected" "$work/output" <<'EOF'
import re, sys
def normal(line):
    return re.sub(r"(origin [A-Z0-9_]+):[0-9]+", r"\1:<seq>", line.rstrip())
expected = [normal(line) for line in open(sys.argv[1]).read().splitlines()]
printed = {normal(line) for line in open(sys.argv[2]).read().splitlines()}
missing = [line for line in expected if line not in printed]
if missing:
    sys.exit("readme-run: the README shows output the blocks did not print:\n  " + "\n  ".join(missing))
EOF
echo "readme-run: every block ran and printed what README.md shows" >&2
