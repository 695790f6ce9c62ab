//! Logs and traces. Spans exist and W3C trace context propagates whether or not an
//! exporter is configured; `[telemetry] otlp_endpoint` only adds OTLP/HTTP export.
//! Set up outside the async runtime, because the exporter's blocking HTTP client must
//! not be dropped inside it; the returned guard flushes and shuts down on drop. Every
//! log line passes the [`Redactor`], so no injected secret is ever logged, at any
//! level, by any crate; so does every exported span ([`RedactingExporter`]).

use std::io::{IsTerminal as _, Write};

use std::borrow::Cow;

use crate::config::{LogConfig, LogFormat, TelemetryConfig};
use anyhow::Context as _;
use opentelemetry::trace::Status;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Array, KeyValue, StringValue, Value, global};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use tracing::Level;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use webproxy_dispatcher::Redactor;

/// Keeps telemetry alive; dropping it exports the spans still buffered.
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("warning: could not flush spans: {e}");
        }
    }
}

fn filter(default_level: &str) -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level))
}

fn json(format: LogFormat) -> bool {
    match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    }
}

/// The service's telemetry: logs as `[log]` says (level overridden by `RUST_LOG`),
/// spans with the caller's trace as parent, exported when an endpoint is set. Secret
/// values `redactor` knows (now or later) are replaced in every log line.
pub fn init_service(
    log: &LogConfig,
    telemetry: &TelemetryConfig,
    redactor: Redactor,
) -> anyhow::Result<TelemetryGuard> {
    global::set_text_map_propagator(TraceContextPropagator::new());
    // Resource::builder reads OTEL_RESOURCE_ATTRIBUTES; the configured name wins.
    let resource = Resource::builder()
        .with_service_name(telemetry.service_name.clone())
        .build();
    let mut provider = SdkTracerProvider::builder().with_resource(resource);
    let endpoint = telemetry.otlp_endpoint.trim().trim_end_matches('/');
    if !endpoint.is_empty() {
        // An https endpoint needs the process-wide rustls provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let url = if endpoint.ends_with("/v1/traces") {
            endpoint.to_string()
        } else {
            format!("{endpoint}/v1/traces")
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url.clone())
            .build()
            .with_context(|| format!("cannot export spans to telemetry.otlp_endpoint = {url}"))?;
        provider = provider.with_batch_exporter(RedactingExporter {
            inner: exporter,
            redactor: redactor.clone(),
        });
    }
    let provider = provider.build();
    // Spans are filtered apart from logs: a quieter log level must not stop the
    // caller's trace context from reaching the upstream and the reply.
    let spans = Targets::new()
        .with_target("webproxy_dispatcher", Level::INFO)
        .with_target("webproxy", Level::INFO);
    let traces = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("webproxy"))
        .with_filter(spans);
    let registry = tracing_subscriber::registry().with(traces);
    // Colour codes only where a person reads them, never in a log file.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(RedactingStderr { redactor })
        .with_ansi(std::io::stderr().is_terminal());
    let logs = filter(&log.level);
    if json(log.format) {
        registry
            .with(fmt.json().flatten_event(true).with_filter(logs))
            .init();
    } else {
        registry.with(fmt.with_filter(logs)).init();
    }
    Ok(TelemetryGuard {
        provider: Some(provider),
    })
}

/// A span exporter that hands spans on with every secret value the [`Redactor`]
/// knows replaced: names, string attributes, events, links and status descriptions,
/// as in log lines. Span fields carry URLs' hosts, error messages and upstream
/// failures, any of which could hold a value that must not leave the process.
#[derive(Debug)]
struct RedactingExporter<E> {
    inner: E,
    redactor: Redactor,
}

impl<E: SpanExporter> SpanExporter for RedactingExporter<E> {
    fn export(
        &self,
        mut batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        for span in &mut batch {
            redact_span(span, &self.redactor);
        }
        self.inner.export(batch)
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

fn redact_span(span: &mut SpanData, redactor: &Redactor) {
    if let Cow::Owned(name) = redactor.redact(&span.name) {
        span.name = name.into();
    }
    redact_attributes(&mut span.attributes, redactor);
    for event in &mut span.events.events {
        if let Cow::Owned(name) = redactor.redact(&event.name) {
            event.name = name.into();
        }
        redact_attributes(&mut event.attributes, redactor);
    }
    for link in &mut span.links.links {
        redact_attributes(&mut link.attributes, redactor);
    }
    if let Status::Error { description } = &mut span.status
        && let Cow::Owned(redacted) = redactor.redact(description)
    {
        *description = redacted.into();
    }
}

fn redact_attributes(attributes: &mut [KeyValue], redactor: &Redactor) {
    let redact = |text: &StringValue| match redactor.redact(text.as_str()) {
        Cow::Owned(redacted) => Some(StringValue::from(redacted)),
        Cow::Borrowed(_) => None,
    };
    for attribute in attributes {
        match &mut attribute.value {
            Value::String(text) => {
                if let Some(redacted) = redact(text) {
                    *text = redacted;
                }
            }
            Value::Array(Array::String(texts)) => {
                for text in texts {
                    if let Some(redacted) = redact(text) {
                        *text = redacted;
                    }
                }
            }
            _ => {}
        }
    }
}

/// The command-line tools' telemetry: warnings and errors as text on stderr.
pub fn init_cli() -> TelemetryGuard {
    tracing_subscriber::fmt()
        .with_env_filter(filter("warn"))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    TelemetryGuard { provider: None }
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

    /// Collects what the redacting exporter hands on.
    #[derive(Debug, Clone, Default)]
    struct Collected(std::sync::Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Collected {
        fn export(
            &self,
            batch: Vec<SpanData>,
        ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(batch);
            std::future::ready(Ok(()))
        }
    }

    /// What span export hands the OTLP exporter has every secret value replaced, in
    /// names, attributes (strings and string arrays), events and the status.
    #[test]
    fn exported_spans_are_redacted() {
        let redactor = Redactor::default();
        redactor.set(vec!["span-secret-5e".into()]);
        let collected = Collected::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(RedactingExporter {
                inner: collected.clone(),
                redactor: redactor.clone(),
            })
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "attempt",
                otel.name = "GET span-secret-5e.example",
                failure = tracing::field::Empty,
            );
            let _entered = span.enter();
            span.record("failure", "denied: Bearer span-secret-5e");
            tracing::error!(detail = "span-secret-5e", "event with span-secret-5e");
        });
        let mut spans = collected
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        assert_eq!(spans.len(), 1);
        let mut span = spans.remove(0);
        let shown = format!("{span:?}");
        assert!(!shown.contains("span-secret-5e"), "{shown}");
        assert!(shown.contains("[REDACTED]"), "{shown}");
        assert_eq!(span.name, "GET [REDACTED].example");

        // String arrays, link attributes and the status too.
        span.attributes.push(KeyValue::new(
            "list",
            Value::Array(Array::String(vec!["a span-secret-5e".into()])),
        ));
        span.status = Status::error("failed with span-secret-5e");
        redact_span(&mut span, &redactor);
        let shown = format!("{span:?}");
        assert!(!shown.contains("span-secret-5e"), "{shown}");
    }
}
