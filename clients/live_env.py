"""A live webproxy for the client tests: a private JetStream nats-server, an HTTP
upstream on 127.0.0.1 and the real `webproxy serve` binary, all on loopback ports of
their own. Standard library only, so every client's tests can use it.

As a module: `with LiveEnv() as env: ...` (env.nats_url, env.url(path), ...).
`LiveEnv(isolated=True)` runs nats-server with deploy/nats/authorization.conf's
accounts and users instead, and webproxy as its `webproxy` user with reply_to
confined to the callers' reply spaces: `env.password(user)` is a user's password.
As a program (for tests in other languages; `--isolated` for the above): prints one
JSON line with the same values once the service is ready, and stops everything when
its stdin closes.

Needs `nats-server` >= 2.11 on PATH (`just` puts one there) and the webproxy binary:
WEBPROXY_BIN, else $CARGO_TARGET_DIR/debug/webproxy, else target/debug/webproxy.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Bounds for a cold start on a loaded 2-core CI machine.
NATS_START_TIMEOUT = 10.0
READY_TIMEOUT = 30.0
POLL_INTERVAL = 0.05


def webproxy_bin() -> Path:
    if os.environ.get("WEBPROXY_BIN"):
        path = Path(os.environ["WEBPROXY_BIN"])
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
        path = target / "debug" / "webproxy"
    if not path.is_file():
        raise RuntimeError(
            f"{path} not found: run `cargo build -p webproxy` first (`just test` does), "
            "or set WEBPROXY_BIN"
        )
    return path


def large_body(size: int) -> bytes:
    """`size` bytes that are not text: what `/bytes/<size>` answers, for the
    large-body tests."""
    pattern = hashlib.sha256(b"webproxy").digest() * 4096
    return (pattern * (size // len(pattern) + 1))[:size]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(timeout: float, what: str, check, on_timeout=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{on_timeout()}")
        time.sleep(POLL_INTERVAL)


class _Upstream(BaseHTTPRequestHandler):
    """`/echo` answers JSON describing the request (its body's length and SHA-256 too,
    and the body itself up to 64 KiB);
    `/bytes/<n>` answers `large_body(n)`; `/delay/<ms>` answers its text
    after `ms` milliseconds; `/hold/<ms>` too, unless the caller hangs up first (a
    dropped attempt), which it counts; `/_hits?path=<path>` and `/_dropped?path=<path>`
    (not counted) answer how many requests `<path>` has had, and how many of them were
    dropped while held; any other path answers its text."""

    hits: Counter = Counter()
    dropped: Counter = Counter()
    hits_lock = threading.Lock()

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        path = self.path.split("?")[0]
        if path in ("/_hits", "/_dropped"):
            query = urllib.parse.parse_qs(self.path.partition("?")[2])
            counts = self.hits if path == "/_hits" else self.dropped
            with self.hits_lock:
                count = counts[query.get("path", [""])[0]]
            self._send(str(count).encode(), "text/plain")
            return
        with self.hits_lock:
            self.hits[path] += 1
        if path.startswith("/delay/") and path[len("/delay/"):].isdigit():
            time.sleep(min(int(path[len("/delay/"):]), 10_000) / 1000)
        if path.startswith("/hold/") and path[len("/hold/"):].isdigit():
            # The request is read whole and nothing is pipelined, so the connection
            # turns readable only when the caller closes it.
            held = min(int(path[len("/hold/"):]), 10_000) / 1000
            if select.select([self.connection], [], [], held)[0]:
                with self.hits_lock:
                    self.dropped[path] += 1
                self.close_connection = True
                return
        if path == "/echo":
            headers: dict = {}
            for name, value in self.headers.items():
                headers.setdefault(name.lower(), []).append(value)
            payload = json.dumps(
                {
                    "method": self.command,
                    "path": self.path,
                    "headers": headers,
                    # A large body is described by its length and hash alone, so the
                    # echo fits a reply.
                    "body": body.decode("utf-8", errors="replace") if len(body) <= 65536 else None,
                    "body_len": len(body),
                    "body_sha256": hashlib.sha256(body).hexdigest(),
                }
            ).encode()
            content_type = "application/json"
        elif path.startswith("/bytes/") and path[len("/bytes/"):].isdigit():
            payload = large_body(int(path[len("/bytes/"):]))
            content_type = "application/octet-stream"
        else:
            payload = f"path {self.path}".encode()
            content_type = "text/plain"
        self._send(payload, content_type)

    def _send(self, payload: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _answer

    def log_message(self, *args) -> None:
        pass


def _escape(text: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$" else c for c in text)


AUTHORIZATION = REPO / "deploy" / "nats" / "authorization.conf"
# The password variables authorization.conf reads from the environment.
_PASSWORD_VARIABLE = re.compile(r"password:\s*\$([A-Z0-9_]+)")
_USER_AND_PASSWORD = re.compile(r"user:\s*(\w+)\s*\n\s*password:\s*\$([A-Z0-9_]+)")


class LiveEnv:
    """Everything a client test talks to. `url(path)` is on the accepting upstream;
    `closed_url` is accepted by a rule but nothing listens there; paths under
    `/forbidden` are denied by a rule."""

    def __init__(self, isolated: bool = False) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="webproxy-clients-"))
        self._procs: list[subprocess.Popen] = []
        self._upstream: ThreadingHTTPServer | None = None
        self.isolated = isolated
        # Each password variable of authorization.conf, set to a password of its own.
        self._passwords = {
            variable: f"{variable.lower()}-live"
            for variable in _PASSWORD_VARIABLE.findall(AUTHORIZATION.read_text())
        } if isolated else {}

    def password(self, user: str) -> str:
        """The password of `user` in authorization.conf (with `isolated` only)."""
        for name, variable in _USER_AND_PASSWORD.findall(AUTHORIZATION.read_text()):
            if name == user:
                return self._passwords[variable]
        raise KeyError(f"no user {user!r} in {AUTHORIZATION}")

    def __enter__(self) -> "LiveEnv":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        # Counts of this environment's upstream only.
        self._handler = type("Upstream", (_Upstream,), {"hits": Counter(), "dropped": Counter()})
        self._upstream = ThreadingHTTPServer(("127.0.0.1", 0), self._handler)
        threading.Thread(target=self._upstream.serve_forever, daemon=True).start()
        self.upstream_url = f"http://127.0.0.1:{self._upstream.server_address[1]}"
        self.closed_url = f"http://127.0.0.1:{free_port()}"
        self.nats_url = self._start_nats()
        self.health_url = self._start_webproxy()

    def url(self, path: str) -> str:
        return self.upstream_url + path

    def hits(self, path: str) -> int:
        """How many requests the upstream has had on `path` (no query string)."""
        with _Upstream.hits_lock:
            return self._handler.hits[path]

    def dropped(self, path: str) -> int:
        """How many requests to `/hold/<ms>` paths the caller hung up on while held."""
        with _Upstream.hits_lock:
            return self._handler.dropped[path]

    def describe(self) -> dict:
        described = {
            "nats_url": self.nats_url,
            "upstream_url": self.upstream_url,
            "closed_url": self.closed_url,
            "health_url": self.health_url,
        }
        if self.isolated:
            described["passwords"] = {
                user: self.password(user) for user in ("caller_a", "caller_b")
            }
        return described

    def webproxy_log(self) -> str:
        path = self._dir / "webproxy.log"
        return path.read_text(errors="replace")[-16000:] if path.exists() else ""

    def _start_nats(self) -> str:
        nats_server = shutil.which("nats-server")
        if nats_server is None:
            raise RuntimeError(
                "no nats-server on PATH: run via `just`, or put the directory printed by "
                "scripts/ensure-nats-server.sh first on PATH"
            )
        ports_dir = self._dir / "ports"
        ports_dir.mkdir()
        log = open(self._dir / "nats-server.log", "ab")
        config: list[str] = []
        if self.isolated:
            # The accounts and users as deployed; the file is included beside the
            # config, where nats-server resolves includes.
            shutil.copy(AUTHORIZATION, self._dir / "authorization.conf")
            (self._dir / "nats-server.conf").write_text("include ./authorization.conf\n")
            config = ["-c", str(self._dir / "nats-server.conf")]
        # Port -1: the server picks a free one itself and says which in its ports file.
        proc = subprocess.Popen(
            [nats_server, *config, "-js", "-a", "127.0.0.1", "-p", "-1",
             "-sd", str(self._dir / "jetstream"), "--ports_file_dir", str(ports_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            env={**os.environ, **self._passwords},
        )
        self._procs.append(proc)
        found: list[str] = []

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {proc.returncode}")
            for path in glob.glob(str(ports_dir / f"*_{proc.pid}.ports")):
                try:
                    found.extend(json.loads(Path(path).read_text())["nats"])
                except (ValueError, KeyError):
                    return False  # written but not complete yet
                return True
            return False

        wait_until(NATS_START_TIMEOUT, "nats-server to listen", listening,
                   lambda: (self._dir / "nats-server.log").read_text(errors="replace"))
        return found[0]

    def _start_webproxy(self) -> str:
        http_port = free_port()
        config = self._dir / "webproxy.toml"
        config.write_text(
            f'[nats]\nurl = "{self.nats_url}"\n\n'
            f'[http]\nlisten = "127.0.0.1:{http_port}"\n\n'
            # Small stream limits: JetStream reserves them against free disk.
            '[streams]\nreply_max_bytes = 67108864\ndead_max_bytes = 67108864\n'
            # Isolated: copies go only to a caller's own reply space, as deployed.
            + ('reply_to_allow = ["callers.{caller}.replies.>"]\n' if self.isolated else "")
            + '\n'
            # The upstream is on loopback, which the address guard denies by default.
            '[outbound]\nallow_private_networks = true\n\n'
            '[[request_rules]]\nname = "forbidden"\nurl_pattern = "/forbidden"\naction = "deny"\n\n'
            f"[[request_rules]]\nname = \"upstream\"\nurl_pattern = '^{_escape(self.upstream_url)}/'\n\n"
            f"[[request_rules]]\nname = \"closed-port\"\nurl_pattern = '^{_escape(self.closed_url)}/'\n"
            "max_retries = 0\n"
        )
        # The nats CLI's variables outrank the config's [nats]; a developer's own
        # must not point the service elsewhere.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("WEBPROXY_")
               and k not in ("NATS_URL", "NATS_CREDS", "NATS_CONTEXT")
               and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
        env.setdefault("RUST_LOG", "info")
        if self.isolated:
            env["WEBPROXY_NATS__USER"] = "webproxy"
            env["WEBPROXY_NATS__PASSWORD"] = self.password("webproxy")
        log = open(self._dir / "webproxy.log", "ab")
        proc = subprocess.Popen(
            [str(webproxy_bin()), "serve", "--config", str(config)],
            cwd=self._dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )
        self._procs.append(proc)
        health_url = f"http://127.0.0.1:{http_port}"
        # No proxy, so a developer's HTTP_PROXY never sees loopback test traffic.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"webproxy exited with {proc.returncode}\n{self.webproxy_log()}")
            try:
                with opener.open(health_url + "/readyz", timeout=1) as response:
                    return response.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(READY_TIMEOUT, "webproxy /readyz to answer 200", ready, self.webproxy_log)
        return health_url

    def stop(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()
        if self._upstream is not None:
            self._upstream.shutdown()
            self._upstream.server_close()
            self._upstream = None
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    with LiveEnv(isolated="--isolated" in sys.argv[1:]) as live:
        print(json.dumps(live.describe()), flush=True)
        # Runs until the test process closes our stdin (or exits).
        sys.stdin.read()
