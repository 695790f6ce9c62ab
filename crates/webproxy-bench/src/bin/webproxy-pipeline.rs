//! `webproxy-pipeline`: the smallest correct implementation of webproxy's conversation
//! contract, which `just bench` measures webproxy against (issue 33). Per pool: a work
//! stream and a replies stream of webproxy's names, one pull consumer whose
//! `max_ack_pending` is the pool's limit; per message: parse the envelope, one HTTP
//! call, the stored reply (message id, expected last subject sequence), the live copy on
//! `webproxy.reply.<id>`, ack. No rules, retries, logs or metrics: it sends exactly the
//! NATS messages the contract requires, so what webproxy sends and spends beyond it is
//! webproxy's own. The envelope's optional `reply_to`, `timeout_ms`, `deadline` and
//! `body_base64` are not read: the bench sends none. The names (subjects, streams,
//! headers, message ids) are the protocol crate's, so they are webproxy's by
//! construction; the work on them is this file's.
//!
//! `webproxy-pipeline --nats URL --pool default=512 --pool slot=1`

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer, context::PublishErrorKind, stream};
use bytes::Bytes;
use clap::Parser;
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::value::RawValue;
use webproxy_protocol::{
    ErrorBody, ErrorCode, HeaderValue, Headers, Origin, Reply, ReplyBody, Subjects,
    collect_headers, header, validate_id,
};

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

/// The envelope's fields the call needs, read without webproxy's validation: the
/// reply and the names are the protocol crate's own.
#[derive(Deserialize)]
struct Envelope<'a> {
    id: &'a str,
    method: &'a str,
    url: &'a str,
    #[serde(default)]
    headers: Headers,
    body: Option<String>,
    metadata: Option<Box<RawValue>>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Err: one is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let nats = async_nats::connect(&args.nats).await?;
    let js = jetstream::new(nats.clone());
    let subjects = Subjects::new("webproxy")?;
    let http = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()?;
    let mut pools = Vec::new();
    for (pool, limit) in args.pools {
        let consumer = provision(&js, &subjects, &pool, limit).await?;
        let (js, nats, http, subjects) = (js.clone(), nats.clone(), http.clone(), subjects.clone());
        pools.push(tokio::spawn(async move {
            let batch = usize::try_from(limit.clamp(1, 512)).unwrap_or(512);
            let mut messages = consumer
                .stream()
                .max_messages_per_batch(batch)
                .messages()
                .await?;
            while let Some(message) = messages.next().await {
                let message = message?;
                let (js, nats, http, subjects) =
                    (js.clone(), nats.clone(), http.clone(), subjects.clone());
                tokio::spawn(async move {
                    // Left unacked: the server redelivers it.
                    if let Err(e) = converse(&js, &nats, &http, &subjects, message).await {
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
    subjects: &Subjects,
    pool: &str,
    limit: i64,
) -> anyhow::Result<consumer::PullConsumer> {
    let name = subjects.pool_stream(pool);
    let work = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subjects.request(pool), subjects.caller_requests(pool)],
            retention: stream::RetentionPolicy::WorkQueue,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    js.get_or_create_stream(stream::Config {
        name: subjects.pool_replies_stream(&name),
        subjects: vec![subjects.pool_replies_filter(&name)],
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
    subjects: &Subjects,
    message: jetstream::Message,
) -> anyhow::Result<()> {
    let info = message.info().map_err(|e| anyhow::anyhow!("{e}"))?;
    let origin = Origin::new(info.stream, info.stream_sequence);
    let published = info.published;
    let parsed = serde_json::from_slice::<Envelope>(&message.payload);
    // The id names subjects: only the protocol's characters.
    let Some(mut envelope) = parsed.ok().filter(|e| validate_id(e.id).is_ok()) else {
        return message
            .ack_with(AckKind::Term)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"));
    };
    let method = reqwest::Method::from_bytes(envelope.method.to_ascii_uppercase().as_bytes())?;
    let mut request = http.request(method, envelope.url);
    for (name, value) in &envelope.headers {
        let values = match value {
            HeaderValue::One(v) => std::slice::from_ref(v),
            HeaderValue::Many(vs) => vs.as_slice(),
        };
        for v in values {
            request = request.header(name, v);
        }
    }
    if let Some(body) = envelope.body.take() {
        request = request.body(body);
    }
    let response = match request.send().await {
        Ok(response) => {
            let status = response.status().as_u16();
            let headers = collect_headers(
                response
                    .headers()
                    .iter()
                    .filter_map(|(n, v)| Some((n.as_str(), v.to_str().ok()?.to_owned()))),
            );
            response.bytes().await.map(|body| (status, headers, body))
        }
        Err(e) => Err(e),
    };
    let elapsed = time::OffsetDateTime::now_utc() - published;
    let duration_ms = u64::try_from(elapsed.whole_milliseconds()).unwrap_or(0);
    let id = envelope.id.to_owned();
    let reply = match response {
        Ok((status, headers, body)) => {
            let body = ReplyBody::encode(body.to_vec());
            Reply::response(id, status, headers, body, 1, duration_ms, envelope.metadata)
        }
        Err(e) => {
            let error = ErrorBody {
                code: ErrorCode::TransportError,
                message: e.to_string(),
                status: None,
            };
            Reply::error(id, error, 1, duration_ms, envelope.metadata)
        }
    };
    let mut payload = Bytes::from(serde_json::to_vec(&reply)?);
    let mut headers = HeaderMap::new();
    headers.insert(header::OUTCOME, reply.outcome.as_str());
    headers.insert(header::GENERATION, "0");
    headers.insert(header::ORIGIN, origin.to_string().as_str());
    let subject = subjects.stored_reply(envelope.id, &origin);
    let stored = jetstream::message::PublishMessage::build()
        .payload(payload.clone())
        .headers(headers.clone())
        .message_id(origin.reply_msg_id(0))
        .expected_last_subject_sequence(0);
    let first = match js.send_publish(subject.clone(), stored).await?.await {
        Ok(ack) => !ack.duplicate,
        Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => false,
        Err(e) => return Err(e.into()),
    };
    // Another delivery of this message stored its reply first (refused, or a duplicate
    // of its message id): send that one, never a second body.
    if !first {
        let replies = js.get_stream(subjects.replies_stream_of(&origin)).await?;
        payload = replies
            .get_last_raw_message_by_subject(&subject)
            .await?
            .payload;
    }
    nats.publish_with_headers(subjects.reply(envelope.id), headers, payload)
        .await?;
    message.ack().await.map_err(|e| anyhow::anyhow!("{e}"))
}
