//! `webproxy-pipeline`: the smallest correct implementation of webproxy's conversation
//! contract, which `just bench` measures webproxy against (issue 33). Per pool: a work
//! stream and a replies stream of webproxy's names, one pull consumer whose
//! `max_ack_pending` is the pool's limit; per message: parse the envelope, one HTTP
//! call, the stored reply (message id, expected last subject sequence), the live copy on
//! `webproxy.reply.<id>`, ack. No rules, retries, logs or metrics: it sends exactly the
//! NATS messages the contract requires, so what webproxy sends and spends beyond it is
//! webproxy's own. The envelope's optional `reply_to`, `timeout_ms`, `deadline` and
//! `body_base64` are not read: the bench sends none.
//!
//! `webproxy-pipeline --nats URL --pool default=512 --pool slot=1`

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer, context::PublishErrorKind, stream};
use base64::prelude::*;
use bytes::Bytes;
use clap::Parser;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

// As webproxy's binary: the allocator is no part of the difference measured.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
struct Args {
    #[arg(long)]
    nats: String,
    /// A pool and its concurrency limit, NAME=MAX_IN_FLIGHT; repeatable.
    #[arg(long = "pool", value_parser = pool, required = true)]
    pools: Vec<(String, i64)>,
}

fn pool(arg: &str) -> Result<(String, i64), String> {
    let (name, limit) = arg.split_once('=').ok_or("not NAME=MAX_IN_FLIGHT")?;
    Ok((
        name.into(),
        limit.parse().map_err(|e| format!("{limit}: {e}"))?,
    ))
}

#[derive(Deserialize)]
struct Envelope<'a> {
    id: &'a str,
    method: &'a str,
    url: &'a str,
    #[serde(default)]
    headers: BTreeMap<&'a str, OneOrMany<'a>>,
    body: Option<String>,
    #[serde(borrow)]
    metadata: Option<&'a RawValue>,
}

/// A header's value in the envelope and the reply: a string, or an array when repeated.
#[derive(Deserialize, Serialize)]
#[serde(untagged)]
enum OneOrMany<'a> {
    One(&'a str),
    Many(Vec<&'a str>),
}

impl<'a> Default for OneOrMany<'a> {
    fn default() -> Self {
        OneOrMany::Many(Vec::new())
    }
}

impl<'a> OneOrMany<'a> {
    fn push(&mut self, value: &'a str) {
        *self = match std::mem::take(self) {
            OneOrMany::Many(values) if values.is_empty() => OneOrMany::One(value),
            OneOrMany::One(first) => OneOrMany::Many(vec![first, value]),
            OneOrMany::Many(mut values) => {
                values.push(value);
                OneOrMany::Many(values)
            }
        };
    }
}

#[derive(Serialize)]
struct Reply<'a> {
    v: u8,
    id: &'a str,
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    /// A repeated header is an array.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    headers: BTreeMap<&'a str, OneOrMany<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body_base64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<serde_json::Value>,
    attempts: u32,
    duration_ms: i128,
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<&'a RawValue>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Err: one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let nats = async_nats::connect(&args.nats).await?;
    let js = jetstream::new(nats.clone());
    let http = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()?;
    let mut pools = Vec::new();
    for (pool, limit) in args.pools {
        let consumer = provision(&js, &pool, limit).await?;
        let (js, nats, http) = (js.clone(), nats.clone(), http.clone());
        pools.push(tokio::spawn(async move {
            let batch = usize::try_from(limit.clamp(1, 512)).unwrap_or(512);
            let mut messages = consumer
                .stream()
                .max_messages_per_batch(batch)
                .messages()
                .await?;
            while let Some(message) = messages.next().await {
                let message = message?;
                let (js, nats, http) = (js.clone(), nats.clone(), http.clone());
                tokio::spawn(async move {
                    // Left unacked: the server redelivers it.
                    if let Err(e) = converse(&js, &nats, &http, message).await {
                        eprintln!("{e:#}");
                    }
                });
            }
            anyhow::Ok(())
        }));
    }
    println!("ready");
    for pool in pools {
        pool.await??;
    }
    Ok(())
}

/// The pool's streams and its work consumer, as webproxy names them.
async fn provision(
    js: &jetstream::Context,
    pool: &str,
    limit: i64,
) -> anyhow::Result<consumer::PullConsumer> {
    let name = format!("WEBPROXY_POOL_{}", pool.to_ascii_uppercase());
    let work = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![
                format!("webproxy.request.{pool}"),
                format!("webproxy.request.{pool}.*"),
            ],
            retention: stream::RetentionPolicy::WorkQueue,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    js.get_or_create_stream(stream::Config {
        name: format!("{name}_REPLIES"),
        subjects: vec![format!("webproxy.reply.*.{name}.*")],
        max_age: Duration::from_secs(15 * 60),
        // As the bench's webproxy runs (the test fixture's 64 MiB).
        max_bytes: 64 << 20,
        ..Default::default()
    })
    .await?;
    let consumer = work
        .get_or_create_consumer(
            "work",
            consumer::pull::Config {
                durable_name: Some("work".into()),
                max_ack_pending: limit,
                ack_wait: Duration::from_secs(15),
                ..Default::default()
            },
        )
        .await?;
    Ok(consumer)
}

/// One delivery: the call, the stored reply, the live copy, the ack. An envelope that
/// does not parse is terminated (webproxy answers `invalid_request`; this measures the
/// path of a valid one).
async fn converse(
    js: &jetstream::Context,
    nats: &async_nats::Client,
    http: &reqwest::Client,
    message: jetstream::Message,
) -> anyhow::Result<()> {
    let info = message.info().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (stream, seq, published) = (info.stream.to_owned(), info.stream_sequence, info.published);
    let parsed = serde_json::from_slice::<Envelope>(&message.payload);
    // The id names subjects: only the protocol's characters.
    let Some(envelope) = parsed.ok().filter(|e| {
        (1..=128).contains(&e.id.len())
            && e.id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    }) else {
        return message
            .ack_with(AckKind::Term)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"));
    };
    let method = reqwest::Method::from_bytes(envelope.method.to_ascii_uppercase().as_bytes())?;
    let mut request = http.request(method, envelope.url);
    for (name, value) in &envelope.headers {
        let values = match value {
            OneOrMany::One(v) => std::slice::from_ref(v),
            OneOrMany::Many(vs) => vs.as_slice(),
        };
        for v in values {
            request = request.header(*name, *v);
        }
    }
    if let Some(body) = envelope.body.clone() {
        request = request.body(body);
    }
    let response = match request.send().await {
        Ok(response) => {
            let status = response.status().as_u16();
            let headers = response.headers().clone();
            response.bytes().await.map(|body| (status, headers, body))
        }
        Err(e) => Err(e),
    };
    let duration_ms = (time::OffsetDateTime::now_utc() - published).whole_milliseconds();
    let mut reply = Reply {
        v: 1,
        id: envelope.id,
        outcome: "response",
        status: None,
        headers: BTreeMap::new(),
        body: None,
        body_base64: None,
        error: None,
        attempts: 1,
        duration_ms,
        metadata: envelope.metadata,
    };
    let payload = match &response {
        Ok((status, headers, body)) => {
            reply.status = Some(*status);
            for (name, value) in headers {
                if let Ok(value) = value.to_str() {
                    reply.headers.entry(name.as_str()).or_default().push(value);
                }
            }
            match std::str::from_utf8(body) {
                Ok(text) => reply.body = Some(text),
                Err(_) => reply.body_base64 = Some(BASE64_STANDARD.encode(body)),
            }
            serde_json::to_vec(&reply)?
        }
        Err(e) => {
            reply.outcome = "error";
            reply.error =
                Some(serde_json::json!({"code": "transport_error", "message": e.to_string()}));
            serde_json::to_vec(&reply)?
        }
    };
    let origin = format!("{stream}:{seq}");
    let mut headers = HeaderMap::new();
    headers.insert("Webproxy-Outcome", reply.outcome);
    headers.insert("Webproxy-Generation", "0");
    headers.insert("Webproxy-Origin", origin.as_str());
    let mut stored = headers.clone();
    stored.insert("Nats-Msg-Id", format!("{origin}:0:reply").as_str());
    stored.insert("Nats-Expected-Last-Subject-Sequence", "0");
    let subject = format!("webproxy.reply.{}.{stream}.{seq}", envelope.id);
    let mut payload = Bytes::from(payload);
    match js
        .publish_with_headers(subject.clone(), stored, payload.clone())
        .await?
        .await
    {
        Ok(_) => {}
        // Another delivery of this message stored its reply first: send that one.
        Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
            let replies = js.get_stream(format!("{stream}_REPLIES")).await?;
            payload = replies
                .get_last_raw_message_by_subject(&subject)
                .await?
                .payload;
        }
        Err(e) => return Err(e.into()),
    }
    nats.publish_with_headers(format!("webproxy.reply.{}", envelope.id), headers, payload)
        .await?;
    message.ack().await.map_err(|e| anyhow::anyhow!("{e}"))
}
