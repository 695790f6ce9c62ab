//! Fault-injection hooks for the integration tests, compiled only with the
//! `test-hooks` feature and switched on by `WEBPROXY_TEST_HOOK` on the service process.
//! Without the feature every hook is a constant no-op.

/// Whether the named hook is switched on for this process.
#[cfg(feature = "test-hooks")]
fn on(name: &str) -> bool {
    std::env::var("WEBPROXY_TEST_HOOK").is_ok_and(|hooks| hooks.split(',').any(|h| h == name))
}

/// Whether the named hook is switched on, for hooks in the binaries (the gateway's):
/// always false without the feature.
pub fn test_hook(name: &str) -> bool {
    #[cfg(feature = "test-hooks")]
    if on(name) {
        tracing::warn!(hook = name, "test hook switched on");
        return true;
    }
    let _ = name;
    false
}

/// `stamp-attempts`: every attempt carries `x-webproxy-test-started: <µs since the Unix
/// epoch>`, the system clock as the attempt leaves the gate, so that a rate test counts
/// attempts by when the service started them. An upstream in the test process stamps
/// an arrival only once that process runs: on a loaded machine it went unscheduled for
/// up to 400 ms, and bunched calls started over 1.2 s into one second.
pub(super) fn attempt_stamp() -> Option<(String, String)> {
    #[cfg(feature = "test-hooks")]
    if on("stamp-attempts") {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return Some((
            "x-webproxy-test-started".to_string(),
            now.as_micros().to_string(),
        ));
    }
    None
}

/// `lose-park-ack`: the delivery that parked a retry is not acked, as if the ack were
/// lost, so the server redelivers it after `ack_wait`.
pub(super) fn lose_park_ack() -> bool {
    #[cfg(feature = "test-hooks")]
    if on("lose-park-ack") {
        tracing::warn!("test hook lose-park-ack: not acking the delivery that parked");
        return true;
    }
    false
}

/// `exit-after-dead-letter`: the process exits (code 86) right after a dead letter is
/// stored, before the reply is published, as a crash there would.
pub(super) fn exit_after_dead_letter() {
    #[cfg(feature = "test-hooks")]
    if on("exit-after-dead-letter") {
        tracing::warn!("test hook exit-after-dead-letter: exiting before the reply");
        std::process::exit(86);
    }
}

/// `WEBPROXY_TEST_PROGRESS_OUTAGE=<path>`: every progress record operation fails while
/// the file at `path` exists, as during an outage of the bucket's stream alone (which
/// one nats-server cannot stage: a missing stream is made again, and a stopped server
/// stops the pool stream too). The test makes and removes the file.
pub(super) fn progress_outage() -> bool {
    #[cfg(feature = "test-hooks")]
    if let Some(path) = std::env::var_os("WEBPROXY_TEST_PROGRESS_OUTAGE") {
        return std::path::Path::new(&path).exists();
    }
    false
}

/// `WEBPROXY_TEST_OWNER_WAIT=<path>`: the lease holder waits before each pool consumer
/// write, after its round checked the lease, while the file at `path` exists (at most
/// a minute), as an owner paused there would; the test takes the lease away meanwhile.
pub(super) async fn owner_waits_before_write() {
    #[cfg(feature = "test-hooks")]
    if let Some(path) = std::env::var_os("WEBPROXY_TEST_OWNER_WAIT") {
        let path = std::path::Path::new(&path);
        if path.exists() {
            tracing::warn!("test hook owner-wait: waiting before a pool consumer write");
        }
        let started = std::time::Instant::now();
        while path.exists() && started.elapsed() < std::time::Duration::from_secs(60) {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}
