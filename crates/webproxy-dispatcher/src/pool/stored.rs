//! Reading a pool's runtime state from the pool-state bucket: the one reader of a
//! stored state.

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
