//! Logs and traces. W3C trace context propagates whether or not an exporter is
//! configured. OTLP export is on when the standard environment names an
//! endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, as the
//! OpenTelemetry Operator injects) or `[telemetry] otlp_endpoint` does; the environment
//! wins, and `OTEL_EXPORTER_OTLP_PROTOCOL` picks gRPC, HTTP/protobuf (the default) or
//! HTTP/JSON. Set up with the async runtime entered (the gRPC exporter's channel needs
//! it) and dropped before the runtime is, since the guard flushes on drop. Every log
//! line passes the [`Redactor`], so no injected secret is ever logged, at any level, by
//! any crate; so does every exported span ([`RedactingExporter`]). JSON log lines logged
//! while a delivery is handled carry its `trace_id` and `span_id`. Spans are built only
//! when they are exported; log lines are events alone.

use std::io::{IsTerminal as _, Write};

use std::borrow::Cow;

use crate::config::schema::{LogConfig, LogFormat, TelemetryConfig};
use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::trace::{SpanId, Status, TraceId};
use opentelemetry::{Array, Key, KeyValue, StringValue, Value, global};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::resource::{EnvResourceDetector, ResourceDetector as _};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{FilterExt as _, Targets, filter_fn};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Registry};
use webproxy_config::Redactor;

/// Keeps telemetry alive; dropping it exports the spans still buffered.
#[derive(Debug)]
pub(crate) struct TelemetryGuard {
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

/// The standard OpenTelemetry variables that decide export and the service name, as
/// read at start (empty counts as unset, as in the exporter).
#[derive(Debug, Default)]
struct OtelEnv {
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set; the
    /// exporter reads and resolves them itself.
    endpoint_set: bool,
    /// `(variable, value)`: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`.
    protocol: Option<(&'static str, String)>,
    /// `OTEL_SERVICE_NAME`.
    service_name: Option<String>,
    /// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`.
    resource_service_name: Option<String>,
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.is_empty())
}

impl OtelEnv {
    fn read() -> OtelEnv {
        let endpoint_set = [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .into_iter()
        .any(|name| env_var(name).is_some());
        let protocol = [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ]
        .into_iter()
        .find_map(|name| env_var(name).map(|value| (name, value)));
        OtelEnv {
            endpoint_set,
            protocol,
            service_name: env_var("OTEL_SERVICE_NAME"),
            // The SDK's own parsing of the variable.
            resource_service_name: EnvResourceDetector::new()
                .detect()
                .get(&Key::new("service.name"))
                .map(|name| name.to_string())
                .filter(|name| !name.is_empty()),
        }
    }
}

/// Where and how spans are exported.
#[derive(Debug, PartialEq)]
struct Export {
    protocol: Protocol,
    /// `None`: the endpoint the environment names, which the exporter resolves (the
    /// signal path is appended to `OTEL_EXPORTER_OTLP_ENDPOINT` for HTTP, as specified).
    endpoint: Option<String>,
}

/// Export is on when the environment or the configuration names an endpoint; the
/// environment wins, as it does over a configured service name. The protocol defaults to
/// HTTP/protobuf, the specification's default, whatever the exporter's features prefer.
fn export(telemetry: &TelemetryConfig, env: &OtelEnv) -> anyhow::Result<Option<Export>> {
    let protocol = match &env.protocol {
        None => Protocol::HttpBinary,
        Some((_, value)) if value.eq_ignore_ascii_case("http/protobuf") => Protocol::HttpBinary,
        Some((_, value)) if value.eq_ignore_ascii_case("http/json") => Protocol::HttpJson,
        Some((_, value)) if value.eq_ignore_ascii_case("grpc") => Protocol::Grpc,
        Some((name, value)) => anyhow::bail!(
            "{name} = {value:?} is not an OTLP protocol: use grpc, http/protobuf or http/json"
        ),
    };
    if env.endpoint_set {
        return Ok(Some(Export {
            protocol,
            endpoint: None,
        }));
    }
    let configured = telemetry.otlp_endpoint.trim().trim_end_matches('/');
    if configured.is_empty() {
        return Ok(None);
    }
    // An HTTP endpoint is a URL per signal; gRPC has no path.
    let endpoint = if protocol == Protocol::Grpc || configured.ends_with("/v1/traces") {
        configured.to_string()
    } else {
        format!("{configured}/v1/traces")
    };
    Ok(Some(Export {
        protocol,
        endpoint: Some(endpoint),
    }))
}

/// `OTEL_SERVICE_NAME`, else `service.name` in `OTEL_RESOURCE_ATTRIBUTES`, else
/// `[telemetry] service_name`: the platform's name for the service (the OpenTelemetry
/// Operator sets both variables) wins over the file's.
fn service_name<'a>(env: &'a OtelEnv, configured: &'a str) -> &'a str {
    env.service_name
        .as_deref()
        .or(env.resource_service_name.as_deref())
        .unwrap_or(configured)
}

fn with_endpoint<B: WithExportConfig>(builder: B, endpoint: Option<&str>) -> B {
    match endpoint {
        Some(url) => builder.with_endpoint(url),
        None => builder,
    }
}

/// The OTLP exporter; every other `OTEL_EXPORTER_OTLP_*` setting (headers, timeout,
/// compression, insecure) is the exporter's own reading of the environment.
fn exporter(export: &Export) -> anyhow::Result<opentelemetry_otlp::SpanExporter> {
    // An https endpoint needs the process-wide rustls provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let builder = opentelemetry_otlp::SpanExporter::builder();
    let endpoint = export.endpoint.as_deref();
    let built = match export.protocol {
        Protocol::Grpc => with_endpoint(builder.with_tonic(), endpoint).build(),
        protocol => with_endpoint(builder.with_http().with_protocol(protocol), endpoint).build(),
    };
    built.with_context(|| match endpoint {
        Some(url) => format!("cannot export spans to telemetry.otlp_endpoint = {url}"),
        None => "cannot export spans to the endpoint OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or \
                 OTEL_EXPORTER_OTLP_ENDPOINT names"
            .to_string(),
    })
}

/// The service's telemetry: logs as `[log]` says (level overridden by `RUST_LOG`),
/// spans with the caller's trace as parent, exported when the environment or the
/// configuration names an endpoint. Secret values `redactor` knows (now or later) are
/// replaced in every log line. Call with the async runtime entered.
pub(crate) fn init_service(
    log: &LogConfig,
    telemetry: &TelemetryConfig,
    redactor: Redactor,
) -> anyhow::Result<TelemetryGuard> {
    global::set_text_map_propagator(TraceContextPropagator::new());
    let env = OtelEnv::read();
    // Spans are built only to be exported: without an exporter the dispatcher makes the
    // trace context it propagates itself, at a fraction of the cost.
    let provider = match export(telemetry, &env)? {
        Some(export) => Some(
            SdkTracerProvider::builder()
                // Resource::builder reads OTEL_RESOURCE_ATTRIBUTES; the name is set last
                // because its detectors let the attributes' service.name win over
                // OTEL_SERVICE_NAME.
                .with_resource(
                    Resource::builder()
                        .with_service_name(service_name(&env, &telemetry.service_name).to_string())
                        .build(),
                )
                .with_batch_exporter(RedactingExporter {
                    inner: exporter(&export)?,
                    redactor: redactor.clone(),
                })
                .build(),
        ),
        None => None,
    };
    // Spans are filtered apart from logs: a quieter log level must not stop the
    // caller's trace context from reaching the upstream and the reply.
    let traces = provider.as_ref().map(|provider| {
        let spans = Targets::new()
            .with_target("webproxy_dispatcher", Level::INFO)
            .with_target("webproxy", Level::INFO);
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("webproxy"))
            .with_filter(spans)
    });
    tracing_subscriber::registry()
        .with(layers(traces.map(|traces| traces.boxed()), log, redactor))
        .init();
    Ok(TelemetryGuard { provider })
}

/// One of the service's subscriber layers.
type ServiceLayer = Box<dyn tracing_subscriber::Layer<Registry> + Send + Sync>;

/// The service's layers: the span exporter's, when there is one, and the log lines'.
/// A list rather than an `Option` layer for the spans: an absent `Option` layer still
/// enables every span, and the registry then builds, enters and closes the request and
/// attempt spans of every conversation for nobody (issue 33's differential profile).
fn layers(traces: Option<ServiceLayer>, log: &LogConfig, redactor: Redactor) -> Vec<ServiceLayer> {
    let mut layers: Vec<ServiceLayer> = traces.into_iter().collect();
    // Colour codes only where a person reads them, never in a log file.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(RedactingStderr { redactor })
        .with_ansi(std::io::stderr().is_terminal());
    // Log lines are events alone, each with the fields it needs: a span seen by this
    // layer is formatted again on every field recorded into it, and its fields again in
    // every line logged inside it.
    let logs = filter(&log.level).and(filter_fn(|metadata| metadata.is_event()));
    if json(log.format) {
        let format = tracing_subscriber::fmt::format().json().flatten_event(true);
        layers.push(
            fmt.json()
                .with_current_span(false)
                .with_span_list(false)
                .event_format(JsonWithTraceIds { inner: format })
                .with_filter(logs)
                .boxed(),
        );
    } else {
        layers.push(fmt.with_filter(logs).boxed());
    }
    layers
}

/// A JSON event format whose lines start with `trace_id` and `span_id` when the event is
/// logged while a delivery is handled (the ids of its `webproxy request` span).
struct JsonWithTraceIds<F> {
    inner: F,
}

impl<S, N, F> FormatEvent<S, N> for JsonWithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let Some((trace_id, span_id)) = webproxy_dispatcher::request_ids() else {
            return self.inner.format_event(ctx, writer, event);
        };
        // Straight into the line, not through a second buffer.
        let mut line = IdsFirst::new(&mut writer, trace_id, span_id);
        self.inner.format_event(ctx, Writer::new(&mut line), event)
    }
}

/// Writes a JSON object with `trace_id` and `span_id` as its first members: passes
/// through what is written to it, opening the object with the ids.
struct IdsFirst<'a, W> {
    out: &'a mut W,
    ids: Option<(TraceId, SpanId)>,
    /// The ids are written and the object's next character decides the comma.
    after_ids: bool,
}

impl<'a, W: std::fmt::Write> IdsFirst<'a, W> {
    fn new(out: &'a mut W, trace_id: TraceId, span_id: SpanId) -> Self {
        IdsFirst {
            out,
            ids: Some((trace_id, span_id)),
            after_ids: false,
        }
    }
}

impl<W: std::fmt::Write> std::fmt::Write for IdsFirst<'_, W> {
    fn write_str(&mut self, mut text: &str) -> std::fmt::Result {
        // Not an object, there is nothing to put the ids in.
        if let Some((trace_id, span_id)) = self.ids.take()
            && let Some(rest) = text.strip_prefix('{')
        {
            write!(
                self.out,
                "{{\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\""
            )?;
            self.after_ids = true;
            text = rest;
        }
        if self.after_ids && !text.is_empty() {
            self.after_ids = false;
            if !text.starts_with('}') {
                self.out.write_char(',')?;
            }
        }
        self.out.write_str(text)
    }
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
pub(crate) fn init_cli() -> TelemetryGuard {
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
        // The formatter hands over a whole line in one write: it goes out as it is
        // redacted, with no copy into the buffer. Pieces are gathered first, so that a
        // secret split between two of them is still found.
        if self.buffer.is_empty() && bytes.ends_with(b"\n") {
            (self.sink)(&self.redactor.redact_bytes(bytes));
        } else {
            self.buffer.extend_from_slice(bytes);
        }
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

    fn text_of(buffer: &Mutex<Vec<u8>>) -> String {
        String::from_utf8(
            buffer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        )
        .expect("utf8")
    }

    #[test]
    fn without_an_exporter_no_span_is_built_and_logs_still_are() {
        let spans =
            || tracing::info_span!(target: "webproxy_dispatcher::conversation::handle", "request");
        for format in [LogFormat::Json, LogFormat::Text] {
            let log = LogConfig {
                format,
                level: "info".into(),
            };
            let subscriber =
                tracing_subscriber::registry().with(layers(None, &log, Redactor::default()));
            tracing::subscriber::with_default(subscriber, || {
                assert!(
                    spans().is_disabled(),
                    "{format:?}: a span was built for nobody"
                );
                assert!(tracing::event_enabled!(target: "webproxy_dispatcher", Level::INFO));
            });
            // With a layer that takes spans, the same span is built.
            let traces = tracing_subscriber::fmt::layer()
                .with_writer(std::io::sink)
                .with_filter(Targets::new().with_target("webproxy_dispatcher", Level::INFO))
                .boxed();
            let subscriber = tracing_subscriber::registry().with(layers(
                Some(traces),
                &log,
                Redactor::default(),
            ));
            tracing::subscriber::with_default(subscriber, || assert!(!spans().is_disabled()));
        }
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
        let captured = text_of(&CAPTURED);
        assert_eq!(captured.lines().count(), 6, "{captured}");
        assert!(!captured.contains("en-42"), "{captured}");
        assert_eq!(captured.matches("[REDACTED]").count(), 6, "{captured}");
    }

    fn telemetry(endpoint: &str) -> TelemetryConfig {
        TelemetryConfig {
            otlp_endpoint: endpoint.to_string(),
            service_name: "webproxy".to_string(),
        }
    }

    fn protocol(value: &str) -> OtelEnv {
        OtelEnv {
            protocol: Some(("OTEL_EXPORTER_OTLP_PROTOCOL", value.to_string())),
            ..OtelEnv::default()
        }
    }

    #[test]
    fn export_is_on_when_the_environment_or_the_file_names_an_endpoint() {
        assert_eq!(
            export(&telemetry(""), &OtelEnv::default()).expect("ok"),
            None
        );
        let from_env = OtelEnv {
            endpoint_set: true,
            ..OtelEnv::default()
        };
        // The environment's endpoint wins, and the exporter resolves it.
        for configured in ["", "http://file:4318"] {
            assert_eq!(
                export(&telemetry(configured), &from_env).expect("ok"),
                Some(Export {
                    protocol: Protocol::HttpBinary,
                    endpoint: None
                })
            );
        }
        assert_eq!(
            export(&telemetry("http://c:4318/"), &OtelEnv::default()).expect("ok"),
            Some(Export {
                protocol: Protocol::HttpBinary,
                endpoint: Some("http://c:4318/v1/traces".into())
            })
        );
        assert_eq!(
            export(&telemetry("http://c:4317"), &protocol("grpc")).expect("ok"),
            Some(Export {
                protocol: Protocol::Grpc,
                endpoint: Some("http://c:4317".into())
            })
        );
        assert_eq!(
            export(
                &telemetry("http://c:4318/v1/traces"),
                &protocol("HTTP/JSON")
            )
            .expect("ok")
            .map(|e| (e.protocol, e.endpoint)),
            Some((Protocol::HttpJson, Some("http://c:4318/v1/traces".into())))
        );
        let error = export(&telemetry("http://c:4318"), &protocol("thrift"))
            .expect_err("not a protocol")
            .to_string();
        assert!(
            error.contains("OTEL_EXPORTER_OTLP_PROTOCOL") && error.contains("thrift"),
            "{error}"
        );
    }

    #[test]
    fn the_environments_service_name_wins_over_the_files() {
        let mut env = OtelEnv::default();
        assert_eq!(service_name(&env, "from-file"), "from-file");
        env.resource_service_name = Some("from-attributes".into());
        assert_eq!(service_name(&env, "from-file"), "from-attributes");
        env.service_name = Some("from-otel-service-name".into());
        assert_eq!(service_name(&env, "from-file"), "from-otel-service-name");
    }

    #[test]
    fn trace_ids_become_the_first_members_of_a_json_line() {
        let trace_id = TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").expect("id");
        let span_id = SpanId::from_hex("b7ad6b7169203331").expect("id");
        let with_trace_ids = |line: &str, trace_id, span_id| {
            let mut out = String::new();
            // In pieces, as a formatter writes.
            let mut ids = IdsFirst::new(&mut out, trace_id, span_id);
            for piece in line.split_inclusive(['{', '"']) {
                std::fmt::Write::write_str(&mut ids, piece).expect("write");
            }
            out
        };
        let line = with_trace_ids("{\"level\":\"INFO\"}\n", trace_id, span_id);
        let parsed: serde_json::Value = serde_json::from_str(&line).expect("json");
        assert_eq!(parsed["trace_id"], "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(parsed["span_id"], "b7ad6b7169203331");
        assert_eq!(parsed["level"], "INFO");
        assert!(line.ends_with('\n'));
        let empty: serde_json::Value =
            serde_json::from_str(&with_trace_ids("{}", trace_id, span_id)).expect("json");
        assert_eq!(empty["span_id"], "b7ad6b7169203331");
        assert_eq!(with_trace_ids("not json", trace_id, span_id), "not json");
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
