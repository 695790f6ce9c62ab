#!/usr/bin/env python3
"""A local HTTP upstream for the loopback quickstart: answers every request with a JSON
echo of what it received (method, path, query, headers, body).

It listens on 127.0.0.1 only, so the quickstart needs no internet. `--port 0` takes a
free port; the first line on stdout is `listening on 127.0.0.1:PORT` either way.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class Echo(BaseHTTPRequestHandler):
    """Every method gets the same answer: 200 and the request, as JSON."""

    server_version = "echo-upstream/1"

    def _echo(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        url = urlsplit(self.path)
        answer = {
            "method": self.command,
            "path": url.path,
            "query": {k: v if len(v) > 1 else v[0] for k, v in parse_qs(url.query).items()},
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body.decode("utf-8", errors="replace"),
        }
        data = json.dumps(answer, indent=2).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _echo

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write("echo-upstream: " + (format % args) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8081, help="0 takes a free port (default 8081)")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Echo)
    print(f"listening on 127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
