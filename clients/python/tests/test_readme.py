"""The READMEs, checked against a live webproxy: the client README's example runs as
written (and the top-level README shows that very example), and a client written from
the top-level README's protocol lines alone, on core NATS calls only (as in a language
with no JetStream support), works: a random Nats-Msg-Id, the origin from the ack, the
origin header on the reply, and the stored reply on the conversation's own subject."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors

from live_env import LiveEnv

PYTHON_DIR = Path(__file__).resolve().parents[1]
REPO = PYTHON_DIR.parents[1]
REPLY_WAIT = 20.0


def code_block(readme: Path, language: str) -> str:
    text = readme.read_text()
    return text.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_the_readme_example_runs(live: LiveEnv, tmp_path: Path):
    code = code_block(PYTHON_DIR / "README.md", "python")
    # The example's addresses, pointed at the live service and upstream instead.
    for placeholder in ("nats://127.0.0.1:4222", "https://example.com/"):
        assert placeholder in code
    code = code.replace("nats://127.0.0.1:4222", live.nats_url)
    code = code.replace("https://example.com/", live.url("/readme"))
    # From an empty directory, as a user's program: webproxy_client is the installed one.
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "200 path /readme\n", result.stdout + result.stderr


def test_the_top_level_readme_shows_the_example_that_runs():
    # README.md's Python example (its first python block) is this client's, which
    # the test above runs: a change to either must be made to both.
    shown = code_block(REPO / "README.md", "python")
    assert shown == code_block(PYTHON_DIR / "README.md", "python"), shown


def test_a_client_from_the_readme_protocol_alone(live: LiveEnv):
    async def main():
        nc = await nats.connect(live.nats_url)
        try:
            id = "readme-" + os.urandom(8).hex()
            # Subscribe first to the live subject.
            sub = await nc.subscribe(f"webproxy.reply.{id}")
            # Publish as a request with a fresh random Nats-Msg-Id; the answer is the
            # ack, whose stream and seq are the conversation's origin.
            msg_id = os.urandom(16).hex()
            envelope = json.dumps({"id": id, "method": "GET", "url": live.url("/core")})
            ack = await nc.request(
                "webproxy.request.default", envelope.encode(),
                headers={"Nats-Msg-Id": msg_id}, timeout=5,
            )
            ack = json.loads(ack.data)
            assert "stream" in ack and "seq" in ack and "error" not in ack, ack
            origin = f"{ack['stream']}:{ack['seq']}"
            # One reply, with its outcome and origin headers.
            message = await sub.next_msg(timeout=REPLY_WAIT)
            assert message.headers["Webproxy-Outcome"] == "response"
            assert message.headers["Webproxy-Origin"] == origin
            reply = json.loads(message.data)
            assert reply["outcome"] == "response" and reply["status"] == 200, reply
            assert reply["body"] == "path /core"

            # The same Nats-Msg-Id again: a duplicate of the same conversation.
            again = await nc.request(
                "webproxy.request.default", envelope.encode(),
                headers={"Nats-Msg-Id": msg_id}, timeout=5,
            )
            again = json.loads(again.data)
            assert again.get("duplicate") is True
            assert (again["stream"], again["seq"]) == (ack["stream"], ack["seq"])

            # The stored reply, on the conversation's own subject in the replies
            # stream of its origin's pool stream, and none for an unknown one.
            get = f"$JS.API.STREAM.MSG.GET.{ack['stream']}_REPLIES"
            own = f"webproxy.reply.{id}.{ack['stream']}.{ack['seq']}"
            found = await nc.request(get, json.dumps({"last_by_subj": own}).encode(), timeout=5)
            stored = json.loads(base64.b64decode(json.loads(found.data)["message"]["data"]))
            assert stored == reply
            missing = await nc.request(
                get,
                json.dumps({"last_by_subj": f"webproxy.reply.{id}.{ack['stream']}.1"}).encode(),
                timeout=5,
            )
            assert json.loads(missing.data)["error"]["err_code"] == 10037

            # An error outcome: a denied request.
            denied_id = id + "-denied"
            denied_sub = await nc.subscribe(f"webproxy.reply.{denied_id}")
            denied = json.dumps({"id": denied_id, "method": "GET", "url": live.url("/forbidden")})
            await nc.request(
                "webproxy.request.default", denied.encode(),
                headers={"Nats-Msg-Id": os.urandom(16).hex()}, timeout=5,
            )
            message = await denied_sub.next_msg(timeout=REPLY_WAIT)
            assert message.headers["Webproxy-Outcome"] == "error"
            assert json.loads(message.data)["error"]["code"] == "denied"

            # No such pool: no responders.
            try:
                await nc.request("webproxy.request.nope", envelope.encode(), timeout=5)
                raise AssertionError("a publish to a missing pool was answered")
            except nats.errors.NoRespondersError:
                pass
        finally:
            await nc.close()

    asyncio.run(asyncio.wait_for(main(), 60))
