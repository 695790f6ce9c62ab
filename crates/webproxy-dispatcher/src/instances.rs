//! The bucket `<PREFIX>_INSTANCES`: one key per running instance (its heartbeat,
//! written by the binary in `kv` mode) and the lease that makes one instance at a time
//! the writer of the pool consumers' settings. A leaf: the configuration store and
//! the runtime both use it.

use async_nats::jetstream::{kv, stream};

use crate::config::Settings;

/// How long the bucket keeps a value: an instance's heartbeat (every 5 s) and the
/// lease holder's renewals are written well within it, so one late write does not make
/// a live instance vanish or lose its lease.
pub(crate) const TTL: std::time::Duration = std::time::Duration::from_secs(20);

/// The key of the lease of the pool consumers' settings; its value is the holder's
/// instance id. Instance ids have no dot, so it is never one.
pub(crate) const POOL_CONSUMERS_LEASE: &str = "lease.pool-consumers";

/// The bucket: history 1, every value kept [`TTL`], the streams' replicas.
pub(crate) fn bucket_config(settings: &Settings) -> kv::Config {
    kv::Config {
        bucket: settings.subjects.instances_bucket(),
        description: "webproxy's running instances and the configuration revision each runs".into(),
        history: 1,
        max_age: TTL,
        storage: stream::StorageType::File,
        num_replicas: settings.streams.replicas,
        ..Default::default()
    }
}

/// This process's id in the bucket: the host name (a pod's name) and the process id,
/// in the characters a KV key allows, and never a dot.
pub(crate) fn instance_id() -> String {
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
