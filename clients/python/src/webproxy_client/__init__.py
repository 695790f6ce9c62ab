"""A small asyncio client for webproxy on nats-py.

It gets right what every caller must: subscribe before publishing, publish with a
fresh random ``Nats-Msg-Id``, pick the pool subject, keep only the reply of its own
conversation (its *origin*, ``<STREAM>:<seq>`` from the publish ack), fall back to
its own stored reply (unless it listens on a ``reply_to`` of its own), and tell an
error outcome from a response. The wire protocol is in the repository's
``docs/protocol.md`` and ``schema/request.schema.json``.

    nc = await nats.connect("nats://127.0.0.1:4222")
    client = Client(nc)
    reply = await client.request("GET", "https://api.example.com/orders/42")
    if reply.ok:
        print(reply.status, reply.text)
    else:
        print(reply.error.code, reply.error.message)

A request made with ``submit`` can be taken back: ``await client.cancel(submitted)``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import secrets
import uuid
from dataclasses import dataclass, replace
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Literal,
    Mapping,
    Optional,
    Sequence,
    TypedDict,
    Union,
    overload,
)

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

if TYPE_CHECKING:
    # Only in annotations, which are never evaluated: no dependency at run time.
    from typing_extensions import Unpack

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Reply",
    "Submitted",
    "ErrorInfo",
    "WebproxyError",
    "InvalidRequest",
    "NoSuchPool",
    "PublishFailed",
    "ReplyTimeout",
    "LookupFailed",
    "BadReply",
    "BodyError",
    "CancelError",
    "CancelState",
    "build_envelope",
    "new_id",
    "new_msg_id",
    "Envelope",
    "EnvelopeFields",
    "HeaderValues",
    "DEFAULT_PREFIX",
    "DEFAULT_POOL",
    "DEFAULT_WAIT",
]

DEFAULT_PREFIX = "webproxy"
DEFAULT_POOL = "default"
DEFAULT_WAIT = 30.0

_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_POOL = re.compile(r"[a-z0-9_-]{1,32}")
_CALLER = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A conversation's origin: its pool stream (one subject token) and stream sequence.
_ORIGIN = re.compile(r"[A-Za-z0-9_-]{1,255}:[1-9][0-9]{0,19}")
# A literal subject: non-empty tokens, no wildcards, no white space.
_SUBJECT = re.compile(r"[^\s.*>]+(\.[^\s.*>]+)*")
# A Nats-Msg-Id set by the caller: printable, no white space.
_MSG_ID = re.compile(r"[!-~]{1,128}")
_ORIGIN_HEADER = "Webproxy-Origin"
# How often a waiting request looks whether the connection was re-made, which is
# when a live reply can have been missed.
_RECONNECT_CHECK = 0.25
# JetStream's error code for "no message found" in a stream message lookup.
_NO_MESSAGE_FOUND = 10037
# JetStream's error code for "stream not found".
_STREAM_NOT_FOUND = 10059
# JetStream's "duplicate message id is in process": an earlier publish with the same
# id is not stored yet. Tried again with the same id, this many times in all, this
# many seconds apart.
_IN_PROCESS = 10158
_PUBLISH_TRIES = 10
_PUBLISH_RETRY_DELAY = 0.05
# How much of a body one body.put message carries: about 350 KB in base64, well within
# the default 1 MiB max_payload.
_UPLOAD_CHUNK = 256 * 1024
# How many times in all a cancel, body.get or body.put answered ``busy`` is sent (the
# service answers a fixed number at once), and the pause before the second, doubling
# after: 50 ms to 800 ms, 1.55 s in all, as the Rust client does.
_BUSY_TRIES = 6
_BUSY_PAUSE = 0.05
# How long one cancel (or body) request waits for its answer.
_ANSWER_TIMEOUT = 10.0

HeaderValues = Union[str, Sequence[str]]
CancelState = Literal["recorded", "finished", "unknown"]
"""What became of a cancel: ``recorded`` (the conversation's next delivery ends it and
an attempt in flight is dropped; its reply says ``cancelled``, or is the response of an
attempt that finished first), ``finished`` (it has its final reply, which stays as it
is) or ``unknown`` (no such conversation, or not the message id it was published
with: one answer for both)."""
_CANCEL_STATES = ("recorded", "finished", "unknown")
# A request envelope as published: JSON, so its values are JSON values.
Envelope = Dict[str, Any]


class EnvelopeFields(TypedDict, total=False):
    """The envelope's optional fields, as build_envelope, ``request`` and ``submit``
    take them (as keyword arguments)."""

    id: Optional[str]
    headers: Optional[Mapping[str, HeaderValues]]
    body: Union[str, bytes, None]
    reply_to: Optional[str]
    timeout_ms: Optional[int]
    deadline: Optional[str]
    metadata: Any
    large_body: bool
    body_object: Optional[Mapping[str, Any]]


class WebproxyError(Exception):
    """Talking to webproxy failed. An error *outcome* is not one: it is a Reply."""


class InvalidRequest(WebproxyError, ValueError):
    """The id or pool cannot be used; nothing was sent."""


class NoSuchPool(WebproxyError):
    """No stream stores the pool's request subject."""


class PublishFailed(WebproxyError):
    """JetStream did not confirm that it stored the request."""


class ReplyTimeout(WebproxyError, TimeoutError):
    """No reply came within the wait, and none is stored. The request was stored:
    read its reply later with ``client.reply(e.id, e.origin)``.

    With a ``reply_to`` (``e.reply_to``) the stored replies were not read: a caller
    confined to its own reply space may not read them. Such a caller captures the
    copies sent to its ``reply_to`` in a stream of its own."""

    def __init__(
        self, id: str, wait: float, origin: str, reply_to: Optional[str] = None
    ) -> None:
        if reply_to is None:
            message = f"no reply to {id} (origin {origin}) within {wait}s, and none is stored"
        else:
            message = (
                f"no reply to {id} (origin {origin}) on {reply_to} within {wait}s "
                "(the stored replies are not read for a reply_to)"
            )
        super().__init__(message)
        self.id = id
        self.wait = wait
        self.origin = origin
        self.reply_to = reply_to


class LookupFailed(WebproxyError):
    """The replies stream could not be read."""


class BadReply(WebproxyError):
    """A reply that is not a valid reply envelope."""


class BodyError(WebproxyError):
    """A stored body could not be read (``body.get``) or an upload was refused
    (``body.put``); ``code`` is the service's (``not_found``, ``expired``, ``quota``,
    ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class CancelError(WebproxyError):
    """A cancel got no state: the service answered an error (``invalid_request``,
    ``busy`` still after the tries, or ``internal``: nothing was recorded, ask again),
    or ``request`` when it could not be asked. Nothing is said of the conversation."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ErrorInfo:
    """An error outcome's details; ``code`` is one of the protocol's error codes."""

    code: str
    message: str
    status: Optional[int] = None


@dataclass(frozen=True)
class Reply:
    """The final reply of a conversation; ``raw`` is the envelope as received and
    ``origin`` the conversation's origin, ``<STREAM>:<seq>``."""

    raw: Mapping[str, Any]
    origin: Optional[str] = None
    msg_id: Optional[str] = None
    """The ``Nats-Msg-Id`` the request was published with: what reading its stored
    body (``body_object``) asks for."""

    @property
    def id(self) -> str:
        return str(self.raw["id"])

    @property
    def outcome(self) -> str:
        return str(self.raw["outcome"])

    @property
    def ok(self) -> bool:
        """Whether this is the upstream's HTTP response rather than an error outcome."""
        return self.outcome == "response"

    @property
    def status(self) -> Optional[int]:
        status: Optional[int] = self.raw.get("status")
        return status

    @property
    def headers(self) -> Mapping[str, HeaderValues]:
        headers: Optional[Mapping[str, HeaderValues]] = self.raw.get("headers")
        return headers or {}

    @property
    def body(self) -> bytes:
        if "body_base64" in self.raw:
            return base64.b64decode(self.raw["body_base64"])
        text: str = self.raw.get("body", "")
        return text.encode()

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    @property
    def error(self) -> Optional[ErrorInfo]:
        error = self.raw.get("error")
        if error is None:
            return None
        return ErrorInfo(error["code"], error["message"], error.get("status"))

    @property
    def attempts(self) -> int:
        return int(self.raw["attempts"])

    @property
    def metadata(self) -> Any:
        return self.raw.get("metadata")

    @property
    def body_object(self) -> Optional[Mapping[str, Any]]:
        """Where a stored body is (``bucket``, ``name``, ``size``, ``digest``), for a
        request that set ``large_body`` and got one above the inline limit; read it
        with ``client.read_body(reply)``."""
        found: Optional[Mapping[str, Any]] = self.raw.get("body_object")
        return found


@dataclass(frozen=True)
class Submitted:
    """A request JetStream has stored: its envelope id and its conversation's origin,
    which together name its stored reply (``client.reply(id, origin)``), and the
    ``Nats-Msg-Id`` it was published with, which with them takes it back
    (``client.cancel(submitted)``); keep it to yourself, it is the capability."""

    id: str
    origin: str
    msg_id: Optional[str] = None


def new_id() -> str:
    """A fresh envelope id. It correlates the reply with the request and names the
    live reply subject; it need not be secret, and anyone may reuse it."""
    return uuid.uuid4().hex


def new_msg_id() -> str:
    """A fresh Nats-Msg-Id: 32 lowercase hex characters (128 bits from the operating
    system's CSPRNG), so no other caller can guess it and pre-empt the publish."""
    return secrets.token_hex(16)


def _is_own(headers: Optional[Mapping[str, str]], origin: str) -> bool:
    # Anyone may reuse an id: a reply with another origin, or none, is not ours.
    return (headers or {}).get(_ORIGIN_HEADER) == origin


def build_envelope(
    method: str,
    url: str,
    *,
    id: Optional[str] = None,
    headers: Optional[Mapping[str, HeaderValues]] = None,
    body: Union[str, bytes, None] = None,
    reply_to: Optional[str] = None,
    timeout_ms: Optional[int] = None,
    deadline: Optional[str] = None,
    metadata: Any = None,
    large_body: bool = False,
    body_object: Optional[Mapping[str, Any]] = None,
) -> Envelope:
    """The request envelope as it is published. ``body`` is sent as text when it is
    a str and as base64 when it is bytes; optional fields left as None are left out.
    ``large_body`` lets the reply name a stored body above the inline limit;
    ``body_object`` (what ``client.upload`` returns) names an uploaded body in place
    of ``body``."""
    envelope: Envelope = {"v": 1, "id": new_id() if id is None else id, "method": method, "url": url}
    if headers:
        envelope["headers"] = {
            name: value if isinstance(value, str) else list(value)
            for name, value in headers.items()
        }
    if isinstance(body, bytes):
        envelope["body_base64"] = base64.b64encode(body).decode("ascii")
    elif body is not None:
        envelope["body"] = body
    optional = {
        "reply_to": reply_to,
        "timeout_ms": timeout_ms,
        "deadline": deadline,
        "metadata": metadata,
    }
    envelope.update({k: v for k, v in optional.items() if v is not None})
    if large_body:
        envelope["large_body"] = True
    if body_object is not None:
        envelope["body_object"] = dict(body_object)
    return envelope


def _check(pattern: "re.Pattern[str]", what: str, value: str) -> None:
    # The id and pool are subject tokens: a '.' or wildcard would subscribe or
    # publish to the wrong subjects instead of getting an invalid_request answer.
    if not pattern.fullmatch(value):
        raise InvalidRequest(f"invalid {what} {value!r}: must match {pattern.pattern}")


def _decode(payload: bytes, origin: Optional[str], msg_id: Optional[str] = None) -> Reply:
    try:
        raw = json.loads(payload)
    except ValueError as e:
        raise BadReply(f"the reply is not JSON: {e}") from e
    if not isinstance(raw, dict) or raw.get("outcome") not in ("response", "error"):
        raise BadReply(f"the reply is not a reply envelope: {payload[:200]!r}")
    return Reply(raw, origin, msg_id)


class Client:
    """A webproxy client over one nats-py connection."""

    def __init__(
        self, nc: NATS, prefix: str = DEFAULT_PREFIX, caller: Optional[str] = None
    ) -> None:
        """``caller``: publish requests as that caller, on
        ``<prefix>.request.<pool>.<caller>``, the name NATS permissions let the
        connection publish under; the service gives a request's ``reply_to`` that
        caller's reply space (``[streams] reply_to_allow`` with ``{caller}``)."""
        if caller is not None:
            _check(_CALLER, "caller", caller)
        self._nc = nc
        self._prefix = prefix
        self._caller = caller
        # The shared replies stream of webproxy before its stream layout 3, retired at
        # the upgrade: it holds the replies stored before it until they age out.
        self._retired_replies_stream = prefix.replace(".", "_").upper() + "_REPLIES"

    @property
    def _js(self) -> JetStreamContext:
        # Made on use, so a client can be built before its connection is up.
        return self._nc.jetstream()

    async def request(
        self,
        method: str,
        url: str,
        *,
        pool: str = DEFAULT_POOL,
        wait: float = DEFAULT_WAIT,
        msg_id: Optional[str] = None,
        **fields: Unpack[EnvelopeFields],
    ) -> Reply:
        """Sends a request and waits up to ``wait`` seconds for its final reply, which
        may be an error outcome. ``fields`` are the envelope's (see build_envelope).

        The live subscription is made before publishing, and only a live reply whose
        ``Webproxy-Origin`` is this conversation's counts. Without ``reply_to`` it
        listens on ``<prefix>.reply.<id>``, and a reply that could have been missed is
        read from this conversation's own stored subject: on a duplicate publish ack,
        after a reconnect, and when the wait runs out. With ``reply_to`` it listens
        there only and reads no stored reply: a caller confined to its own reply space
        may neither subscribe to ``<prefix>.reply.>`` nor read the replies stream, so
        it captures the copies to its ``reply_to`` in a stream of its own if it must
        survive a reconnect.

        Every call is a new conversation with a fresh random ``Nats-Msg-Id``. Pass the
        ``msg_id`` of an earlier call only to publish that very message again (after a
        crash, within the duplicate window): the same conversation answers."""
        envelope = build_envelope(method, url, **fields)
        id = str(envelope["id"])
        _check(_ID, "id", id)
        reply_to = fields.get("reply_to")
        live = _live_subject(self._prefix, id, reply_to)
        lookups = reply_to is None
        msg_id = _own_msg_id(msg_id)
        sub = await self._nc.subscribe(live)
        try:
            reconnects = self._nc.stats["reconnects"]
            loop = asyncio.get_running_loop()
            wait_until = loop.time() + wait
            ack = await self._publish(envelope, pool, msg_id)
            origin = f"{ack.stream}:{ack.seq}"
            if ack.duplicate and lookups:
                stored = await self.reply(id, origin)
                if stored is not None:
                    return replace(stored, msg_id=msg_id)
            while (remaining := wait_until - loop.time()) > 0:
                try:
                    message = await sub.next_msg(timeout=min(remaining, _RECONNECT_CHECK))
                except nats.errors.TimeoutError:
                    message = None
                if message is not None and _is_own(message.headers, origin):
                    return _decode(message.data, origin, msg_id)
                # Subscriptions are replayed as part of reconnecting, so a reply
                # published after this lookup reaches the subscription.
                if lookups and self._nc.stats["reconnects"] != reconnects:
                    reconnects = self._nc.stats["reconnects"]
                    stored = await self.reply(id, origin)
                    if stored is not None:
                        return replace(stored, msg_id=msg_id)
            if not lookups:
                raise ReplyTimeout(id, wait, origin, reply_to)
            stored = await self.reply(id, origin)
            if stored is None:
                raise ReplyTimeout(id, wait, origin)
            return replace(stored, msg_id=msg_id)
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                # A closed connection has dropped the subscription already; the
                # exception that got us here is the one to report.
                pass

    async def submit(
        self,
        method: str,
        url: str,
        *,
        pool: str = DEFAULT_POOL,
        msg_id: Optional[str] = None,
        **fields: Unpack[EnvelopeFields],
    ) -> Submitted:
        """Publishes a request and returns its id, origin and message id once
        JetStream has stored it; read the reply later with ``reply(id, origin)`` (or,
        with a ``reply_to``, from wherever the caller keeps the copies sent there),
        take it back with ``cancel(submitted)``."""
        envelope = build_envelope(method, url, **fields)
        id = str(envelope["id"])
        _check(_ID, "id", id)
        msg_id = _own_msg_id(msg_id)
        ack = await self._publish(envelope, pool, msg_id)
        return Submitted(id, f"{ack.stream}:{ack.seq}", msg_id)

    @overload
    async def cancel(self, conversation: Union[Submitted, Reply], /) -> CancelState: ...

    @overload
    async def cancel(self, id: str, origin: str, msg_id: str, /) -> CancelState: ...

    async def cancel(
        self,
        conversation: Union[Submitted, Reply, str],
        origin: Optional[str] = None,
        msg_id: Optional[str] = None,
        /,
    ) -> CancelState:
        """Takes back the conversation a ``Submitted`` (or ``Reply``) names, or the
        one with envelope id ``id`` and origin ``origin`` published with ``msg_id``,
        through ``<prefix>.cancel``; the message id is the capability, so only its
        publisher can. ``recorded``: its next delivery ends it and an attempt in
        flight is dropped; its reply says ``cancelled`` (or is the response of an
        attempt that finished first), and it still arrives as its reply. ``finished``:
        it has its final reply, unchanged. ``unknown``: no such conversation, or not
        this message id. An answer ``busy`` is asked again (6 tries in all, 50 ms
        apart, doubling); any other error raises ``CancelError``."""
        if isinstance(conversation, (Submitted, Reply)):
            if origin is not None or msg_id is not None:
                raise InvalidRequest(
                    "cancel takes a Submitted or Reply alone, or id, origin and msg_id"
                )
            id, origin, msg_id = conversation.id, conversation.origin, conversation.msg_id
            if origin is None or msg_id is None:
                raise InvalidRequest("cancel needs a request made with this client")
        else:
            id = conversation
            if origin is None or msg_id is None:
                raise InvalidRequest("cancel needs id, origin and msg_id")
        _check(_ID, "id", id)
        _check(_ORIGIN, "origin", origin)
        _check(_MSG_ID, "msg_id", msg_id)
        payload = json.dumps({"id": id, "origin": origin, "msg_id": msg_id}).encode()
        try:
            answer = await self._ask_while_busy(f"{self._prefix}.cancel", payload, _busy_in_json)
        except nats.errors.Error as e:
            raise CancelError("request", f"cancel was not answered: {e}") from e
        try:
            answered = json.loads(answer.data)
        except ValueError as e:
            raise CancelError("internal", f"the cancel answer is not JSON: {e}") from e
        state = answered.get("cancel") if isinstance(answered, dict) else None
        if state in _CANCEL_STATES:
            found: CancelState = state
            return found
        error = answered.get("error") if isinstance(answered, dict) else None
        if not isinstance(error, dict):
            raise CancelError(
                "internal",
                f"the cancel answer has neither a state nor an error: {answer.data[:200]!r}",
            )
        raise CancelError(str(error.get("code")), str(error.get("message", "")))

    async def reply(self, id: str, origin: str) -> Optional[Reply]:
        """The stored final reply of the conversation ``origin`` with envelope id
        ``id``, or None if there is none (yet, or any more: replies are kept for the
        service's reply_max_age). Another conversation's reply for the same id is
        never it: the lookup reads exactly ``<prefix>.reply.<id>.<STREAM>.<seq>``,
        in the replies stream of the origin's pool stream, ``<STREAM>_REPLIES``, and,
        when that has none, in the shared stream ``<PREFIX>_REPLIES`` that webproxy
        retired when it gave each pool its own (replies stored before that upgrade).
        It needs read access to those streams, which an isolated caller (one
        confined to its own ``reply_to`` subjects) does not have."""
        _check(_ID, "id", id)
        _check(_ORIGIN, "origin", origin)
        stream, seq = origin.split(":")
        subject = f"{self._prefix}.reply.{id}.{stream}.{seq}"
        for replies in (f"{stream}_REPLIES", self._retired_replies_stream):
            data = await self._last(replies, subject)
            if data is not None:
                return _decode(data, origin)
        return None

    async def read_body(self, reply: Reply) -> bytes:
        """The stored body a reply names (``reply.body_object``), read whole through
        ``<prefix>.body.get`` (which callers without read access to the stores may use
        too) with the message id the request was published with, chunk by chunk, and
        checked against its size and digest. A chunk answered ``busy`` is asked again,
        as a cancel is."""
        if reply.origin is None or reply.msg_id is None:
            raise InvalidRequest("read_body needs the reply of a request made with this client")
        request: Dict[str, Any] = {"id": reply.id, "origin": reply.origin, "msg_id": reply.msg_id}
        body = bytearray()
        while True:
            try:
                answer = await self._ask_while_busy(
                    f"{self._prefix}.body.get", json.dumps(request).encode(), _busy_in_header
                )
            except nats.errors.Error as e:
                raise BodyError("request", f"body.get was not answered: {e}") from e
            headers = answer.headers or {}
            if "Webproxy-Body-Error" in headers:
                message = json.loads(answer.data or b"{}").get("message", "")
                raise BodyError(headers["Webproxy-Body-Error"], message)
            body += answer.data
            cursor = headers.get("Webproxy-Body-Cursor")
            if cursor is None:
                break
            request["cursor"] = cursor
        digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(body).digest()).decode()
        size = headers.get("Webproxy-Body-Size")
        if size != str(len(body)) or headers.get("Webproxy-Body-Digest") != digest:
            raise BodyError("digest", f"read {len(body)} bytes with {digest}; the store says otherwise")
        return bytes(body)

    async def upload(self, data: bytes, *, pool: str = DEFAULT_POOL) -> Dict[str, Any]:
        """Uploads ``data`` for a request to ``pool`` through
        ``<prefix>.body.put.<pool>`` (under this client's caller name, if it has one),
        256 KiB per message, resuming where the service says the upload ends; a piece
        answered ``busy`` is sent again, as a cancel is. Pass the result as the
        envelope's ``body_object``."""
        _check(_POOL, "pool", pool)
        subject = f"{self._prefix}.body.put.{pool}"
        if self._caller is not None:
            subject = f"{subject}.{self._caller}"
        name = new_msg_id()
        offset = 0
        while offset < len(data):
            chunk = data[offset : offset + _UPLOAD_CHUNK]
            put = {
                "upload": name,
                "offset": offset,
                "data_base64": base64.b64encode(chunk).decode("ascii"),
            }
            try:
                answer = await self._ask_while_busy(subject, json.dumps(put).encode(), _busy_in_json)
            except nats.errors.Error as e:
                raise BodyError("request", f"body.put was not answered: {e}") from e
            answered = json.loads(answer.data)
            error = answered.get("error")
            if error is not None and not (error["code"] == "offset" and "size" in answered):
                raise BodyError(error["code"], error["message"])
            offset = int(answered["size"])
        digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
        return {"upload": name, "size": len(data), "digest": digest}

    async def _ask_while_busy(
        self, subject: str, payload: bytes, busy: Callable[[Msg], bool]
    ) -> Msg:
        """Sends ``payload`` to ``subject`` and returns the answer, asking again while
        ``busy(answer)`` says the service was busy, up to ``_BUSY_TRIES`` times in
        all, with doubling pauses; the last answer is returned busy or not."""
        pause = _BUSY_PAUSE
        for _ in range(1, _BUSY_TRIES):
            answer = await self._nc.request(subject, payload, timeout=_ANSWER_TIMEOUT)
            if not busy(answer):
                return answer
            await asyncio.sleep(pause)
            pause *= 2
        return await self._nc.request(subject, payload, timeout=_ANSWER_TIMEOUT)

    async def _last(self, stream: str, subject: str) -> Optional[bytes]:
        """The last message's data on ``subject`` in ``stream``; None when there is
        none, or no such stream (the retired shared one, once deleted)."""
        try:
            message = await self._js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError as e:
            if e.err_code in (_NO_MESSAGE_FOUND, _STREAM_NOT_FOUND):
                return None
            raise LookupFailed(f"cannot read the stored reply: {e}") from e
        except nats.errors.Error as e:
            raise LookupFailed(f"cannot read the stored reply: {e}") from e
        return message.data or b""

    async def _publish(self, envelope: Envelope, pool: str, msg_id: str) -> PubAck:
        _check(_POOL, "pool", pool)
        subject = f"{self._prefix}.request.{pool}"
        if self._caller is not None:
            subject = f"{subject}.{self._caller}"
        payload = json.dumps(envelope).encode()
        for attempt in range(1, _PUBLISH_TRIES + 1):
            try:
                return await self._js.publish(
                    subject, payload, headers={"Nats-Msg-Id": msg_id}
                )
            except nats.js.errors.NoStreamResponseError as e:
                raise NoSuchPool(f"no pool {pool!r} exists (nothing stores {subject})") from e
            except nats.js.errors.APIError as e:
                if e.err_code == _IN_PROCESS and attempt < _PUBLISH_TRIES:
                    await asyncio.sleep(_PUBLISH_RETRY_DELAY)
                    continue
                raise PublishFailed(f"the request was not stored: {e}") from e
            except nats.errors.Error as e:
                raise PublishFailed(f"the request was not stored: {e}") from e
        raise AssertionError("unreachable: the last try returns or raises")


def _busy_in_json(answer: Msg) -> bool:
    """Whether a JSON answer (cancel, body.put) is the error ``busy``."""
    try:
        answered = json.loads(answer.data)
    except ValueError:
        return False
    error = answered.get("error") if isinstance(answered, dict) else None
    return isinstance(error, dict) and error.get("code") == "busy"


def _busy_in_header(answer: Msg) -> bool:
    """Whether a body.get answer is the error ``busy`` (its errors are headers)."""
    return (answer.headers or {}).get("Webproxy-Body-Error") == "busy"


def _live_subject(prefix: str, id: str, reply_to: Optional[str]) -> str:
    """Where a request listens for its live reply: its own ``reply_to`` only, when it
    has one (an isolated caller may subscribe nowhere else), else ``<prefix>.reply.<id>``."""
    if reply_to is None:
        return f"{prefix}.reply.{id}"
    _check(_SUBJECT, "reply_to", reply_to)
    return reply_to


def _own_msg_id(msg_id: Optional[str]) -> str:
    if msg_id is None:
        return new_msg_id()
    _check(_MSG_ID, "msg_id", msg_id)
    return msg_id
