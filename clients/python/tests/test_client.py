"""webproxy_client against the published schema and a live webproxy on a real
nats-server (see clients/live_env.py): what it sends, a response, a denied request,
an error outcome, a reply fetched after it was stored, conversations that share
an envelope id: each gets its own reply, live and stored, also after a reconnect,
and cancels: of a conversation in flight, with a wrong message id, of a finished one."""

from __future__ import annotations

import asyncio
import json
import re
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
HEX32 = re.compile(r"[0-9a-f]{32}")


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
                await client.reply(bad, "WEBPROXY_POOL_DEFAULT:1")

    asyncio.run(main())


def run_live(live: LiveEnv, test):
    """Runs `test(client, nc)` with a client on the live service (and its connection),
    and checks that every request envelope it published to the default pool arrived
    valid, with the fresh random Nats-Msg-Id the client chose. (Only that pool is
    watched: a subscriber on another pool's subject would answer for the missing
    stream and hide the "no such pool" error.)"""

    async def main():
        nc = await nats.connect(live.nats_url)
        watcher = await nats.connect(live.nats_url)
        arrived: dict = {}

        async def collect(msg) -> None:
            msg_id = (msg.headers or {}).get("Nats-Msg-Id")
            arrived[msg_id] = json.loads(msg.data)

        # A core subscription sees what JetStream stores: the bytes the client sent.
        sub = await watcher.subscribe("webproxy.request.default", cb=collect)
        await watcher.flush()
        client = Client(nc)
        published: list = []
        publish = client._publish

        async def recording_publish(envelope: dict, pool: str, msg_id: str):
            if pool == "default":
                published.append((envelope, msg_id))
            return await publish(envelope, pool, msg_id)

        client._publish = recording_publish
        try:
            await test(client, nc)
            for _ in range(int(REPLY_WAIT / 0.02)):
                if all(msg_id in arrived for _, msg_id in published):
                    break
                await asyncio.sleep(0.02)
        finally:
            await sub.unsubscribe()
            await watcher.close()
            await nc.close()
        # Every envelope the client sent matches the schema, and each conversation has
        # its own random Nats-Msg-Id, never the envelope id: a msg id is sent again
        # only with the very same message. The bytes seen on the wire are checked too,
        # for each message the core subscriber saw: on a loaded machine it can miss
        # one, which is no fault of the client's.
        by_msg_id: dict = {}
        for envelope, msg_id in published:
            assert errors(REQUEST, envelope) == [], envelope
            assert HEX32.fullmatch(msg_id), msg_id
            assert msg_id != envelope["id"]
            assert by_msg_id.setdefault(msg_id, envelope) == envelope, msg_id
        for envelope, msg_id in published:
            if msg_id in arrived:
                assert arrived[msg_id] == envelope
                assert errors(REQUEST, arrived[msg_id]) == [], arrived[msg_id]

    try:
        asyncio.run(asyncio.wait_for(main(), TEST_TIMEOUT))
    except BaseException:
        print(live.webproxy_log())
        raise


def assert_valid_reply(reply: webproxy_client.Reply) -> None:
    assert errors(REPLY, dict(reply.raw)) == [], reply.raw


def test_response(live):
    async def test(client: Client, nc):
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
    async def test(client: Client, nc):
        reply = await client.request("GET", live.url("/forbidden/x"), wait=REPLY_WAIT)
        assert_valid_reply(reply)
        assert not reply.ok
        assert reply.status is None
        assert reply.error.code == "denied"
        assert "forbidden" in reply.error.message
        assert reply.attempts == 0

    run_live(live, test)


def test_refused_connection_is_an_error_outcome(live):
    async def test(client: Client, nc):
        reply = await client.request("GET", live.closed_url + "/x", wait=REPLY_WAIT)
        assert_valid_reply(reply)
        assert reply.outcome == "error"
        assert reply.error.code == "retries_exhausted"
        assert reply.attempts == 1

    run_live(live, test)


def test_reply_fetched_after_it_was_stored(live):
    async def test(client: Client, nc):
        msg_id = webproxy_client.new_msg_id()
        submitted = await client.submit("GET", live.url("/stored"), msg_id=msg_id)
        assert re.fullmatch(r"WEBPROXY_POOL_DEFAULT:[0-9]+", submitted.origin), submitted
        assert await client.reply(webproxy_client.new_id(), submitted.origin) is None
        stored = None
        for _ in range(int(REPLY_WAIT / 0.05)):
            stored = await client.reply(submitted.id, submitted.origin)
            if stored is not None:
                break
            await asyncio.sleep(0.05)
        assert stored is not None, f"no reply to {submitted} stored within {REPLY_WAIT}s"
        assert_valid_reply(stored)
        assert stored.id == submitted.id
        assert stored.origin == submitted.origin
        assert stored.text == "path /stored"

        # The very same message published again (its Nats-Msg-Id, as after a crash):
        # a duplicate of the same conversation that no live reply follows, answered
        # from its stored subject at once rather than after the wait.
        again = await asyncio.wait_for(
            client.request("GET", live.url("/stored"), id=submitted.id, msg_id=msg_id, wait=600),
            REPLY_WAIT,
        )
        assert again.raw == stored.raw
        assert again.origin == submitted.origin

    run_live(live, test)


def test_two_conversations_with_one_id_each_get_their_own_reply(live):
    async def test(client: Client, nc):
        id = webproxy_client.new_id()
        first = await client.request("GET", live.url("/one"), id=id, wait=REPLY_WAIT)
        second = await client.request("GET", live.url("/two"), id=id, wait=REPLY_WAIT)
        assert (first.id, first.text) == (id, "path /one")
        assert (second.id, second.text) == (id, "path /two")
        assert first.origin != second.origin
        assert (await client.reply(id, first.origin)).text == "path /one"
        assert (await client.reply(id, second.origin)).text == "path /two"

    run_live(live, test)


async def wait_until(what: str, check) -> None:
    for _ in range(int(REPLY_WAIT / 0.02)):
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {REPLY_WAIT}s waiting for {what}")


def test_a_live_reply_with_another_origin_is_ignored(live):
    async def test(client: Client, nc):
        id = webproxy_client.new_id()
        in_flight = asyncio.ensure_future(
            client.request("GET", live.url("/delay/1000"), id=id, wait=600)
        )

        async def called():
            return live.hits("/delay/1000") == 1

        await wait_until("the upstream call", called)
        forged = json.dumps({"v": 1, "id": id, "outcome": "response", "status": 418,
                             "headers": {}, "body": "forged", "attempts": 1,
                             "duration_ms": 1}).encode()
        for origin in ("WEBPROXY_POOL_DEFAULT:1", None):
            headers = {"Webproxy-Outcome": "response"}
            if origin:
                headers["Webproxy-Origin"] = origin
            await nc.publish(f"webproxy.reply.{id}", forged, headers=headers)
        await nc.flush()
        reply = await asyncio.wait_for(in_flight, REPLY_WAIT)
        assert (reply.status, reply.text) == (200, "path /delay/1000")
        assert reply.origin != "WEBPROXY_POOL_DEFAULT:1"

    run_live(live, test)


class Relay:
    """A TCP relay on 127.0.0.1 in front of the live nats-server. Cutting it drops
    every connection through it and refuses new ones until it is healed: one caller's
    network going away while the server and everyone else stay up."""

    def __init__(self, target_port: int):
        self._target_port = target_port
        self._cut = False
        self._connections: set = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader, writer) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._connections.add(pair)

        async def pump(source, sink) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.transport.abort()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            self._connections.discard(pair)

    def cut(self) -> None:
        self._cut = True
        for pair in list(self._connections):
            for writer in pair:
                writer.transport.abort()

    def heal(self) -> None:
        self._cut = False

    def close(self) -> None:
        self.cut()
        self._server.close()


async def stored_replies(nc) -> int:
    info = await nc.jetstream().stream_info("WEBPROXY_POOL_DEFAULT_REPLIES")
    return info.state.messages


def test_reply_missed_while_disconnected_is_read_from_its_own_stored_subject(live):
    """The caller's connection drops while its request is in flight, and the reply is
    published while it is away. Meanwhile another conversation reuses the id and is
    answered, so the newest stored reply for the id is not this caller's. Once
    reconnected, the client reads exactly its own stored subject."""

    async def test(client: Client, nc):
        relay = Relay(int(live.nats_url.rsplit(":", 1)[1]))
        relayed = await nats.connect(
            await relay.start(), reconnect_time_wait=0.1, max_reconnect_attempts=-1
        )
        try:
            id = webproxy_client.new_id()
            before = await stored_replies(nc)
            in_flight = asyncio.ensure_future(
                Client(relayed).request("GET", live.url("/delay/1500"), id=id, wait=600)
            )

            async def called():
                return live.hits("/delay/1500") == 1

            await wait_until("the upstream call", called)
            relay.cut()

            async def stored():
                return await stored_replies(nc) == before + 1

            await wait_until("the reply stored while cut off", stored)
            other = await client.request("GET", live.url("/other"), id=id, wait=REPLY_WAIT)
            assert other.text == "path /other"
            assert await stored_replies(nc) == before + 2
            assert not in_flight.done(), "a reply arrived while cut off"
            relay.heal()
            reply = await asyncio.wait_for(in_flight, REPLY_WAIT)
            assert (reply.id, reply.text) == (id, "path /delay/1500")
            assert reply.origin != other.origin
        finally:
            relay.close()
            await relayed.close()

    run_live(live, test)


def test_no_such_pool(live):
    async def test(client: Client, nc):
        with pytest.raises(webproxy_client.NoSuchPool):
            await client.submit("GET", live.url("/x"), pool="nope")

    run_live(live, test)


def test_a_large_body_each_way(live):
    """Issue 34: a response above the inline limit comes back stored, named by the
    reply's body_object, and reads back whole through body.get with the request's
    message id; a request body uploaded through body.put arrives upstream whole."""
    import hashlib

    from live_env import large_body

    async def test(client: Client, nc):
        size = 2_000_000
        reply = await client.request(
            "GET", live.url(f"/bytes/{size}"), large_body=True, wait=REPLY_WAIT
        )
        assert_valid_reply(reply)
        assert reply.ok, reply.raw
        assert reply.body_object is not None and reply.body_object["size"] == size
        assert await client.read_body(reply) == large_body(size)

        data = large_body(3_000_000)
        uploaded = await client.upload(data)
        assert uploaded["size"] == len(data)
        echoed = await client.request(
            "POST", live.url("/echo"), body_object=uploaded, wait=REPLY_WAIT
        )
        assert echoed.ok, echoed.raw
        echo = json.loads(echoed.text)
        assert echo["body_len"] == len(data)
        assert echo["body_sha256"] == hashlib.sha256(data).hexdigest()

    run_live(live, test)


async def stored_reply(client: Client, submitted: webproxy_client.Submitted):
    """The conversation's stored reply, once there is one (within REPLY_WAIT)."""
    for _ in range(int(REPLY_WAIT / 0.02)):
        stored = await client.reply(submitted.id, submitted.origin)
        if stored is not None:
            return stored
        await asyncio.sleep(0.02)
    raise AssertionError(f"no reply to {submitted} stored within {REPLY_WAIT}s")


def test_a_cancel_drops_the_attempt_in_flight(live):
    """Issue 35: a conversation whose upstream holds the request is cancelled by its
    publisher: the cancel is recorded, the upstream sees the HTTP request dropped long
    before it would answer, and the one reply says cancelled, with the attempt made."""

    async def test(client: Client, nc):
        submitted = await client.submit("GET", live.url("/hold/10000"))
        assert submitted.msg_id is not None and HEX32.fullmatch(submitted.msg_id)

        async def called():
            return live.hits("/hold/10000") == 1

        await wait_until("the upstream call", called)
        assert await client.cancel(submitted) == "recorded"

        async def dropped():
            return live.dropped("/hold/10000") == 1

        # Within REPLY_WAIT, under the 10 s the upstream holds it: not waited for.
        await wait_until("the held request dropped", dropped)
        reply = await stored_reply(client, submitted)
        assert_valid_reply(reply)
        assert not reply.ok, reply.raw
        assert reply.error is not None and reply.error.code == "cancelled", reply.raw
        assert reply.attempts == 1
        # Its one reply stands: a second cancel finds it finished.
        assert await client.cancel(submitted) == "finished"
        assert live.hits("/hold/10000") == 1

    run_live(live, test)


def test_a_cancel_with_another_msg_id_is_unknown_and_changes_nothing(live):
    """The message id is the capability: anyone else's cancel of a conversation in
    flight, or of an origin that names none, answers unknown, and the conversation
    goes on to its response."""

    async def test(client: Client, nc):
        submitted = await client.submit("GET", live.url("/delay/2000"))

        async def called():
            return live.hits("/delay/2000") == 1

        await wait_until("the upstream call", called)
        assert submitted.msg_id is not None
        guessed = webproxy_client.new_msg_id()
        assert await client.cancel(submitted.id, submitted.origin, guessed) == "unknown"
        assert await client.cancel(submitted.id, "WEBPROXY_POOL_DEFAULT:1", submitted.msg_id) == "unknown"
        reply = await stored_reply(client, submitted)
        assert (reply.status, reply.text) == (200, "path /delay/2000"), reply.raw

    run_live(live, test)


def test_a_cancel_of_a_finished_conversation_leaves_its_reply(live):
    async def test(client: Client, nc):
        submitted = await client.submit("GET", live.url("/finished"))
        before = await stored_reply(client, submitted)
        assert await client.cancel(submitted) == "finished"
        after = await client.reply(submitted.id, submitted.origin)
        assert after is not None and after.raw == before.raw
        assert after.text == "path /finished"

        # What request returns names its conversation too.
        reply = await client.request("GET", live.url("/finished"), wait=REPLY_WAIT)
        assert await client.cancel(reply) == "finished"

    run_live(live, test)
