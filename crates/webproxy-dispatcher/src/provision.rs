//! Creates or updates the streams and consumers of the pools in this instance's config,
//! idempotently, and touches no other pool: in a rolling deploy an old instance must not
//! take away a new pool.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};
use thiserror::Error;
use tracing::warn;

use crate::config::{PoolConfig, Settings};

/// Provisioning failed; the message names the stream or consumer.
#[derive(Debug, Error)]
#[error("cannot provision {what}: {source}")]
pub struct ProvisionError {
    pub what: String,
    #[source]
    pub source: async_nats::Error,
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
/// actions and TERM with a reason.
pub const MIN_SERVER_VERSION: (u64, u64) = (2, 10);

/// Whether a server version string (`"2.10.4"`, `"v2.15.1"`) is new enough.
pub fn server_version_supported(version: &str) -> bool {
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
            subjects.hop_filter(pool),
            subjects.retry_filter(pool),
        ],
        duplicate_window: settings.config.streams.duplicate_window,
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        num_replicas: settings.config.streams.replicas,
        max_messages_per_subject: max_waiting,
        // Per-subject discard-new rejects a publish into a full queue at once, so
        // callers feel back-pressure. Hop and retry subjects hold one message each, so
        // the limit binds only the request subject and no handler waits for room.
        discard: stream::DiscardPolicy::New,
        discard_new_per_subject: config.max_waiting.is_some(),
        ..Default::default()
    }
}

/// The durable pull consumer of one pool's request subject.
pub fn pool_consumer_config(
    settings: &Settings,
    pool: &str,
    config: &PoolConfig,
) -> consumer::pull::Config {
    let subjects = &settings.subjects;
    consumer::pull::Config {
        durable_name: Some(subjects.pool_consumer(pool)),
        description: Some(format!("webproxy pool {pool}: the concurrency limit")),
        filter_subjects: vec![subjects.request(pool), subjects.hop_filter(pool)],
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: settings.config.service.ack_wait,
        max_ack_pending: i64::try_from(config.max_in_flight).unwrap_or(i64::MAX),
        // Unlimited: poison messages are counted and ended by the dispatcher itself.
        max_deliver: -1,
        ..Default::default()
    }
}

/// The most parked retries a pool holds at once; a parked retry waiting out its delay
/// holds one of these, never a slot of the pool's concurrency limit.
pub const MAX_PARKED: i64 = 100_000;

/// The durable pull consumer of one pool's retry subject.
pub fn retry_consumer_config(settings: &Settings, pool: &str) -> consumer::pull::Config {
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
        ..Default::default()
    }
}

/// A pool's two consumers.
pub struct PoolConsumers {
    pub pool: String,
    /// The request subject: `max_ack_pending` is the concurrency limit.
    pub work: consumer::PullConsumer,
    /// The retry subject: parked retries waiting to be due.
    pub parked: consumer::PullConsumer,
}

fn limits_stream(
    name: String,
    subject: String,
    description: &str,
    max_age: Duration,
    max_bytes: i64,
    replicas: usize,
) -> stream::Config {
    stream::Config {
        name,
        description: Some(description.to_string()),
        subjects: vec![subject],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        num_replicas: replicas,
        max_age,
        max_bytes,
        discard: stream::DiscardPolicy::Old,
        ..Default::default()
    }
}

/// The stream that stores final replies: one subject per conversation, never the live
/// copies on `<prefix>.reply.<id>`.
pub fn replies_stream_config(settings: &Settings) -> stream::Config {
    let streams = &settings.config.streams;
    limits_stream(
        settings.subjects.replies_stream(),
        settings.subjects.stored_reply_wildcard(),
        "webproxy final replies, one per conversation",
        streams.reply_max_age,
        streams.reply_max_bytes,
        streams.replicas,
    )
}

/// The stream that stores dead letters.
pub fn dead_stream_config(settings: &Settings) -> stream::Config {
    let streams = &settings.config.streams;
    limits_stream(
        settings.subjects.dead_stream(),
        settings.subjects.dead_wildcard(),
        "webproxy dead letters: conversations that ended in an error",
        streams.dead_max_age,
        streams.dead_max_bytes,
        streams.replicas,
    )
}

/// The bucket of progress records. Records outlive no dead letter: a conversation
/// that parked may be replayed as long as its letter is kept.
pub fn progress_bucket_config(settings: &Settings) -> kv::Config {
    let streams = &settings.config.streams;
    kv::Config {
        bucket: settings.subjects.progress_bucket(),
        description:
            "webproxy progress records: the next hop of conversations that parked or moved".into(),
        history: 1,
        max_age: streams.dead_max_age.max(streams.reply_max_age),
        storage: stream::StorageType::File,
        num_replicas: streams.replicas,
        ..Default::default()
    }
}

/// A first sequence no earlier incarnation of a pool stream can have used: the current
/// Unix time in microseconds, so origins never repeat across a `pools remove` and a
/// re-add.
fn fresh_first_sequence() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Creates a pool stream starting at a fresh first sequence, or updates it keeping
/// the one it has.
async fn provision_pool_stream(
    js: &jetstream::Context,
    mut config: stream::Config,
) -> Result<(), ProvisionError> {
    let name = config.name.clone();
    let what = || format!("stream {name}");
    match js.get_stream(&name).await {
        Ok(mut existing) => {
            let info = existing
                .info()
                .await
                .map_err(|e| provision_error(what(), e))?;
            config.first_sequence = info.config.first_sequence;
            js.update_stream(config)
                .await
                .map_err(|e| provision_error(what(), e))?;
        }
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            config.first_sequence = Some(fresh_first_sequence());
            js.create_stream(config)
                .await
                .map_err(|e| provision_error(what(), e))?;
        }
        Err(e) => return Err(provision_error(what(), e)),
    }
    Ok(())
}

/// What provisioning made: the pools' consumers and the progress bucket.
pub struct Provisioned {
    pub pools: Vec<PoolConsumers>,
    pub progress: kv::Store,
}

/// Creates or updates every stream, bucket and consumer of this instance's config.
pub async fn provision(
    js: &jetstream::Context,
    settings: &Settings,
) -> Result<Provisioned, ProvisionError> {
    for config in [
        replies_stream_config(settings),
        dead_stream_config(settings),
    ] {
        let name = config.name.clone();
        js.create_or_update_stream(config)
            .await
            .map_err(|e| provision_error(format!("stream {name}"), e))?;
    }
    let bucket = progress_bucket_config(settings);
    let bucket_name = bucket.bucket.clone();
    let progress = js
        .create_or_update_key_value(bucket)
        .await
        .map_err(|e| provision_error(format!("bucket {bucket_name}"), e))?;
    let mut consumers = Vec::new();
    for (pool, pool_config) in &settings.pools {
        let stream_config = pool_stream_config(settings, pool, pool_config);
        let stream_name = stream_config.name.clone();
        provision_pool_stream(js, stream_config).await?;
        let wanted = pool_consumer_config(settings, pool, pool_config);
        let name = wanted.durable_name.clone().unwrap_or_default();
        let what = format!("consumer {name} on {stream_name}");
        let stream = js
            .get_stream_no_info(&stream_name)
            .await
            .map_err(|e| provision_error(what.clone(), e))?;
        if let Ok(info) = stream.consumer_info(&name).await {
            let current = &info.config;
            if current.max_ack_pending != wanted.max_ack_pending
                || current.ack_wait != wanted.ack_wait
            {
                warn!(
                    consumer = %name,
                    server_max_ack_pending = current.max_ack_pending,
                    local_max_in_flight = wanted.max_ack_pending,
                    server_ack_wait = ?current.ack_wait,
                    local_ack_wait = ?wanted.ack_wait,
                    "the server's consumer config differs from this instance's; updating it (last writer wins)"
                );
            }
        }
        let work: consumer::PullConsumer = stream
            .create_consumer(wanted)
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
        consumers.push(PoolConsumers {
            pool: pool.clone(),
            work,
            parked,
        });
    }
    Ok(Provisioned {
        pools: consumers,
        progress,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert!(server_version_supported("2.10.0"));
        assert!(server_version_supported("2.15.1"));
        assert!(server_version_supported("v3.0.0"));
        assert!(server_version_supported("2.11.0-beta.1"));
        assert!(!server_version_supported("2.9.10"));
        assert!(!server_version_supported("1.4.1"));
        assert!(!server_version_supported("garbage"));
    }
}
