//! A small async Rust client for webproxy: it gets right what every caller must —
//! subscribe before publishing, set `Nats-Msg-Id`, pick the pool subject, fall back to
//! the stored reply, and tell an error outcome from a response.
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
//! # Ok(())
//! # }
//! ```

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::{self, context::PublishErrorKind, stream::LastRawMessageErrorKind};
use bytes::Bytes;
use futures::StreamExt as _;
use thiserror::Error;
use tokio::time::Instant;
use webproxy_protocol::{InvalidName, ReplyBody, Subjects, validate_id, validate_pool_name};

pub use webproxy_protocol::{
    ErrorBody, ErrorCode, HeaderValue, Headers, Outcome, Reply, RequestEnvelope,
};

/// The pool every deployment has.
pub const DEFAULT_POOL: &str = "default";

/// How long [`Client::request`] waits for a reply unless told otherwise.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);

/// How often a waiting [`Client::request`] looks whether the connection was re-made,
/// which is when a live reply can have been missed.
const RECONNECT_CHECK: Duration = Duration::from_millis(250);

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
    #[error("cannot encode the request: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("no pool {pool:?} exists (nothing stores {subject})")]
    NoSuchPool { pool: String, subject: String },
    #[error("the request was not stored: {0}")]
    Publish(#[source] jetstream::context::PublishError),
    #[error("cannot subscribe to the reply subject: {0}")]
    Subscribe(#[source] async_nats::SubscribeError),
    #[error("no reply to {id} within {waited:?}, and none is stored")]
    Timeout { id: String, waited: Duration },
    #[error("cannot read the stored reply: {0}")]
    Lookup(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the reply is not a valid reply envelope: {0}")]
    Decode(#[source] serde_json::Error),
}

/// A fresh conversation id (a NUID: 22 characters of `[A-Za-z0-9]`).
pub fn new_id() -> String {
    nuid::next().to_string()
}

/// One request: its envelope, the pool it goes to, and how long [`Client::request`]
/// waits for the reply. Built with a fresh id for pool `default`.
#[derive(Debug, Clone)]
pub struct Request {
    envelope: RequestEnvelope,
    pool: String,
    wait: Duration,
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
        }
    }

    /// The conversation id; reuse one to ask again for the same conversation (a
    /// publish within the duplicate window is stored once).
    pub fn id(mut self, id: impl Into<String>) -> Request {
        self.envelope.id = id.into();
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
}

/// What JetStream said about a stored request.
struct Stored {
    /// The same id was already stored within the duplicate window: this publish was
    /// dropped and the earlier one's conversation is the one that answers.
    duplicate: bool,
}

impl Client {
    /// A client for the deployment whose streams use `prefix` (`webproxy` by default).
    pub fn new(nats: async_nats::Client, prefix: &str) -> Result<Client, Error> {
        Ok(Client {
            js: jetstream::new(nats.clone()),
            nats,
            subjects: Subjects::new(prefix).map_err(Error::InvalidPrefix)?,
        })
    }

    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// Sends `request` and waits up to its wait time for the final reply, which may be
    /// an error outcome. The reply subscription is made before publishing. A reply that
    /// could have been missed is read from the replies stream instead: when the request
    /// was already stored (an id sent before), after the connection was re-made, and
    /// when the wait runs out.
    pub async fn request(&self, request: &Request) -> Result<Reply, Error> {
        let id = &request.envelope.id;
        check_id(id)?;
        let mut replies = self
            .nats
            .subscribe(self.subjects.reply(id))
            .await
            .map_err(Error::Subscribe)?;
        let statistics = self.nats.statistics();
        let mut seen_connects = statistics.connects.load(Ordering::Relaxed);
        let deadline = Instant::now() + request.wait;
        let stored = self.publish(request).await?;
        if stored.duplicate
            && let Some(reply) = self.reply(id).await?
        {
            return Ok(reply);
        }
        let mut reconnect_check = tokio::time::interval(RECONNECT_CHECK);
        loop {
            tokio::select! {
                message = replies.next() => match message {
                    Some(message) => return decode(&message.payload),
                    // The subscription ends only when the client is closed.
                    None => break,
                },
                _ = reconnect_check.tick() => {
                    let now = statistics.connects.load(Ordering::Relaxed);
                    // Resubscribing is part of reconnecting, so a reply published after
                    // this lookup reaches the subscription.
                    if now != seen_connects {
                        seen_connects = now;
                        if let Some(reply) = self.reply(id).await? {
                            return Ok(reply);
                        }
                    }
                }
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        self.reply(id).await?.ok_or_else(|| Error::Timeout {
            id: id.clone(),
            waited: request.wait,
        })
    }

    /// Publishes `request` to its pool and returns its id once JetStream has stored it;
    /// read the reply later with [`Client::reply`].
    pub async fn submit(&self, request: &Request) -> Result<String, Error> {
        check_id(&request.envelope.id)?;
        self.publish(request).await?;
        Ok(request.envelope.id.clone())
    }

    /// The stored final reply of conversation `id`, if there is one (yet, or still:
    /// replies are kept for the service's `reply_max_age`).
    pub async fn reply(&self, id: &str) -> Result<Option<Reply>, Error> {
        match self.reply_message(id).await? {
            Some(message) => decode(&message.payload).map(Some),
            None => Ok(None),
        }
    }

    /// The stored reply message of conversation `id` with its headers
    /// (`Webproxy-Outcome`, `Webproxy-Generation`), if there is one.
    pub async fn reply_message(&self, id: &str) -> Result<Option<StreamMessage>, Error> {
        check_id(id)?;
        stored_reply_message(&self.js, &self.subjects, id).await
    }

    /// The NATS connection.
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    async fn publish(&self, request: &Request) -> Result<Stored, Error> {
        let pool = &request.pool;
        validate_pool_name(pool).map_err(Error::InvalidPool)?;
        let subject = self.subjects.request(pool);
        let payload = Bytes::from(serde_json::to_vec(&request.envelope).map_err(Error::Encode)?);
        let publish = jetstream::message::PublishMessage::build()
            .payload(payload)
            .message_id(&request.envelope.id);
        let ack = self
            .js
            .send_publish(subject.clone(), publish)
            .await
            .map_err(|e| publish_error(e, pool, &subject))?
            .await
            .map_err(|e| publish_error(e, pool, &subject))?;
        Ok(Stored {
            duplicate: ack.duplicate,
        })
    }
}

/// An id is a subject token; anything else would subscribe to the wrong subject (a
/// `>` to every reply) instead of getting an `invalid_request` answer.
fn check_id(id: &str) -> Result<(), Error> {
    validate_id(id).map_err(|source| Error::InvalidId {
        id: id.to_string(),
        source,
    })
}

/// The stored reply message of conversation `id`, read from the stream leader through
/// the message-get API (a direct get may be answered by a lagging replica).
pub async fn stored_reply_message(
    js: &jetstream::Context,
    subjects: &Subjects,
    id: &str,
) -> Result<Option<StreamMessage>, Error> {
    let stream = js
        .get_stream_no_info(subjects.replies_stream())
        .await
        .map_err(|e| Error::Lookup(Box::new(e)))?;
    match stream
        .get_last_raw_message_by_subject(&subjects.reply(id))
        .await
    {
        Ok(message) => Ok(Some(message)),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(Error::Lookup(Box::new(e))),
    }
}

fn publish_error(error: jetstream::context::PublishError, pool: &str, subject: &str) -> Error {
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
}
