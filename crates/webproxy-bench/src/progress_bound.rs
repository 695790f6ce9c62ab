//! The bench's progress-bound section (issue 29, point 5): what the progress bucket
//! holds after many parked-and-settled conversations, and a minute later. A settled
//! record is purged with a marker whose `Nats-TTL` is 60 s, so the bucket holds at most
//! a minute of settles' markers and then nothing. Its own nats-server and release
//! `webproxy serve`, sharing nothing with the main measurement; the figures go to
//! `progress_bound.json` beside the main ones.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use futures::StreamExt as _;
use serde::Serialize;
use webproxy_client::Client;
use webproxy_testkit::rules::path_rule;
use webproxy_testkit::{NatsServer, Service, ServiceOptions, Upstream, fails_once_routes};

use crate::load::{Replies, proxied_within};
use crate::write_beside;

/// Conversations, each on a key of its own so that each parks exactly once: the
/// issue's 10k.
const CONVERSATIONS: usize = 10_000;

/// Conversations the bench keeps outstanding: enough to keep the pool's slots busy
/// while others wait out their retry delay, few enough that the parked retries do not
/// crowd the one nats-server.
const OUTSTANDING: usize = 1_000;

/// The pool's slots: a fresh 503 and a 200 take a millisecond at the upstream, so the
/// broker's work, not the slots, sets the pace.
const SLOTS: usize = 256;

/// The wait before the one retry: short, so the run is quick, but long enough to park
/// (every retry parks, whatever its delay).
const RETRY_DELAY: &str = "200ms";

/// How long one conversation may take to be answered before the bench counts it
/// unanswered: far above its 200 ms retry delay, for a loaded 2-core machine.
const ANSWER: Duration = Duration::from_secs(120);

/// The marker TTL (`PROGRESS_MARKER_TTL`, 60 s) and 10 s for the server's expiry pass
/// and a loaded machine.
const LATER: Duration = Duration::from_secs(70);

const POOL: &str = "bound";

/// The progress bucket's stream at one instant.
#[derive(Debug, Clone, Copy, Serialize)]
struct BucketState {
    /// Messages: records still held and purge markers not yet expired.
    messages: u64,
    bytes: u64,
}

#[derive(Debug, Serialize)]
struct Figures {
    conversations: usize,
    /// Answered with the upstream's response (the 200 after the one retry).
    answered: usize,
    /// Calls the upstream saw: two per conversation when each parked exactly once.
    upstream_calls: usize,
    /// From the first publish to the last answer, in seconds.
    run_s: f64,
    /// As soon as every conversation was answered.
    settled: BucketState,
    /// Seconds between the two readings.
    later_s: f64,
    /// [`LATER`] after the first reading.
    later: BucketState,
}

/// The state of `stream` (a KV bucket's), read now.
async fn bucket_state(js: &jetstream::Context, stream: &str) -> anyhow::Result<BucketState> {
    let info = js
        .get_stream(stream)
        .await
        .with_context(|| format!("cannot read the stream {stream}"))?;
    let state = info.cached_info().state.clone();
    Ok(BucketState {
        messages: state.messages,
        bytes: state.bytes,
    })
}

/// Runs the section, prints its figures and writes them to `progress_bound.json` in
/// the directory of `json` (the main figures' file). It takes the run's time (8 s on
/// the 2-core development machine, with other builds beside it) plus [`LATER`].
pub(crate) async fn report(json: &Path) -> anyhow::Result<()> {
    eprintln!("progress bound: {CONVERSATIONS} conversations that park once, then {LATER:?}");
    let nats = NatsServer::start();
    let upstream = Upstream::start_with(fails_once_routes()).await;
    let config = format!(
        "[log]\nlevel = \"warn\"\n\n[pools.{POOL}]\nmax_in_flight = {SLOTS}\n\n{}pool = \"{POOL}\"\nmax_retries = 3\nretry_delay = \"{RETRY_DELAY}\"\nbackoff_factor = 1.0\n",
        path_rule("bound", &upstream, "/fails-once/")
    );
    let _service = Service::start_with(
        &nats.url(),
        &config,
        ServiceOptions::default().env("RUST_LOG", "warn"),
    )
    .await;
    let nats_client = nats.client().await;
    let client = Client::new(nats_client.clone(), "webproxy")?;
    let stream = format!("KV_{}", client.subjects().progress_bucket());
    let js = jetstream::new(nats_client.clone());
    // The live copies only (see `Candidate::start`).
    let replies = Replies::subscribe(
        &nats_client,
        "webproxy.reply.*".into(),
        "webproxy.reply.".len(),
    )
    .await?;

    let started = Instant::now();
    let answered = futures::stream::iter(0..CONVERSATIONS)
        .map(|key| {
            let url: Arc<str> = Arc::from(upstream.url(&format!("/fails-once/{key}")));
            proxied_within(client.clone(), replies.clone(), POOL, url, ANSWER)
        })
        .buffer_unordered(OUTSTANDING)
        .filter(|answered| std::future::ready(*answered))
        .count()
        .await;
    let run = started.elapsed();
    let settled = bucket_state(&js, &stream).await?;
    let read = Instant::now();
    // A fixed wait is the measurement itself, not a wait for a condition: the bucket's
    // use a minute after the last settle, whatever it is.
    tokio::time::sleep(LATER).await;
    let later = bucket_state(&js, &stream).await?;
    let figures = Figures {
        conversations: CONVERSATIONS,
        answered,
        upstream_calls: upstream.hits(),
        run_s: run.as_secs_f64(),
        settled,
        later_s: read.elapsed().as_secs_f64(),
        later,
    };
    println!(
        "progress bound ({} conversations parked once and answered of {}, {} upstream calls, in {:.1} s): {stream} holds {} messages, {} bytes at once; {} messages, {} bytes {:.0} s later",
        figures.answered,
        figures.conversations,
        figures.upstream_calls,
        figures.run_s,
        figures.settled.messages,
        figures.settled.bytes,
        figures.later.messages,
        figures.later.bytes,
        figures.later_s
    );
    write_beside(json, "progress_bound", &figures)
}
