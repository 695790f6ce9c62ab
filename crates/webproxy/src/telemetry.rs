//! Logging setup. Returns a guard that flushes what it buffers when dropped, so that
//! exporters added later keep the same shape. Every line passes the [`Redactor`], so
//! no injected secret is ever logged, at any level, by any crate.

use std::io::{IsTerminal as _, Write};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use webproxy_dispatcher::secrets::Redactor;

/// Keeps telemetry alive until the process ends.
#[derive(Debug)]
pub struct TelemetryGuard {
    _private: (),
}

/// Logs to stderr: text on a terminal, JSON otherwise; the level comes from `RUST_LOG`,
/// else `default_level`. Secret values `redactor` knows (now or later) are replaced.
pub fn init(default_level: &str, redactor: Redactor) -> TelemetryGuard {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let terminal = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(terminal)
        .with_writer(RedactingStderr { redactor });
    if terminal {
        builder.init();
    } else {
        builder.json().flatten_event(true).init();
    }
    TelemetryGuard { _private: () }
}

/// Hands each log event a buffer that is redacted and written to stderr whole when
/// the event is done (the formatter writes one event per writer).
struct RedactingStderr {
    redactor: Redactor,
}

impl<'a> MakeWriter<'a> for RedactingStderr {
    type Writer = RedactedLine;

    fn make_writer(&'a self) -> RedactedLine {
        RedactedLine {
            buffer: Vec::new(),
            redactor: self.redactor.clone(),
        }
    }
}

struct RedactedLine {
    buffer: Vec<u8>,
    redactor: Redactor,
}

impl Write for RedactedLine {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for RedactedLine {
    fn drop(&mut self) {
        if self.buffer.is_empty() {
            return;
        }
        let line = self.redactor.redact_bytes(&self.buffer);
        // A log line that cannot be written has nowhere else to go.
        let _ = std::io::stderr().lock().write_all(&line);
    }
}
