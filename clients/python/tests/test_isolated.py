"""webproxy_client as an isolated caller, under deploy/nats/authorization.conf's
permissions (see clients/live_env.py): caller_a may subscribe only to its own space
`callers.a.>` and may not read the stored replies. With a reply_to there, the client
listens on it only and never reads the replies stream: its reply arrives, a wait that
runs out is a ReplyTimeout naming the reply_to (not a refused lookup), and the server
reports no permission violation, which it does for a subscription outside the space."""

from __future__ import annotations

import asyncio

import nats
import pytest

import webproxy_client
from live_env import LiveEnv
from webproxy_client import Client

REPLY_WAIT = 20.0


@pytest.fixture(scope="module")
def isolated():
    with LiveEnv(isolated=True) as env:
        yield env


def test_an_isolated_caller_listens_on_its_reply_to_only(isolated: LiveEnv):
    async def main():
        reported: list[str] = []

        async def on_error(e: Exception) -> None:
            reported.append(str(e))

        nc = await nats.connect(
            isolated.nats_url,
            user="caller_a",
            password=isolated.password("caller_a"),
            # JetStream publish acks come to the inbox: it must be in the caller's space.
            inbox_prefix="callers.a._INBOX",
            error_cb=on_error,
        )
        try:
            # caller_a may publish requests only under its own caller name.
            client = Client(nc, caller="a")
            id = webproxy_client.new_id()
            reply = await client.request(
                "GET", isolated.url("/isolated"), id=id,
                reply_to=f"callers.a.replies.{id}", wait=REPLY_WAIT,
            )
            assert (reply.id, reply.text) == (id, "path /isolated")

            slow = webproxy_client.new_id()
            with pytest.raises(webproxy_client.ReplyTimeout) as timeout:
                await client.request(
                    "GET", isolated.url("/delay/3000"), id=slow,
                    reply_to=f"callers.a.replies.{slow}", wait=0.3,
                )
            assert timeout.value.reply_to == f"callers.a.replies.{slow}"
            await nc.flush()
            assert reported == [], reported

            # The control: what the client must not do is reported here.
            await nc.subscribe(f"webproxy.reply.{id}")
            await nc.flush()
            for _ in range(int(REPLY_WAIT / 0.02)):
                if reported:
                    break
                await asyncio.sleep(0.02)
            assert len(reported) == 1 and f"webproxy.reply.{id}" in reported[0], reported
        finally:
            await nc.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    except BaseException:
        print(isolated.webproxy_log())
        raise
