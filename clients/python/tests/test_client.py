"""webproxy_client against the published schema and a live webproxy on a real
nats-server (see clients/live_env.py): what it sends, a response, a denied request,
an error outcome, and a reply fetched after it was stored."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import nats
import pytest

import webproxy_client
from live_env import LiveEnv  # noqa: F401 (the type of the `live` fixture)
from webproxy_client import Client, build_envelope

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "schema"
# Generous for a loaded 2-core CI machine; a healthy run takes well under a second.
REPLY_WAIT = 20.0
TEST_TIMEOUT = 60.0


def load(name: str):
    return json.loads((SCHEMA_DIR / name).read_text())


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = load(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


REQUEST = validator("request.schema.json")
REPLY = validator("reply.schema.json")


def errors(validator: jsonschema.Draft202012Validator, instance) -> list[str]:
    return [e.message for e in validator.iter_errors(instance)]


@pytest.mark.parametrize(
    "envelope",
    [
        build_envelope("GET", "http://127.0.0.1:8080/x"),
        build_envelope(
            "post",
            "https://api.example.com/orders?x=1",
            id="order-42",
            headers={"Content-Type": "application/json", "X-Multi": ("a", "b")},
            body='{"qty": 1}',
            reply_to="app.replies.42",
            timeout_ms=5000,
            deadline="2026-11-30T12:00:00Z",
            metadata={"order": 42},
        ),
        build_envelope("PUT", "http://h/", body=b"\x00\x01\xff"),
        build_envelope("DELETE", "http://h/", body=""),
    ],
)
def test_built_envelopes_are_valid(envelope):
    assert errors(REQUEST, envelope) == []


def test_bytes_bodies_travel_as_base64_and_text_as_text():
    assert build_envelope("PUT", "http://h/", body=b"\x00\x01\xff")["body_base64"] == "AAH/"
    assert build_envelope("PUT", "http://h/", body="grüße")["body"] == "grüße"
    assert "body" not in build_envelope("GET", "http://h/")


def test_schema_agrees_with_the_service_on_the_examples():
    examples = load("examples.json")
    for envelope in examples["valid"]:
        assert errors(REQUEST, envelope) == [], envelope
    for case in examples["invalid"]:
        assert errors(REQUEST, case["envelope"]), case


def test_an_id_that_is_not_a_subject_token_is_refused_before_sending():
    async def main():
        # Never connected: the check must come before any I/O.
        client = Client(nats.NATS())
        for bad in ("a.>", ">", "a b", ""):
            with pytest.raises(webproxy_client.InvalidRequest):
                await client.request("GET", "http://h/", id=bad)
            with pytest.raises(webproxy_client.InvalidRequest):
                await client.reply(bad)

    asyncio.run(main())


def run_live(live: LiveEnv, test):
    """Runs `test(client)` with a client on the live service, and checks that every
    request envelope it published to the default pool arrived valid, with its id as
    Nats-Msg-Id. (Only that pool is watched: a subscriber on another pool's subject
    would answer for the missing stream and hide the "no such pool" error.)"""

    async def main():
        nc = await nats.connect(live.nats_url)
        watcher = await nats.connect(live.nats_url)
        arrived: dict = {}

        async def collect(msg) -> None:
            envelope = json.loads(msg.data)
            arrived[envelope["id"]] = (envelope, (msg.headers or {}).get("Nats-Msg-Id"))

        # A core subscription sees what JetStream stores: the bytes the client sent.
        sub = await watcher.subscribe("webproxy.request.default", cb=collect)
        await watcher.flush()
        client = Client(nc)
        published: list = []
        publish = client._publish

        sent: dict = {}

        async def recording_publish(envelope: dict, pool: str):
            if pool == "default":
                published.append(envelope["id"])
                sent[envelope["id"]] = envelope
            return await publish(envelope, pool)

        client._publish = recording_publish
        try:
            await test(client)
            for _ in range(int(REPLY_WAIT / 0.02)):
                if all(id in arrived for id in published):
                    break
                await asyncio.sleep(0.02)
        finally:
            await sub.unsubscribe()
            await watcher.close()
            await nc.close()
        # Every envelope the client sent matches the schema. The bytes and the
        # Nats-Msg-Id seen on the wire are checked too, for each message the core
        # subscriber saw: on a loaded machine it can miss one, which is no fault of
        # the client's.
        for id in published:
            assert errors(REQUEST, sent[id]) == [], sent[id]
        for id in (id for id in published if id in arrived):
            envelope, msg_id = arrived[id]
            assert errors(REQUEST, envelope) == [], envelope
            assert msg_id == id

    try:
        asyncio.run(asyncio.wait_for(main(), TEST_TIMEOUT))
    except BaseException:
        print(live.webproxy_log())
        raise


def assert_valid_reply(reply: webproxy_client.Reply) -> None:
    assert errors(REPLY, dict(reply.raw)) == [], reply.raw


def test_response(live):
    async def test(client: Client):
        reply = await client.request(
            "POST",
            live.url("/echo?q=1"),
            headers={"X-Multi": ["a", "b"]},
            body="hello",
            metadata={"order": 42},
            wait=REPLY_WAIT,
        )
        assert_valid_reply(reply)
        assert reply.ok and reply.error is None
        assert reply.status == 200
        assert reply.attempts == 1
        assert reply.metadata == {"order": 42}
        echo = json.loads(reply.text)
        assert echo["method"] == "POST"
        assert echo["path"] == "/echo?q=1"
        assert echo["body"] == "hello"
        assert echo["headers"]["x-multi"] == ["a", "b"]

        binary = await client.request(
            "PUT", live.url("/echo"), body=b"\x00\x01\xff", wait=REPLY_WAIT
        )
        assert json.loads(binary.text)["body_len"] == 3

    run_live(live, test)


def test_denied_request_is_an_error_outcome(live):
    async def test(client: Client):
        reply = await client.request("GET", live.url("/forbidden/x"), wait=REPLY_WAIT)
        assert_valid_reply(reply)
        assert not reply.ok
        assert reply.status is None
        assert reply.error.code == "denied"
        assert "forbidden" in reply.error.message
        assert reply.attempts == 0

    run_live(live, test)


def test_refused_connection_is_an_error_outcome(live):
    async def test(client: Client):
        reply = await client.request("GET", live.closed_url + "/x", wait=REPLY_WAIT)
        assert_valid_reply(reply)
        assert reply.outcome == "error"
        assert reply.error.code == "retries_exhausted"
        assert reply.attempts == 1

    run_live(live, test)


def test_reply_fetched_after_it_was_stored(live):
    async def test(client: Client):
        id = await client.submit("GET", live.url("/stored"))
        assert await client.reply(webproxy_client.new_id()) is None
        stored = None
        for _ in range(int(REPLY_WAIT / 0.05)):
            stored = await client.reply(id)
            if stored is not None:
                break
            await asyncio.sleep(0.05)
        assert stored is not None, f"no reply to {id} stored within {REPLY_WAIT}s"
        assert_valid_reply(stored)
        assert stored.id == id
        assert stored.text == "path /stored"

        # Asking again with the answered id: a duplicate publish that no live reply
        # follows, answered from the stream at once rather than after the wait.
        again = await asyncio.wait_for(
            client.request("GET", live.url("/stored"), id=id, wait=600), REPLY_WAIT
        )
        assert again.raw == stored.raw

    run_live(live, test)


def test_no_such_pool(live):
    async def test(client: Client):
        with pytest.raises(webproxy_client.NoSuchPool):
            await client.submit("GET", live.url("/x"), pool="nope")

    run_live(live, test)
