//! A pool's streams: the work stream, its replies and dead-letter streams, made or
//! brought to their configuration.

use super::*;

/// The work stream of one pool, as a work queue: the callers' request subject, and the
/// service's own per-conversation hop and retry subjects.
pub fn pool_stream_config(settings: &Settings, pool: &str, config: &PoolConfig) -> stream::Config {
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
/// (`pool::owner`: `max_in_flight`, `ack_wait`), and the local permits resized to
/// `max_in_flight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSpec {
    pub max_in_flight: u64,
    pub max_waiting: Option<u64>,
    pub ack_wait: Duration,
}

impl PoolSpec {
    pub fn of(settings: &Settings, config: &PoolConfig) -> PoolSpec {
        PoolSpec {
            max_in_flight: config.max_in_flight,
            max_waiting: config.max_waiting,
            ack_wait: settings.cluster.ack_wait,
        }
    }

    /// The limits that differ from `from`, each with its old value, for the log line
    /// that says a revision's limits are applied: `max_waiting 1 (was unlimited)`.
    pub fn changes_from(&self, from: &PoolSpec) -> String {
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
pub async fn update_pool_stream(
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

pub(crate) fn limits_stream(
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

/// The stream of `pool`'s body store: an Object Store bucket's stream in the layout
/// Object Store clients read (`OBJ_<bucket>`, chunks and metadata subjects), made by
/// the service itself because `create_object_store` sets none of what it needs:
/// `body_max_bytes` with discard new (a full store refuses a body, evicting none),
/// rollups for the metadata, direct get for lookups by subject, and per-message TTLs
/// (which, once allowed, a stream cannot drop) as every body's lifetime.
pub fn pool_body_store_config(settings: &Settings, pool: &str) -> stream::Config {
    body_store_config(settings, &settings.subjects.pool_body_bucket(pool))
}

/// [`pool_body_store_config`] by the bucket's name, `<pool stream>_BODIES`, as an
/// origin gives it: the store that keeps the receipts of that pool's conversations.
pub fn body_store_config(settings: &Settings, bucket: &str) -> stream::Config {
    let mut config = object_store_config(
        settings,
        bucket,
        settings.streams.body_max_bytes,
        format!(
            "webproxy large bodies: Object Store bucket {bucket}, and the receipts of its pool's conversations"
        ),
    );
    config.subjects.push(Subjects::body_receipts(bucket));
    config
}

/// The stream of `pool`'s upload store, `OBJ_<pool stream>_UPLOADS`: large request
/// bodies callers upload, each chunk with a TTL of `upload_max_age` until an envelope
/// binds it; `upload_max_bytes` is the pool's quota.
pub fn upload_store_config(settings: &Settings, pool: &str) -> stream::Config {
    let bucket = settings.subjects.pool_upload_bucket(pool);
    object_store_config(
        settings,
        &bucket,
        settings.streams.upload_max_bytes,
        format!("webproxy pool {pool}: uploaded request bodies (Object Store bucket {bucket})"),
    )
}

/// An Object Store bucket's stream as the service makes it: discard new at `max_bytes`,
/// rollups, direct get and per-message TTLs.
fn object_store_config(
    settings: &Settings,
    bucket: &str,
    max_bytes: i64,
    description: String,
) -> stream::Config {
    stream::Config {
        name: Subjects::object_stream(bucket),
        description: Some(description),
        subjects: vec![
            Subjects::object_chunks(bucket, ">"),
            Subjects::object_meta(bucket, ">"),
        ],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        num_replicas: settings.streams.replicas,
        max_bytes,
        discard: stream::DiscardPolicy::New,
        allow_rollup: true,
        allow_direct: true,
        allow_message_ttl: true,
        ..Default::default()
    }
}

/// A first sequence no earlier incarnation of a pool stream can have used: the current
/// Unix time in microseconds, so origins never repeat across a `pools remove` and a
/// re-add. ([`crate::clock::now`]: at start, before any skew is measured, this pod's.)
pub fn fresh_first_sequence() -> u64 {
    crate::clock::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The stream `name`, with its info, or `None` when it does not exist.
pub async fn existing_stream(
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
pub struct StreamPlan {
    pub config: stream::Config,
    /// A new stream starts at [`fresh_first_sequence`] (pool streams: origins).
    pub fresh_first_sequence: bool,
    /// Older layouts' consumers on it, deleted before it is migrated.
    pub old_consumers: Vec<String>,
    /// The fence created once it has this instance's layout, if it has one.
    pub fence: Option<stream::Config>,
}

/// Creates a stream with this instance's layout, or updates an existing one in place:
/// an older layout is migrated (its consumers deleted first, so that their instances
/// take nothing more), a newer one, or one marked for removal, is left alone with an
/// error. Then its fence is made. Returns the layout it had, `None` when it was created.
pub async fn provision_stream(
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

/// A stream's storage as its configuration spells it.
pub(crate) fn storage_name(storage: stream::StorageType) -> &'static str {
    match storage {
        stream::StorageType::File => "file",
        stream::StorageType::Memory => "memory",
    }
}
