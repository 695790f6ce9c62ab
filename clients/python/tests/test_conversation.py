"""webproxy_client's side of a conversation against a fake NATS connection, no server:
the random Nats-Msg-Id, retrying a publish that is still in process, the origin from
the publish ack, ignoring live replies of other conversations, reading exactly
the conversation's own stored subject, and a cancel: what it sends, and asking
again while the service is busy, as body.get and body.put do."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re

import nats.errors
import nats.js.errors
import pytest
from nats.js import api

import webproxy_client
from webproxy_client import Client

ORIGIN = "WEBPROXY_POOL_DEFAULT:1733025600000123"
STORED = "webproxy.reply.order-42.WEBPROXY_POOL_DEFAULT.1733025600000123"
HEX32 = re.compile(r"[0-9a-f]{32}")
# Bounds every fake conversation, so a client that waits for nothing fails.
TEST_TIMEOUT = 10.0


class Message:
    def __init__(self, data: bytes, headers=None):
        self.data = data
        self.headers = headers


def reply_message(status: int, origin=ORIGIN) -> Message:
    raw = {"v": 1, "id": "order-42", "outcome": "response", "status": status,
           "headers": {}, "body": f"status {status}", "attempts": 1, "duration_ms": 1}
    headers = {"Webproxy-Outcome": "response"}
    if origin is not None:
        headers["Webproxy-Origin"] = origin
    return Message(json.dumps(raw).encode(), headers)


class FakeSub:
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    async def next_msg(self, timeout: float):
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise nats.errors.TimeoutError from None

    async def unsubscribe(self):
        pass


class FakeNats:
    """Records subscriptions, publishes and lookups. `answers` are what successive
    publishes get (an ack or an exception); `on_publish(fake)` runs after each
    successful one; `stored` maps subjects to stored reply messages."""

    def __init__(self, answers, on_publish=lambda fake: None, stored=None, requests=()):
        self.answers = list(answers)
        # What successive core requests get: a JSON answer or an exception.
        self.request_answers = list(requests)
        self.requested: list[tuple[str, dict, float]] = []
        self.on_publish = on_publish
        self.stored = stored or {}
        self.subscribed: list[str] = []
        self.published: list[tuple[str, dict]] = []
        self.looked_up: list[str] = []
        self.subscriptions_at_publish: list[int] = []
        self.stats = {"reconnects": 0}
        self.sub = FakeSub()

    async def subscribe(self, subject):
        self.subscribed.append(subject)
        return self.sub

    def jetstream(self):
        return self

    async def publish(self, subject, payload, headers):
        self.subscriptions_at_publish.append(len(self.subscribed))
        self.published.append((subject, headers))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        self.on_publish(self)
        return answer

    async def request(self, subject, payload, timeout):
        self.requested.append((subject, json.loads(payload), asyncio.get_running_loop().time()))
        answer = self.request_answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, Message):
            return answer
        return Message(json.dumps(answer).encode())

    async def get_last_msg(self, stream, subject):
        if stream == "WEBPROXY_REPLIES":
            # The shared stream of webproxy before layout 3, retired and empty here.
            raise nats.js.errors.NotFoundError(code=404, err_code=10037, description="no message found")
        assert stream == "WEBPROXY_POOL_DEFAULT_REPLIES"
        self.looked_up.append(subject)
        if subject in self.stored:
            return self.stored[subject]
        raise nats.js.errors.NotFoundError(code=404, err_code=10037, description="no message found")


def ack(duplicate=False) -> api.PubAck:
    return api.PubAck(stream="WEBPROXY_POOL_DEFAULT", seq=1733025600000123, duplicate=duplicate)


def in_process() -> Exception:
    return nats.js.errors.ServiceUnavailableError(
        code=503, err_code=10158, description="duplicate message id is in process"
    )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT))


def test_msg_ids_are_32_lowercase_hex_and_never_repeat():
    ids = [webproxy_client.new_msg_id() for _ in range(1000)]
    assert all(HEX32.fullmatch(i) for i in ids), ids[:3]
    assert len(set(ids)) == len(ids)


def test_each_request_publishes_with_a_fresh_random_msg_id_not_the_envelope_id():
    def answer(fake):
        fake.sub.queue.put_nowait(reply_message(200))

    fake = FakeNats([ack(), ack()], on_publish=answer)
    client = Client(fake)
    for _ in range(2):
        run(client.request("GET", "http://h/", id="order-42", wait=5))
    msg_ids = [headers["Nats-Msg-Id"] for _, headers in fake.published]
    assert all(HEX32.fullmatch(m) for m in msg_ids), msg_ids
    assert msg_ids[0] != msg_ids[1]
    assert "order-42" not in msg_ids
    assert fake.subscribed == ["webproxy.reply.order-42"] * 2
    # Each conversation subscribed before it published.
    assert fake.subscriptions_at_publish == [1, 2]


def test_live_replies_of_other_conversations_are_ignored():
    def answer(fake):
        fake.sub.queue.put_nowait(reply_message(418, origin="WEBPROXY_POOL_DEFAULT:1"))
        fake.sub.queue.put_nowait(reply_message(419, origin=None))
        fake.sub.queue.put_nowait(reply_message(200))

    fake = FakeNats([ack()], on_publish=answer)
    reply = run(Client(fake).request("GET", "http://h/", id="order-42", wait=5))
    assert reply.status == 200
    assert reply.origin == ORIGIN
    assert fake.looked_up == []


def test_a_custom_reply_to_is_the_only_live_subject():
    fake = FakeNats([ack()], on_publish=lambda f: f.sub.queue.put_nowait(reply_message(200)))
    reply = run(Client(fake).request("GET", "http://h/", id="order-42", reply_to="app.r.42", wait=5))
    assert reply.status == 200
    assert fake.subscribed == ["app.r.42"]
    assert fake.looked_up == []
    for bad in ("app.>", "app.*", "a b", "a..b"):
        with pytest.raises(webproxy_client.InvalidRequest):
            run(Client(fake).request("GET", "http://h/", reply_to=bad))


def test_with_a_reply_to_the_stored_replies_are_never_read():
    """A caller confined to its own reply space may not read the replies stream: with
    a reply_to, neither a duplicate ack, nor a reconnect, nor the end of the wait
    looks there (even where a stored reply would be found)."""
    stored = {STORED: reply_message(201)}
    duplicate = FakeNats([ack(duplicate=True)], stored=dict(stored))
    with pytest.raises(webproxy_client.ReplyTimeout) as timeout:
        run(Client(duplicate).request(
            "GET", "http://h/", id="order-42", reply_to="callers.a.replies.42", wait=0.3
        ))
    assert (timeout.value.origin, timeout.value.reply_to) == (ORIGIN, "callers.a.replies.42")
    assert "callers.a.replies.42" in str(timeout.value)

    def reconnect(fake):
        fake.stats["reconnects"] += 1

    reconnected = FakeNats([ack()], on_publish=reconnect, stored=dict(stored))
    with pytest.raises(webproxy_client.ReplyTimeout):
        run(Client(reconnected).request(
            "GET", "http://h/", id="order-42", reply_to="callers.a.replies.42", wait=0.6
        ))
    for fake in (duplicate, reconnected):
        assert fake.subscribed == ["callers.a.replies.42"]
        assert fake.looked_up == []


def test_a_publish_in_process_is_tried_again_with_the_same_id():
    fake = FakeNats(
        [in_process(), in_process(), ack()],
        on_publish=lambda f: f.sub.queue.put_nowait(reply_message(200)),
    )
    reply = run(Client(fake).request("GET", "http://h/", id="order-42", wait=5))
    assert reply.status == 200
    msg_ids = {headers["Nats-Msg-Id"] for _, headers in fake.published}
    assert len(fake.published) == 3 and len(msg_ids) == 1


def test_retries_of_a_publish_in_process_are_bounded():
    fake = FakeNats([in_process() for _ in range(10)])
    with pytest.raises(webproxy_client.PublishFailed):
        run(Client(fake).submit("GET", "http://h/"))
    assert len(fake.published) == 10


def test_other_publish_errors_are_not_retried():
    bad = nats.js.errors.BadRequestError(code=400, err_code=10071, description="wrong last sequence")
    fake = FakeNats([bad])
    with pytest.raises(webproxy_client.PublishFailed):
        run(Client(fake).submit("GET", "http://h/"))
    assert len(fake.published) == 1


def test_a_duplicate_ack_reads_the_own_stored_subject_at_once():
    stored = reply_message(201)
    fake = FakeNats([ack(duplicate=True)], stored={STORED: stored})
    reply = run(
        Client(fake).request(
            "GET", "http://h/", id="order-42", msg_id="f" * 32, wait=600
        )
    )
    assert reply.status == 201
    assert reply.origin == ORIGIN
    assert fake.looked_up == [STORED]
    assert fake.published[0][1] == {"Nats-Msg-Id": "f" * 32}


def test_after_a_reconnect_the_own_stored_subject_is_read():
    stored = reply_message(202)

    def reconnect(fake):
        fake.stats["reconnects"] += 1
        fake.stored[STORED] = stored

    fake = FakeNats([ack()], on_publish=reconnect)
    reply = run(Client(fake).request("GET", "http://h/", id="order-42", wait=600))
    assert reply.status == 202
    assert fake.looked_up == [STORED]


def test_a_timeout_reads_the_stored_subject_and_names_the_origin():
    fake = FakeNats([ack()])
    with pytest.raises(webproxy_client.ReplyTimeout) as timeout:
        run(Client(fake).request("GET", "http://h/", id="order-42", wait=0.3))
    assert (timeout.value.id, timeout.value.origin) == ("order-42", ORIGIN)
    assert fake.looked_up == [STORED]


def test_submit_returns_the_id_origin_and_msg_id():
    fake = FakeNats([ack(), ack()])
    submitted = run(Client(fake).submit("GET", "http://h/", id="order-42"))
    assert (submitted.id, submitted.origin) == ("order-42", ORIGIN)
    assert submitted.msg_id == fake.published[0][1]["Nats-Msg-Id"]
    assert HEX32.fullmatch(submitted.msg_id)
    again = run(Client(fake).submit("GET", "http://h/", id="order-42", msg_id="f" * 32))
    assert again == webproxy_client.Submitted("order-42", ORIGIN, "f" * 32)
    # Made by hand as before the message id was there: still a Submitted.
    assert webproxy_client.Submitted("order-42", ORIGIN).msg_id is None


def test_a_cancel_sends_the_id_origin_and_msg_id_and_answers_the_state():
    for state in ("recorded", "finished", "unknown"):
        fake = FakeNats([], requests=[{"cancel": state}, {"cancel": state}])
        client = Client(fake, prefix="acme.webproxy")
        submitted = webproxy_client.Submitted("order-42", ORIGIN, "f" * 32)
        assert run(client.cancel(submitted)) == state
        assert run(client.cancel("order-42", ORIGIN, "f" * 32)) == state
        sent = {"id": "order-42", "origin": ORIGIN, "msg_id": "f" * 32}
        assert [(s, r) for s, r, _ in fake.requested] == [("acme.webproxy.cancel", sent)] * 2


def test_a_cancel_is_checked_before_it_is_sent():
    fake = FakeNats([])
    client = Client(fake)
    for bad in (
        ("a.b", ORIGIN, "f" * 32),
        ("order-42", "S:0", "f" * 32),
        ("order-42", ORIGIN, "a b"),
        ("order-42", ORIGIN, ""),
    ):
        with pytest.raises(webproxy_client.InvalidRequest):
            run(client.cancel(*bad))
    with pytest.raises(webproxy_client.InvalidRequest):
        run(client.cancel(webproxy_client.Submitted("order-42", ORIGIN)))
    with pytest.raises(webproxy_client.InvalidRequest):
        run(client.cancel("order-42", ORIGIN))
    assert fake.requested == []


def test_a_busy_cancel_is_asked_again_with_doubling_pauses():
    busy = {"error": {"code": "busy", "message": "too many cancels at once"}}
    fake = FakeNats([], requests=[busy, busy, busy, {"cancel": "recorded"}])
    assert run(Client(fake).cancel("order-42", ORIGIN, "f" * 32)) == "recorded"
    times = [t for _, _, t in fake.requested]
    pauses = [later - earlier for earlier, later in zip(times, times[1:])]
    assert len(pauses) == 3
    for pause, least in zip(pauses, (0.05, 0.1, 0.2)):
        assert pause >= least * 0.9, pauses

    # Six tries in all, then the busy answer is the error.
    fake = FakeNats([], requests=[busy] * 6)
    with pytest.raises(webproxy_client.CancelError) as error:
        run(Client(fake).cancel("order-42", ORIGIN, "f" * 32))
    assert (error.value.code, error.value.message) == ("busy", "too many cancels at once")
    assert len(fake.requested) == 6


def test_busy_body_requests_are_asked_again_and_the_last_busy_is_the_error():
    body = b"a stored body"
    digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(body).digest()).decode()
    busy_get = Message(b'{"message": "too many body reads at once"}', {"Webproxy-Body-Error": "busy"})
    whole = Message(body, {"Webproxy-Body-Size": str(len(body)), "Webproxy-Body-Digest": digest})
    reply = webproxy_client.Reply({"id": "order-42", "outcome": "response"}, ORIGIN, "f" * 32)
    fake = FakeNats([], requests=[busy_get, busy_get, whole])
    assert run(Client(fake).read_body(reply)) == body
    assert [subject for subject, _, _ in fake.requested] == ["webproxy.body.get"] * 3
    fake = FakeNats([], requests=[busy_get] * 6)
    with pytest.raises(webproxy_client.BodyError) as error:
        run(Client(fake).read_body(reply))
    assert error.value.code == "busy"
    assert len(fake.requested) == 6

    busy_put = {"error": {"code": "busy", "message": "too many uploads at once"}}
    fake = FakeNats([], requests=[busy_put, {"size": len(body)}])
    uploaded = run(Client(fake).upload(body))
    assert (uploaded["size"], uploaded["digest"]) == (len(body), digest)
    assert [r["offset"] for _, r, _ in fake.requested] == [0, 0]
    fake = FakeNats([], requests=[busy_put] * 6)
    with pytest.raises(webproxy_client.BodyError) as error:
        run(Client(fake).upload(body))
    assert error.value.code == "busy"
    assert len(fake.requested) == 6


def test_other_cancel_errors_are_raised_at_once():
    for code in ("internal", "invalid_request"):
        fake = FakeNats([], requests=[{"error": {"code": code, "message": "no"}}])
        with pytest.raises(webproxy_client.CancelError) as error:
            run(Client(fake).cancel("order-42", ORIGIN, "f" * 32))
        assert (error.value.code, error.value.message) == (code, "no")
        assert len(fake.requested) == 1
    fake = FakeNats([], requests=[nats.errors.NoRespondersError()])
    with pytest.raises(webproxy_client.CancelError) as error:
        run(Client(fake).cancel("order-42", ORIGIN, "f" * 32))
    assert error.value.code == "request"


def test_a_stored_reply_is_looked_up_only_by_a_valid_origin():
    fake = FakeNats([], stored={STORED: reply_message(200)})
    client = Client(fake)
    assert run(client.reply("order-42", ORIGIN)).status == 200
    assert run(client.reply("order-42", "WEBPROXY_POOL_DEFAULT:1")) is None
    for bad in ("", "WEBPROXY_POOL_DEFAULT", "A.B:1", "*:1", ">:1", "S:1:2", "S:-1", "S:x", "S:0", "S:01"):
        with pytest.raises(webproxy_client.InvalidRequest):
            run(client.reply("order-42", bad))
    with pytest.raises(webproxy_client.InvalidRequest):
        run(client.submit("GET", "http://h/", msg_id="a b"))
