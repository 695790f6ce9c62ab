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
use webproxy_protocol::Subjects;

use crate::state::Bucket;

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

pub use buckets::*;
pub use consumers::*;
pub use fences::*;
pub use layout::mark_removing;
pub use layout::*;
pub use streams::*;

/// Provisioning failed; the message names the stream or consumer, and what to change
/// when the server has no room for it.
#[derive(Debug, Error)]
#[error("cannot provision {what}: {source}{}", no_room_hint(source))]
pub struct ProvisionError {
    pub what: String,
    #[source]
    pub source: async_nats::Error,
}

impl ProvisionError {
    /// Why provisioning declined to touch the stream, when it did: retrying is then
    /// pointless until an operator (or a newer instance) changes the stream.
    pub fn refusal(&self) -> Option<&LayoutRefusal> {
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

pub fn refused(what: String, refusal: LayoutRefusal) -> ProvisionError {
    ProvisionError {
        what,
        source: Box::new(refusal),
    }
}

pub fn provision_error(
    what: impl Into<String>,
    source: impl Into<async_nats::Error>,
) -> ProvisionError {
    ProvisionError {
        what: what.into(),
        source: source.into(),
    }
}

/// Creates or updates `pool`'s own replies and dead-letter streams.
pub async fn provision_endings(
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
