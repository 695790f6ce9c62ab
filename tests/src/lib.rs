//! webproxy's integration tests' fixtures: those the bench shares come from
//! `webproxy-testkit` (a private nats-server per test, the `webproxy serve` binary as a
//! subprocess, an in-process HTTP upstream, bounded waits) and are re-exported here at
//! the paths the tests use; the rest (a caller's side of the protocol, a pool's body
//! store as the tests read it, a nats-server cluster, a TCP relay, a test CA, the
//! deploy file's users, a Secret volume, a DNS server that never answers, config
//! pushes and `webproxy pools`' output) live in this package.
//!
//! Nothing here is shared between tests (ports, store dirs and config files are
//! all per-fixture), so tests can run in parallel. Everything listens on and
//! talks to loopback only (127.0.0.0/8, ::1).
//!
//! This package enables `webproxy-dispatcher`'s `test-hooks`, so a workspace build gives
//! the spawned binary the fault-injection hooks; the bench does not depend on it.

pub mod authorized;
pub mod bodies;
pub mod caller;
mod cluster;
pub mod gateway_answers;
pub mod pools;
pub mod rate;
mod relay;
mod secret_volume;
mod silent_dns;
mod tls;

pub use cluster::NatsCluster;
pub use relay::Relay;
pub use secret_volume::SecretVolume;
pub use silent_dns::SilentDns;
pub use tls::TestCa;
pub use webproxy_testkit::{
    ALLOW_PRIVATE_NETWORKS, Gate, Gateway, NATS_CLI_VARS, NatsServer, Service, ServiceOptions,
    Upstream, closed_port, default_routes, fails_once_routes, free_port, http_client, large_body,
    large_body_byte, large_routes, run_webproxy, wait_for, wait_until, webproxy_bin,
};
pub use webproxy_testkit::{adaptive, process, recovery};

/// The dead-letter streams under the default prefix that exist now: each pool's
/// (`WEBPROXY_POOL_<POOL>_DEAD`) by name, then the retired shared one of layout 2
/// (`WEBPROXY_DEAD`), if it is there.
pub async fn dead_streams(js: &async_nats::jetstream::Context) -> Vec<String> {
    try_dead_streams(js).await.expect("list streams")
}

/// [`dead_streams`], or `None` while JetStream cannot answer.
pub async fn try_dead_streams(js: &async_nats::jetstream::Context) -> Option<Vec<String>> {
    let mut dead = pool_streams_ending(js, "_DEAD").await?;
    if js.get_stream("WEBPROXY_DEAD").await.is_ok() {
        dead.push("WEBPROXY_DEAD".to_string());
    }
    Some(dead)
}

/// Each pool's replies stream (`WEBPROXY_POOL_<POOL>_REPLIES`) that exists now, by
/// name; `None` while JetStream cannot answer.
pub async fn replies_streams(js: &async_nats::jetstream::Context) -> Option<Vec<String>> {
    pool_streams_ending(js, "_REPLIES").await
}

async fn pool_streams_ending(
    js: &async_nats::jetstream::Context,
    suffix: &str,
) -> Option<Vec<String>> {
    use futures::TryStreamExt as _;
    let names: Vec<String> = js.stream_names().try_collect().await.ok()?;
    let mut found: Vec<String> = names
        .into_iter()
        .filter(|n| n.starts_with("WEBPROXY_POOL_") && n.ends_with(suffix))
        .collect();
    found.sort();
    Some(found)
}

/// How many messages every dead-letter stream of [`dead_streams`] holds together;
/// `None` while JetStream cannot answer.
pub async fn dead_letter_count(js: &async_nats::jetstream::Context) -> Option<u64> {
    let mut count = 0;
    for name in try_dead_streams(js).await? {
        let mut stream = js.get_stream(&name).await.ok()?;
        count += stream.info().await.ok()?.state.messages;
    }
    Some(count)
}
