//! A small async Rust client for webproxy: it gets right what every caller must —
//! subscribe before publishing, publish with a fresh random `Nats-Msg-Id`, pick the
//! pool subject, keep only the reply of its own conversation (its *origin*, from the
//! publish ack), fall back to its own stored reply (unless it listens on a `reply_to`
//! of its own), and tell an error outcome from a response.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use webproxy_client::{Client, Outcome, Request};
//!
//! let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let client = Client::new(nats, "webproxy")?;
//! let request = Request::new("GET", "https://api.example.com/orders/42")
//!     .header("Accept", "application/json")
//!     .wait(Duration::from_secs(10));
//! let reply = client.request(&request).await?;
//! match reply.outcome {
//!     Outcome::Response => println!("{:?} {:?}", reply.status, reply.body.body),
//!     Outcome::Error => println!("failed: {:?}", reply.error),
//! }
//!
//! // Fire and forget, and read the stored reply later: the envelope id is for
//! // correlation only (anyone may reuse it); the origin names this conversation.
//! let submitted = client.submit(&Request::new("GET", "https://api.example.com/")).await?;
//! let stored = client.reply(&submitted.id, &submitted.origin).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # The conversation
//!
//! A conversation is one stored request message. Its origin, `<STREAM>:<seq>`, comes
//! from JetStream's publish ack; every reply carries it in `Webproxy-Origin`. The
//! envelope `id` names the live reply subject `<prefix>.reply.<id>`, which anyone may
//! reuse, so a live reply with another origin is ignored. The stored reply is read
//! from exactly `<prefix>.reply.<id>.<STREAM>.<seq>` in the replies stream of the
//! origin's pool stream, `<STREAM>_REPLIES` (then in the shared stream that layout 3
//! retired, for a reply stored before that upgrade), never from the newest reply for
//! the id. Each publish has a fresh random `Nats-Msg-Id`
//! (32 hex characters from the operating system's CSPRNG), reused only when that same
//! publish is tried again: when JetStream answers that a message with that id is still
//! in process (err_code 10158), or when the caller sets [`Request::msg_id`].
//!
//! With a `reply_to` ([`Request::reply_to`]) the client listens there only and never
//! reads the replies stream: a caller confined to its own reply space may neither
//! subscribe to `<prefix>.reply.>` nor read the stored replies. Such a caller captures
//! the copies sent to its `reply_to` in a stream of its own if a reply must survive a
//! reconnect.

use std::error::Error as _;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, ErrorCode as JsErrorCode, stream::LastRawMessageErrorKind};
use bytes::Bytes;
use futures::StreamExt as _;
use thiserror::Error;
use tokio::time::Instant;
use webproxy_protocol::{
    InvalidName, ReplyBody, Subjects, header, validate_caller, validate_id, validate_pool_name,
    validate_subject_literal,
};

mod body;
mod cancel;

pub use body::{BodyReader, Upload};
pub use webproxy_protocol::{
    CancelState, ErrorBody, ErrorCode, HeaderValue, Headers, Origin, Outcome, Reply,
    RequestEnvelope, UploadRef,
};

/// The pool every deployment has.
pub const DEFAULT_POOL: &str = "default";

/// How long [`Client::request`] waits for a reply unless told otherwise.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);

/// How often a waiting [`Client::request`] looks whether the connection was re-made,
/// which is when a live reply can have been missed.
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// How many times in all a publish is tried while JetStream answers that a message
/// with its id is still in process, and the pause between tries.
const PUBLISH_TRIES: u32 = 10;
const PUBLISH_RETRY_DELAY: Duration = Duration::from_millis(50);

/// What can go wrong talking to webproxy. An error *outcome* is not one of these: it
/// is a [`Reply`] whose `outcome` is [`Outcome::Error`].
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    #[error("invalid subject prefix: {0}")]
    InvalidPrefix(#[source] InvalidName),
    #[error("invalid request id {id:?}: {source}")]
    InvalidId {
        id: String,
        #[source]
        source: InvalidName,
    },
    #[error("invalid pool name: {0}")]
    InvalidPool(#[source] InvalidName),
    #[error("invalid caller name: {0}")]
    InvalidCaller(#[source] InvalidName),
    #[error("invalid reply_to {subject:?}: {source}")]
    InvalidReplyTo {
        subject: String,
        #[source]
        source: InvalidName,
    },
    #[error("invalid Nats-Msg-Id {0:?}: must be 1 to 128 printable characters, no white space")]
    InvalidMsgId(String),
    #[error("cannot draw a random message id: {0}")]
    Random(#[source] getrandom::Error),
    #[error("cannot encode the request: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("no pool {pool:?} exists (nothing stores {subject})")]
    NoSuchPool { pool: String, subject: String },
    #[error("the request was not stored: {0}")]
    Publish(#[source] jetstream::context::PublishError),
    #[error("cannot subscribe to the reply subject: {0}")]
    Subscribe(#[source] async_nats::SubscribeError),
    /// The request was stored (as `origin`) but no reply came in time; read it later
    /// with [`Client::reply`]. With a `reply_to` the stored replies were not read (see
    /// the crate documentation).
    #[error("no reply to {id} (origin {origin}) within {waited:?}{}", timeout_detail(reply_to.as_deref()))]
    Timeout {
        id: String,
        origin: Origin,
        waited: Duration,
        /// The `reply_to` the request listened on, if it had one.
        reply_to: Option<String>,
    },
    #[error("cannot read the stored reply: {0}")]
    Lookup(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the reply is not a valid reply envelope: {0}")]
    Decode(#[source] serde_json::Error),
    /// `body.get` answered without a chunk: `not_found` (or not this caller's),
    /// `expired`, `busy`, ...
    #[error("the stored body could not be read: {code}: {message}")]
    Body { code: String, message: String },
    #[error("cannot ask for the stored body: {0}")]
    BodyRequest(#[source] async_nats::RequestError),
    /// The cancel was not taken: `busy`, `internal` or `invalid_request`.
    #[error("the cancel was not taken: {code}: {message}")]
    Cancel { code: String, message: String },
    #[error("cannot send the cancel: {0}")]
    CancelRequest(#[source] async_nats::RequestError),
}

/// What a timeout says about the stored replies: looked up and absent, or not read
/// at all because the request listened on a `reply_to` of its own.
fn timeout_detail(reply_to: Option<&str>) -> String {
    match reply_to {
        None => ", and none is stored".to_string(),
        Some(subject) => format!(" on {subject} (the stored replies are not read for a reply_to)"),
    }
}

impl Error {
    /// The pool refused the publish because its queue is full: `max_waiting`, the
    /// request subject's per-subject limit, is reached. Publishing later may succeed.
    /// Told by the description: the code, 10077, is any store failure (a full disk too).
    pub fn is_queue_full(&self) -> bool {
        let Error::Publish(error) = self else {
            return false;
        };
        error
            .source()
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
            .is_some_and(|e| {
                e.error_code() == JsErrorCode::STREAM_STORE_FAILED
                    && e.to_string().contains("maximum messages per subject")
            })
    }
}

/// A fresh conversation id (a NUID: 22 characters of `[A-Za-z0-9]`). It correlates
/// the reply with the request and names the live reply subject; it need not be secret.
pub fn new_id() -> String {
    nuid::next().to_string()
}

/// A fresh `Nats-Msg-Id`: 32 lowercase hex characters, 128 bits from the operating
/// system's CSPRNG, so no other caller can guess it and pre-empt the publish.
pub fn new_msg_id() -> Result<String, Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(Error::Random)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether a reply message with `headers` answers the conversation `origin`.
/// A reply without the header is someone else's too.
pub fn is_own_reply(headers: Option<&HeaderMap>, origin: &Origin) -> bool {
    headers
        .and_then(|headers| headers.get(header::ORIGIN))
        .is_some_and(|value| value.as_str() == origin.to_string())
}

/// One request: its envelope, the pool it goes to, and how long [`Client::request`]
/// waits for the reply. Built with a fresh id for pool `default`. Each
/// [`Client::request`] or [`Client::submit`] of it is a conversation of its own,
/// published with a fresh random `Nats-Msg-Id`, unless [`Request::msg_id`] is set.
#[derive(Debug, Clone)]
pub struct Request {
    envelope: RequestEnvelope,
    pool: String,
    wait: Duration,
    msg_id: Option<String>,
    /// Headers of the NATS message itself (trace context), not of the HTTP request.
    message_headers: Vec<(String, String)>,
}

impl Request {
    /// `method` (any case) on the absolute http(s) `url`.
    pub fn new(method: impl Into<String>, url: impl Into<String>) -> Request {
        Request::from_envelope(RequestEnvelope {
            id: new_id(),
            method: method.into(),
            url: url.into(),
            ..Default::default()
        })
    }

    /// A request with an envelope built by hand.
    pub fn from_envelope(envelope: RequestEnvelope) -> Request {
        Request {
            envelope,
            pool: DEFAULT_POOL.to_string(),
            wait: DEFAULT_WAIT,
            msg_id: None,
            message_headers: Vec::new(),
        }
    }

    /// The envelope id, for correlation: it names the live reply subject and comes
    /// back in the reply. It need not be secret or unique; a conversation that reuses
    /// one is a new conversation with its own reply.
    pub fn id(mut self, id: impl Into<String>) -> Request {
        self.envelope.id = id.into();
        self
    }

    /// The publish's `Nats-Msg-Id`, to publish again the very request an earlier call
    /// published (say, from a process that crashed after sending it): within the pool
    /// stream's duplicate window that is the same conversation, and its stored reply
    /// is read at once. Use an id from [`new_msg_id`]; a guessable one lets another
    /// caller pre-empt the publish. Unset, every call draws a fresh one.
    pub fn msg_id(mut self, msg_id: impl Into<String>) -> Request {
        self.msg_id = Some(msg_id.into());
        self
    }

    /// A header on the NATS message rather than in the envelope: `traceparent` and
    /// `tracestate`, which the service reads as the parent of its spans. The
    /// service ignores every `Webproxy-*` header a caller sends.
    pub fn message_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Request {
        self.message_headers.push((name.into(), value.into()));
        self
    }

    pub fn pool(mut self, pool: impl Into<String>) -> Request {
        self.pool = pool.into();
        self
    }

    /// How long [`Client::request`] waits for the reply.
    pub fn wait(mut self, wait: Duration) -> Request {
        self.wait = wait;
        self
    }

    /// Adds a header; a name given again becomes an array, sent once per value.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Request {
        let (name, value) = (name.into(), value.into());
        let merged = match self.envelope.headers.remove(&name) {
            None => HeaderValue::One(value),
            Some(HeaderValue::One(first)) => HeaderValue::Many(vec![first, value]),
            Some(HeaderValue::Many(mut all)) => {
                all.push(value);
                HeaderValue::Many(all)
            }
        };
        self.envelope.headers.insert(name, merged);
        self
    }

    /// A text body.
    pub fn body(mut self, text: impl Into<String>) -> Request {
        self.envelope.body = Some(text.into());
        self.envelope.body_base64 = None;
        self
    }

    /// A body of any bytes: sent as `body` when they are UTF-8, so the envelope stays
    /// readable, and as `body_base64` otherwise. The upstream gets the same bytes.
    pub fn body_bytes(mut self, bytes: Vec<u8>) -> Request {
        let ReplyBody { body, body_base64 } = ReplyBody::encode(bytes);
        self.envelope.body = body;
        self.envelope.body_base64 = body_base64;
        self
    }

    /// A core-NATS subject that also gets a copy of the reply.
    pub fn reply_to(mut self, subject: impl Into<String>) -> Request {
        self.envelope.reply_to = Some(subject.into());
        self
    }

    /// The per-attempt timeout, clamped by the service to the matched rule's.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Request {
        // Rounded up: a sub-millisecond timeout must not become the invalid 0.
        let ms = timeout.as_nanos().div_ceil(1_000_000).max(1);
        self.envelope.timeout_ms = Some(u64::try_from(ms).unwrap_or(u64::MAX));
        self
    }

    /// An RFC 3339 date-time after which the request is not attempted.
    pub fn deadline(mut self, rfc3339: impl Into<String>) -> Request {
        self.envelope.deadline = Some(rfc3339.into());
        self
    }

    /// Any JSON, echoed in the reply.
    pub fn metadata(mut self, metadata: serde_json::Value) -> Request {
        self.envelope.metadata = Some(metadata);
        self
    }

    pub fn envelope(&self) -> &RequestEnvelope {
        &self.envelope
    }

    pub fn pool_name(&self) -> &str {
        &self.pool
    }

    pub fn wait_time(&self) -> Duration {
        self.wait
    }

    /// The `Nats-Msg-Id` set with [`Request::msg_id`] (or drawn by
    /// [`Request::large_body`]), if any.
    pub fn msg_id_set(&self) -> Option<&str> {
        self.msg_id.as_deref()
    }

    /// Sends the body uploaded as `upload` ([`Client::upload`]) in place of
    /// `body`/`body_base64`.
    pub fn body_upload(mut self, upload: UploadRef) -> Request {
        self.envelope.body = None;
        self.envelope.body_base64 = None;
        self.envelope.body_object = Some(upload);
        self
    }

    /// Opts in to a response body above the inline limit: the reply then names it
    /// (`body_object`), for [`Client::read_body`]. Reading it asks for the request's
    /// `Nats-Msg-Id`, so one is drawn now unless set ([`Request::msg_id_set`] gives
    /// it); every call of this request is then the same conversation.
    pub fn large_body(mut self) -> Result<Request, Error> {
        self.envelope.large_body = true;
        if self.msg_id.is_none() {
            self.msg_id = Some(new_msg_id()?);
        }
        Ok(self)
    }
}

impl From<RequestEnvelope> for Request {
    fn from(envelope: RequestEnvelope) -> Request {
        Request::from_envelope(envelope)
    }
}

/// A webproxy client over one NATS connection.
#[derive(Debug, Clone)]
pub struct Client {
    nats: async_nats::Client,
    js: jetstream::Context,
    subjects: Subjects,
    /// The caller name requests are published under, if any: see [`Client::with_caller`].
    caller: Option<String>,
}

/// A request JetStream has stored: its envelope id and its conversation's origin,
/// which together name its stored reply ([`Client::reply`]), and the `Nats-Msg-Id` it
/// was published with, the capability [`Client::cancel`] and [`Client::read_body`]
/// show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitted {
    pub id: String,
    pub origin: Origin,
    pub msg_id: String,
}

/// A final reply and the origin of the conversation it answers.
#[derive(Debug, Clone)]
pub struct Answer {
    pub origin: Origin,
    pub reply: Reply,
}

/// A subscription to a live reply subject, made before publishing, and what is
/// needed to notice a reconnect (when a live reply can have been missed).
#[derive(Debug)]
pub struct Watch {
    client: Client,
    replies: async_nats::Subscriber,
    statistics: std::sync::Arc<async_nats::Statistics>,
    seen_connects: u64,
    /// Whether a missed live reply may be read from the replies stream: only when
    /// watching the service's own reply subject, never a caller's `reply_to`.
    lookups: bool,
}

impl Watch {
    /// Waits until `deadline` for the final reply of the conversation `origin` with
    /// envelope id `id`: the first live reply whose `Webproxy-Origin` is `origin`, or
    /// its stored reply, read first when `stored_first` (a duplicate publish, or a
    /// conversation published earlier) and after a reconnect (each until a lookup
    /// succeeds: one that fails does not end the wait), and when the wait runs out.
    /// `None` when none came and none is stored. A watch on a `reply_to` reads
    /// no stored reply: `None` when no live one came.
    pub async fn answer(
        mut self,
        id: &str,
        origin: &Origin,
        stored_first: bool,
        deadline: Instant,
    ) -> Result<Option<Reply>, Error> {
        let client = &self.client;
        let lookups = self.lookups;
        // Whether a stored reply may be there that no lookup has found yet: one read
        // first, or one published while the subscription was down.
        let mut unread = lookups && stored_first;
        let mut reconnect_check = tokio::time::interval(RECONNECT_CHECK);
        loop {
            tokio::select! {
                message = self.replies.next() => match message {
                    Some(message) if is_own_reply(message.headers.as_ref(), origin) => {
                        return decode(&message.payload).map(Some);
                    }
                    // Another conversation that uses the same id (or subject).
                    Some(_) => {}
                    // The subscription ends only when the client is closed.
                    None => break,
                },
                _ = reconnect_check.tick() => {
                    let now = self.statistics.connects.load(Ordering::Relaxed);
                    // Resubscribing is part of reconnecting, so a reply published after
                    // this lookup reaches the subscription.
                    if lookups && (unread || now != self.seen_connects) {
                        match client.reply(id, origin).await {
                            Ok(Some(reply)) => return Ok(Some(reply)),
                            Ok(None) => {
                                self.seen_connects = now;
                                unread = false;
                            }
                            // The server may not answer for a while (a stream leader
                            // being elected, a reconnect): that says nothing about the
                            // reply, so the wait goes on and the lookup is made again
                            // at the next check. Only the last lookup's failure, when
                            // the wait runs out, is the caller's.
                            Err(_) => unread = true,
                        }
                    }
                }
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        if !lookups {
            return Ok(None);
        }
        client.reply(id, origin).await
    }
}

/// What JetStream said about a stored request.
struct Stored {
    origin: Origin,
    /// The same `Nats-Msg-Id` was already stored within the duplicate window: the
    /// earlier publish of this conversation may have been answered already.
    duplicate: bool,
    /// The `Nats-Msg-Id` it was published with.
    msg_id: String,
}

impl Client {
    /// A client for the deployment whose streams use `prefix` (`webproxy` by default).
    pub fn new(nats: async_nats::Client, prefix: &str) -> Result<Client, Error> {
        Ok(Client {
            js: jetstream::new(nats.clone()),
            nats,
            subjects: Subjects::new(prefix).map_err(Error::InvalidPrefix)?,
            caller: None,
        })
    }

    /// Publishes requests as caller `caller`, on `<prefix>.request.<pool>.<caller>`: the
    /// name NATS permissions let this connection publish under, whose reply space the
    /// service's `[streams] reply_to_allow` (`{caller}`) gives the requests' `reply_to`.
    pub fn with_caller(mut self, caller: &str) -> Result<Client, Error> {
        validate_caller(caller).map_err(Error::InvalidCaller)?;
        self.caller = Some(caller.to_owned());
        Ok(self)
    }

    /// Makes the JetStream API calls under `prefix` instead of `$JS.API`: for a
    /// caller whose account imports the service's JetStream under that prefix.
    pub fn with_js_api_prefix(mut self, prefix: &str) -> Client {
        self.js = jetstream::with_prefix(self.nats.clone(), prefix);
        self
    }

    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// The JetStream context this client's API calls go through (with its prefix).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Sends `request` and waits up to its wait time for the final reply, which may be
    /// an error outcome. See [`Client::request_answer`].
    pub async fn request(&self, request: &Request) -> Result<Reply, Error> {
        self.request_answer(request)
            .await
            .map(|answer| answer.reply)
    }

    /// Sends `request` and waits up to its wait time for the final reply of this
    /// conversation, returned with its origin. The live subscription is made before
    /// publishing, and only a live reply whose `Webproxy-Origin` is this
    /// conversation's counts. Without a `reply_to` it is `<prefix>.reply.<id>`, and a
    /// reply that could have been missed is read from this conversation's stored
    /// subject instead: on a duplicate publish ack, after the connection was re-made,
    /// and when the wait runs out. With a `reply_to` it is that subject only, and no
    /// stored reply is read (an isolated caller may read neither; see the crate
    /// documentation). A `reply_to` the service refuses gets no copy, so such a
    /// request times out; its `invalid_request` answer is in the store, for
    /// [`Client::reply`] where the caller may read it.
    pub async fn request_answer(&self, request: &Request) -> Result<Answer, Error> {
        let id = &request.envelope.id;
        check_id(id)?;
        let reply_to = &request.envelope.reply_to;
        let watch = match reply_to {
            Some(subject) => {
                validate_subject_literal(subject).map_err(|source| Error::InvalidReplyTo {
                    subject: subject.clone(),
                    source,
                })?;
                self.watch_subject(subject.clone(), false).await?
            }
            None => self.watch_subject(self.subjects.reply(id), true).await?,
        };
        let deadline = Instant::now() + request.wait;
        let Stored {
            origin, duplicate, ..
        } = self.publish(request).await?;
        match watch.answer(id, &origin, duplicate, deadline).await? {
            Some(reply) => Ok(Answer { origin, reply }),
            None => Err(Error::Timeout {
                id: id.clone(),
                origin,
                waited: request.wait,
                reply_to: reply_to.clone(),
            }),
        }
    }

    /// Subscribes to the live reply subject of `id`, `<prefix>.reply.<id>`, to wait
    /// for a conversation published (or to be published) with that envelope id: make
    /// it before publishing, then [`Watch::answer`] with the origin. The gateway
    /// splits [`Client::request_answer`] this way to record the origin in between.
    pub async fn watch(&self, id: &str) -> Result<Watch, Error> {
        check_id(id)?;
        self.watch_subject(self.subjects.reply(id), true).await
    }

    async fn watch_subject(&self, live: String, lookups: bool) -> Result<Watch, Error> {
        let replies = self.nats.subscribe(live).await.map_err(Error::Subscribe)?;
        let statistics = self.nats.statistics();
        let seen_connects = statistics.connects.load(Ordering::Relaxed);
        Ok(Watch {
            client: self.clone(),
            replies,
            statistics,
            seen_connects,
            lookups,
        })
    }

    /// Publishes `request` and returns its origin, and whether the publish was a
    /// duplicate of an earlier one with the same `Nats-Msg-Id` (whose reply may be
    /// stored already). Subscribe with [`Client::watch`] first.
    pub async fn publish_request(&self, request: &Request) -> Result<(Origin, bool), Error> {
        check_id(&request.envelope.id)?;
        let stored = self.publish(request).await?;
        Ok((stored.origin, stored.duplicate))
    }

    /// Publishes `request` to its pool and returns its id and origin once JetStream
    /// has stored it; read the reply later with [`Client::reply`].
    pub async fn submit(&self, request: &Request) -> Result<Submitted, Error> {
        check_id(&request.envelope.id)?;
        let stored = self.publish(request).await?;
        Ok(Submitted {
            id: request.envelope.id.clone(),
            origin: stored.origin,
            msg_id: stored.msg_id,
        })
    }

    /// The stored final reply of the conversation `origin` with envelope id `id`, if
    /// there is one (yet, or still: replies are kept for the service's
    /// `reply_max_age`). Another conversation's reply for the same id is never it.
    pub async fn reply(&self, id: &str, origin: &Origin) -> Result<Option<Reply>, Error> {
        match self.reply_message(id, origin).await? {
            Some(message) => decode(&message.payload).map(Some),
            None => Ok(None),
        }
    }

    /// The stored reply message of the conversation `origin` with envelope id `id`,
    /// with its headers (`Webproxy-Outcome`, `Webproxy-Generation`, `Webproxy-Origin`),
    /// if there is one.
    pub async fn reply_message(
        &self,
        id: &str,
        origin: &Origin,
    ) -> Result<Option<StreamMessage>, Error> {
        check_id(id)?;
        stored_reply(&self.js, &self.subjects, id, origin).await
    }

    /// The NATS connection.
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    async fn publish(&self, request: &Request) -> Result<Stored, Error> {
        let pool = &request.pool;
        validate_pool_name(pool).map_err(Error::InvalidPool)?;
        let subject = match &self.caller {
            None => self.subjects.request(pool),
            Some(caller) => self.subjects.caller_request(pool, caller),
        };
        let msg_id = match &request.msg_id {
            Some(msg_id) => {
                check_msg_id(msg_id)?;
                msg_id.clone()
            }
            None => new_msg_id()?,
        };
        let payload = Bytes::from(serde_json::to_vec(&request.envelope).map_err(Error::Encode)?);
        let ack = publish_retrying(&msg_id, |msg_id| {
            let mut publish = jetstream::message::PublishMessage::build()
                .payload(payload.clone())
                .message_id(msg_id);
            for (name, value) in &request.message_headers {
                publish = publish.header(name.as_str(), value.as_str());
            }
            let subject = subject.clone();
            async move { self.js.send_publish(subject, publish).await?.await }
        })
        .await
        .map_err(|e| publish_error(e, pool, &subject))?;
        Ok(Stored {
            origin: Origin::new(ack.stream, ack.sequence),
            duplicate: ack.duplicate,
            msg_id,
        })
    }
}

/// Publishes with `publish(msg_id)`, and again with the same id while JetStream
/// answers that a message with that id is still in process (err_code 10158), up to
/// [`PUBLISH_TRIES`] tries in all.
async fn publish_retrying<F, Fut>(msg_id: &str, mut publish: F) -> Result<PublishAck, PublishError>
where
    F: FnMut(&str) -> Fut,
    Fut: Future<Output = Result<PublishAck, PublishError>>,
{
    let mut tries = 1;
    loop {
        match publish(msg_id).await {
            Err(e) if tries < PUBLISH_TRIES && in_process(&e) => {
                tries += 1;
                tokio::time::sleep(PUBLISH_RETRY_DELAY).await;
            }
            result => return result,
        }
    }
}

/// JetStream's "duplicate message id is in process": an earlier publish with the same
/// id is not stored yet, and this one may be tried again.
fn in_process(error: &PublishError) -> bool {
    error.kind() == PublishErrorKind::Other
        && error
            .source()
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
            .is_some_and(|e| e.error_code() == JsErrorCode::STREAM_DUPLICATE_MESSAGE_CONFLICT)
}

/// An id is a subject token; anything else would subscribe to the wrong subject (a
/// `>` to every reply) instead of getting an `invalid_request` answer.
fn check_id(id: &str) -> Result<(), Error> {
    validate_id(id).map_err(|source| Error::InvalidId {
        id: id.to_string(),
        source,
    })
}

/// A caller's own `Nats-Msg-Id` must fit in one header value.
fn check_msg_id(msg_id: &str) -> Result<(), Error> {
    let ok =
        !msg_id.is_empty() && msg_id.len() <= 128 && msg_id.chars().all(|c| c.is_ascii_graphic());
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidMsgId(msg_id.to_string()))
    }
}

/// The stored reply message of the conversation `origin` with envelope id `id`: the
/// last message on exactly its own subject ([`Subjects::stored_reply`]), read from
/// the stream leader through the message-get API (a direct get may be answered by a
/// lagging replica). The stream is the origin pool stream's own replies stream
/// ([`Subjects::replies_stream_of`]); when that has nothing on the subject, the
/// shared stream of webproxy before layout 3 ([`Subjects::replies_stream`]) is read,
/// which holds the replies stored before the upgrade until they age out, and which an
/// operator may delete after that.
pub async fn stored_reply(
    js: &jetstream::Context,
    subjects: &Subjects,
    id: &str,
    origin: &Origin,
) -> Result<Option<StreamMessage>, Error> {
    let subject = subjects.stored_reply(id, origin);
    if let Some(message) = last_message(js, &subjects.replies_stream_of(origin), &subject).await? {
        return Ok(Some(message));
    }
    last_message(js, &subjects.replies_stream(), &subject).await
}

/// The last message on `subject` in `stream`; none when there is none, or when the
/// stream does not exist (the retired shared stream, once deleted).
async fn last_message(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
) -> Result<Option<StreamMessage>, Error> {
    let stream = js
        .get_stream_no_info(stream)
        .await
        .map_err(|e| Error::Lookup(Box::new(e)))?;
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(message) => Ok(Some(message)),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e)
            if matches!(e.kind(), LastRawMessageErrorKind::JetStream(ref js)
            if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            Ok(None)
        }
        Err(e) => Err(Error::Lookup(Box::new(e))),
    }
}

fn publish_error(error: PublishError, pool: &str, subject: &str) -> Error {
    if error.kind() == PublishErrorKind::StreamNotFound {
        Error::NoSuchPool {
            pool: pool.to_string(),
            subject: subject.to_string(),
        }
    } else {
        Error::Publish(error)
    }
}

fn decode(payload: &[u8]) -> Result<Reply, Error> {
    serde_json::from_slice(payload).map_err(Error::Decode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_header_becomes_an_array_in_order() {
        let request = Request::new("GET", "http://127.0.0.1/")
            .header("X-Multi", "a")
            .header("X-One", "1")
            .header("X-Multi", "b")
            .header("X-Multi", "c");
        let headers = &request.envelope().headers;
        assert_eq!(
            headers["X-Multi"],
            HeaderValue::Many(vec!["a".into(), "b".into(), "c".into()])
        );
        assert_eq!(headers["X-One"], HeaderValue::One("1".into()));
    }

    #[test]
    fn bodies_replace_each_other() {
        let binary = Request::new("POST", "http://127.0.0.1/").body_bytes(vec![0, 255]);
        assert_eq!(binary.envelope().body, None);
        assert_eq!(binary.envelope().body_base64.as_deref(), Some("AP8="));
        let text = binary.body("hi");
        assert_eq!(text.envelope().body.as_deref(), Some("hi"));
        assert_eq!(text.envelope().body_base64, None);
        let utf8 = text.body_bytes("grüße".as_bytes().to_vec());
        assert_eq!(utf8.envelope().body.as_deref(), Some("grüße"));
    }

    #[test]
    fn attempt_timeout_rounds_up_to_a_valid_millisecond() {
        let request = Request::new("GET", "http://127.0.0.1/");
        let tiny = request.clone().attempt_timeout(Duration::from_micros(10));
        assert_eq!(tiny.envelope().timeout_ms, Some(1));
        let exact = request.attempt_timeout(Duration::from_millis(1500));
        assert_eq!(exact.envelope().timeout_ms, Some(1500));
    }

    #[test]
    fn fresh_requests_get_distinct_valid_ids_and_the_default_pool() {
        let a = Request::new("GET", "http://127.0.0.1/");
        let b = Request::new("GET", "http://127.0.0.1/");
        assert_ne!(a.envelope().id, b.envelope().id);
        assert!(validate_id(&a.envelope().id).is_ok());
        assert_eq!(a.pool_name(), DEFAULT_POOL);
        assert_eq!(a.wait_time(), DEFAULT_WAIT);
    }

    #[test]
    fn msg_ids_are_32_lowercase_hex_and_never_repeat() {
        let ids: Vec<String> = (0..1000).map(|_| new_msg_id().expect("random")).collect();
        for id in &ids {
            assert_eq!(id.len(), 32, "{id}");
            assert!(
                id.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{id}"
            );
        }
        let distinct: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
    }

    #[test]
    fn a_requests_msg_id_is_drawn_per_publish_unless_set() {
        let request = Request::new("GET", "http://127.0.0.1/");
        assert_eq!(request.msg_id_set(), None);
        let again = request.msg_id("0123456789abcdef0123456789abcdef");
        assert_eq!(again.msg_id_set(), Some("0123456789abcdef0123456789abcdef"));
        assert!(check_msg_id("0123456789abcdef0123456789abcdef").is_ok());
        for bad in ["", "a b", "a\r\nX-Evil: 1", &"a".repeat(129)] {
            assert!(check_msg_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_stored_reply_subject_names_exactly_one_conversation() {
        let subjects = Subjects::new("webproxy").expect("prefix");
        let origin = Origin::new("WEBPROXY_POOL_DEFAULT", 1_733_025_600_000_123);
        assert_eq!(
            subjects.stored_reply("order-42", &origin),
            "webproxy.reply.order-42.WEBPROXY_POOL_DEFAULT.1733025600000123"
        );
    }

    #[test]
    fn only_a_reply_with_the_own_origin_counts() {
        let origin = Origin::new("WEBPROXY_POOL_DEFAULT", 17);
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::ORIGIN, value);
            headers
        };
        assert!(is_own_reply(
            Some(&with("WEBPROXY_POOL_DEFAULT:17")),
            &origin
        ));
        for other in [
            "WEBPROXY_POOL_DEFAULT:170",
            "WEBPROXY_POOL_DEFAULT:1",
            "WEBPROXY_POOL_OTHER:17",
            "",
        ] {
            assert!(!is_own_reply(Some(&with(other)), &origin), "{other}");
        }
        let mut no_origin = HeaderMap::new();
        no_origin.insert(header::OUTCOME, "response");
        assert!(!is_own_reply(Some(&no_origin), &origin));
        assert!(!is_own_reply(None, &origin));
    }

    #[test]
    fn a_timeout_says_whether_the_stored_replies_were_read() {
        let timeout = |reply_to: Option<&str>| {
            Error::Timeout {
                id: "order-42".into(),
                origin: Origin::new("WEBPROXY_POOL_DEFAULT", 17),
                waited: Duration::from_secs(1),
                reply_to: reply_to.map(str::to_string),
            }
            .to_string()
        };
        assert_eq!(
            timeout(None),
            "no reply to order-42 (origin WEBPROXY_POOL_DEFAULT:17) within 1s, and none is stored"
        );
        assert_eq!(
            timeout(Some("callers.a.replies.42")),
            "no reply to order-42 (origin WEBPROXY_POOL_DEFAULT:17) within 1s on \
             callers.a.replies.42 (the stored replies are not read for a reply_to)"
        );
    }

    fn api_error(err_code: u64) -> PublishError {
        let error: jetstream::Error = serde_json::from_value(serde_json::json!({
            "code": 503, "err_code": err_code, "description": "test"
        }))
        .expect("api error");
        PublishError::with_source(PublishErrorKind::Other, error)
    }

    fn ack(seq: u64, duplicate: bool) -> PublishAck {
        serde_json::from_value(serde_json::json!({
            "stream": "WEBPROXY_POOL_DEFAULT", "seq": seq, "duplicate": duplicate
        }))
        .expect("ack")
    }

    /// Publishes through `publish_retrying` with a fake that answers `answers` in
    /// turn; returns the result and the message ids it was called with.
    async fn retried(
        mut answers: Vec<Result<PublishAck, PublishError>>,
    ) -> (Result<PublishAck, PublishError>, Vec<String>) {
        answers.reverse();
        let answers = std::sync::Mutex::new(answers);
        let calls = std::sync::Mutex::new(Vec::new());
        let result = publish_retrying("f00d", |msg_id| {
            calls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(msg_id.to_string());
            let answer = answers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop()
                .expect("an answer for every try");
            async move { answer }
        })
        .await;
        let calls = calls
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (result, calls)
    }

    #[tokio::test]
    async fn a_publish_in_process_is_tried_again_with_the_same_id() {
        let (result, calls) = retried(vec![
            Err(api_error(10158)),
            Err(api_error(10158)),
            Ok(ack(7, true)),
        ])
        .await;
        let ack = result.expect("stored");
        assert_eq!((ack.sequence, ack.duplicate), (7, true));
        assert_eq!(calls, ["f00d", "f00d", "f00d"]);
    }

    #[tokio::test]
    async fn retries_of_a_publish_in_process_are_bounded() {
        let answers = (0..PUBLISH_TRIES).map(|_| Err(api_error(10158))).collect();
        let (result, calls) = retried(answers).await;
        assert!(result.is_err());
        assert_eq!(calls.len(), PUBLISH_TRIES as usize);
    }

    #[tokio::test]
    async fn other_publish_errors_are_not_retried() {
        for error in [
            api_error(10071),
            PublishError::new(PublishErrorKind::TimedOut),
            PublishError::new(PublishErrorKind::StreamNotFound),
        ] {
            let (result, calls) = retried(vec![Err(error)]).await;
            assert!(result.is_err());
            assert_eq!(calls.len(), 1);
        }
    }
}
