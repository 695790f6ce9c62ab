# Helpers the scripts share; sourced, not run (demo.sh, readme-run.sh, soak-rate.sh).

# Prints a TCP port on 127.0.0.1 that nothing listens on now.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Ends the process group led by $1 (a child of this shell) and everything in it:
# nats-servers, webproxy instances, test binaries. TERM first, so nats-servers and
# instances shut down as they would; KILL whatever is left after 15 s.
stop_group() {
    kill -TERM -- "-$1" 2>/dev/null || true
    for _ in $(seq 150); do
        kill -0 -- "-$1" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL -- "-$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}
