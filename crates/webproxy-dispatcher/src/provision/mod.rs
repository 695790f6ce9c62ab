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

// One file per thing provisioned. They share this module's imports and one another's
// items through `use super::*`, and what the rest of the crate names is re-exported here,
// so `crate::provision::X` stays the one path.
mod buckets;
mod consumers;
mod fences;
mod layout;
mod streams;
#[cfg(test)]
mod tests;

pub(crate) use buckets::*;
pub(crate) use consumers::*;
pub(crate) use fences::*;
pub use layout::mark_removing;
pub(crate) use layout::*;
pub(crate) use streams::*;

/// Provisioning failed; the message names the stream or consumer, and what to change
/// when the server has no room for it.
#[derive(Debug, Error)]
#[error("cannot provision {what}: {source}{}", no_room_hint(source))]
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

/// The server reserves a stream's whole `max_bytes` when it makes the stream, against
/// its `max_file_store` (by default 75% of the disk free when it started): a small disk
/// refuses the default budgets though nothing has been stored yet.
fn no_room_hint(source: &async_nats::Error) -> &'static str {
    let code = source
        .downcast_ref::<jetstream::context::CreateStreamError>()
        .and_then(|e| match e.kind() {
            jetstream::context::CreateStreamErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        });
    if code == Some(jetstream::ErrorCode::STORAGE_RESOURCES_EXCEEDED) {
        "; JetStream reserves each stream's max_bytes on disk when it makes it: give \
         nats-server more disk or a larger jetstream max_file_store, or lower [streams] \
         reply_max_bytes and dead_max_bytes"
    } else {
        ""
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
