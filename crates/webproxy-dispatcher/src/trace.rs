//! Trace context across NATS and HTTP: the caller's `traceparent`/`tracestate`
//! message headers become the parent of webproxy's spans, and the current span's
//! context goes out on the upstream request and on the reply. Uses the globally
//! installed propagator, which the binary sets to W3C trace context.

use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::{Context, global};

/// The headers trace context travels in, which hops forward unchanged.
pub(crate) const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

struct NatsHeaders<'a>(Option<&'a HeaderMap>);

impl Extractor for NatsHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0?.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        TRACE_HEADERS.to_vec()
    }
}

struct NatsHeadersMut<'a>(&'a mut HeaderMap);

impl Injector for NatsHeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

struct HttpHeaders<'a>(&'a mut Vec<(String, String)>);

impl Injector for HttpHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The attempt's own context replaces whatever trace header the caller put in
        // the request's HTTP headers.
        self.0.retain(|(name, _)| !name.eq_ignore_ascii_case(key));
        self.0.push((key.to_string(), value));
    }
}

/// The caller's trace context from a message's headers (an empty context when there is
/// none, so webproxy's spans start a new trace).
pub(crate) fn extract(headers: Option<&HeaderMap>) -> Context {
    global::get_text_map_propagator(|p| p.extract(&NatsHeaders(headers)))
}

/// Writes `context` into NATS headers.
pub(crate) fn inject_nats(context: &Context, headers: &mut HeaderMap) {
    global::get_text_map_propagator(|p| p.inject_context(context, &mut NatsHeadersMut(headers)));
}

/// Writes `context` into outbound HTTP headers.
pub(crate) fn inject_http(context: &Context, headers: &mut Vec<(String, String)>) {
    global::get_text_map_propagator(|p| p.inject_context(context, &mut HttpHeaders(headers)));
}

/// Copies the trace headers of `from`, so a hop keeps the caller's trace.
pub(crate) fn forward(from: Option<&HeaderMap>, to: &mut HeaderMap) {
    for name in TRACE_HEADERS {
        if let Some(value) = from.and_then(|h| h.get(name)) {
            to.insert(name, value.clone());
        }
    }
}
