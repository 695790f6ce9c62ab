//! The load the bench makes: closed loops that keep a fixed number of operations
//! outstanding, and the three operations it measures (a proxied conversation, the
//! same HTTP call made directly, and the broker-only loop).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use futures::StreamExt as _;
use serde::Serialize;
use tokio::sync::oneshot;
use webproxy_client::{Client, Request, new_id};

/// One measurement's figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Figures {
    pub(crate) requests: usize,
    pub(crate) errors: usize,
    pub(crate) rps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p90_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
}

impl Figures {
    fn from(mut latencies: Vec<Duration>, errors: usize, elapsed: Duration) -> Figures {
        latencies.sort_unstable();
        let at = |q: f64| {
            if latencies.is_empty() {
                return 0.0;
            }
            let index = ((latencies.len() as f64 - 1.0) * q).round() as usize;
            latencies[index].as_secs_f64() * 1000.0
        };
        Figures {
            requests: latencies.len(),
            errors,
            rps: latencies.len() as f64 / elapsed.as_secs_f64(),
            p50_ms: at(0.50),
            p90_ms: at(0.90),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        }
    }
}

/// Keeps `concurrency` operations outstanding for `duration`; an operation returns
/// whether it succeeded.
pub(crate) async fn closed_loop<F, Fut>(concurrency: usize, duration: Duration, op: F) -> Figures
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = bool> + Send,
{
    let started = Instant::now();
    let deadline = started + duration;
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0;
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    if op().await {
                        latencies.push(t0.elapsed());
                    } else {
                        errors += 1;
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut errors = 0;
    for worker in workers {
        if let Ok((l, e)) = worker.await {
            latencies.extend(l);
            errors += e;
        }
    }
    Figures::from(latencies, errors, started.elapsed())
}

/// Routes replies from one wildcard subscription, made before any publish, to the
/// conversation waiting for each.
#[derive(Clone, Default)]
pub(crate) struct Replies(Arc<Mutex<HashMap<String, oneshot::Sender<async_nats::Message>>>>);

impl Replies {
    pub(crate) async fn subscribe(
        nats: &async_nats::Client,
        wildcard: String,
        prefix_len: usize,
    ) -> anyhow::Result<Replies> {
        let replies = Replies::default();
        let mut subscription = nats.subscribe(wildcard).await?;
        let routes = replies.clone();
        tokio::spawn(async move {
            while let Some(message) = subscription.next().await {
                let id = message
                    .subject
                    .get(prefix_len..)
                    .unwrap_or_default()
                    .to_string();
                if let Some(waiter) = routes.lock().remove(&id) {
                    let _ = waiter.send(message);
                }
            }
        });
        Ok(replies)
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, oneshot::Sender<async_nats::Message>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn expect(&self, id: &str) -> oneshot::Receiver<async_nats::Message> {
        let (tx, rx) = oneshot::channel();
        self.lock().insert(id.to_string(), tx);
        rx
    }
}

pub(crate) const REPLY_WAIT: Duration = Duration::from_secs(30);

/// One proxied conversation: publish with the client, wait for the reply.
pub(crate) async fn proxied(
    client: Client,
    replies: Replies,
    pool: &'static str,
    url: Arc<str>,
) -> bool {
    proxied_within(client, replies, pool, url, REPLY_WAIT).await
}

/// [`proxied`], waiting up to `wait` for the reply.
pub(crate) async fn proxied_within(
    client: Client,
    replies: Replies,
    pool: &'static str,
    url: Arc<str>,
    wait: Duration,
) -> bool {
    let id = new_id();
    let reply = replies.expect(&id);
    let request = Request::new("GET", url.as_ref()).id(id).pool(pool);
    if client.submit(&request).await.is_err() {
        return false;
    }
    match tokio::time::timeout(wait, reply).await {
        Ok(Ok(message)) => message
            .headers
            .as_ref()
            .and_then(|h| h.get("Webproxy-Outcome"))
            .is_some_and(|v| v.as_str() == "response"),
        _ => false,
    }
}

pub(crate) async fn direct(http: reqwest::Client, url: Arc<str>) -> bool {
    match http.get(url.as_ref()).send().await {
        Ok(response) => response.status().is_success() && response.bytes().await.is_ok(),
        Err(_) => false,
    }
}

/// The broker-only loop's server side: what webproxy does with NATS, without HTTP.
pub(crate) async fn broker_echo(js: jetstream::Context) -> anyhow::Result<()> {
    js.create_stream(stream::Config {
        name: "BENCH_WORK".into(),
        subjects: vec!["bench.work".into()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await?;
    js.create_stream(stream::Config {
        name: "BENCH_REPLIES".into(),
        subjects: vec!["bench.reply.>".into()],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await?;
    let work: consumer::PullConsumer = js
        .get_stream("BENCH_WORK")
        .await?
        .create_consumer(consumer::pull::Config {
            durable_name: Some("bench".into()),
            max_ack_pending: 512,
            ..Default::default()
        })
        .await?;
    tokio::spawn(async move {
        loop {
            let Ok(mut batch) = work
                .batch()
                .max_messages(256)
                .expires(Duration::from_secs(5))
                .messages()
                .await
            else {
                continue;
            };
            while let Some(Ok(message)) = batch.next().await {
                let js = js.clone();
                tokio::spawn(async move {
                    let id = String::from_utf8_lossy(&message.payload).into_owned();
                    let publish = jetstream::message::PublishMessage::build()
                        .payload(Bytes::from_static(b"{\"outcome\":\"response\"}"))
                        .message_id(format!("{id}:0:reply"));
                    if let Ok(ack) = js.send_publish(format!("bench.reply.{id}"), publish).await
                        && ack.await.is_ok()
                    {
                        let _ = message.ack().await;
                    }
                });
            }
        }
    });
    Ok(())
}

pub(crate) async fn broker(js: jetstream::Context, replies: Replies) -> bool {
    let id = new_id();
    let reply = replies.expect(&id);
    let publish = jetstream::message::PublishMessage::build()
        .payload(Bytes::from(id.clone()))
        .message_id(&id);
    let Ok(ack) = js.send_publish("bench.work", publish).await else {
        return false;
    };
    if ack.await.is_err() {
        return false;
    }
    matches!(tokio::time::timeout(REPLY_WAIT, reply).await, Ok(Ok(_)))
}
