//! `webproxy pools`: each pool's limit and queue, read from JetStream; and
//! `webproxy pools remove`, which deletes a pool that no longer has waiting work.

use std::ops::ControlFlow;
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, consumer, stream};
use futures::TryStreamExt as _;
use serde::Serialize;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use webproxy_client::Client;
use webproxy_dispatcher::{PoolPauses, Settled};
use webproxy_jetstream::config_store::ConfigStore;
use webproxy_jetstream::provision::mark_removing;
use webproxy_jetstream::state::is_stream_not_found;
use webproxy_protocol::{ErrorBody, ErrorCode, Subjects};

use crate::commands::operator::{
    NatsArgs, connect, connect_with_settings, for_each_message, operator,
};
use crate::commands::serve_follow;
use crate::config::document;
use crate::table::{self, Align, Column};

/// One pool as the server sees it.
#[derive(Debug, Serialize)]
struct PoolState {
    pool: String,
    /// Its pauses in force.
    pauses: Vec<Paused>,
    /// Its circuit breaker: `closed`, `open` or `half_open`.
    breaker: &'static str,
    /// The adaptive limit its runtime state holds, if any.
    adaptive_limit: Option<u64>,
    /// The pool consumer's `max_ack_pending`.
    max_in_flight: i64,
    waiting: u64,
    in_flight: usize,
    parked: u64,
    /// How long the oldest waiting request has waited, in milliseconds.
    oldest_waiting_ms: Option<u64>,
}

/// The pools that exist on the server under this prefix, whatever config made them.
async fn pool_names(client: &Client, js: &jetstream::Context) -> anyhow::Result<Vec<String>> {
    let stream_prefix = client.subjects().pool_stream("");
    let names: Vec<String> = js
        .stream_names()
        .try_collect()
        .await
        .context("cannot list streams")?;
    // A pool's replies and dead-letter streams share the prefix; no pool's name ends
    // like theirs (`validate_pool_name`).
    let mut pools: Vec<String> = names
        .iter()
        .filter_map(|n| n.strip_prefix(stream_prefix.as_str()))
        .filter(|n| !n.ends_with("_REPLIES") && !n.ends_with("_DEAD"))
        .map(str::to_ascii_lowercase)
        .collect();
    pools.sort();
    Ok(pools)
}

async fn pool_state(
    client: &Client,
    js: &jetstream::Context,
    pauses: &PoolPauses,
    pool: &str,
) -> anyhow::Result<PoolState> {
    let runtime = pauses.pool_runtime(pool).await?;
    let subjects = client.subjects();
    let stream = js
        .get_stream_no_info(subjects.pool_stream(pool))
        .await
        .with_context(|| format!("cannot open the stream of pool {pool}"))?;
    // A pool not yet migrated from an older layout still has that layout's consumers.
    let mut work = None;
    for name in [
        subjects.pool_consumer(pool),
        subjects.layout2_pool_consumer(pool),
        subjects.layout1_pool_consumer(pool),
    ] {
        if let Ok(info) = stream.consumer_info(name).await {
            work = Some(info);
            break;
        }
    }
    let work =
        work.with_context(|| format!("cannot read consumer {}", subjects.pool_consumer(pool)))?;
    let parked = [
        subjects.retry_consumer(pool),
        subjects.layout2_retry_consumer(pool),
        subjects.layout1_retry_consumer(pool),
    ];
    let mut parked_count = 0;
    for name in parked {
        if let Ok(info) = stream.consumer_info(name).await {
            parked_count = info.num_pending + info.num_ack_pending as u64;
            break;
        }
    }
    let parked = parked_count;
    // The first undelivered request, with or without a caller name.
    let mut oldest: Option<Duration> = None;
    for filter in [subjects.request(pool), subjects.caller_requests(pool)] {
        let waited = stream
            .raw_message_builder()
            .next_by_subject(filter)
            .sequence(work.delivered.stream_sequence + 1)
            .send()
            .await
            .ok()
            .map(|message| {
                SystemTime::now()
                    .duration_since(SystemTime::from(message.time))
                    .unwrap_or_default()
            });
        oldest = oldest.max(waited);
    }
    let pauses = runtime
        .pauses
        .iter()
        .map(|p| Paused::new(&p.cause, p.until, &p.reason))
        .collect();
    Ok(PoolState {
        pool: pool.to_string(),
        pauses,
        breaker: runtime.breaker,
        adaptive_limit: runtime.adaptive_limit,
        max_in_flight: work.config.max_ack_pending,
        waiting: work.num_pending,
        in_flight: work.num_ack_pending,
        parked,
        oldest_waiting_ms: oldest.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
    })
}

/// `pools`' columns, one row a pool.
const POOL_COLUMNS: [Column; 6] = [
    ("POOL", Align::Left),
    ("MAX_IN_FLIGHT", Align::Right),
    ("WAITING", Align::Right),
    ("IN_FLIGHT", Align::Right),
    ("PARKED", Align::Right),
    ("OLDEST_WAITING", Align::Right),
];

/// The table of the live instances under the pools' (from their heartbeats).
const INSTANCE_COLUMNS: [Column; 4] = [
    ("INSTANCE", Align::Left),
    ("REVISION", Align::Right),
    ("VERSION", Align::Left),
    ("REPORTED", Align::Left),
];

/// One pool as a row of `pools`' table; the oldest wait in human units (`-` when none
/// waits).
fn pool_row(state: &PoolState) -> [String; 6] {
    let oldest = state.oldest_waiting_ms.map_or("-".to_string(), |ms| {
        humantime::format_duration(Duration::from_millis(ms)).to_string()
    });
    [
        state.pool.clone(),
        state.max_in_flight.to_string(),
        state.waiting.to_string(),
        state.in_flight.to_string(),
        state.parked.to_string(),
        oldest,
    ]
}

/// `pools`: a table of the pools (or one JSON array of them), then their pauses,
/// breakers and adaptive limits, the live instances, and who writes the consumers.
pub(crate) async fn list(args: &NatsArgs, json: bool) -> anyhow::Result<()> {
    let client = connect(args).await?;
    let js = client.jetstream().clone();
    let names = pool_names(&client, &js).await?;
    let mut states = Vec::new();
    // No pool, no service run yet: nothing to read pauses from.
    if !names.is_empty() {
        let pauses = PoolPauses::new(js.clone(), client.subjects().clone());
        for pool in names {
            states.push(pool_state(&client, &js, &pauses, &pool).await?);
        }
    }
    if json {
        outln!("{}", serde_json::to_string_pretty(&states)?)?;
        return Ok(());
    }
    let rows: Vec<[String; 6]> = states.iter().map(pool_row).collect();
    out!("{}", table::render(POOL_COLUMNS, &rows))?;
    for s in &states {
        for pause in &s.pauses {
            outln!(
                "{} paused until {} ({}: {})",
                s.pool,
                pause.until,
                pause.cause,
                pause.reason
            )?;
        }
        match s.breaker {
            "open" => outln!(
                "{} breaker open: one probe attempt when its pause ends",
                s.pool
            )?,
            "half_open" => outln!(
                "{} breaker half-open: one probe attempt at a time (max_in_flight 1)",
                s.pool
            )?,
            _ => {}
        }
        if let Some(limit) = s.adaptive_limit {
            outln!("{} adaptive limit {limit}", s.pool)?;
        }
    }
    let instances = serve_follow::reports(&js, client.subjects()).await?;
    if !instances.is_empty() {
        outln!()?;
        let rows: Vec<[String; 4]> = instances
            .iter()
            .map(|i| {
                [
                    i.instance.clone(),
                    i.revision.to_string(),
                    i.version.clone(),
                    i.time.clone(),
                ]
            })
            .collect();
        out!("{}", table::render(INSTANCE_COLUMNS, &rows))?;
    }
    if let Some(owner) = ConfigStore::pool_consumers_owner(&js, client.subjects()).await? {
        outln!()?;
        outln!("{owner} writes the pool consumers' settings (it holds their lease)")?;
    }
    Ok(())
}

/// One pause in force, as `pools` shows it.
#[derive(Debug, Serialize)]
struct Paused {
    cause: String,
    /// RFC 3339, or "resumed by hand" for a pause by hand with no end.
    until: String,
    reason: String,
}

/// How long a pause by hand without `--for` lasts: until resumed, in practice, and
/// within what the server's timers hold.
const UNTIL_RESUMED: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

impl Paused {
    fn new(cause: &str, until: OffsetDateTime, reason: &str) -> Paused {
        let open_ended = until - OffsetDateTime::now_utc()
            > time::Duration::seconds(UNTIL_RESUMED.as_secs() as i64 / 2);
        Paused {
            cause: cause.to_string(),
            until: if open_ended {
                "resumed by hand".into()
            } else {
                until.format(&Rfc3339).unwrap_or_default()
            },
            reason: reason.to_string(),
        }
    }
}

/// `pools pause`: a pause by hand of an existing pool, for `duration` or until resumed.
pub(crate) async fn pause(
    args: &NatsArgs,
    pool: &str,
    duration: Option<Duration>,
    reason: Option<String>,
) -> anyhow::Result<()> {
    let client = connect(args).await?;
    let pauses = existing_pool(&client, pool).await?;
    let until = OffsetDateTime::now_utc() + duration.unwrap_or(UNTIL_RESUMED);
    let reason = reason.unwrap_or_else(|| "paused by hand".into());
    pauses.pause_pool(pool, until, reason).await?;
    let shown = Paused::new("manual", until, "");
    outln!(
        "pool {pool} paused until {}; requests wait in its stream",
        shown.until
    )?;
    Ok(())
}

/// `pools resume`: ends the pause by hand; says which pauses are still in force.
pub(crate) async fn resume(args: &NatsArgs, pool: &str) -> anyhow::Result<()> {
    let client = connect(args).await?;
    let pauses = existing_pool(&client, pool).await?;
    let left = pauses.resume_pool(pool).await?;
    if left.is_empty() {
        outln!("pool {pool} resumed")?;
    }
    for pause in &left {
        let shown = Paused::new(&pause.cause, pause.until, &pause.reason);
        outln!(
            "pool {pool} is still paused until {} ({}: {})",
            shown.until,
            shown.cause,
            shown.reason
        )?;
    }
    Ok(())
}

/// The pools' pauses, once `pool`'s stream is known to exist.
async fn existing_pool(client: &Client, pool: &str) -> anyhow::Result<PoolPauses> {
    let js = client.jetstream().clone();
    pool_stream(&js, client.subjects(), pool).await?;
    Ok(PoolPauses::new(js, client.subjects().clone()))
}

/// `pool`'s stream, read from the server (an info request: a stream handle made
/// without one would "exist" for any name), or an error naming the pool and the
/// command that lists the pools when there is no such stream.
async fn pool_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
    pool: &str,
) -> anyhow::Result<stream::Stream> {
    let stream_name = subjects.pool_stream(pool);
    match js.get_stream(&stream_name).await {
        Ok(stream) => Ok(stream),
        Err(e) if is_stream_not_found(&e.kind()) => {
            bail!(
                "no pool {pool}: its stream {stream_name} does not exist; `webproxy pools` lists the pools"
            )
        }
        Err(e) => {
            Err(e).with_context(|| format!("cannot read stream {stream_name} of pool {pool}"))
        }
    }
}

/// `pools remove`: refused for a pool that does not exist, that the running
/// configuration still has (unless `force`), or that holds messages (unless
/// `dead_letter`).
pub(crate) async fn remove(
    args: &NatsArgs,
    pool: &str,
    dead_letter: bool,
    force: bool,
) -> anyhow::Result<()> {
    if pool == "default" {
        bail!("pool default always exists and cannot be removed");
    }
    let (client, settings) = connect_with_settings(args).await?;
    let js = client.jetstream().clone();
    let subjects = settings.dispatcher.subjects.clone();
    let stream_name = subjects.pool_stream(pool);
    let mut stream = pool_stream(&js, &subjects, pool).await?;
    let routing = still_routed(&js, &subjects, pool).await?;
    if !routing.is_empty() && !force {
        bail!(
            "refused: pool {pool} is still in the running configuration ({}), whose instances would serve it without a stream; take [pools.{pool}] and the request rules naming it out of the configuration first (`webproxy config push` in kv mode; in file mode, the file of every instance, restarted), then remove it, or pass --force to remove it anyway. Instances in file mode older than this check do not report their pools",
            routing.join("; ")
        );
    }
    let waiting = stream
        .info()
        .await
        .context("cannot read the pool's stream")?
        .state
        .messages;
    if waiting > 0 && !dead_letter {
        bail!(
            "pool {pool} still holds {waiting} messages (waiting, in flight or parked); remove it from every instance's config and let it drain, or pass --dead-letter to dead-letter them"
        );
    }
    // Marked first, so that no instance recreates the consumers deleted next (an
    // instance recreates its pool consumer only on a stream not so marked).
    mark_removing(&js, &mut stream).await?;
    // The pool's own consumers go next, so no instance takes more work from it; a
    // work-queue stream also allows only one consumer per subject. Layout 1's, too,
    // for a pool that was never migrated.
    for name in [
        subjects.pool_consumer(pool),
        subjects.retry_consumer(pool),
        subjects.layout2_pool_consumer(pool),
        subjects.layout2_retry_consumer(pool),
        subjects.layout1_pool_consumer(pool),
        subjects.layout1_retry_consumer(pool),
    ] {
        match stream.delete_consumer(&name).await {
            Ok(_) => {}
            Err(e) if consumer_not_found(&e) => {}
            Err(e) => eprintln!("warning: cannot delete consumer {name}: {e}"),
        }
    }
    if waiting > 0 {
        let ended = dead_letter_all(&client, &subjects, &stream, pool).await?;
        outln!("dead-lettered {ended} messages of pool {pool}")?;
    }
    js.delete_stream(&stream_name)
        .await
        .with_context(|| format!("cannot delete stream {stream_name}"))?;
    // The fence outlives nothing it guards.
    let fence = subjects.pool_fence_stream(pool);
    if let Err(e) = js.delete_stream(&fence).await
        && !matches!(
            e.kind(),
            jetstream::context::DeleteStreamErrorKind::JetStream(ref js)
                if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
        )
    {
        eprintln!("warning: cannot delete fence stream {fence}: {e}");
    }
    outln!("removed pool {pool}")?;
    Ok(())
}

/// Where the running cluster configuration still has `pool`: the current document
/// of the configuration bucket (what every instance in kv mode runs, or will), and
/// the live instances whose heartbeat lists it (in either mode). Empty when nothing
/// routes to it, as far as can be known: an instance in file mode older than the
/// heartbeat's `pools` does not say.
async fn still_routed(
    js: &jetstream::Context,
    subjects: &Subjects,
    pool: &str,
) -> anyhow::Result<Vec<String>> {
    let mut routing = Vec::new();
    if let Some(store) = ConfigStore::open(js, subjects).await?
        && let Some(current) = store.current().await?
    {
        match document::parse(&current.document) {
            Ok(document) if document.pools.keys().any(|p| p.eq_ignore_ascii_case(pool)) => {
                routing.push(format!(
                    "revision {} of {} has [pools.{pool}]",
                    current.revision,
                    store.bucket()
                ));
            }
            Ok(_) => {}
            // The instances keep their last good revision: the heartbeats still say.
            Err(e) => eprintln!(
                "warning: cannot read revision {} of {}: {e:#}",
                current.revision,
                store.bucket()
            ),
        }
    }
    let instances: Vec<String> = serve_follow::reports(js, subjects)
        .await?
        .into_iter()
        .filter(|r| {
            r.pools
                .as_ref()
                .is_some_and(|pools| pools.iter().any(|p| p.eq_ignore_ascii_case(pool)))
        })
        .map(|r| r.instance)
        .collect();
    if !instances.is_empty() {
        routing.push(format!(
            "live instances running it: {}",
            instances.join(", ")
        ));
    }
    Ok(routing)
}

fn consumer_not_found(e: &stream::ConsumerError) -> bool {
    matches!(
        e.kind(),
        stream::ConsumerErrorKind::JetStream(ref js)
            if js.error_code() == jetstream::ErrorCode::CONSUMER_NOT_FOUND
    )
}

/// Ends every message left in a pool with an `internal` error: the caller is answered
/// and the request is dead-lettered, so it can be replayed into another pool.
async fn dead_letter_all(
    client: &Client,
    subjects: &Subjects,
    stream: &stream::Stream,
    pool: &str,
) -> anyhow::Result<u64> {
    let operator = operator(client, subjects).await?;
    let reader: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            ack_policy: consumer::AckPolicy::Explicit,
            inactive_threshold: Duration::from_secs(60),
            ..Default::default()
        })
        .await
        .context("cannot read the pool's messages")?;
    let max_payload = client.nats().server_info().max_payload;
    for_each_message(&reader, max_payload, async |message| {
        let error = ErrorBody {
            code: ErrorCode::Internal,
            message: format!("pool {pool} was removed before this request was attempted"),
            status: None,
        };
        match operator.end_unattempted(pool, &message, error).await {
            Settled::Done => Ok(ControlFlow::Continue(())),
            Settled::AwaitingRedelivery => {
                bail!("could not store the ending of a waiting request; the pool is left as it is")
            }
        }
    })
    .await
}
