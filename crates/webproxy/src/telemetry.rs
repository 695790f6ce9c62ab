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

/// Where a finished, redacted log line goes.
type Sink = fn(&[u8]);

fn to_stderr(line: &[u8]) {
    // A log line that cannot be written has nowhere else to go.
    let _ = std::io::stderr().lock().write_all(line);
}

/// Hands each log event a buffer that is redacted and written whole when the event is
/// done (the formatter writes one event per writer).
struct RedactingStderr {
    redactor: Redactor,
}

impl RedactingStderr {
    fn line(&self, sink: Sink) -> RedactedLine {
        RedactedLine {
            buffer: Vec::new(),
            redactor: self.redactor.clone(),
            sink,
        }
    }
}

impl<'a> MakeWriter<'a> for RedactingStderr {
    type Writer = RedactedLine;

    fn make_writer(&'a self) -> RedactedLine {
        self.line(to_stderr)
    }
}

struct RedactedLine {
    buffer: Vec<u8>,
    redactor: Redactor,
    sink: Sink,
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
        if !self.buffer.is_empty() {
            (self.sink)(&self.redactor.redact_bytes(&self.buffer));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    static CAPTURED: Mutex<Vec<u8>> = Mutex::new(Vec::new());

    fn capture(line: &[u8]) {
        CAPTURED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(line);
    }

    struct Capturing(RedactingStderr);

    impl<'a> MakeWriter<'a> for Capturing {
        type Writer = RedactedLine;
        fn make_writer(&'a self) -> RedactedLine {
            self.0.line(capture)
        }
    }

    #[test]
    fn secrets_are_redacted_from_every_line_at_every_level_in_text_and_json() {
        let redactor = Redactor::default();
        let writer = RedactingStderr {
            redactor: redactor.clone(),
        };
        let text = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(Capturing(writer))
            .finish();
        let json = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .json()
            .with_writer(Capturing(RedactingStderr {
                redactor: redactor.clone(),
            }))
            .finish();
        // Set after the logger exists, as serve does once the config is loaded.
        redactor.set(vec!["tok\"en-42".into()]);
        for subscriber in [
            Box::new(text) as Box<dyn tracing::Subscriber + Send + Sync>,
            Box::new(json),
        ] {
            tracing::subscriber::with_default(subscriber, || {
                tracing::trace!(header = "Bearer tok\"en-42", "trace");
                tracing::debug!("debug tok\"en-42");
                tracing::error!(value = ?"tok\"en-42", "error");
            });
        }
        let captured = String::from_utf8(
            CAPTURED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        )
        .expect("utf8");
        assert_eq!(captured.lines().count(), 6, "{captured}");
        assert!(!captured.contains("en-42"), "{captured}");
        assert_eq!(captured.matches("[REDACTED]").count(), 6, "{captured}");
    }
}
