"""A small asyncio client for webproxy on nats-py.

It gets right what every caller must: subscribe before publishing, set
``Nats-Msg-Id``, pick the pool subject, fall back to the stored reply, and tell an
error outcome from a response. The wire protocol is in the repository's README and
``schema/request.schema.json``.

    nc = await nats.connect("nats://127.0.0.1:4222")
    client = Client(nc)
    reply = await client.request("GET", "https://api.example.com/orders/42")
    if reply.ok:
        print(reply.status, reply.text)
    else:
        print(reply.error.code, reply.error.message)
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

__all__ = [
    "Client",
    "Reply",
    "ErrorInfo",
    "WebproxyError",
    "InvalidRequest",
    "NoSuchPool",
    "PublishFailed",
    "ReplyTimeout",
    "LookupFailed",
    "BadReply",
    "build_envelope",
    "new_id",
]

DEFAULT_PREFIX = "webproxy"
DEFAULT_POOL = "default"
DEFAULT_WAIT = 30.0

_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_POOL = re.compile(r"[a-z0-9_-]{1,32}")
# How often a waiting request looks whether the connection was re-made, which is
# when a live reply can have been missed.
_RECONNECT_CHECK = 0.25
# JetStream's error code for "no message found" in a stream message lookup.
_NO_MESSAGE_FOUND = 10037

HeaderValues = Union[str, Sequence[str]]


class WebproxyError(Exception):
    """Talking to webproxy failed. An error *outcome* is not one: it is a Reply."""


class InvalidRequest(WebproxyError, ValueError):
    """The id or pool cannot be used; nothing was sent."""


class NoSuchPool(WebproxyError):
    """No stream stores the pool's request subject."""


class PublishFailed(WebproxyError):
    """JetStream did not confirm that it stored the request."""


class ReplyTimeout(WebproxyError, TimeoutError):
    """No reply came within the wait, and none is stored."""

    def __init__(self, id: str, wait: float):
        super().__init__(f"no reply to {id} within {wait}s, and none is stored")
        self.id = id
        self.wait = wait


class LookupFailed(WebproxyError):
    """The replies stream could not be read."""


class BadReply(WebproxyError):
    """A reply that is not a valid reply envelope."""


@dataclass(frozen=True)
class ErrorInfo:
    """An error outcome's details; ``code`` is one of the protocol's error codes."""

    code: str
    message: str
    status: Optional[int] = None


@dataclass(frozen=True)
class Reply:
    """The final reply of a conversation; ``raw`` is the envelope as received."""

    raw: Mapping[str, Any]

    @property
    def id(self) -> str:
        return self.raw["id"]

    @property
    def outcome(self) -> str:
        return self.raw["outcome"]

    @property
    def ok(self) -> bool:
        """Whether this is the upstream's HTTP response rather than an error outcome."""
        return self.outcome == "response"

    @property
    def status(self) -> Optional[int]:
        return self.raw.get("status")

    @property
    def headers(self) -> Mapping[str, HeaderValues]:
        return self.raw.get("headers") or {}

    @property
    def body(self) -> bytes:
        if "body_base64" in self.raw:
            return base64.b64decode(self.raw["body_base64"])
        return self.raw.get("body", "").encode()

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
        return self.raw["attempts"]

    @property
    def metadata(self) -> Any:
        return self.raw.get("metadata")


def new_id() -> str:
    """A fresh conversation id."""
    return uuid.uuid4().hex


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
) -> dict:
    """The request envelope as it is published. ``body`` is sent as text when it is
    a str and as base64 when it is bytes; optional fields left as None are left out."""
    envelope: dict = {"v": 1, "id": new_id() if id is None else id, "method": method, "url": url}
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
    return envelope


def _check(pattern: re.Pattern, what: str, value: str) -> None:
    # The id and pool are subject tokens: a '.' or wildcard would subscribe or
    # publish to the wrong subjects instead of getting an invalid_request answer.
    if not pattern.fullmatch(value):
        raise InvalidRequest(f"invalid {what} {value!r}: must match {pattern.pattern}")


def _decode(payload: bytes) -> Reply:
    try:
        raw = json.loads(payload)
    except ValueError as e:
        raise BadReply(f"the reply is not JSON: {e}") from e
    if not isinstance(raw, dict) or raw.get("outcome") not in ("response", "error"):
        raise BadReply(f"the reply is not a reply envelope: {payload[:200]!r}")
    return Reply(raw)


class Client:
    """A webproxy client over one nats-py connection."""

    def __init__(self, nc: NATS, prefix: str = DEFAULT_PREFIX):
        self._nc = nc
        self._prefix = prefix
        self._replies_stream = prefix.replace(".", "_").upper() + "_REPLIES"

    @property
    def _js(self):
        # Made on use, so a client can be built before its connection is up.
        return self._nc.jetstream()

    async def request(
        self,
        method: str,
        url: str,
        *,
        pool: str = DEFAULT_POOL,
        wait: float = DEFAULT_WAIT,
        **fields: Any,
    ) -> Reply:
        """Sends a request and waits up to ``wait`` seconds for its final reply, which
        may be an error outcome. ``fields`` are the envelope's (see build_envelope).
        A reply that could have been missed is read from the replies stream: when the
        id was already stored, after a reconnect, and when the wait runs out."""
        envelope = build_envelope(method, url, **fields)
        id = envelope["id"]
        _check(_ID, "id", id)
        sub = await self._nc.subscribe(f"{self._prefix}.reply.{id}")
        try:
            reconnects = self._nc.stats["reconnects"]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait
            ack = await self._publish(envelope, pool)
            if ack.duplicate:
                stored = await self.reply(id)
                if stored is not None:
                    return stored
            while (remaining := deadline - loop.time()) > 0:
                try:
                    message = await sub.next_msg(timeout=min(remaining, _RECONNECT_CHECK))
                    return _decode(message.data)
                except nats.errors.TimeoutError:
                    pass
                # Subscriptions are replayed as part of reconnecting, so a reply
                # published after this lookup reaches the subscription.
                if self._nc.stats["reconnects"] != reconnects:
                    reconnects = self._nc.stats["reconnects"]
                    stored = await self.reply(id)
                    if stored is not None:
                        return stored
            stored = await self.reply(id)
            if stored is None:
                raise ReplyTimeout(id, wait)
            return stored
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                # A closed connection has dropped the subscription already; the
                # exception that got us here is the one to report.
                pass

    async def submit(
        self, method: str, url: str, *, pool: str = DEFAULT_POOL, **fields: Any
    ) -> str:
        """Publishes a request and returns its id once JetStream has stored it; read
        the reply later with ``reply``."""
        envelope = build_envelope(method, url, **fields)
        _check(_ID, "id", envelope["id"])
        await self._publish(envelope, pool)
        return envelope["id"]

    async def reply(self, id: str) -> Optional[Reply]:
        """The stored final reply of conversation ``id``, or None if there is none
        (yet, or any more: replies are kept for the service's reply_max_age)."""
        _check(_ID, "id", id)
        try:
            message = await self._js.get_last_msg(
                self._replies_stream, f"{self._prefix}.reply.{id}"
            )
        except nats.js.errors.NotFoundError as e:
            if e.err_code == _NO_MESSAGE_FOUND:
                return None
            raise LookupFailed(f"cannot read the stored reply: {e}") from e
        except nats.errors.Error as e:
            raise LookupFailed(f"cannot read the stored reply: {e}") from e
        return _decode(message.data)

    async def _publish(self, envelope: dict, pool: str):
        _check(_POOL, "pool", pool)
        subject = f"{self._prefix}.request.{pool}"
        payload = json.dumps(envelope).encode()
        try:
            return await self._js.publish(
                subject, payload, headers={"Nats-Msg-Id": envelope["id"]}
            )
        except nats.js.errors.NoStreamResponseError as e:
            raise NoSuchPool(f"no pool {pool!r} exists (nothing stores {subject})") from e
        except nats.errors.Error as e:
            raise PublishFailed(f"the request was not stored: {e}") from e
