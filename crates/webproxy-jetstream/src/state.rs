//! The service's cluster state in NATS: every KV bucket it keeps, declared once with
//! its storage, replicas, history, age, size bound and marker TTL ([`Bucket::spec`]),
//! and [`StateBucket`], the one handle through which a feature reaches its bucket. The
//! handle recreates a bucket only after the server confirmed its stream gone (err_code
//! 10059 from `STREAM.INFO`): a KV call on a missing bucket and a JetStream API that is
//! down both answer "no responders", and only the first may be mended by creating.
//!
//! What a lost or full bucket means, bucket by bucket, is in ARCHITECTURE.md ("Cluster
//! state").

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::{GetStreamError, GetStreamErrorKind, KeyValueError};
use async_nats::jetstream::{self, ErrorCode, kv, stream};
use thiserror::Error;
use tokio::sync::Mutex;
use webproxy_protocol::Subjects;

use webproxy_config::settings::StreamsConfig;

/// A KV bucket of the service's (or its gateway's) state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucket {
    /// Progress records of conversations that parked or moved.
    Progress,
    /// The cluster document (`[config] source = "kv"`).
    Config,
    /// Instances' heartbeats and counts, and the lease of the pool consumers' settings.
    Instances,
    /// The pools' runtime state: pauses, adaptive limits.
    PoolState,
    /// The pools' rate schedules.
    Rate,
    /// The gateway's minted ids.
    Gateway,
    /// The gateway's shared HMAC key.
    GatewayKey,
    /// Recorded cancels, until their generation settles.
    Cancels,
}

/// How a bucket is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketSpec {
    pub name: String,
    pub description: &'static str,
    pub storage: stream::StorageType,
    pub replicas: usize,
    pub history: i64,
    /// Zero keeps values until changed.
    pub max_age: Duration,
    /// The size bound: the bucket is discard-new, so a full one refuses writes.
    pub max_bytes: i64,
    /// The TTL of a purge's marker (`Nats-TTL`), on a bucket whose stream allows
    /// per-message TTLs. A delete or purge always leaves a marker: without a TTL it
    /// stays for `max_age`.
    pub marker_ttl: Option<Duration>,
    /// Whether the bucket is made allowing per-message TTLs, with the server marking a
    /// value its age limit removes, so that a watch learns of it and no open updates
    /// the stream afterwards (an update racing a deletion left nats-server 2.15 with a
    /// stream that answers its info and never acks a write, about 1 in 1000 races,
    /// which no "not found" ever mends). The cancels' only: the progress bucket adds no
    /// markers of its own (its records age out silently) and gets its TTLs by update.
    pub age_markers: bool,
    /// Whether the handle creates the bucket when the server confirms it gone. The
    /// cluster document and the gateway key are never made again behind the
    /// operators' back: a new empty document or a new key would change what every
    /// instance or gateway does.
    pub recreate: bool,
}

const MIB: i64 = 1024 * 1024;

/// How long `<PREFIX>_INSTANCES` keeps a value: an instance's heartbeat (every 5 s)
/// and the lease holder's renewals are written well within it, so one late write does
/// not make a live instance vanish or lose its lease.
pub const INSTANCES_TTL: Duration = Duration::from_secs(20);

/// Revisions the configuration bucket keeps: what `config history`, `show
/// --revision` and `rollback` can reach (JetStream's most).
pub(crate) const CONFIG_HISTORY: i64 = 64;

/// How long a settled progress record's purge marker stays: long enough for a
/// redelivery racing the settle to read "deleted", short enough that markers do not
/// pile up (at 100 settles a second, a minute's worth is 6000 small markers).
pub const PROGRESS_MARKER_TTL: Duration = Duration::from_secs(60);

impl Bucket {
    /// Every bucket, for the gauges and the docs' table.
    pub const ALL: [Bucket; 8] = [
        Bucket::Progress,
        Bucket::Config,
        Bucket::Instances,
        Bucket::PoolState,
        Bucket::Rate,
        Bucket::Gateway,
        Bucket::GatewayKey,
        Bucket::Cancels,
    ];

    /// The label of the bucket in metrics and messages: its name without the prefix.
    pub fn label(self) -> &'static str {
        match self {
            Bucket::Progress => "progress",
            Bucket::Config => "config",
            Bucket::Instances => "instances",
            Bucket::PoolState => "pool_state",
            Bucket::Rate => "rate",
            Bucket::Gateway => "gateway",
            Bucket::GatewayKey => "gateway_key",
            Bucket::Cancels => "cancels",
        }
    }

    /// How this bucket is kept under `subjects`' prefix and `streams`' settings.
    pub fn spec(self, subjects: &Subjects, streams: &StreamsConfig) -> BucketSpec {
        let replicas = streams.replicas;
        let file = stream::StorageType::File;
        let memory = stream::StorageType::Memory;
        let (name, description, storage, history, max_age, max_bytes, marker_ttl, recreate) =
            match self {
                // Records outlive no dead letter: a conversation that parked may be
                // replayed as long as its letter is kept. A record is a hop's state
                // (under 4 KiB with a full attempt history), so 512 MiB holds over
                // 100k conversations parked at once.
                Bucket::Progress => (
                    subjects.progress_bucket(),
                    "webproxy progress records: the next hop of conversations that parked or moved",
                    file,
                    1,
                    streams.dead_max_age.max(streams.reply_max_age),
                    512 * MIB,
                    Some(PROGRESS_MARKER_TTL),
                    true,
                ),
                Bucket::Config => (
                    subjects.config_bucket(),
                    "webproxy's cluster configuration: rules, pools, outbound policy",
                    file,
                    CONFIG_HISTORY,
                    Duration::ZERO,
                    64 * MIB,
                    None,
                    false,
                ),
                // Rewritten every few seconds by every instance, gone 20 s after its
                // writer stops: a lost bucket is written again within 5 s (the lease
                // taken again, the heartbeats and counts rewritten). On file all the
                // same, as it has always been: moving it would need a delete and
                // recreate for nothing gained.
                Bucket::Instances => (
                    subjects.instances_bucket(),
                    "webproxy's running instances and the configuration revision each runs",
                    file,
                    1,
                    INSTANCES_TTL,
                    16 * MIB,
                    None,
                    true,
                ),
                // Pauses by hand and breaker pauses must survive a restart.
                Bucket::PoolState => (
                    subjects.pool_state_bucket(),
                    "webproxy pools' runtime state: pauses and their reasons, adaptive limits",
                    file,
                    5,
                    Duration::ZERO,
                    16 * MIB,
                    None,
                    true,
                ),
                // One small value per pool, rewritten a few times a second. A lost
                // schedule starts again at the next claim: an idle pool may spend its
                // burst at once, and no more. Harmless, so memory.
                Bucket::Rate => (
                    subjects.rate_bucket(),
                    "webproxy pools' rate schedules: the next unclaimed slot of each",
                    memory,
                    1,
                    Duration::ZERO,
                    8 * MIB,
                    None,
                    true,
                ),
                // A minted id's record lives as long as the reply it points to.
                Bucket::Gateway => (
                    subjects.gateway_bucket(),
                    "webproxy gateway: the conversation behind each minted id",
                    file,
                    1,
                    streams.reply_max_age,
                    streams.reply_max_bytes.max(64 * MIB),
                    None,
                    true,
                ),
                Bucket::GatewayKey => (
                    subjects.gateway_key_bucket(),
                    "webproxy gateway: the shared HMAC key of minted ids",
                    file,
                    1,
                    Duration::ZERO,
                    MIB,
                    None,
                    false,
                ),
                // A cancel is recorded only for a conversation that is under way, once
                // per generation, and removed when that generation settles: at most
                // one small record (under 200 bytes) per live conversation, so 64 MiB
                // holds over 300k. One left by a race goes with the dead letters. A
                // lost bucket loses the cancels not yet acted on (their callers were
                // told `recorded`); it is made again at the next cancel.
                Bucket::Cancels => (
                    subjects.cancel_bucket(),
                    "webproxy cancels: conversations to end at their next delivery",
                    file,
                    1,
                    streams.dead_max_age,
                    64 * MIB,
                    Some(PROGRESS_MARKER_TTL),
                    true,
                ),
            };
        BucketSpec {
            age_markers: self == Bucket::Cancels,
            name,
            description,
            storage,
            replicas,
            history,
            max_age,
            max_bytes,
            marker_ttl,
            recreate,
        }
    }
}

impl BucketSpec {
    /// The bucket's configuration for async-nats.
    pub fn kv_config(&self) -> kv::Config {
        kv::Config {
            bucket: self.name.clone(),
            description: self.description.into(),
            history: self.history,
            max_age: self.max_age,
            max_bytes: self.max_bytes,
            storage: self.storage,
            num_replicas: self.replicas,
            limit_markers: self.marker_ttl.filter(|_| self.age_markers),
            ..Default::default()
        }
    }

    /// The name of the bucket's stream.
    pub fn stream_name(&self) -> String {
        format!("KV_{}", self.name)
    }

    /// Whether `config`, the bucket's stream as the server has it, lacks what this spec
    /// changes in place: the bound, the age, per-message TTLs. Storage cannot be
    /// changed by an update (docs/operations.md says how to move a bucket).
    fn needs_update(&self, config: &stream::Config) -> bool {
        config.max_bytes != self.max_bytes
            || config.max_age != self.max_age
            || (self.marker_ttl.is_some() && !config.allow_message_ttl)
    }
}

/// A bucket could not be reached.
#[derive(Debug, Error)]
pub enum BucketError {
    /// The server confirmed the bucket gone, and this bucket is not made again.
    #[error("the bucket {bucket} is gone, and webproxy does not make it again by itself")]
    Lost { bucket: String },
    #[error("the bucket {bucket}: {message}")]
    Unreachable { bucket: String, message: String },
}

/// Whether the JetStream API answered that no stream by this name exists.
pub fn is_stream_not_found(kind: &GetStreamErrorKind) -> bool {
    matches!(kind, GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// Whether opening a bucket failed because its stream does not exist (10059): the
/// stream lookup is the error's source.
pub(crate) fn is_bucket_not_found(e: &KeyValueError) -> bool {
    use std::error::Error as _;
    e.source()
        .and_then(|source| source.downcast_ref::<GetStreamError>())
        .is_some_and(|e| is_stream_not_found(&e.kind()))
}

/// One bucket of the cluster state, opened on first use and again after a failure.
/// Clones share one handle. Public for the gateway, whose buckets are declared here
/// too.
#[derive(Debug, Clone)]
pub struct StateBucket(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    js: jetstream::Context,
    spec: BucketSpec,
    store: Mutex<Option<kv::Store>>,
}

impl StateBucket {
    pub fn new(js: jetstream::Context, spec: BucketSpec) -> StateBucket {
        StateBucket(Arc::new(Shared {
            js,
            spec,
            store: Mutex::new(None),
        }))
    }

    pub fn spec(&self) -> &BucketSpec {
        &self.0.spec
    }

    /// Puts `value` under `key` in `store` (this bucket's handle) only if the key's last
    /// message is at `expected` (0: it has none), expiring after `ttl` (whole seconds,
    /// at least one). async-nats has no update with a TTL. Returns the new revision.
    /// `Ok(None)`: the key had moved on (err_code 10071).
    pub async fn put_expecting(
        &self,
        store: &kv::Store,
        key: &str,
        value: bytes::Bytes,
        expected: u64,
        ttl: Duration,
    ) -> Result<Option<u64>, async_nats::Error> {
        use async_nats::header::{self, HeaderValue};
        use async_nats::jetstream::context::PublishErrorKind;
        if store.use_jetstream_prefix {
            // Only `serve` holds the service's handle, and it uses its account's own
            // $JS.API (config.rs warns of nats.js_api_prefix for it).
            return Err("a checked put with a TTL needs the account's own $JS.API".into());
        }
        let subject = format!(
            "{}{key}",
            store.put_prefix.as_deref().unwrap_or(&store.prefix)
        );
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            HeaderValue::from(expected),
        );
        headers.insert(
            header::NATS_MESSAGE_TTL,
            HeaderValue::from(ttl.as_secs().max(1)),
        );
        let acked = self
            .0
            .js
            .publish_with_headers(subject, headers, value)
            .await?
            .await;
        match acked {
            Ok(ack) => Ok(Some(ack.sequence)),
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The bucket's handle: the one opened before, or opened now, and made when the
    /// server confirms it missing (for a bucket that may be made again).
    pub async fn store(&self) -> Result<kv::Store, BucketError> {
        let mut store = self.0.store.lock().await;
        if let Some(store) = store.as_ref() {
            return Ok(store.clone());
        }
        // Boxed: the lookup-or-make future is about 9 KB, and inline it would make this
        // one, and every conversation's handler that awaits it, carry and move those
        // bytes on every call though the handle is almost always kept already.
        let opened = Box::pin(self.open()).await?;
        *store = Some(opened.clone());
        Ok(opened)
    }

    /// Forgets the handle after an operation on it failed, so that the next
    /// [`StateBucket::store`] looks the bucket up again: a bucket deleted by hand, or
    /// lost with a memory store in a restart, is then made again.
    pub async fn reopen(&self) {
        *self.0.store.lock().await = None;
    }

    /// Makes the bucket now (or brings an existing one to its spec), whatever the
    /// spec's `recreate` says, and keeps the handle: for a bucket that is never made
    /// again by itself, on an operator's explicit command or a deployment's very first
    /// start (the gateway key).
    pub async fn create(&self) -> Result<kv::Store, BucketError> {
        let mut store = self.0.store.lock().await;
        let made = self
            .0
            .js
            .create_or_update_key_value(self.0.spec.kv_config())
            .await
            .map_err(|e| self.unreachable(e))?;
        *store = Some(made.clone());
        Ok(made)
    }

    fn unreachable(&self, message: impl ToString) -> BucketError {
        BucketError::Unreachable {
            bucket: self.0.spec.name.clone(),
            message: message.to_string(),
        }
    }

    async fn open(&self) -> Result<kv::Store, BucketError> {
        let spec = &self.0.spec;
        let store = match self.0.js.get_key_value(&spec.name).await {
            Ok(store) => store,
            Err(e) if is_bucket_not_found(&e) => {
                if !spec.recreate {
                    return Err(BucketError::Lost {
                        bucket: spec.name.clone(),
                    });
                }
                self.0
                    .js
                    .create_or_update_key_value(spec.kv_config())
                    .await
                    .map_err(|e| self.unreachable(e))?
            }
            Err(e) => return Err(self.unreachable(e)),
        };
        let config = &store.stream.cached_info().config;
        if spec.needs_update(config) {
            self.update(config.clone()).await?;
        }
        Ok(store)
    }

    /// Brings the bucket's stream to the spec's bound, age and TTL setting.
    async fn update(&self, mut config: stream::Config) -> Result<(), BucketError> {
        config.max_bytes = self.0.spec.max_bytes;
        config.max_age = self.0.spec.max_age;
        // Once on it stays on: the server refuses to turn it off (10052).
        config.allow_message_ttl |= self.0.spec.marker_ttl.is_some();
        self.0
            .js
            .update_stream(config)
            .await
            .map(drop)
            .map_err(|e| self.unreachable(e))
    }

    /// The bucket's bytes and its bound, from the server (one `STREAM.INFO`), for the
    /// gauge of its use; `None` when the server confirms the bucket gone. Reading it
    /// never makes, opens or updates the bucket.
    pub async fn usage(&self) -> Result<Option<BucketUse>, BucketError> {
        match self.0.js.get_stream(self.0.spec.stream_name()).await {
            Ok(found) => {
                let info = found.cached_info();
                Ok(Some(BucketUse {
                    bytes: info.state.bytes,
                    max_bytes: info.config.max_bytes,
                }))
            }
            Err(e) if is_stream_not_found(&e.kind()) => Ok(None),
            Err(e) => Err(self.unreachable(e)),
        }
    }
}

/// How much of its bound a bucket holds, as the server reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketUse {
    pub bytes: u64,
    /// The stream's bound; zero or negative when it has none (never declared so, but
    /// a stream may be changed by hand until the service next opens it).
    pub max_bytes: i64,
}

/// From this share of its bound a bucket is nearly full: the service is not ready
/// until it falls below [`NO_LONGER_FULL`]. A discard-new bucket refuses writes at its
/// bound, so the operator is told while the last tenth still takes writes.
pub(crate) const NEARLY_FULL: f64 = 0.90;

/// Below this share a nearly full bucket is no longer so: the gap keeps a bucket that
/// hovers at the threshold from flapping the service's readiness at every refresh.
pub(crate) const NO_LONGER_FULL: f64 = 0.85;

impl BucketUse {
    /// The share of its bound the bucket holds: 0 for a bucket without a bound, which
    /// cannot fill.
    pub fn ratio(self) -> f64 {
        if self.max_bytes <= 0 {
            return 0.0;
        }
        // Bytes above 2^53 lose precision, far beyond any bound the service declares.
        self.bytes as f64 / self.max_bytes as f64
    }

    /// `/readyz`'s line for the nearly full bucket `name`.
    pub fn describe(self, name: &str) -> String {
        let mib = |bytes: f64| bytes / MIB as f64;
        format!(
            "bucket {name} is {:.0}% full ({:.1} MiB of {:.1} MiB): writes to it are refused when it is full; not ready from {:.0}% until below {:.0}%",
            self.ratio() * 100.0,
            mib(self.bytes as f64),
            mib(self.max_bytes as f64),
            NEARLY_FULL * 100.0,
            NO_LONGER_FULL * 100.0,
        )
    }

    /// Whether the bucket is nearly full now, given whether it `was` at the last reading.
    pub fn nearly_full(self, was: bool) -> bool {
        let ratio = self.ratio();
        if was {
            ratio >= NO_LONGER_FULL
        } else {
            ratio >= NEARLY_FULL
        }
    }
}

#[cfg(test)]
mod tests;
