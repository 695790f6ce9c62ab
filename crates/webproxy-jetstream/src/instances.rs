//! The bucket `<PREFIX>_INSTANCES`: one key per running instance (its heartbeat,
//! written by the binary in `kv` mode) and the lease that makes one instance at a time
//! the writer of the pool consumers' settings. A leaf: the configuration store and
//! the runtime both use it.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::TryStreamExt as _;
use serde::{Deserialize, Serialize};
use tracing::debug;
use webproxy_config::settings::Settings;

use crate::state::Bucket;

pub use crate::state::INSTANCES_TTL as TTL;

/// The key of the lease of the pool consumers' settings; its value is the holder's
/// instance id. Instance ids have no dot, so it is never one.
pub const POOL_CONSUMERS_LEASE: &str = "lease.pool-consumers";

/// The bucket, as `state.rs` declares it: history 1, every value kept [`TTL`].
pub fn bucket_config(settings: &Settings) -> kv::Config {
    Bucket::Instances
        .spec(&settings.subjects, &settings.streams)
        .kv_config()
}

/// One instance's heartbeat in the bucket, under its id: written by the binary every
/// 5 s and at once when what it reports changes (in `kv` mode, and since issue 31 in
/// `file` mode too, so that `config push` and `pools remove` see what file-mode
/// instances run).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceReport {
    pub instance: String,
    /// The configuration revision it runs.
    pub revision: u64,
    pub version: String,
    /// RFC 3339, when it reported.
    pub time: String,
    /// The longest `ack_wait`, in milliseconds, that any of its deliveries' progress
    /// acks are paced from now (`conversation/pacing.rs`): the pool consumers' owner lowers
    /// a consumer's `ack_wait` only to a value every live instance paces from. Absent
    /// from instances older than the field, which pace from the revision a message
    /// arrived under, and are waited for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pacing_ack_wait_ms: Option<u64>,
    /// Where its configuration comes from: `"kv"` or `"file"` (`[config] source`).
    /// Absent from instances older than the field, which reported only in `kv` mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The pools its running configuration has (`[pools]`, which every request rule's
    /// pool is in), so that `pools remove` can refuse one still routed to. Absent from
    /// instances older than the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<Vec<String>>,
}

impl InstanceReport {
    /// Whether it runs `[config] source = "file"`: it never follows the configuration
    /// bucket, so no pushed revision reaches it.
    pub fn runs_file_mode(&self) -> bool {
        self.source.as_deref() == Some("file")
    }

    /// The `ack_wait` it paces from, when it says.
    pub fn pacing_ack_wait(&self) -> Option<Duration> {
        self.pacing_ack_wait_ms.map(Duration::from_millis)
    }
}

/// The live instances' reports in `store`, by id: an instance whose heartbeat expired
/// is gone from the bucket, and so from here.
pub async fn reports(store: &kv::Store) -> Result<Vec<InstanceReport>, String> {
    let keys: Vec<String> = store
        .keys()
        .await
        .map_err(|e| e.to_string())?
        .try_collect()
        .await
        .map_err(|e| e.to_string())?;
    let mut reports = BTreeMap::new();
    for key in keys {
        // Instance ids have no dot; other keys (the lease, attempt counts) do.
        if key.contains('.') {
            continue;
        }
        // A report that expired between the listing and the read is gone: skipped.
        let value = store
            .get(&key)
            .await
            .map_err(|e| format!("key {key}: {e}"))?;
        if let Some(value) = value {
            match serde_json::from_slice::<InstanceReport>(&value) {
                Ok(report) => {
                    reports.insert(key, report);
                }
                Err(e) => debug!(key, error = %e, "not an instance report; skipped"),
            }
        }
    }
    Ok(reports.into_values().collect())
}

/// This process's id in the bucket: the host name (a pod's name) and the process id,
/// in the characters a KV key allows, and never a dot.
pub fn instance_id() -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".into());
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_ids_are_valid_keys_without_a_dot() {
        let id = instance_id();
        assert!(
            id.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            "{id}"
        );
        assert!(POOL_CONSUMERS_LEASE.contains('.'));
    }
}
