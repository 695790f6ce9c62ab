# Developer and CI entry points for webproxy. `just test` is what CI runs.

set shell := ["bash", "-euo", "pipefail", "-c"]

# Shell prefix putting a nats-server >= 2.11 first on PATH. A plain assignment
# (not `export PATH="$(...)"`) so a failing script aborts the recipe under -e.
# Kept as text rather than a backtick variable so `just fmt` never installs it.
_nats_path := 'nats_dir="$(bash scripts/ensure-nats-server.sh | tail -n1)"; export PATH="$nats_dir:$PATH"'

# List the recipes.
default:
    @{{ just_executable() }} --justfile {{ justfile() }} --list

# Run webproxy and its HTTP gateway (127.0.0.1:8080) against a local JetStream nats-server on 127.0.0.1:4222, with the local echo upstream on 127.0.0.1:8081 (each started here unless something already listens there).
run:
    #!/usr/bin/env bash
    set -euo pipefail
    {{ _nats_path }}
    listening() { (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; }
    nats_pid=""
    gateway_pid=""
    echo_pid=""
    stop_nats() {
        for pid in "$gateway_pid" "$echo_pid"; do
            [[ -n "$pid" ]] || continue
            kill -TERM "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
        done
        gateway_pid=""
        echo_pid=""
        [[ -n "$nats_pid" ]] || return 0
        # TERM first so JetStream flushes its store; KILL only if it hangs.
        kill -TERM "$nats_pid" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$nats_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$nats_pid" 2>/dev/null || true
        wait "$nats_pid" 2>/dev/null || true
        nats_pid=""
    }
    trap stop_nats EXIT
    # Turn Ctrl-C/TERM into a normal exit so the EXIT trap always stops nats-server.
    trap 'exit 130' INT TERM
    if listening; then
        echo "using the nats-server already listening on 127.0.0.1:4222" >&2
    else
        mkdir -p .nats/data
        nats-server -js -sd .nats/data -a 127.0.0.1 -p 4222 >>.nats/nats-server.log 2>&1 &
        nats_pid=$!
        echo "started nats-server (pid $nats_pid, log .nats/nats-server.log)" >&2
        for _ in $(seq 100); do
            listening && break
            if ! kill -0 "$nats_pid" 2>/dev/null; then
                echo "nats-server exited early:" >&2
                tail -n 20 .nats/nats-server.log >&2
                exit 1
            fi
            sleep 0.1
        done
        if ! listening; then
            echo "nats-server did not accept connections on 127.0.0.1:4222 within 10s" >&2
            exit 1
        fi
    fi
    # The loopback quickstart's upstream (README, "Quickstart"): config/webproxy.toml's
    # rule local-echo and gateway route /local send to it.
    if (exec 3<>/dev/tcp/127.0.0.1/8081) 2>/dev/null; then
        echo "something already listens on 127.0.0.1:8081; not starting the echo upstream" >&2
    else
        mkdir -p .nats
        python3 scripts/echo_upstream.py --port 8081 >/dev/null 2>>.nats/echo-upstream.log &
        echo_pid=$!
    fi
    # The HTTP gateway beside the service (docs/gateway.md): built once,
    # then both run from the same build.
    cargo build --release -p webproxy
    cargo run --release -q -p webproxy -- gateway --config config/webproxy.toml &
    gateway_pid=$!
    cargo run --release -q -p webproxy -- serve --config config/webproxy.toml

# Format check, clippy, build the binaries the integration tests spawn, check deploy/, module cycles and log fields, then run every test, the clients' and the loopback quickstart last (from a tree without ./target, with CARGO_TARGET_DIR set), and the README's "Run it yourself".
test: && test-python test-node demo-target-dir readme
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings
    # Issue 15: the bench must not depend on the test package, which turns on the
    # dispatcher's test-hooks in whatever is built with it, and `just bench` builds the
    # release binary beside the bench. The output is captured first so that a failing
    # `cargo tree` fails the recipe instead of passing the check.
    tree="$(cargo tree -p webproxy -p webproxy-bench -e normal,build,features --prefix none)"; if grep -E '^webproxy-tests |^webproxy-(dispatcher|jetstream) feature "test-hooks"' <<<"$tree"; then echo 'webproxy-bench (or webproxy beside it) pulls in webproxy-tests or test-hooks; use webproxy-testkit (issue 15)' >&2; exit 1; fi
    cargo build --workspace --bins
    # With the binary just built: `just deploy-check`'s own build would compile another feature set.
    bash scripts/deploy-check.sh
    # No module imports form a cycle (issue 15): a new cycle fails the build.
    python3 scripts/module_cycles.py --self-test
    python3 scripts/module_cycles.py
    # Log lines carry Display, never Rust's Debug (`?field`, `{:?}`) (issue 31, point 9).
    python3 scripts/log_fields.py --self-test
    python3 scripts/log_fields.py
    # nextest cannot run doctests, so they run first: the suite's summary stays the last line.
    # tests/tests/startup.rs runs the service against a nats-server too old for it.
    {{ _nats_path }}; old_nats="$(bash scripts/ensure-old-nats-server.sh | tail -n1)"; export WEBPROXY_OLD_NATS_SERVER="$old_nats"; if cargo nextest --version >/dev/null 2>&1; then cargo test --workspace --doc -q && cargo nextest run --workspace --no-fail-fast; else cargo test --workspace; fi

# The last commit of stream layout 1 (before the conversation core): `just test-upgrade`'s old version.
upgrade_from := "c7a4dcd"

# The last commit of stream layout 2 (one replies and one dead-letter stream for every pool; caller names on the request subject): `just test-upgrade`'s other old version.
upgrade_from_layout2 := "3952bf2"

# Mixed versions: the old versions (`upgrade_from` and `upgrade_from_layout2`, each built once into <target>/upgrade/) and today's on one nats-server, in either order.
test-upgrade:
    #!/usr/bin/env bash
    set -euo pipefail
    {{ _nats_path }}
    old_bin="$(bash scripts/build-commit.sh {{ upgrade_from }} debug upgrade | tail -n1)"
    layout2_bin="$(bash scripts/build-commit.sh {{ upgrade_from_layout2 }} debug upgrade | tail -n1)"
    cargo build --workspace --bins
    WEBPROXY_OLD_BINARY="$old_bin" WEBPROXY_LAYOUT2_BINARY="$layout2_bin" cargo test -p webproxy-tests --test upgrade -- --ignored

# Issue 29's fault matrix: checks that docs/guarantees.md reproduces tests/fault_matrix.toml's table, runs every test the matrix names against real nats-servers and binaries (the matrix binary's 80 cells, two at a time: about 9 minutes warm), then prints the table.
test-faults:
    cargo build --workspace --bins
    python3 scripts/fault_matrix.py --check
    {{ _nats_path }}; python3 scripts/fault_matrix.py --pairs | while read -r file test; do cargo test -p webproxy-tests --test "$file" -- --exact "$test"; done
    # The services log each delivery's steps (webproxy_dispatcher and webproxy_jetstream at debug), so that a failed cell's logs show where a conversation stopped.
    {{ _nats_path }}; RUST_LOG="${RUST_LOG:-info,webproxy_dispatcher=debug,webproxy_jetstream=debug}" cargo test -p webproxy-tests --test matrix -- --ignored --exact --test-threads 2 $(python3 scripts/fault_matrix.py --matrix)
    python3 scripts/fault_matrix.py

# cargo-deny's checks (deny.toml): licenses, banned and duplicate crates, sources. Installs cargo-deny into .tools/ the first time (minutes of compiling), so it stays out of `just test`. Advisories need GitHub's RustSec database: `cargo deny check advisories` where it is reachable.
audit:
    deny_dir="$(bash scripts/ensure-cargo-deny.sh | tail -n1)"; "$deny_dir/cargo-deny" --offline check licenses bans sources

# Issue 20's adaptive-limit test: about 2 minutes, since the limit moves once per 5 s and needs tens of seconds to settle (ignored by `just test`; `.ci/run` runs it).
test-adaptive:
    cargo build --workspace --bins
    {{ _nats_path }}; if cargo nextest --version >/dev/null 2>&1; then cargo nextest run -p webproxy-tests --test adaptive --run-ignored ignored-only --no-capture; else cargo test -p webproxy-tests --test adaptive -- --ignored --nocapture; fi

# The Python client's tests: installed as a package and type-checked (mypy --strict), the schema, and a live webproxy on a real nats-server. Dependencies (pinned) go into .venv-clients/.
test-python:
    cargo build --workspace --bins
    [[ -x .venv-clients/bin/python ]] || python3 -m venv .venv-clients
    .venv-clients/bin/python -m pip install --quiet --disable-pip-version-check -r clients/python/requirements-dev.txt
    # Installed from its directory as a user would (a wheel, not editable), so the tests
    # import it from site-packages; built by the pinned hatchling, without isolation.
    .venv-clients/bin/python -m pip uninstall --quiet --yes webproxy-client 2>/dev/null || true
    .venv-clients/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation ./clients/python
    .venv-clients/bin/python -m pip check
    .venv-clients/bin/python -m mypy --config-file clients/python/pyproject.toml clients/python/src/webproxy_client
    {{ _nats_path }}; cd clients/python && ../../.venv-clients/bin/python -m pytest

# The Node client's tests: type-checked (tsc), packed and installed from the tarball, the schema, and a live webproxy on a real nats-server. Dependencies from its lockfile.
test-node:
    cargo build --workspace --bins
    cd clients/node && npm ci --no-audit --no-fund
    # The declarations, and a typed caller that imports the package by name (tsc --noEmit).
    cd clients/node && npm run --silent typecheck
    # test/package.test.js packs the package and installs the tarball into a project of its own.
    {{ _nats_path }}; cd clients/node && node --test test/*.test.js

# The README's loopback quickstart end to end, on free ports: nats-server, the local echo upstream (scripts/echo_upstream.py) and webproxy, then the quickstart's `webproxy send` calls, each checked. No internet needed.
demo:
    cargo build --workspace --bins
    {{ _nats_path }}; target="$(bash scripts/target-dir.sh)"; bash scripts/demo.sh "$target/debug/webproxy"

# README.md's "Run it yourself" section as a newcomer runs it: its `sh` blocks in order, from an empty temporary directory, with only the webproxy binary, a nats-server and the system's tools on PATH, on free ports; the output the section shows is checked. No internet needed.
readme:
    cargo build --workspace --bins
    {{ _nats_path }}; target="$(bash scripts/target-dir.sh)"; bash scripts/readme-run.sh "$target/debug/webproxy"

# `just demo` from a tree without ./target, with CARGO_TARGET_DIR naming the real target dir through a symlink (nothing rebuilt): recipes and scripts find the binaries where cargo put them. `just test` runs the demo this way.
demo-target-dir:
    cargo build --workspace --bins
    bash scripts/demo-target-dir.sh

# Rewrite the JSON Schemas under schema/ from the protocol types (the drift test fails until they match).
schema:
    UPDATE_SCHEMA=1 cargo test -p webproxy-protocol --test schema

# Check deploy/ offline: Dockerfile lint, the Kubernetes base against Kubernetes and KEDA schemas, NATS values, dashboard, and the config against the Deployment.
deploy-check:
    cargo build -p webproxy
    bash scripts/deploy-check.sh --verbose

# Run the integration tests `runs` times in a row, stopping at the first failure, to shake out flakes.
soak runs="10":
    cargo build --workspace --bins
    {{ _nats_path }}; for i in $(seq {{ runs }}); do echo "=== soak run $i/{{ runs }}" >&2; cargo test -p webproxy-tests --tests; done

# Issue 29, table item 11: the 200/s rate test `runs` times in a row, stopping at the first failure, while the rest of the suite loops beside it as load. A soak loop, kept out of `just test` and CI (about 2 minutes after the build).
soak-rate runs="20":
    {{ _nats_path }}; bash scripts/soak-rate.sh {{ runs }}

# Fuzz each target for `seconds` (cargo-fuzz, nightly; not in `just test`); crashes land in fuzz/artifacts/ and become regression tests.
fuzz seconds="60":
    #!/usr/bin/env bash
    set -euo pipefail
    if ! rustup toolchain list | grep -q '^nightly'; then
        rustup toolchain install nightly --profile minimal
    fi
    command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
    cd fuzz
    for target in envelope guard_url; do
        echo "=== fuzzing $target for {{ seconds }}s" >&2
        # corpus/ collects what the fuzzer finds (ignored by git); seeds/ are committed.
        mkdir -p "corpus/$target"
        cargo +nightly fuzz run "$target" "corpus/$target" "seeds/$target" -- -max_total_time={{ seconds }}
    done

# Format every crate in place.
fmt:
    cargo fmt --all

# Clippy over the whole workspace, warnings are errors.
lint:
    cargo clippy --workspace --all-targets -- -D warnings

# Measure webproxy (release build) against direct HTTP calls, a broker-only loop and the minimal pipeline (3 rounds); prints a table, issue 33's gates against the pipeline, and writes target/bench/latest.json. Its sections (main, adaptive, progress-bound, large-bodies) run in turn; `--only progress-bound` or `--skip adaptive,progress-bound` picks among them. large-bodies fails the recipe when webproxy's RSS goes over 200 MiB with 64 × 50 MiB bodies in flight (issue 34).
bench *args:
    cargo build --release -p webproxy -p webproxy-bench
    {{ _nats_path }}; target="$(bash scripts/target-dir.sh)"; "$target/release/webproxy-bench" {{ args }}

# The performance reference (issue 17): main as it stood when the performance work began.
bench_reference := "1e76bb6"

# `just bench` with the reference's release binary (built once into <target>/reference/) measured beside this build: 3 interleaved rounds, medians compared.
bench-reference *args:
    #!/usr/bin/env bash
    set -euo pipefail
    {{ _nats_path }}
    reference="$(bash scripts/build-commit.sh {{ bench_reference }} release reference | tail -n1)"
    cargo build --release -p webproxy -p webproxy-bench
    "$(bash scripts/target-dir.sh)/release/webproxy-bench" --rounds 3 --reference "{{ bench_reference }}=$reference" {{ args }}

# The differential profile (issue 33): perf samples of `webproxy serve` and of the minimal pipeline (both release) at 256 outstanding for `seconds` each, as CPU per conversation by crate and by kind of work, each beside the other and the difference (data in <target>/profile/).
profile seconds="10":
    cargo build --release -p webproxy -p webproxy-bench
    {{ _nats_path }}; bash scripts/profile.sh {{ seconds }}
