//! The pool state bucket's configuration and reading a pool's stored state.

use super::*;

/// The bucket of the pools' runtime state (`pool::state::PoolState`, one key per pool): kept
/// until changed, with the streams' replicas, a few revisions for whoever looks into
/// why a pool paused.
pub fn pool_state_bucket_config(settings: &Settings) -> kv::Config {
    Bucket::PoolState
        .spec(&settings.subjects, &settings.streams)
        .kv_config()
}
