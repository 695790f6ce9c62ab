//! webproxy's integration tests' fixtures: those the bench shares come from
//! `webproxy-testkit` (a private nats-server per test, the `webproxy serve` binary as a
//! subprocess, an in-process HTTP upstream, bounded waits) and are re-exported here at
//! the paths the tests use; the rest (a caller's side of the protocol, a nats-server
//! cluster, a TCP relay, a test CA, the deploy file's users, a Secret volume, a DNS
//! server that never answers, config pushes and `webproxy pools`' output) live in this
//! package.
//!
//! Nothing here is shared between tests (ports, store dirs and config files are
//! all per-fixture), so tests can run in parallel. Everything listens on and
//! talks to loopback only (127.0.0.0/8, ::1).
//!
//! This package enables `webproxy-dispatcher`'s `test-hooks`, so a workspace build gives
//! the spawned binary the fault-injection hooks; the bench does not depend on it.

pub mod authorized;
pub mod caller;
mod cluster;
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
    Upstream, closed_port, default_routes, fails_once_routes, free_port, http_client, run_webproxy,
    wait_for, wait_until, webproxy_bin,
};
pub use webproxy_testkit::{adaptive, process, recovery};
