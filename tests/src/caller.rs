//! A caller's side of the protocol for tests: a running service with its upstream and
//! client, raw publishes, and readers for stored replies and dead letters.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer};
use bytes::Bytes;
use webproxy_client::{Answer, Client, Request, new_id};
use webproxy_protocol::{DeadLetter, Origin, Reply, RequestEnvelope, Subjects};

use crate::{NatsServer, Service, ServiceOptions, Upstream, wait_for};

pub use webproxy_testkit::rules::{accept_rule, origin_rule, path_rule};

/// How long a test waits for a reply that should come at once; generous for a loaded
/// 2-core CI machine.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(20);

/// The stored reply of the conversation `id` of `origin`, once `client` reads it; a
/// lookup that fails is asked again, as one that finds none yet. Panics if `within`
/// passes first.
pub async fn stored_reply(client: &Client, id: &str, origin: &Origin, within: Duration) -> Reply {
    wait_for(
        within,
        &format!("the stored reply of {id} ({origin})"),
        || async { client.reply(id, origin).await.ok().flatten() },
    )
    .await
}

/// A request envelope with a fresh id.
pub fn envelope(method: &str, url: &str) -> RequestEnvelope {
    RequestEnvelope {
        id: new_id(),
        method: method.into(),
        url: url.into(),
        ..Default::default()
    }
}

/// A nats-server, an upstream, a service configured with `config`, and a client.
pub struct Harness {
    pub nats: NatsServer,
    pub upstream: Upstream,
    pub service: Service,
    pub client: Client,
    pub js: jetstream::Context,
    pub subjects: Subjects,
}

impl Harness {
    /// Starts everything; `config` is given the upstream so it can name its URL.
    pub async fn start(config: impl FnOnce(&Upstream) -> String) -> Harness {
        Self::start_with_upstream(Upstream::start().await, config).await
    }

    pub async fn start_with_upstream(
        upstream: Upstream,
        config: impl FnOnce(&Upstream) -> String,
    ) -> Harness {
        Self::start_with_options(upstream, ServiceOptions::default(), config).await
    }

    /// Starts everything, the service with `options` (e.g. [`ServiceOptions::guarded`]).
    pub async fn start_with_options(
        upstream: Upstream,
        options: ServiceOptions,
        config: impl FnOnce(&Upstream) -> String,
    ) -> Harness {
        let nats = NatsServer::start();
        let service = Service::start_with(&nats.url(), &config(&upstream), options).await;
        let nats_client = nats.client().await;
        let client = Client::new(nats_client.clone(), "webproxy").expect("client");
        Harness {
            js: jetstream::new(nats_client),
            subjects: Subjects::new("webproxy").expect("prefix"),
            nats,
            upstream,
            service,
            client,
        }
    }

    /// Sends `envelope` to the default pool and waits for its reply.
    pub async fn request(&self, envelope: &RequestEnvelope) -> Reply {
        self.request_answer(envelope).await.reply
    }

    /// Sends `envelope` to the default pool and waits for its reply, returned with
    /// the conversation's origin.
    pub async fn request_answer(&self, envelope: &RequestEnvelope) -> Answer {
        let request = Request::from_envelope(envelope.clone()).wait(REPLY_TIMEOUT);
        self.client
            .request_answer(&request)
            .await
            .unwrap_or_else(|e| {
                panic!("no reply for {}: {e}\n{}", envelope.id, self.service.logs())
            })
    }

    /// Publishes raw bytes to a pool's request subject with JetStream.
    pub async fn publish_raw(&self, pool: &str, msg_id: &str, payload: impl Into<Bytes>) {
        let publish = jetstream::message::PublishMessage::build()
            .payload(payload.into())
            .message_id(msg_id);
        self.js
            .send_publish(self.subjects.request(pool), publish)
            .await
            .expect("publish")
            .await
            .expect("stored");
    }

    /// Every dead letter stored so far, with its headers: every pool's, pool by pool.
    pub async fn dead_letters(&self) -> Vec<(HeaderMap, DeadLetter)> {
        let mut letters = Vec::new();
        for name in crate::dead_streams(&self.js).await {
            let mut stream = self.js.get_stream(&name).await.expect("dead stream");
            let last = stream.info().await.expect("info").state.last_sequence;
            for seq in 1..=last {
                if let Ok(message) = stream.get_raw_message(seq).await
                    && !message.subject.ends_with(".superseded")
                {
                    let letter =
                        serde_json::from_slice(&message.payload).expect("dead letter json");
                    letters.push((message.headers, letter));
                }
            }
        }
        letters
    }

    /// Waits until `count` dead letters are stored and returns them.
    pub async fn wait_dead_letters(&self, count: usize) -> Vec<(HeaderMap, DeadLetter)> {
        wait_for(REPLY_TIMEOUT, &format!("{count} dead letters"), || async {
            let letters = self.dead_letters().await;
            (letters.len() >= count).then_some(letters)
        })
        .await
    }

    /// The pool consumer's state on the server.
    pub async fn pool_consumer(&self, pool: &str) -> consumer::Info {
        pool_consumer_in(&self.js, &self.subjects, pool).await
    }
}

/// `pool`'s work consumer's state on `nats`, under the default prefix.
pub async fn pool_consumer(nats: &NatsServer, pool: &str) -> consumer::Info {
    let js = jetstream::new(nats.client().await);
    pool_consumer_in(&js, &Subjects::new("webproxy").expect("prefix"), pool).await
}

async fn pool_consumer_in(
    js: &jetstream::Context,
    subjects: &Subjects,
    pool: &str,
) -> consumer::Info {
    let stream = js
        .get_stream_no_info(subjects.pool_stream(pool))
        .await
        .expect("pool stream");
    stream
        .consumer_info(subjects.pool_consumer(pool))
        .await
        .expect("consumer info")
}

/// `envelope` as a client request to `pool`.
pub fn to(pool: &str, envelope: &RequestEnvelope) -> Request {
    Request::from_envelope(envelope.clone()).pool(pool)
}

/// The next message on `subscriber` within `within`; panics naming `what` when none
/// comes in time or the subscription ends.
pub async fn next_message(
    subscriber: &mut async_nats::Subscriber,
    within: std::time::Duration,
    what: &str,
) -> async_nats::Message {
    use futures::StreamExt as _;
    tokio::time::timeout(within, subscriber.next())
        .await
        .unwrap_or_else(|_| panic!("no {what} within {within:?}"))
        .unwrap_or_else(|| panic!("the subscription for {what} ended"))
}
