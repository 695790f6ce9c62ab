//! Logs and traces. Spans exist and W3C trace context propagates whether or not an
//! exporter is configured; `[telemetry] otlp_endpoint` only adds OTLP/HTTP export.
//! Set up outside the async runtime, because the exporter's blocking HTTP client must
//! not be dropped inside it; the returned guard flushes and shuts down on drop.

use std::io::IsTerminal as _;

use anyhow::Context as _;
use opentelemetry::global;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use webproxy_dispatcher::config::{LogConfig, LogFormat, TelemetryConfig};

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
/// spans with the caller's trace as parent, exported when an endpoint is set.
pub fn init_service(
    log: &LogConfig,
    telemetry: &TelemetryConfig,
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
        provider = provider.with_batch_exporter(exporter);
    }
    let provider = provider.build();
    let traces = tracing_opentelemetry::layer().with_tracer(provider.tracer("webproxy"));
    let registry = tracing_subscriber::registry()
        .with(filter(&log.level))
        .with(traces);
    // Colour codes only where a person reads them, never in a log file.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json(log.format) {
        registry.with(fmt.json().flatten_event(true)).init();
    } else {
        registry.with(fmt).init();
    }
    Ok(TelemetryGuard {
        provider: Some(provider),
    })
}

/// The command-line tools' telemetry: warnings and errors as text on stderr.
pub fn init_cli() -> TelemetryGuard {
    tracing_subscriber::fmt()
        .with_env_filter(filter("warn"))
        .with_writer(std::io::stderr)
        .init();
    TelemetryGuard { provider: None }
}
