//! A nats-server with deploy/nats/authorization.conf's users and permissions, and the
//! people on it: callers connected as the file's caller users, the service as its
//! `webproxy` user, and an `admin` who may do anything (to observe what callers
//! cannot). Also a conversation's origin and readers for what the service stored.

use std::time::Duration;

use async_nats::jetstream::context::{Context, PublishError};
use async_nats::jetstream::message::{PublishMessage, StreamMessage};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_nats::{HeaderMap, Message, Subscriber};
use bytes::Bytes;
use futures::StreamExt as _;
use tokio::sync::mpsc;
use tokio::time::Instant;
use webproxy_client::new_id;
use webproxy_protocol::{Subjects, header::ORIGIN};

pub use webproxy_protocol::Origin;
pub use webproxy_testkit::authorization::{
    ADMIN, AUTHORIZATION, CALLERS_ADMIN, GATEWAY_USER, OPERATOR_USER, SERVICE_USER, password,
};

use crate::caller::REPLY_TIMEOUT;
use crate::{NatsServer, ServiceOptions};

/// Options that run the service as `user` of [`NatsServer::start_authorized`].
pub fn service_as(user: &str) -> ServiceOptions {
    ServiceOptions::default()
        .env("WEBPROXY_NATS__USER", user)
        .env("WEBPROXY_NATS__PASSWORD", &password(user))
}

/// Runs `webproxy ARGS` as the file's operator user on `nats`; its standard output.
/// Panics, with its standard error, unless the command succeeds.
pub async fn as_operator(nats: &NatsServer, args: &[&str]) -> String {
    let url = nats.url();
    let password = password(OPERATOR_USER);
    let mut all = args.to_vec();
    all.extend_from_slice(&["--nats", &url, "--user", OPERATOR_USER]);
    all.extend_from_slice(&["--password", &password]);
    let output = crate::run_webproxy(&all).await;
    assert!(
        output.status.success(),
        "webproxy {args:?} as the operator failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A connection as `user` (with its inbox under `inbox_prefix`, when given), and the
/// server errors (permission violations) the connection reports.
pub async fn connect_as(
    nats: &NatsServer,
    user: &str,
    inbox_prefix: Option<&str>,
) -> (async_nats::Client, mpsc::UnboundedReceiver<String>) {
    let (errors, reported) = mpsc::unbounded_channel();
    let client = nats
        .client_with(|| {
            let errors = errors.clone();
            let mut options =
                async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
                    .event_callback(move |event| {
                        let errors = errors.clone();
                        async move {
                            if let async_nats::Event::ServerError(e) = event {
                                // The receiver may be gone; the error is then unwanted.
                                let _ = errors.send(e.to_string());
                            }
                        }
                    });
            if let Some(prefix) = inbox_prefix {
                options = options.custom_inbox_prefix(prefix);
            }
            options
        })
        .await;
    (client, reported)
}

/// Waits up to `within` for a permission violation naming `subject`.
pub async fn violation(
    reported: &mut mpsc::UnboundedReceiver<String>,
    subject: &str,
    within: Duration,
) -> String {
    tokio::time::timeout(within, async {
        loop {
            match reported.recv().await {
                Some(e) if e.contains("Permissions Violation") && e.contains(subject) => return e,
                Some(_) => {}
                None => panic!("the connection closed before reporting a violation for {subject}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no permission violation for {subject} within {within:?}"))
}

/// The origin of the conversation a publish ack stored.
pub fn origin_of(ack: &PublishAck) -> Origin {
    Origin::new(ack.stream.clone(), ack.sequence)
}

/// The message id of what generation `generation` of the conversation from `origin`
/// stores: `<STREAM>:<seq>:<generation>:<kind>`, `kind` being `reply` or `dead`.
pub fn stored_msg_id(origin: &Origin, generation: u64, kind: &str) -> String {
    format!("{}:{kind}", origin.generation_key(generation))
}

/// The names of the default prefix, `webproxy`.
fn subjects() -> Subjects {
    Subjects::new("webproxy").expect("the default prefix is valid")
}

/// A header's value on a message, if it has it.
pub fn header<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    headers.and_then(|h| h.get(name)).map(|v| v.as_str())
}

/// A caller connected as one of the file's caller users: `caller_a` owns
/// `callers.a.>`, `caller_b` owns `callers.b.>`.
pub struct Caller {
    pub nats: async_nats::Client,
    pub js: Context,
    /// `a` for `caller_a`: the caller name it publishes requests under.
    pub name: String,
    /// `callers.a` for `caller_a`.
    pub space: String,
    /// Server errors (permission violations) reported on this connection.
    pub errors: mpsc::UnboundedReceiver<String>,
}

impl Caller {
    /// Connects as `user`, which must be `caller_<x>`.
    pub async fn connect(nats: &NatsServer, user: &str) -> Caller {
        let name = user
            .strip_prefix("caller_")
            .unwrap_or_else(|| panic!("{user} is not one of the file's caller users"));
        let space = format!("callers.{name}");
        let (client, errors) = connect_as(nats, user, Some(&format!("{space}._INBOX"))).await;
        Caller {
            js: async_nats::jetstream::new(client.clone()),
            nats: client,
            name: name.to_owned(),
            space,
            errors,
        }
    }

    /// A reply subject in this caller's own space, `callers.<x>.replies.<tail>`.
    pub fn reply_to(&self, tail: &str) -> String {
        format!("{}.replies.{tail}", self.space)
    }

    /// Publishes `payload` on its own request subject of `pool`,
    /// `webproxy.request.<pool>.<name>`, with JetStream, with message id `msg_id` and
    /// `headers` on top; the server's answer.
    pub async fn try_publish(
        &self,
        pool: &str,
        msg_id: &str,
        headers: &HeaderMap,
        payload: impl Into<Bytes>,
    ) -> Result<PublishAck, PublishError> {
        let subject = format!("webproxy.request.{pool}.{}", self.name);
        self.try_publish_on(&subject, msg_id, headers, payload)
            .await
    }

    /// Like [`Caller::try_publish`], on any `subject`: another caller's name, or none.
    pub async fn try_publish_on(
        &self,
        subject: &str,
        msg_id: &str,
        headers: &HeaderMap,
        payload: impl Into<Bytes>,
    ) -> Result<PublishAck, PublishError> {
        let publish = PublishMessage::build()
            .payload(payload.into())
            .headers(headers.clone())
            .message_id(msg_id);
        self.js
            .send_publish(subject.to_owned(), publish)
            .await?
            .await
    }

    /// Like [`Caller::try_publish`]; panics unless the message is stored.
    pub async fn publish(
        &self,
        pool: &str,
        msg_id: &str,
        headers: &HeaderMap,
        payload: impl Into<Bytes>,
    ) -> PublishAck {
        self.try_publish(pool, msg_id, headers, payload)
            .await
            .unwrap_or_else(|e| panic!("{}: publish to pool {pool} as {msg_id}: {e}", self.space))
    }

    /// Sends a request as a well-behaved caller does: subscribes to the envelope's
    /// `reply_to` first, then publishes with a fresh random message id (and no
    /// headers), retrying a publish the server refuses (a full queue) with the same id
    /// for up to [`REPLY_TIMEOUT`]. Returns the conversation's origin and the
    /// subscription.
    pub async fn send(&self, pool: &str, envelope: &serde_json::Value) -> (Origin, Subscriber) {
        self.send_with(pool, envelope, &HeaderMap::new()).await
    }

    /// Like [`Caller::send`], with `headers` on the request message.
    pub async fn send_with(
        &self,
        pool: &str,
        envelope: &serde_json::Value,
        headers: &HeaderMap,
    ) -> (Origin, Subscriber) {
        let reply_to = envelope["reply_to"]
            .as_str()
            .expect("a caller's envelope names its reply_to");
        let inbox = self
            .nats
            .subscribe(reply_to.to_owned())
            .await
            .expect("subscribe to the reply_to");
        // The subscription reaches the server before the request can be answered.
        self.nats.flush().await.expect("flush");
        let msg_id = new_id();
        let payload = Bytes::from(envelope.to_string());
        let what = format!("pool {pool} to store {msg_id} from {}", self.space);
        let ack = crate::wait_for(REPLY_TIMEOUT, &what, || async {
            self.try_publish(pool, &msg_id, headers, payload.clone())
                .await
                .ok()
        })
        .await;
        (origin_of(&ack), inbox)
    }
}

/// The admin's view: what the service stored, and live subjects callers cannot read.
pub struct Admin {
    pub nats: async_nats::Client,
    pub js: Context,
}

impl Admin {
    pub async fn connect(nats: &NatsServer) -> Admin {
        let (client, _) = connect_as(nats, ADMIN, None).await;
        Admin {
            js: async_nats::jetstream::new(client.clone()),
            nats: client,
        }
    }

    /// Subscribes to `subject` and makes sure the server has the subscription.
    pub async fn subscribe(&self, subject: String) -> Subscriber {
        let subscriber = self.nats.subscribe(subject).await.expect("subscribe");
        self.nats.flush().await.expect("flush");
        subscriber
    }

    /// Every message of `stream` whose subject is `subject`, oldest first.
    pub async fn messages(&self, stream: &str, subject: &str) -> Vec<StreamMessage> {
        self.messages_where(stream, |m| m.subject.as_str() == subject)
            .await
    }

    /// Every message of `stream` that `keep` keeps, oldest first.
    pub async fn messages_where(
        &self,
        stream: &str,
        keep: impl Fn(&StreamMessage) -> bool,
    ) -> Vec<StreamMessage> {
        let mut stream = self
            .js
            .get_stream(stream)
            .await
            .unwrap_or_else(|e| panic!("stream {stream}: {e}"));
        let state = stream.info().await.expect("stream info").state.clone();
        let mut kept = Vec::new();
        if state.messages == 0 {
            return kept;
        }
        for seq in state.first_sequence..=state.last_sequence {
            // Err: deleted (or acked off a work queue) meanwhile.
            if let Ok(message) = stream.get_raw_message(seq).await
                && keep(&message)
            {
                kept.push(message);
            }
        }
        kept
    }

    /// The last stored reply on `subject`, if any.
    pub async fn last_stored_reply(&self, subject: &str) -> Option<StreamMessage> {
        // The subject names the origin's pool stream, whose replies stream holds it.
        let pool_stream = subject.split('.').nth(3).expect("a stored reply subject");
        let stream = self
            .js
            .get_stream_no_info(subjects().pool_replies_stream(pool_stream))
            .await
            .expect("replies stream");
        match stream.get_last_raw_message_by_subject(subject).await {
            Ok(message) => Some(message),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => None,
            Err(e) => panic!("read the last reply on {subject}: {e}"),
        }
    }

    /// Every stored reply of conversation `id` from `origin`, oldest first.
    pub async fn stored_replies(&self, id: &str, origin: &Origin) -> Vec<StreamMessage> {
        self.messages(
            &subjects().replies_stream_of(origin),
            &subjects().stored_reply(id, origin),
        )
        .await
    }

    /// Waits up to `within` for the stored reply of `id` from `origin`, and returns
    /// every one stored by then.
    pub async fn wait_stored_replies(
        &self,
        id: &str,
        origin: &Origin,
        within: Duration,
    ) -> Vec<StreamMessage> {
        crate::wait_for(within, &format!("a stored reply for {origin}"), || async {
            let replies = self.stored_replies(id, origin).await;
            (!replies.is_empty()).then_some(replies)
        })
        .await
    }

    /// Every dead letter whose `Webproxy-Origin` is `origin`, oldest first.
    pub async fn dead_letters(&self, origin: &Origin) -> Vec<StreamMessage> {
        let origin = origin.to_string();
        let mut letters = Vec::new();
        for stream in crate::dead_streams(&self.js).await {
            letters.extend(
                self.messages_where(&stream, |m| {
                    header(Some(&m.headers), ORIGIN) == Some(origin.as_str())
                })
                .await,
            );
        }
        letters
    }

    /// Waits up to `within` for a dead letter from `origin`, and returns every one
    /// stored by then.
    pub async fn wait_dead_letters(&self, origin: &Origin, within: Duration) -> Vec<StreamMessage> {
        crate::wait_for(within, &format!("a dead letter for {origin}"), || async {
            let letters = self.dead_letters(origin).await;
            (!letters.is_empty()).then_some(letters)
        })
        .await
    }
}

/// The first message on `subscriber` within `within`, then every further one that
/// comes within `grace` of the first: the way to tell one final reply from several.
pub async fn first_and_repeats(
    subscriber: &mut Subscriber,
    within: Duration,
    grace: Duration,
    what: &str,
) -> Vec<Message> {
    let first = crate::caller::next_message(subscriber, within, what).await;
    let until = Instant::now() + grace;
    let mut messages = vec![first];
    while let Ok(Some(message)) = tokio::time::timeout_at(until, subscriber.next()).await {
        messages.push(message);
    }
    messages
}
