//! Creates or updates the streams and consumers of the pools in this instance's config,
//! idempotently, and touches no other pool: in a rolling deploy an old instance must not
//! take away a new pool.
//!
//! Streams and consumers carry the layout they were made for in their metadata
//! ([`LAYOUT_KEY`]). An instance migrates an older layout, refuses (and leaves alone)
//! a newer one, and fences instances of older layouts out: new consumer names, the old
//! consumers deleted, fence streams that capture a subject layout 1 lists, and, against
//! layout 2, per-pool replies and dead-letter streams whose subjects overlap what
//! layout 2's shared streams list, so that an old instance's rewrite of a stream fails
//! (see ARCHITECTURE.md's invariants).

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use thiserror::Error;
use tracing::{error, info, warn};
use webproxy_config::settings::{PoolConfig, Settings};

use crate::pool_state::PoolState;
use crate::state::{Bucket, StateBucket};
use time::OffsetDateTime;

/// Provisioning failed; the message names the stream or consumer.
#[derive(Debug, Error)]
#[error("cannot provision {what}: {source}")]
pub(crate) struct ProvisionError {
    pub(crate) what: String,
    #[source]
    pub(crate) source: async_nats::Error,
}

impl ProvisionError {
    /// Why provisioning declined to touch the stream, when it did: retrying is then
    /// pointless until an operator (or a newer instance) changes the stream.
    pub(crate) fn refusal(&self) -> Option<&LayoutRefusal> {
        self.source.downcast_ref()
    }
}

/// The layout of streams and consumers this instance makes: `3` has per-conversation
/// hop and retry subjects, stored replies per conversation, a replies stream and a
/// dead-letter stream per pool (`<POOL STREAM>_REPLIES`, `<POOL STREAM>_DEAD`, each with
/// its own byte budget) and the consumers `<prefix>-<pool>-l3` and
/// `<prefix>-<pool>-retry-l3`. Layout 2 had the same subjects but one replies stream
/// and one dead-letter stream shared by every pool (and consumers named `-l2`); layout
/// 1 (webproxy before the conversation core) had one retry subject per pool and stored
/// every reply.
pub(crate) const LAYOUT: u32 = 3;

/// The metadata key holding a stream's or consumer's layout; absent means layout 1.
pub(crate) const LAYOUT_KEY: &str = "webproxy.layout";

/// The metadata key `webproxy pools remove` sets to `"true"` before it deletes a pool,
/// so that no instance recreates what it is taking away.
pub(crate) const REMOVING_KEY: &str = "removing";

/// The layout recorded in `metadata`: absent is layout 1, the one before layouts were
/// recorded; `None` when the value is no layout number.
pub(crate) fn layout(metadata: &HashMap<String, String>) -> Option<u32> {
    match metadata.get(LAYOUT_KEY) {
        None => Some(1),
        Some(value) => value.trim().parse().ok(),
    }
}

/// Whether `webproxy pools remove` has marked the stream for removal.
pub(crate) fn marked_removing(metadata: &HashMap<String, String>) -> bool {
    metadata.get(REMOVING_KEY).is_some_and(|v| v == "true")
}

/// A stream that `pools remove` could not mark for removal.
#[derive(Debug, Error)]
pub enum RemovalError {
    #[error("cannot read the pool's stream")]
    Read(#[source] async_nats::Error),
    #[error("cannot mark stream {stream} for removal")]
    Update {
        stream: String,
        #[source]
        source: async_nats::Error,
    },
    #[error("stream {0} did not keep its removal mark")]
    NotKept(String),
}

/// Marks `stream` for removal ([`REMOVING_KEY`]), keeping the rest of its config, so
/// that no instance provisions it or recreates its consumers while `pools remove`
/// takes it away.
pub async fn mark_removing(
    js: &jetstream::Context,
    stream: &mut stream::Stream,
) -> Result<(), RemovalError> {
    let mut config = stream
        .info()
        .await
        .map_err(|e| RemovalError::Read(e.into()))?
        .config
        .clone();
    let name = config.name.clone();
    config
        .metadata
        .insert(REMOVING_KEY.to_string(), "true".to_string());
    let updated = js
        .update_stream(config)
        .await
        .map_err(|e| RemovalError::Update {
            stream: name.clone(),
            source: e.into(),
        })?;
    if !marked_removing(&updated.config.metadata) {
        return Err(RemovalError::NotKept(name));
    }
    Ok(())
}

/// `existing` metadata with this instance's layout recorded; every other key (the
/// server's own `_nats.*`, an operator's) is kept.
pub(crate) fn with_layout(existing: &HashMap<String, String>) -> HashMap<String, String> {
    let mut metadata = existing.clone();
    metadata.insert(LAYOUT_KEY.to_string(), LAYOUT.to_string());
    metadata
}

/// Why an instance leaves a stream alone.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub(crate) enum LayoutRefusal {
    /// A newer webproxy made it (or its layout cannot be read): migrating it back
    /// would break that version's instances.
    #[error(
        "its layout {found:?} is newer than this instance's layout {own}; leaving it alone and staying not ready (roll forward, or see docs/operations.md to roll back)"
    )]
    NewerLayout { found: String, own: u32 },
    /// An older layout, which only provisioning migrates.
    #[error("its layout {found} is older than this instance's layout {own}; a restart migrates it")]
    OlderLayout { found: u32, own: u32 },
    /// `webproxy pools remove` is taking the pool away.
    #[error(
        "it is marked for removal by `webproxy pools remove`; run that command again to finish"
    )]
    Removing,
    /// The stream does not exist.
    #[error("it does not exist")]
    Missing,
}

impl LayoutRefusal {
    /// The stream is gone or going: `pools remove` took the pool away.
    pub(crate) fn is_removal(&self) -> bool {
        matches!(self, LayoutRefusal::Removing | LayoutRefusal::Missing)
    }
}

/// What provisioning does with an existing stream, given its metadata (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Examined {
    /// This instance's layout: update it in place.
    Current,
    /// An older layout: fence its instances out, then update it.
    Migrate { from: u32 },
    /// Leave it alone.
    Refuse(LayoutRefusal),
}

/// Decides what to do with an existing stream from its metadata (pure).
pub(crate) fn examine(metadata: &HashMap<String, String>) -> Examined {
    if marked_removing(metadata) {
        return Examined::Refuse(LayoutRefusal::Removing);
    }
    match layout(metadata) {
        Some(found) if found == LAYOUT => Examined::Current,
        Some(found) if found < LAYOUT => Examined::Migrate { from: found },
        _ => Examined::Refuse(LayoutRefusal::NewerLayout {
            found: metadata.get(LAYOUT_KEY).cloned().unwrap_or_default(),
            own: LAYOUT,
        }),
    }
}

fn refused(what: String, refusal: LayoutRefusal) -> ProvisionError {
    ProvisionError {
        what,
        source: Box::new(refusal),
    }
}

fn provision_error(
    what: impl Into<String>,
    source: impl Into<async_nats::Error>,
) -> ProvisionError {
    ProvisionError {
        what: what.into(),
        source: source.into(),
    }
}

/// The oldest server webproxy runs against: it needs multi-filter consumers, create
/// actions and TERM with a reason (2.10), and consumer pause (2.11), which the pool
/// consumers' owner keeps across updates.
pub(crate) const MIN_SERVER_VERSION: (u64, u64) = (2, 11);

/// Whether a server version string (`"2.11.4"`, `"v2.15.1"`) is new enough.
pub(crate) fn server_version_supported(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|p| p.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= MIN_SERVER_VERSION,
        _ => false,
    }
}

/// The work stream of one pool, as a work queue: the callers' request subject, and the
/// service's own per-conversation hop and retry subjects.
pub(crate) fn pool_stream_config(
    settings: &Settings,
    pool: &str,
    config: &PoolConfig,
) -> stream::Config {
    let subjects = &settings.subjects;
    let max_waiting = config
        .max_waiting
        .map_or(-1, |m| i64::try_from(m).unwrap_or(i64::MAX));
    stream::Config {
        name: subjects.pool_stream(pool),
        description: Some(format!(
            "webproxy pool {pool}: requests, hops and parked retries"
        )),
        subjects: vec![
            subjects.request(pool),
            subjects.caller_requests(pool),
            subjects.hop_filter(pool),
            subjects.retry_filter(pool),
        ],
        duplicate_window: settings.streams.duplicate_window,
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        num_replicas: settings.streams.replicas,
        max_messages_per_subject: max_waiting,
        // Per-subject discard-new rejects a publish into a full queue at once, so
        // callers feel back-pressure. Hop and retry subjects hold one message each, so
        // the limit binds only the request subjects, each caller's its own, and no
        // handler waits for room.
        discard: stream::DiscardPolicy::New,
        discard_new_per_subject: config.max_waiting.is_some(),
        ..Default::default()
    }
}

/// What provisioning writes to the server for one pool, from the configuration: a
/// revision that changes any of it has the pool's stream updated by every instance
/// ([`update_pool_stream`]: `max_waiting`), its consumers by their owner
/// (`runtime::owner`: `max_in_flight`, `ack_wait`), and the local permits resized to
/// `max_in_flight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolSpec {
    pub(crate) max_in_flight: u64,
    pub(crate) max_waiting: Option<u64>,
    pub(crate) ack_wait: Duration,
}

impl PoolSpec {
    pub(crate) fn of(settings: &Settings, config: &PoolConfig) -> PoolSpec {
        PoolSpec {
            max_in_flight: config.max_in_flight,
            max_waiting: config.max_waiting,
            ack_wait: settings.cluster.ack_wait,
        }
    }

    /// The limits that differ from `from`, each with its old value, for the log line
    /// that says a revision's limits are applied: `max_waiting 1 (was unlimited)`.
    pub(crate) fn changes_from(&self, from: &PoolSpec) -> String {
        let waiting = |limit: Option<u64>| limit.map_or("unlimited".to_owned(), |n| n.to_string());
        let wait = |d: Duration| humantime::format_duration(d).to_string();
        let mut changes = Vec::new();
        if self.max_in_flight != from.max_in_flight {
            changes.push(format!(
                "max_in_flight {} (was {})",
                self.max_in_flight, from.max_in_flight
            ));
        }
        if self.max_waiting != from.max_waiting {
            changes.push(format!(
                "max_waiting {} (was {})",
                waiting(self.max_waiting),
                waiting(from.max_waiting)
            ));
        }
        if self.ack_wait != from.ack_wait {
            changes.push(format!(
                "ack_wait {} (was {})",
                wait(self.ack_wait),
                wait(from.ack_wait)
            ));
        }
        changes.join(", ")
    }
}

/// Writes `pool`'s stream settings from the configuration onto its stream (its
/// `max_waiting`, the request subjects' per-subject limit): provisioning a pool runs
/// only when the pool is new, so a revision that changes them needs this. Idempotent;
/// every instance that runs the revision writes the same settings.
pub(crate) async fn update_pool_stream(
    js: &jetstream::Context,
    settings: &Settings,
    pool: &str,
    config: &PoolConfig,
) -> Result<(), ProvisionError> {
    let plan = StreamPlan {
        config: pool_stream_config(settings, pool, config),
        fresh_first_sequence: true,
        old_consumers: Vec::new(),
        fence: None,
    };
    provision_stream(js, plan).await.map(|_| ())
}

/// The durable pull consumer of one pool's request subject: the configured limits with
/// the pool's runtime `state` on top. Every write of its settings (creation, and the
/// owner's updates) is computed here, so none can undo that state.
pub(crate) fn pool_consumer_config(
    settings: &Settings,
    pool: &str,
    config: &PoolConfig,
    state: &PoolState,
) -> consumer::pull::Config {
    let subjects = &settings.subjects;
    consumer::pull::Config {
        durable_name: Some(subjects.pool_consumer(pool)),
        description: Some(format!("webproxy pool {pool}: the concurrency limit")),
        filter_subjects: vec![
            subjects.request(pool),
            subjects.caller_requests(pool),
            subjects.hop_filter(pool),
        ],
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: settings.cluster.ack_wait,
        max_ack_pending: i64::try_from(state.max_ack_pending(config)).unwrap_or(i64::MAX),
        // Unlimited: poison messages are counted and ended by the dispatcher itself.
        max_deliver: -1,
        metadata: with_layout(&HashMap::new()),
        ..Default::default()
    }
}

/// A write that brings a pool's work consumer in line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ConsumerWrite {
    /// Its settings differ from the wanted ones: an update, which leaves out
    /// `pause_until`, so a pause made through the JetStream API stays.
    Update,
    /// The state holds a pause in force that the consumer lacks, or that ends at
    /// another time: through the pause API.
    Pause(OffsetDateTime),
}

/// How a log line names the write: `update`, or `pause until <RFC 3339>`.
impl std::fmt::Display for ConsumerWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConsumerWrite::Update => f.write_str("update"),
            ConsumerWrite::Pause(until) => {
                let until = until
                    .format(&time::format_description::well_known::Rfc3339)
                    .map_err(|_| std::fmt::Error)?;
                write!(f, "pause until {until}")
            }
        }
    }
}

impl ConsumerWrite {
    /// Its label in `webproxy_pool_consumer_writes_total`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            ConsumerWrite::Update => "update",
            ConsumerWrite::Pause(_) => "pause",
        }
    }
}

/// How far apart two ends of a pause may be and count as the same: the server keeps
/// what it is sent, but RFC 3339 round trips may drop sub-second digits.
const PAUSE_TOLERANCE: time::Duration = time::Duration::seconds(1);

/// What to write so that the consumer whose server-side settings are `current` has
/// the `wanted` ones and the state's pause in force, `paused_until`; nothing when it
/// has them already, so the server sees an update only for a change.
pub(crate) fn consumer_writes(
    current: &consumer::Config,
    wanted: &consumer::pull::Config,
    paused_until: Option<OffsetDateTime>,
) -> Vec<ConsumerWrite> {
    let mut writes = Vec::new();
    let differs = current.max_ack_pending != wanted.max_ack_pending
        || current.ack_wait != wanted.ack_wait
        || current.max_deliver != wanted.max_deliver
        || current.filter_subjects != wanted.filter_subjects
        || current.description != wanted.description
        || layout(&current.metadata) != layout(&wanted.metadata);
    if differs {
        writes.push(ConsumerWrite::Update);
    }
    if let Some(until) = paused_until {
        let paused_then = current
            .pause_until
            .is_some_and(|current| (current - until).abs() < PAUSE_TOLERANCE);
        if !paused_then {
            writes.push(ConsumerWrite::Pause(until));
        }
    }
    writes
}

/// The most parked retries a pool holds at once; a parked retry waiting out its delay
/// holds one of these, never a slot of the pool's concurrency limit.
pub(crate) const MAX_PARKED: i64 = 100_000;

/// The durable pull consumer of one pool's retry subject.
pub(crate) fn retry_consumer_config(settings: &Settings, pool: &str) -> consumer::pull::Config {
    let subjects = &settings.subjects;
    consumer::pull::Config {
        durable_name: Some(subjects.retry_consumer(pool)),
        description: Some(format!("webproxy pool {pool}: parked retries")),
        filter_subject: subjects.retry_filter(pool),
        ack_policy: consumer::AckPolicy::Explicit,
        // Handling a parked retry is a NAK or a republish: quick, so a short wait is
        // enough and a crashed instance's retries come back soon.
        ack_wait: Duration::from_secs(30),
        max_ack_pending: MAX_PARKED,
        max_deliver: -1,
        metadata: with_layout(&HashMap::new()),
        ..Default::default()
    }
}

/// A pool's two consumers.
pub(crate) struct PoolConsumers {
    pub(crate) pool: String,
    /// The request subject: `max_ack_pending` is the concurrency limit.
    pub(crate) work: consumer::PullConsumer,
    /// The retry subject: parked retries waiting to be due.
    pub(crate) parked: consumer::PullConsumer,
}

fn limits_stream(
    name: String,
    subjects: Vec<String>,
    description: &str,
    max_age: Duration,
    max_bytes: i64,
    replicas: usize,
) -> stream::Config {
    stream::Config {
        name,
        description: Some(description.to_string()),
        subjects,
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        num_replicas: replicas,
        max_age,
        max_bytes,
        discard: stream::DiscardPolicy::Old,
        ..Default::default()
    }
}

/// The stream that stores the final replies of the conversations that started in
/// `pool`'s stream: one subject per conversation, never the live copies on
/// `<prefix>.reply.<id>`. `reply_max_bytes` is its own budget, so a flood through
/// another pool cannot evict these replies.
pub(crate) fn pool_replies_stream_config(settings: &Settings, pool: &str) -> stream::Config {
    let streams = &settings.streams;
    let subjects = &settings.subjects;
    let pool_stream = subjects.pool_stream(pool);
    limits_stream(
        subjects.pool_replies_stream(&pool_stream),
        vec![subjects.pool_replies_filter(&pool_stream)],
        &format!("webproxy pool {pool}: final replies, one per conversation"),
        streams.reply_max_age,
        streams.reply_max_bytes,
        streams.replicas,
    )
}

/// The stream that stores `pool`'s dead letters and the marks of superseded ones,
/// with its own `dead_max_bytes`.
pub(crate) fn pool_dead_stream_config(settings: &Settings, pool: &str) -> stream::Config {
    let streams = &settings.streams;
    let subjects = &settings.subjects;
    limits_stream(
        subjects.pool_dead_stream(pool),
        vec![subjects.dead(pool), subjects.dead_superseded(pool)],
        &format!("webproxy pool {pool}: dead letters, conversations that ended in an error"),
        streams.dead_max_age,
        streams.dead_max_bytes,
        streams.replicas,
    )
}

/// The bucket of the pools' runtime state ([`PoolState`], one key per pool): kept
/// until changed, with the streams' replicas, a few revisions for whoever looks into
/// why a pool paused.
pub(crate) fn pool_state_bucket_config(settings: &Settings) -> kv::Config {
    Bucket::PoolState
        .spec(&settings.subjects, &settings.streams)
        .kv_config()
}

/// `pool`'s runtime state in `store`, and the revision it was read at (none when the
/// key was never written): the one reader of a stored state. A deleted key is no state.
pub(crate) async fn stored_pool_state(
    store: &kv::Store,
    pool: &str,
) -> Result<(PoolState, Option<u64>), String> {
    match store.entry(pool).await.map_err(|e| e.to_string())? {
        Some(entry) if entry.operation == kv::Operation::Put => Ok((
            PoolState::from_json(&entry.value).map_err(|e| e.to_string())?,
            Some(entry.revision),
        )),
        Some(entry) => Ok((PoolState::default(), Some(entry.revision))),
        None => Ok((PoolState::default(), None)),
    }
}

/// `pool`'s runtime state as stored now, for creating its consumer: none when the
/// bucket or the key is missing. A value that cannot be read is logged and taken as
/// none (as every instance's watch takes it), so a consumer is still created.
pub(crate) async fn read_pool_state(
    js: &jetstream::Context,
    settings: &Settings,
    pool: &str,
) -> PoolState {
    let bucket = settings.subjects.pool_state_bucket();
    let Ok(store) = js.get_key_value(&bucket).await else {
        return PoolState::default();
    };
    stored_pool_state(&store, pool)
        .await
        .map(|(state, _)| state)
        .unwrap_or_else(|e| {
            warn!(pool, bucket, error = %e, "cannot read the pool's runtime state; taken as none");
            PoolState::default()
        })
}

/// A fence: a tiny stream that captures `subject`, a subject an instance of layout 1
/// lists in one of its streams and layout 2 never uses. Two streams' subjects may not
/// overlap, so that instance's rewrite of its stream fails (err_code 10065) instead of
/// undoing the migration. It keeps at most one message (an old instance's last stray
/// publish, which nothing reads), on file: a memory fence is gone after a restart of
/// the server, and with it the fence, until a pod of this layout starts again.
pub(crate) fn fence_config(name: String, subject: String) -> stream::Config {
    stream::Config {
        name,
        description: Some(
            "webproxy fence: keeps instances of an older layout from rewriting a stream"
                .to_string(),
        ),
        subjects: vec![subject],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        max_messages: 1,
        discard: stream::DiscardPolicy::Old,
        metadata: with_layout(&HashMap::new()),
        ..Default::default()
    }
}

/// The fence of a pool stream: it captures layout 1's `<prefix>.retry.<pool>`.
pub(crate) fn pool_fence_config(settings: &Settings, pool: &str) -> stream::Config {
    let subjects = &settings.subjects;
    fence_config(
        subjects.pool_fence_stream(pool),
        subjects.layout1_retry(pool),
    )
}

/// The fence of the replies stream: it captures `<prefix>.reply.*.*`, which layout 1's
/// `<prefix>.reply.>` overlaps.
pub(crate) fn replies_fence_config(settings: &Settings) -> stream::Config {
    let subjects = &settings.subjects;
    fence_config(
        subjects.replies_fence_stream(),
        subjects.replies_fence_subject(),
    )
}

/// A first sequence no earlier incarnation of a pool stream can have used: the current
/// Unix time in microseconds, so origins never repeat across a `pools remove` and a
/// re-add. ([`crate::clock::now`]: at start, before any skew is measured, this pod's.)
fn fresh_first_sequence() -> u64 {
    crate::clock::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The stream `name`, with its info, or `None` when it does not exist.
async fn existing_stream(
    js: &jetstream::Context,
    name: &str,
) -> Result<Option<(stream::Stream, stream::Info)>, ProvisionError> {
    let what = || format!("stream {name}");
    match js.get_stream(name).await {
        Ok(mut stream) => {
            let info = stream
                .info()
                .await
                .map_err(|e| provision_error(what(), e))?
                .clone();
            Ok(Some((stream, info)))
        }
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(provision_error(what(), e)),
    }
}

/// How a stream of this instance is made.
struct StreamPlan {
    config: stream::Config,
    /// A new stream starts at [`fresh_first_sequence`] (pool streams: origins).
    fresh_first_sequence: bool,
    /// Older layouts' consumers on it, deleted before it is migrated.
    old_consumers: Vec<String>,
    /// The fence created once it has this instance's layout, if it has one.
    fence: Option<stream::Config>,
}

/// Creates a stream with this instance's layout, or updates an existing one in place:
/// an older layout is migrated (its consumers deleted first, so that their instances
/// take nothing more), a newer one, or one marked for removal, is left alone with an
/// error. Then its fence is made. Returns the layout it had, `None` when it was created.
async fn provision_stream(
    js: &jetstream::Context,
    plan: StreamPlan,
) -> Result<Option<u32>, ProvisionError> {
    let StreamPlan {
        mut config,
        fresh_first_sequence: fresh,
        old_consumers,
        fence,
    } = plan;
    let name = config.name.clone();
    let what = || format!("stream {name}");
    let found = match existing_stream(js, &name).await? {
        Some((stream, info)) => {
            let found = match examine(&info.config.metadata) {
                Examined::Refuse(refusal) => {
                    error!(stream = %name, own_layout = LAYOUT, "not provisioning stream {name}: {refusal}");
                    return Err(refused(what(), refusal));
                }
                Examined::Migrate { from } => {
                    warn!(stream = %name, from, to = LAYOUT, "migrating stream {name} from layout {from} to layout {LAYOUT}; instances of layout {from} are fenced out from now on");
                    for consumer in &old_consumers {
                        delete_consumer(&stream, consumer).await?;
                    }
                    from
                }
                Examined::Current => LAYOUT,
            };
            config.metadata = with_layout(&info.config.metadata);
            config.first_sequence = info.config.first_sequence;
            js.update_stream(config)
                .await
                .map_err(|e| provision_error(what(), e))?;
            // Again, now that the stream records this layout, and on every start: an
            // instance of layout 2 recreates its work consumer when it finds it gone
            // (`recreate_pool_consumer`), and one that looked at the stream before
            // the update above saw its own layout and may have done so since the
            // deletion. From now on it refuses to. A consumer left that way would
            // overlap this layout's on the work queue (10100) for good.
            for consumer in &old_consumers {
                delete_consumer(&stream, consumer).await?;
            }
            Some(found)
        }
        None => {
            config.metadata = with_layout(&HashMap::new());
            if fresh {
                config.first_sequence = Some(fresh_first_sequence());
            }
            js.create_stream(config)
                .await
                .map_err(|e| provision_error(what(), e))?;
            None
        }
    };
    if let Some(fence) = fence {
        make_fence(js, fence).await?;
    }
    Ok(found)
}

/// What becomes of layout 2's shared replies or dead-letter stream (pure), given its
/// subjects and metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Retirement {
    /// Retired already (it captures only `retired`): nothing to do.
    Done,
    /// Take its subjects away: they become `retired`, and its layout this one's.
    Retire,
    /// A newer layout made it what it is, or it is being removed: leave it alone.
    Refuse(LayoutRefusal),
}

pub(crate) fn retirement(
    subjects: &[String],
    metadata: &HashMap<String, String>,
    retired: &str,
) -> Retirement {
    match examine(metadata) {
        Examined::Refuse(refusal) => Retirement::Refuse(refusal),
        _ if subjects.len() == 1 && subjects[0] == retired => Retirement::Done,
        _ => Retirement::Retire,
    }
}

/// Retires layout 2's shared stream `name` (the replies or the dead letters of every
/// pool): its subjects become `retired`, which nothing publishes on, so that each
/// pool's own stream may capture what it captured. What it stored stays, readable by
/// subject until its `max_age` ends it (readers look there when a pool's own stream
/// has nothing for a subject); its limits are kept. Its metadata records this layout,
/// so an instance of layout 2 that starts again refuses it as newer, and its rewrite
/// of the dead-letter stream (which it makes without looking at the layout) lists
/// subjects that now overlap the pools' streams and fails with err_code 10065: either
/// way it stays not ready. A missing stream is fine: a deployment that began at
/// layout 3 never had one.
async fn retire_shared_stream(
    js: &jetstream::Context,
    name: &str,
    retired: String,
) -> Result<(), ProvisionError> {
    let what = || format!("stream {name}");
    let Some((_, info)) = existing_stream(js, name).await? else {
        return Ok(());
    };
    let mut config = info.config;
    match retirement(&config.subjects, &config.metadata, &retired) {
        Retirement::Done => return Ok(()),
        Retirement::Refuse(refusal) => {
            error!(stream = %name, own_layout = LAYOUT, "not retiring stream {name}: {refusal}");
            return Err(refused(what(), refusal));
        }
        Retirement::Retire => {}
    }
    warn!(stream = %name, from = %config.subjects.join(", "), to = %retired, "retiring the shared stream {name}: each pool's own stream stores what it stored from now on; what it holds stays readable until it ages out, and instances of layout 2 are fenced out");
    config.subjects = vec![retired];
    config.metadata = with_layout(&config.metadata);
    js.update_stream(config)
        .await
        .map_err(|e| provision_error(what(), e))?;
    Ok(())
}

/// How a fence is brought to its config, given the storage of the one there (pure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FenceStep {
    /// None there, or one on the wanted storage: create it, or update it in place.
    CreateOrUpdate,
    /// One on other storage (a memory fence of an earlier release), which an update
    /// cannot change: delete it and create it again.
    Move,
}

pub(crate) fn fence_step(
    found: Option<stream::StorageType>,
    wanted: stream::StorageType,
) -> FenceStep {
    match found {
        Some(storage) if storage != wanted => FenceStep::Move,
        _ => FenceStep::CreateOrUpdate,
    }
}

/// A stream's storage as its configuration spells it.
fn storage_name(storage: stream::StorageType) -> &'static str {
    match storage {
        stream::StorageType::File => "file",
        stream::StorageType::Memory => "memory",
    }
}

/// Creates or updates a fence, moving one on other storage by deleting it and
/// creating it again. Deleting loses at most the one stray message of an old instance
/// it holds, which nothing reads. An old instance that rewrites its stream in the gap
/// adds the fence's subject to that stream, so the fence's creation then fails (10065),
/// provisioning fails and its retry migrates the stream again and makes the fence: the
/// gap cannot undo a migration for longer than that retry.
async fn make_fence(js: &jetstream::Context, fence: stream::Config) -> Result<(), ProvisionError> {
    let name = fence.name.clone();
    let what = || format!("fence stream {name}");
    let found = existing_stream(js, &name)
        .await?
        .map(|(_, info)| info.config.storage);
    if fence_step(found, fence.storage) == FenceStep::Move {
        warn!(stream = %name, from = found.map_or("none", storage_name), to = storage_name(fence.storage), "moving fence stream {name}: deleting it and creating it again");
        match js.delete_stream(&name).await {
            Ok(_) => {}
            // Another instance moved it first.
            Err(e) if crate::state::is_stream_not_found(&e.kind()) => {}
            Err(e) => return Err(provision_error(what(), e)),
        }
    }
    js.create_or_update_stream(fence)
        .await
        .map_err(|e| provision_error(what(), e))?;
    Ok(())
}

/// Deletes a consumer; one that is gone already is fine.
async fn delete_consumer(stream: &stream::Stream, name: &str) -> Result<(), ProvisionError> {
    match stream.delete_consumer(name).await {
        Ok(_) => {
            info!(consumer = name, "deleted a consumer of the older layout");
            Ok(())
        }
        Err(e) if consumer_missing(&e) => Ok(()),
        Err(e) => Err(provision_error(format!("consumer {name}"), e)),
    }
}

/// The consumer asked for does not exist.
pub(crate) fn consumer_missing(e: &stream::ConsumerError) -> bool {
    matches!(
        e.kind(),
        stream::ConsumerErrorKind::JetStream(ref js)
            if js.error_code() == jetstream::ErrorCode::CONSUMER_NOT_FOUND
    )
}

/// What provisioning made: the pools' consumers and the progress bucket.
pub(crate) struct Provisioned {
    pub(crate) pools: Vec<PoolConsumers>,
    pub(crate) progress: StateBucket,
}

/// Creates or updates every stream, bucket and consumer of this instance's config.
pub(crate) async fn provision(
    js: &jetstream::Context,
    settings: &Settings,
) -> Result<Provisioned, ProvisionError> {
    // Layout 2's shared streams first: their subjects overlap every pool's own
    // replies and dead-letter streams, which the server would refuse to create.
    let subjects = &settings.subjects;
    retire_shared_stream(
        js,
        &subjects.replies_stream(),
        subjects.retired_replies_subject(),
    )
    .await?;
    retire_shared_stream(js, &subjects.dead_stream(), subjects.retired_dead_subject()).await?;
    // At once: until a pool's own streams exist, what an instance of layout 2 still
    // running stores for that pool has no stream (it logs that and answers live only).
    for pool in settings.cluster.pools.keys() {
        provision_endings(js, settings, pool).await?;
    }
    make_fence(js, replies_fence_config(settings)).await?;
    let progress = StateBucket::new(
        js.clone(),
        Bucket::Progress.spec(&settings.subjects, &settings.streams),
    );
    progress
        .store()
        .await
        .map_err(|e| provision_error(format!("bucket {}", progress.spec().name), e))?;
    let bucket = pool_state_bucket_config(settings);
    let bucket_name = bucket.bucket.clone();
    js.create_or_update_key_value(bucket)
        .await
        .map_err(|e| provision_error(format!("bucket {bucket_name}"), e))?;
    let mut consumers = Vec::new();
    for (pool, pool_config) in &settings.cluster.pools {
        consumers.push(provision_pool(js, settings, pool, pool_config).await?);
    }
    Ok(Provisioned {
        pools: consumers,
        progress,
    })
}

/// Provisions one pool: its replies and dead-letter streams, its stream (migrated
/// from an older layout if need be), its fence and its two consumers. A work consumer that exists is bound as it is: its
/// settings are written only by their owner (`runtime::owner`), under a lease, from
/// the configured limits and the pool's runtime state; one that does not is created
/// from them.
pub(crate) async fn provision_pool(
    js: &jetstream::Context,
    settings: &Settings,
    pool: &str,
    pool_config: &PoolConfig,
) -> Result<PoolConsumers, ProvisionError> {
    let subjects = &settings.subjects;
    // Where the pool's conversations end go first, so that none ends before its
    // reply or letter can be stored (a pool added live has none yet).
    provision_endings(js, settings, pool).await?;
    let stream_config = pool_stream_config(settings, pool, pool_config);
    let stream_name = stream_config.name.clone();
    provision_stream(
        js,
        StreamPlan {
            config: stream_config,
            fresh_first_sequence: true,
            old_consumers: vec![
                subjects.layout1_pool_consumer(pool),
                subjects.layout1_retry_consumer(pool),
                subjects.layout2_pool_consumer(pool),
                subjects.layout2_retry_consumer(pool),
            ],
            fence: Some(pool_fence_config(settings, pool)),
        },
    )
    .await?;
    let name = subjects.pool_consumer(pool);
    let what = format!("consumer {name} on {stream_name}");
    let stream = js
        .get_stream_no_info(&stream_name)
        .await
        .map_err(|e| provision_error(what.clone(), e))?;
    let state = read_pool_state(js, settings, pool).await;
    let work: consumer::PullConsumer = stream
        .get_or_create_consumer(
            &name,
            pool_consumer_config(settings, pool, pool_config, &state),
        )
        .await
        .map_err(|e| provision_error(what, e))?;
    let retry = retry_consumer_config(settings, pool);
    let what = format!(
        "consumer {} on {stream_name}",
        retry.durable_name.as_deref().unwrap_or_default()
    );
    let parked: consumer::PullConsumer = stream
        .create_consumer(retry)
        .await
        .map_err(|e| provision_error(what, e))?;
    Ok(PoolConsumers {
        pool: pool.to_string(),
        work,
        parked,
    })
}

/// Creates or updates `pool`'s own replies and dead-letter streams.
async fn provision_endings(
    js: &jetstream::Context,
    settings: &Settings,
    pool: &str,
) -> Result<(), ProvisionError> {
    for config in [
        pool_replies_stream_config(settings, pool),
        pool_dead_stream_config(settings, pool),
    ] {
        provision_stream(
            js,
            StreamPlan {
                config,
                fresh_first_sequence: false,
                old_consumers: Vec::new(),
                fence: None,
            },
        )
        .await?;
    }
    Ok(())
}

/// What [`recreate_pool_consumer`] found.
pub(crate) enum Recreated {
    /// The consumer was there after all (it did not answer a pull, but the API found
    /// it): nothing was written.
    Found(consumer::PullConsumer),
    /// It was confirmed gone (10014) and made anew.
    Made(consumer::PullConsumer),
}

/// Recreates `pool`'s work consumer, exactly as provisioning makes it, and nothing
/// else: the pull loop calls it when a pull finds no consumer to answer it. It does so
/// only while the pool's stream exists, is not marked for removal and has this
/// instance's layout; otherwise the error (a [`LayoutRefusal`]) says why not.
///
/// A pull answered "no responders" says as little as a KV call does: the consumer is
/// gone, or it has no leader, or the JetStream API is down. So it is made only after
/// `CONSUMER.INFO` answers 10014, and made strictly (action create): a write of this
/// instance's settings over a consumer that exists would undo what the pools' owner
/// wrote there (a newer revision's limits, a lowered `ack_wait` no instance paces
/// from yet).
pub(crate) async fn recreate_pool_consumer(
    js: &jetstream::Context,
    settings: &Settings,
    pool: &str,
) -> Result<Recreated, ProvisionError> {
    let stream_name = settings.subjects.pool_stream(pool);
    let name = settings.subjects.pool_consumer(pool);
    let what = format!("consumer {name} on {stream_name}");
    let Some(pool_config) = settings.cluster.pools.get(pool) else {
        return Err(provision_error(
            what,
            format!("pool {pool} is not in this instance's config"),
        ));
    };
    let Some((stream, info)) = existing_stream(js, &stream_name).await? else {
        return Err(refused(what, LayoutRefusal::Missing));
    };
    match examine(&info.config.metadata) {
        Examined::Current => {}
        Examined::Migrate { from } => {
            return Err(refused(
                what,
                LayoutRefusal::OlderLayout {
                    found: from,
                    own: LAYOUT,
                },
            ));
        }
        Examined::Refuse(refusal) => return Err(refused(what, refusal)),
    }
    if let Some(found) = existing_consumer(&stream, &name)
        .await
        .map_err(|e| provision_error(what.clone(), e))?
    {
        return Ok(Recreated::Found(found));
    }
    let state = read_pool_state(js, settings, pool).await;
    match stream
        .create_consumer_strict(pool_consumer_config(settings, pool, pool_config, &state))
        .await
    {
        Ok(made) => Ok(Recreated::Made(made)),
        // Another instance made it first.
        Err(e) if e.kind() == stream::ConsumerCreateStrictErrorKind::AlreadyExists => stream
            .get_consumer(&name)
            .await
            .map(Recreated::Found)
            .map_err(|e| provision_error(what, e)),
        Err(e) => Err(provision_error(what, e)),
    }
}

/// The consumer `name` on `stream`, or `None` when the API answers that it does not
/// exist (10014); any other failure (a timeout, no responders) is an error.
async fn existing_consumer(
    stream: &stream::Stream,
    name: &str,
) -> Result<Option<consumer::PullConsumer>, async_nats::Error> {
    match stream.get_consumer(name).await {
        Ok(found) => Ok(Some(found)),
        Err(e)
            if e.downcast_ref::<jetstream::context::ConsumerInfoError>()
                .is_some_and(|e| {
                    e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound
                }) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use webproxy_config::testing::settings_from;

    use super::*;

    #[test]
    fn a_limit_change_names_each_limit_with_its_old_value() {
        let from = PoolSpec {
            max_in_flight: 2,
            max_waiting: None,
            ack_wait: Duration::from_secs(15),
        };
        let to = PoolSpec {
            max_waiting: Some(1),
            ack_wait: Duration::from_secs(90),
            ..from
        };
        assert_eq!(
            to.changes_from(&from),
            "max_waiting 1 (was unlimited), ack_wait 1m 30s (was 15s)"
        );
        assert_eq!(
            from.changes_from(&PoolSpec {
                max_in_flight: 3,
                ..from
            }),
            "max_in_flight 2 (was 3)"
        );
        assert_eq!(from.changes_from(&from), "");
    }

    #[test]
    fn fences_are_on_file_and_a_memory_fence_is_moved() {
        let settings = settings_from("").expect("the defaults");
        let file = stream::StorageType::File;
        let memory = stream::StorageType::Memory;
        for fence in [
            pool_fence_config(&settings, "default"),
            replies_fence_config(&settings),
        ] {
            assert_eq!(fence.storage, file, "{}", fence.name);
            assert_eq!(fence.max_messages, 1, "{}", fence.name);
        }
        assert_eq!(fence_step(None, file), FenceStep::CreateOrUpdate);
        assert_eq!(fence_step(Some(file), file), FenceStep::CreateOrUpdate);
        assert_eq!(fence_step(Some(memory), file), FenceStep::Move);
    }

    #[test]
    fn the_shared_streams_of_layout_2_are_retired_once() {
        let retired = "webproxy.retired.dead";
        let shared = vec!["webproxy.dead.>".to_string()];
        for layout in [&[][..], &[(LAYOUT_KEY, "2")][..]] {
            assert_eq!(
                retirement(&shared, &metadata(layout), retired),
                Retirement::Retire
            );
        }
        assert_eq!(
            retirement(
                &[retired.to_string()],
                &metadata(&[(LAYOUT_KEY, "3")]),
                retired
            ),
            Retirement::Done
        );
        // Marked layout 3 but still capturing (an update lost half-way): retired again.
        assert_eq!(
            retirement(&shared, &metadata(&[(LAYOUT_KEY, "3")]), retired),
            Retirement::Retire
        );
        assert!(matches!(
            retirement(&shared, &metadata(&[(LAYOUT_KEY, "4")]), retired),
            Retirement::Refuse(LayoutRefusal::NewerLayout { .. })
        ));
    }

    #[test]
    fn each_pool_has_its_own_replies_and_dead_letter_streams() {
        let settings =
            settings_from("[pools.a]\nmax_in_flight = 1\n[pools.b]\nmax_in_flight = 1\n")
                .expect("settings");
        let replies = pool_replies_stream_config(&settings, "a");
        assert_eq!(replies.name, "WEBPROXY_POOL_A_REPLIES");
        assert_eq!(replies.subjects, ["webproxy.reply.*.WEBPROXY_POOL_A.*"]);
        assert_eq!(replies.max_bytes, settings.streams.reply_max_bytes);
        assert_eq!(replies.max_age, settings.streams.reply_max_age);
        assert_eq!(replies.discard, stream::DiscardPolicy::Old);
        let dead = pool_dead_stream_config(&settings, "b");
        assert_eq!(dead.name, "WEBPROXY_POOL_B_DEAD");
        assert_eq!(
            dead.subjects,
            ["webproxy.dead.b", "webproxy.dead.b.superseded"]
        );
        assert_eq!(dead.max_bytes, settings.streams.dead_max_bytes);
        assert_eq!(dead.max_age, settings.streams.dead_max_age);
    }

    #[test]
    fn versions() {
        assert!(server_version_supported("2.11.0"));
        assert!(!server_version_supported("2.10.29"));
        assert!(server_version_supported("2.15.1"));
        assert!(server_version_supported("v3.0.0"));
        assert!(server_version_supported("2.11.0-beta.1"));
        assert!(!server_version_supported("2.9.10"));
        assert!(!server_version_supported("1.4.1"));
        assert!(!server_version_supported("garbage"));
    }

    fn metadata(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn layouts_are_read_from_metadata() {
        assert_eq!(layout(&metadata(&[])), Some(1), "absent is layout 1");
        assert_eq!(layout(&metadata(&[("_nats.ver", "2.15.1")])), Some(1));
        assert_eq!(layout(&metadata(&[(LAYOUT_KEY, "2")])), Some(2));
        assert_eq!(layout(&metadata(&[(LAYOUT_KEY, "17")])), Some(17));
        assert_eq!(layout(&metadata(&[(LAYOUT_KEY, "two")])), None);
        assert_eq!(layout(&metadata(&[(LAYOUT_KEY, "")])), None);
    }

    #[test]
    fn with_layout_keeps_every_other_key() {
        let before = metadata(&[("_nats.ver", "2.15.1"), (LAYOUT_KEY, "1"), ("team", "x")]);
        let after = with_layout(&before);
        assert_eq!(layout(&after), Some(LAYOUT));
        assert_eq!(after.get("_nats.ver").map(String::as_str), Some("2.15.1"));
        assert_eq!(after.get("team").map(String::as_str), Some("x"));
    }

    #[test]
    fn removal_marks() {
        assert!(marked_removing(&metadata(&[(REMOVING_KEY, "true")])));
        assert!(!marked_removing(&metadata(&[(REMOVING_KEY, "false")])));
        assert!(!marked_removing(&metadata(&[])));
    }

    #[test]
    fn older_layouts_migrate_newer_ones_are_left_alone() {
        assert_eq!(examine(&metadata(&[])), Examined::Migrate { from: 1 });
        assert_eq!(
            examine(&metadata(&[(LAYOUT_KEY, "1")])),
            Examined::Migrate { from: 1 }
        );
        assert_eq!(
            examine(&metadata(&[(LAYOUT_KEY, "2")])),
            Examined::Migrate { from: 2 }
        );
        assert_eq!(examine(&metadata(&[(LAYOUT_KEY, "3")])), Examined::Current);
        assert_eq!(
            examine(&metadata(&[(LAYOUT_KEY, "4")])),
            Examined::Refuse(LayoutRefusal::NewerLayout {
                found: "4".into(),
                own: LAYOUT
            })
        );
        // A layout that cannot be read is no reason to rewrite the stream either.
        assert!(matches!(
            examine(&metadata(&[(LAYOUT_KEY, "x")])),
            Examined::Refuse(LayoutRefusal::NewerLayout { .. })
        ));
        // A removal in progress wins over any layout.
        for layout in ["1", "2", "3", "4"] {
            assert_eq!(
                examine(&metadata(&[(LAYOUT_KEY, layout), (REMOVING_KEY, "true")])),
                Examined::Refuse(LayoutRefusal::Removing)
            );
        }
    }

    #[test]
    fn refusals_are_found_in_provision_errors() {
        let error = refused("stream S".into(), LayoutRefusal::Removing);
        assert_eq!(error.refusal(), Some(&LayoutRefusal::Removing));
        assert!(error.to_string().contains("stream S"), "{error}");
        let other = provision_error("stream S", "timed out");
        assert_eq!(other.refusal(), None);
    }

    fn at(seconds: i64) -> time::OffsetDateTime {
        time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(seconds)
    }

    /// The consumer as the server reports it after `wanted` was written.
    fn as_written(wanted: &consumer::pull::Config) -> consumer::Config {
        consumer::Config {
            durable_name: wanted.durable_name.clone(),
            description: wanted.description.clone(),
            filter_subjects: wanted.filter_subjects.clone(),
            ack_policy: wanted.ack_policy,
            ack_wait: wanted.ack_wait,
            max_ack_pending: wanted.max_ack_pending,
            max_deliver: wanted.max_deliver,
            // The server adds keys of its own.
            metadata: wanted
                .metadata
                .clone()
                .into_iter()
                .chain([("_nats.level".to_string(), "1".to_string())])
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_change_is_written() {
        let settings = settings_from("[pools.p]\nmax_in_flight = 4\n").expect("settings");
        let config = &settings.cluster.pools["p"];
        let state = PoolState::default();
        let wanted = pool_consumer_config(&settings, "p", config, &state);
        let current = as_written(&wanted);
        assert_eq!(consumer_writes(&current, &wanted, None), vec![]);

        let raised = settings_from("[pools.p]\nmax_in_flight = 9\n").expect("raised");
        let wanted_raised = pool_consumer_config(&raised, "p", &raised.cluster.pools["p"], &state);
        assert_eq!(
            consumer_writes(&current, &wanted_raised, None),
            vec![ConsumerWrite::Update]
        );

        // An adaptive limit is part of what is wanted: a push cannot undo it.
        let adaptive =
            settings_from("[pools.p]\nmax_in_flight = 9\nadaptive = true\n").expect("adaptive");
        let lowered = PoolState {
            adaptive_limit: Some(2),
            ..Default::default()
        };
        let wanted_lowered =
            pool_consumer_config(&adaptive, "p", &adaptive.cluster.pools["p"], &lowered);
        assert_eq!(wanted_lowered.max_ack_pending, 2);
        assert_eq!(
            consumer_writes(&as_written(&wanted_lowered), &wanted_lowered, None),
            vec![]
        );
        // Without `adaptive`, a stored limit does not apply.
        let ignored = pool_consumer_config(&raised, "p", &raised.cluster.pools["p"], &lowered);
        assert_eq!(ignored.max_ack_pending, 9);
        // An open breaker's probe limit wins over both.
        let mut open = lowered.clone();
        open.open_breaker(OffsetDateTime::now_utc(), Duration::from_secs(30), "test");
        let probing = pool_consumer_config(&adaptive, "p", &adaptive.cluster.pools["p"], &open);
        assert_eq!(probing.max_ack_pending, 1);
    }

    #[test]
    fn a_pause_is_written_when_missing_or_moved_and_never_lifted_here() {
        let settings = settings_from("[pools.p]\nmax_in_flight = 4\n").expect("settings");
        let wanted = pool_consumer_config(
            &settings,
            "p",
            &settings.cluster.pools["p"],
            &PoolState::default(),
        );
        let mut current = as_written(&wanted);
        assert_eq!(
            consumer_writes(&current, &wanted, Some(at(500))),
            vec![ConsumerWrite::Pause(at(500))]
        );
        current.pause_until = Some(at(500) + time::Duration::milliseconds(300));
        assert_eq!(consumer_writes(&current, &wanted, Some(at(500))), vec![]);
        assert_eq!(
            consumer_writes(&current, &wanted, Some(at(900))),
            vec![ConsumerWrite::Pause(at(900))]
        );
        // A pause the state does not hold (made by hand through the JetStream API) is
        // left as it is.
        assert_eq!(consumer_writes(&current, &wanted, None), vec![]);
    }
}
