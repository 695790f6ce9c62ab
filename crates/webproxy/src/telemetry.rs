//! Logging setup. Returns a guard that flushes what it buffers when dropped, so that
//! exporters added later keep the same shape.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Keeps telemetry alive until the process ends.
#[derive(Debug)]
pub struct TelemetryGuard {
    _private: (),
}

/// Logs to stderr: text on a terminal, JSON otherwise; the level comes from `RUST_LOG`,
/// else `default_level`.
pub fn init(default_level: &str) -> TelemetryGuard {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::io::stderr().is_terminal() {
        builder.init();
    } else {
        builder.json().flatten_event(true).init();
    }
    TelemetryGuard { _private: () }
}
