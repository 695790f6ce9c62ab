//! Fixtures shared by webproxy's integration tests and its bench: a private
//! nats-server, the `webproxy serve` and `webproxy gateway` binaries as subprocesses, an in-process HTTP
//! upstream on loopback that counts what it sees, and bounded waits.
//!
//! Nothing here is shared between users (ports, store dirs and config files are
//! all per-fixture), so tests can run in parallel. Everything listens on and
//! talks to loopback only (127.0.0.0/8, ::1).
//!
//! The service's address guard denies loopback by default, so [`Service::start`]
//! sets `WEBPROXY_OUTBOUND__ALLOW_PRIVATE_NETWORKS=true`; guard tests start it with
//! [`ServiceOptions::guarded`] and open exactly what they need in the config.
//!
//! This crate depends on no crate of the service's, so a package that uses it (the
//! bench) never builds the service with the tests' `test-hooks` feature (issue 15);
//! the `recovery` and `adaptive` features add only the Rust client.

#[cfg(feature = "adaptive")]
pub mod adaptive;
pub mod authorization;
mod gateway;
mod nats;
pub mod process;
#[cfg(feature = "recovery")]
pub mod recovery;
pub mod rules;
mod service;
mod upstream;
mod wait;

use std::sync::Once;

pub use gateway::Gateway;
pub use nats::NatsServer;
pub use service::{
    ALLOW_PRIVATE_NETWORKS, NATS_CLI_VARS, Service, ServiceOptions, run_webproxy, webproxy_bin,
};
pub use upstream::{
    Gate, Upstream, default_routes, fails_once_routes, large_body, large_body_byte, large_routes,
};
pub use wait::{closed_port, free_port, wait_for, wait_until};

/// A reqwest client for talking to fixtures: no proxy, so a developer's
/// `HTTP_PROXY` can never route loopback test traffic off the machine.
pub fn http_client() -> reqwest::Client {
    install_crypto_provider();
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("build reqwest client")
}

/// The workspace builds reqwest with `rustls-no-provider`, and building any
/// client (even a plain-http one) panics unless a process-wide provider exists.
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err only means another provider is already installed, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The last `max` bytes of `text` (on a char boundary), for panic messages
/// that should show the end of a log without flooding the terminal.
fn tail(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}
