//! A small async Rust client for webproxy: it gets right what every caller must —
//! subscribe before publishing, set `Nats-Msg-Id`, pick the pool subject, fall back to
//! the stored reply, and tell an error outcome from a response.

use std::time::Duration;

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::{self, stream::LastRawMessageErrorKind};
use bytes::Bytes;
use futures::StreamExt as _;
use thiserror::Error;
use webproxy_protocol::{InvalidName, Reply, RequestEnvelope, Subjects};

/// What can go wrong talking to webproxy.
#[derive(Debug, Error)]
pub enum Error {
    #[error("invalid subject prefix: {0}")]
    InvalidPrefix(#[from] InvalidName),
    #[error("cannot encode the request: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("no pool {pool:?} exists (nothing stores {subject})")]
    NoSuchPool { pool: String, subject: String },
    #[error("the request was not stored: {0}")]
    Publish(String),
    #[error("cannot subscribe to the reply subject: {0}")]
    Subscribe(String),
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    #[error("cannot read the stored reply: {0}")]
    Lookup(String),
    #[error("the reply is not a valid envelope: {0}")]
    Decode(String),
}

/// A webproxy client over one NATS connection.
#[derive(Debug, Clone)]
pub struct Client {
    nats: async_nats::Client,
    js: jetstream::Context,
    subjects: Subjects,
}

/// A fresh conversation id (a NUID: 22 characters of `[A-Za-z0-9]`).
pub fn new_id() -> String {
    nuid::next().to_string()
}

impl Client {
    /// A client for the deployment whose streams use `prefix` (`webproxy` by default).
    pub fn new(nats: async_nats::Client, prefix: &str) -> Result<Client, Error> {
        Ok(Client {
            js: jetstream::new(nats.clone()),
            nats,
            subjects: Subjects::new(prefix)?,
        })
    }

    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// Sends a request to `pool` and waits up to `timeout` for its final reply. The reply
    /// subscription is made before publishing; a reply missed while subscribed (a
    /// reconnect) is read from the replies stream instead.
    pub async fn request(
        &self,
        pool: &str,
        envelope: &RequestEnvelope,
        timeout: Duration,
    ) -> Result<Reply, Error> {
        let mut replies = self
            .nats
            .subscribe(self.subjects.reply(&envelope.id))
            .await
            .map_err(|e| Error::Subscribe(e.to_string()))?;
        self.submit(pool, envelope).await?;
        let live = tokio::time::timeout(timeout, replies.next()).await;
        if let Ok(Some(message)) = live {
            return decode(&message.payload);
        }
        self.reply(&envelope.id)
            .await?
            .ok_or(Error::Timeout(timeout))
    }

    /// Publishes a request to `pool` and returns its id once JetStream has stored it.
    pub async fn submit(&self, pool: &str, envelope: &RequestEnvelope) -> Result<String, Error> {
        let subject = self.subjects.request(pool);
        let payload = Bytes::from(serde_json::to_vec(envelope)?);
        let publish = jetstream::message::PublishMessage::build()
            .payload(payload)
            .message_id(&envelope.id);
        let ack = self
            .js
            .send_publish(subject.clone(), publish)
            .await
            .map_err(|e| publish_error(e, pool, &subject))?;
        ack.await.map_err(|e| publish_error(e, pool, &subject))?;
        Ok(envelope.id.clone())
    }

    /// The NATS connection.
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    /// The stored final reply of conversation `id`, if there is one.
    pub async fn reply(&self, id: &str) -> Result<Option<Reply>, Error> {
        match self.reply_message(id).await? {
            Some(message) => decode(&message.payload).map(Some),
            None => Ok(None),
        }
    }

    /// The stored reply message of conversation `id` with its headers
    /// (`Webproxy-Outcome`, `Webproxy-Generation`), if there is one.
    pub async fn reply_message(&self, id: &str) -> Result<Option<StreamMessage>, Error> {
        stored_reply_message(&self.js, &self.subjects, id).await
    }
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
        .map_err(|e| Error::Lookup(e.to_string()))?;
    match stream
        .get_last_raw_message_by_subject(&subjects.reply(id))
        .await
    {
        Ok(message) => Ok(Some(message)),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(Error::Lookup(e.to_string())),
    }
}

fn publish_error(error: jetstream::context::PublishError, pool: &str, subject: &str) -> Error {
    if error.kind() == jetstream::context::PublishErrorKind::StreamNotFound {
        Error::NoSuchPool {
            pool: pool.to_string(),
            subject: subject.to_string(),
        }
    } else {
        Error::Publish(error.to_string())
    }
}

fn decode(payload: &[u8]) -> Result<Reply, Error> {
    serde_json::from_slice(payload).map_err(|e| Error::Decode(e.to_string()))
}
