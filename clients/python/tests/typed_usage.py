"""How a typed caller uses webproxy_client: checked with `mypy --strict` against the
installed package by test_installed.py (never run), so its py.typed marker and its
signatures are what a user's type checker sees."""

from __future__ import annotations

from typing import Optional

import nats

import webproxy_client
from webproxy_client import (
    CancelError,
    CancelState,
    Client,
    ErrorInfo,
    Reply,
    ReplyTimeout,
    Submitted,
)


async def fetch(url: str) -> tuple[int, str]:
    nc = await nats.connect("nats://127.0.0.1:4222")
    client = Client(nc, prefix="webproxy")
    try:
        reply: Reply = await client.request(
            "POST",
            url,
            pool="default",
            wait=10.0,
            headers={"Accept": "application/json", "X-Multi": ["a", "b"]},
            body=b"\x00\x01",
            metadata={"order": 42},
        )
    except ReplyTimeout as e:
        later: Optional[Reply] = await client.reply(e.id, e.origin)
        return (0, later.text if later is not None else "")
    finally:
        await nc.close()
    error: Optional[ErrorInfo] = reply.error
    if error is not None:
        return (error.status or 0, f"{error.code}: {error.message}")
    status: Optional[int] = reply.status
    return (status or 0, reply.text)


async def submit(client: Client, reply_to: str) -> str:
    submitted: Submitted = await client.submit(
        "GET", "http://127.0.0.1/", reply_to=reply_to, msg_id=webproxy_client.new_msg_id()
    )
    return f"{submitted.id} {submitted.origin}"


async def take_back(client: Client, url: str) -> str:
    submitted = await client.submit("GET", url)
    msg_id: Optional[str] = submitted.msg_id
    try:
        state: CancelState = await client.cancel(submitted)
        if msg_id is not None:
            by_hand: CancelState = await client.cancel(submitted.id, submitted.origin, msg_id)
            return f"{state} {by_hand}"
        return state
    except CancelError as e:
        return e.code
