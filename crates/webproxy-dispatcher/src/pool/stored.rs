//! A pool's runtime state in the pool-state bucket: the one reader of a stored state,
//! and the one writer, by compare-and-set.

use async_nats::jetstream::{self, kv};
use tracing::warn;
use webproxy_config::settings::Settings;

use super::state::PoolState;

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

/// Compare-and-set tries before a write of shared state gives up: each lost try means
/// another instance wrote meanwhile.
pub(crate) const CAS_TRIES: usize = 20;

/// The pools' runtime state could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("cannot update the runtime state of pool {pool} in {bucket}: {message}")]
pub struct StateError {
    pool: String,
    bucket: String,
    message: String,
}

impl StateError {
    pub(crate) fn new(pool: &str, bucket: &str, message: String) -> StateError {
        StateError {
            pool: pool.to_string(),
            bucket: bucket.to_string(),
            message,
        }
    }
}

/// Changes `pool`'s state in `bucket` with `change` (which says whether it changed
/// anything), by compare-and-set, again while other writers win. The state written,
/// or `None` when `change` left it as it was.
pub(crate) async fn update_pool_state(
    js: &jetstream::Context,
    bucket: &str,
    pool: &str,
    mut change: impl FnMut(&mut PoolState) -> bool,
) -> Result<Option<PoolState>, StateError> {
    let error = |message: String| StateError::new(pool, bucket, message);
    let store = js
        .get_key_value(bucket)
        .await
        .map_err(|e| error(e.to_string()))?;
    for _ in 0..CAS_TRIES {
        let (mut state, revision) = stored_pool_state(&store, pool).await.map_err(error)?;
        if !change(&mut state) {
            return Ok(None);
        }
        let value = serde_json::to_vec(&state).map_err(|e| error(e.to_string()))?;
        let written = match revision {
            Some(revision) => store.update(pool, value.into(), revision).await.is_ok(),
            None => store.create(pool, value.into()).await.is_ok(),
        };
        if written {
            return Ok(Some(state));
        }
    }
    Err(error(format!(
        "it kept changing; gave up after {CAS_TRIES} tries"
    )))
}
