//! Trace context across NATS and HTTP: the caller's `traceparent`/`tracestate`
//! message headers become the parent of webproxy's spans, and the current span's
//! context goes out on the upstream request and on the reply. Uses the globally
//! installed propagator, which the binary sets to W3C trace context. An empty
//! `tracestate` (the propagator writes one whenever the trace has no vendor state) is
//! never sent: W3C allows leaving it out, and some receivers reject an empty one.
//!
//! OpenTelemetry spans are built only when they are exported (the binary installs the
//! layer then): building them costs about a tenth of a conversation's CPU. Without
//! them the context is made here, in the same shape: each delivery is a span of the
//! caller's trace with an id of its own ([`in_request`]), each attempt a child of it
//! ([`attempt_context`]); a request without trace context starts a new, sampled trace,
//! as the SDK's default sampler would.

use std::future::Future;

use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Context, global};
use tracing::{Instrument as _, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

tokio::task_local! {
    /// The span context of the delivery being handled in this task: the `webproxy
    /// request` span's when spans are built, else one made by [`in_request`].
    static REQUEST: SpanContext;
}

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
        if !value.is_empty() {
            self.0.insert(key, value.as_str());
        }
    }
}

struct HttpHeaders<'a>(&'a mut Vec<(String, String)>);

impl Injector for HttpHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The attempt's own context replaces whatever trace header the caller put in
        // the request's HTTP headers.
        self.0.retain(|(name, _)| !name.eq_ignore_ascii_case(key));
        if !value.is_empty() {
            self.0.push((key.to_string(), value));
        }
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

/// Runs `work`, the handling of one delivery, in `span`, whose parent is the caller's
/// context `parent`: log lines and published contexts inside it belong to the span.
pub(crate) async fn in_request<F: Future>(span: Span, parent: Context, work: F) -> F::Output {
    let _ = span.set_parent(parent.clone());
    let built = span.context().span().span_context().clone();
    let own = if built.is_valid() {
        built
    } else {
        child_of(parent.span().span_context())
    };
    REQUEST.scope(own, work.instrument(span)).await
}

/// The context the reply carries: the request span's.
pub(crate) fn request_context() -> Context {
    let built = Span::current().context();
    if built.span().span_context().is_valid() {
        return built;
    }
    REQUEST
        .try_with(|own| Context::new().with_remote_span_context(own.clone()))
        .unwrap_or_default()
}

/// The context an attempt's upstream request carries: the attempt span's, or, when
/// spans are not built, a new child of the request's.
pub(crate) fn attempt_context(span: &Span) -> Context {
    let built = span.context();
    if built.span().span_context().is_valid() {
        return built;
    }
    REQUEST
        .try_with(|own| Context::new().with_remote_span_context(child_of(own)))
        .unwrap_or_default()
}

/// The trace and span ids of the delivery handled in this task, for its log lines.
pub fn request_ids() -> Option<(TraceId, SpanId)> {
    REQUEST.try_with(|own| (own.trace_id(), own.span_id())).ok()
}

/// A new span of `parent`'s trace, or the root of a new sampled trace when `parent` is
/// not valid (pure but for the random ids).
fn child_of(parent: &SpanContext) -> SpanContext {
    let span_id = SpanId::from(fastrand::u64(1..));
    if parent.is_valid() {
        SpanContext::new(
            parent.trace_id(),
            span_id,
            parent.trace_flags(),
            false,
            parent.trace_state().clone(),
        )
    } else {
        SpanContext::new(
            TraceId::from(fastrand::u128(1..)),
            span_id,
            TraceFlags::SAMPLED,
            false,
            TraceState::NONE,
        )
    }
}

/// Copies the trace headers of `from`, so a hop keeps the caller's trace.
pub(crate) fn forward(from: Option<&HeaderMap>, to: &mut HeaderMap) {
    for name in TRACE_HEADERS {
        if let Some(value) = from.and_then(|h| h.get(name))
            && !value.as_str().is_empty()
        {
            to.insert(name, value.clone());
        }
    }
}

/// Span fields as i64: OpenTelemetry has no unsigned integers, and u64 fields would be
/// exported as strings.
pub(crate) fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use opentelemetry_sdk::propagation::TraceContextPropagator;

    use super::*;

    fn context(state: TraceState) -> Context {
        Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").expect("trace id"),
            SpanId::from_hex("b7ad6b7169203331").expect("span id"),
            TraceFlags::SAMPLED,
            true,
            state,
        ))
    }

    /// Without vendor state only `traceparent` goes out, on NATS and HTTP alike, and a
    /// caller's HTTP `tracestate` is dropped rather than left beside a new parent; with
    /// vendor state both go out.
    #[test]
    fn an_empty_tracestate_is_never_sent() {
        global::set_text_map_propagator(TraceContextPropagator::new());
        let mut nats = HeaderMap::new();
        inject_nats(&context(TraceState::NONE), &mut nats);
        assert!(nats.get("traceparent").is_some());
        assert!(nats.get("tracestate").is_none(), "{nats:?}");
        let mut http = vec![("TraceState".to_string(), "caller=1".to_string())];
        inject_http(&context(TraceState::NONE), &mut http);
        let names: Vec<&str> = http.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["traceparent"]);

        let state = TraceState::from_key_value([("vendor", "x")]).expect("state");
        let mut nats = HeaderMap::new();
        inject_nats(&context(state.clone()), &mut nats);
        assert_eq!(nats.get("tracestate").map(|v| v.as_str()), Some("vendor=x"));
        let mut http = Vec::new();
        inject_http(&context(state), &mut http);
        assert!(http.contains(&("tracestate".to_string(), "vendor=x".to_string())));

        let mut from = HeaderMap::new();
        from.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        from.insert("tracestate", "");
        let mut to = HeaderMap::new();
        forward(Some(&from), &mut to);
        assert!(to.get("traceparent").is_some());
        assert!(to.get("tracestate").is_none(), "{to:?}");
    }

    /// Without spans, a delivery is a new span of the caller's trace, its attempts
    /// children of it, and what is published inside carries them; a delivery without a
    /// caller's trace starts a new one; outside a delivery there is no context.
    #[tokio::test]
    async fn without_spans_the_context_is_made_in_the_callers_trace() {
        let caller = context(TraceState::NONE);
        let caller_span = caller.span().span_context().clone();
        let (request, attempt, ids) = in_request(Span::none(), caller, async {
            let request = request_context().span().span_context().clone();
            let attempt = attempt_context(&Span::none()).span().span_context().clone();
            (request, attempt, request_ids())
        })
        .await;
        assert_eq!(request.trace_id(), caller_span.trace_id());
        assert_ne!(request.span_id(), caller_span.span_id());
        assert_eq!(request.trace_flags(), TraceFlags::SAMPLED);
        assert_eq!(attempt.trace_id(), caller_span.trace_id());
        assert_ne!(attempt.span_id(), request.span_id());
        assert_eq!(ids, Some((request.trace_id(), request.span_id())));

        let root = in_request(Span::none(), Context::new(), async {
            request_context().span().span_context().clone()
        })
        .await;
        assert!(root.is_valid());
        assert_ne!(root.trace_id(), caller_span.trace_id());

        assert_eq!(request_ids(), None);
        assert!(!request_context().span().span_context().is_valid());
    }
}
