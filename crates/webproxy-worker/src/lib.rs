//! The HTTP call: one attempt as the caller sees it. A shared reqwest client, the
//! address guard on every address it connects to, redirects followed leg by leg with
//! each leg asked of the dispatcher's [`LegPolicy`] (rules and secrets) again, the
//! headers and injected credentials of each leg, a timeout for the whole chain, caps on
//! the response's size and headers, and a typed, redacted outcome. No NATS, no retries:
//! what to do with the outcome is the dispatcher's decision.

#![warn(unreachable_pub)]

mod chain;
mod dns;
/// The address guard's pure decision, public for the `guard_url` fuzz target.
pub mod guard;
mod large;
mod redirect;
mod resolve;

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use thiserror::Error;
use url::Url;
use webproxy_protocol::AttemptRecord;

pub use crate::chain::{Chain, ChainRequest, Denial, Leg, LegPolicy};
use crate::dns::{Dns, DnsError};
pub use crate::dns::{DnsConfig, DnsFailure};
use crate::guard::Denied;
pub use crate::guard::GuardPolicy;
use crate::large::{BodyError, BodyReader};
pub use crate::large::{
    BodySink, LargeBody, STORED_BODY_PREFIX, SinkError, SinkFuture, StreamedBody,
};
use crate::resolve::GuardedResolver;

/// Why the HTTP client could not be built.
#[derive(Debug, Error)]
pub enum BuildError {
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("cannot build the DNS resolver: {0}")]
    Dns(String),
}

/// Settings of the shared client.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The largest response body accepted; more is `TooLarge`.
    pub max_response_bytes: usize,
    /// Which addresses may be connected to.
    pub guard: GuardPolicy,
    /// The most response headers accepted; more is `HeadersTooLarge`.
    pub max_response_headers: usize,
    /// The most bytes of response header names and values accepted.
    pub max_response_header_bytes: usize,
    /// How host names are looked up, and the bounds on it.
    pub dns: DnsConfig,
}

impl WorkerConfig {
    /// The default guard (private networks denied) and header limits.
    pub fn new(max_response_bytes: usize) -> WorkerConfig {
        WorkerConfig {
            max_response_bytes,
            guard: GuardPolicy::default(),
            max_response_headers: 100,
            max_response_header_bytes: 64 * 1024,
            dns: DnsConfig::default(),
        }
    }
}

/// The request of one attempt.
#[derive(Debug, Clone)]
pub struct AttemptRequest<'a> {
    pub method: &'a str,
    pub url: &'a Url,
    pub headers: &'a [(String, String)],
    pub body: Bytes,
    pub timeout: Duration,
}

/// A complete HTTP response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    /// Names lower case, in the order received, a repeated header once per value.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl HttpResponse {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What kind of transport failure ended an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The connection was refused or could not be made.
    Connect,
    /// The host name did not resolve.
    Dns,
    /// The attempt ran out of time.
    Timeout,
    /// The connection broke after it was made.
    Reset,
    /// The TLS handshake failed (certificate, protocol).
    Tls,
    Other,
}

impl FailureKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FailureKind::Connect => "connect",
            FailureKind::Dns => "dns",
            FailureKind::Timeout => "timeout",
            FailureKind::Reset => "reset",
            FailureKind::Tls => "tls",
            FailureKind::Other => "other",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An attempt that produced no HTTP response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportFailure {
    pub kind: FailureKind,
    /// Whether the request may have reached the upstream: false only when no
    /// connection was ever established.
    pub may_have_reached_upstream: bool,
    pub message: String,
}

/// The outcome of one attempt.
#[derive(Debug, Clone)]
pub enum AttemptOutcome {
    Response(HttpResponse),
    Failed(TransportFailure),
    /// The response body exceeded `max_response_bytes` (or, for a request that opted
    /// in to a stored body, `max_large_body`): `limit`.
    TooLarge {
        status: u16,
        limit: usize,
    },
    /// The upstream answered, but its large body could not be stored: webproxy's
    /// failure, not the upstream's. `full`: the body store is full, so another try
    /// would fail alike.
    StoreFailed {
        status: u16,
        message: String,
        full: bool,
    },
    /// The response's headers exceeded a limit; `status` is unknown when the HTTP
    /// parser refused them.
    HeadersTooLarge {
        status: Option<u16>,
        message: String,
    },
    /// The address guard refused the destination: no connection was made to it.
    Denied {
        message: String,
    },
    /// The request cannot be sent as it is (a redirect to a URL webproxy refuses, such
    /// as one with user information): nothing was sent for it. Never produced by
    /// [`Worker::attempt`]; [`Worker::perform`] ends a chain with it.
    Invalid {
        message: String,
    },
}

impl AttemptOutcome {
    /// The HTTP status the upstream answered with, when it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            AttemptOutcome::Response(response) => Some(response.status),
            AttemptOutcome::TooLarge { status, .. }
            | AttemptOutcome::StoreFailed { status, .. } => Some(*status),
            AttemptOutcome::HeadersTooLarge { status, .. } => *status,
            AttemptOutcome::Failed(_)
            | AttemptOutcome::Denied { .. }
            | AttemptOutcome::Invalid { .. } => None,
        }
    }

    /// What ended an attempt that got no response, as its record and span tell it:
    /// the failure kind and message, `denied: ` or `invalid: ` and the message.
    pub fn failure(&self) -> Option<String> {
        match self {
            AttemptOutcome::Failed(f) => Some(format!("{}: {}", f.kind, f.message)),
            AttemptOutcome::Denied { message } => Some(format!("denied: {message}")),
            AttemptOutcome::Invalid { message } => Some(format!("invalid: {message}")),
            AttemptOutcome::Response(_)
            | AttemptOutcome::TooLarge { .. }
            | AttemptOutcome::StoreFailed { .. }
            | AttemptOutcome::HeadersTooLarge { .. } => None,
        }
    }

    /// The message webproxy wrote about the outcome, when it wrote one; the response
    /// itself (the upstream's own words) is not webproxy's.
    fn message_mut(&mut self) -> Option<&mut String> {
        match self {
            AttemptOutcome::Failed(failure) => Some(&mut failure.message),
            AttemptOutcome::HeadersTooLarge { message, .. }
            | AttemptOutcome::StoreFailed { message, .. }
            | AttemptOutcome::Denied { message }
            | AttemptOutcome::Invalid { message } => Some(message),
            AttemptOutcome::Response(_) | AttemptOutcome::TooLarge { .. } => None,
        }
    }

    /// The attempt's metric class (the `result` label): `2xx` to `5xx` by its status,
    /// the failure kind, or `other`.
    pub fn class(&self) -> &'static str {
        match self {
            AttemptOutcome::Failed(f) => f.kind.as_str(),
            _ => self.status().map_or("other", status_class),
        }
    }

    /// The attempt's record in the conversation's history: started `at` (RFC 3339),
    /// lasting `duration_ms`.
    pub fn record(&self, at: String, duration_ms: u64) -> AttemptRecord {
        AttemptRecord {
            at,
            status: self.status(),
            failure: self.failure(),
            duration_ms,
        }
    }
}

/// The class of an HTTP status for metrics.
fn status_class(status: u16) -> &'static str {
    match status {
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    }
}

/// Performs attempts over one shared connection pool.
#[derive(Debug, Clone)]
pub struct Worker {
    client: reqwest::Client,
    max_response_bytes: usize,
    max_response_headers: usize,
    max_response_header_bytes: usize,
    guard: Arc<GuardPolicy>,
}

impl Worker {
    pub fn new(config: &WorkerConfig) -> Result<Worker, BuildError> {
        // reqwest is built without a default crypto provider so that it shares ring with
        // async-nats instead of compiling a second one; installing twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let guard = Arc::new(config.guard.clone());
        let client = reqwest::Client::builder()
            // Redirects are followed by `Worker::perform`, leg by leg, so that every
            // leg is asked of the policy and guarded again.
            .redirect(reqwest::redirect::Policy::none())
            // Environment proxy settings would send requests somewhere no rule names,
            // and past the guard: the proxy's address is not the destination's.
            .no_proxy()
            .dns_resolver(GuardedResolver::new(
                guard.clone(),
                Dns::new(&config.dns).map_err(BuildError::Dns)?,
            ))
            .http1_max_headers(config.max_response_headers)
            .http2_max_header_list_size(
                u32::try_from(config.max_response_header_bytes + 32 * config.max_response_headers)
                    .unwrap_or(u32::MAX),
            )
            .pool_idle_timeout(Duration::from_secs(90))
            .connect_timeout(Duration::from_secs(10))
            .build()?;
        Ok(Worker {
            client,
            max_response_bytes: config.max_response_bytes,
            max_response_headers: config.max_response_headers,
            max_response_header_bytes: config.max_response_header_bytes,
            guard,
        })
    }

    /// The guard's decision on `url`'s host when it is an IP literal, which reqwest
    /// connects to without asking the resolver.
    fn check_url(&self, url: &Url) -> Result<(), Denied> {
        guard::check_url(url, &self.guard)
    }

    /// Performs one attempt. Never panics on what the network sends.
    pub async fn attempt(&self, request: AttemptRequest<'_>) -> AttemptOutcome {
        self.attempt_leg(request, None, None).await
    }

    /// One attempt whose body may go to `large`'s sink past the inline limit, and whose
    /// request body is `streamed` rather than `request.body` when given.
    pub(crate) async fn attempt_leg(
        &self,
        request: AttemptRequest<'_>,
        large: Option<&mut LargeBody<'_>>,
        streamed: Option<StreamedBody>,
    ) -> AttemptOutcome {
        let timeout = request.timeout;
        match tokio::time::timeout(timeout, self.attempt_inner(request, large, streamed)).await {
            Ok(outcome) => outcome,
            Err(_) => AttemptOutcome::Failed(TransportFailure {
                kind: FailureKind::Timeout,
                may_have_reached_upstream: true,
                message: format!("no complete response within {}", fmt_duration(timeout)),
            }),
        }
    }

    async fn attempt_inner(
        &self,
        request: AttemptRequest<'_>,
        large: Option<&mut LargeBody<'_>>,
        streamed: Option<StreamedBody>,
    ) -> AttemptOutcome {
        let started = Instant::now();
        if let Err(denied) = self.check_url(request.url) {
            return refused(&denied, request.url);
        }
        let method = match reqwest::Method::from_bytes(request.method.as_bytes()) {
            Ok(m) => m,
            Err(e) => return failed_other(format!("invalid method: {e}")),
        };
        let mut builder = self
            .client
            .request(method, request.url.clone())
            .timeout(request.timeout);
        for (name, value) in request.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        if let Some(streamed) = streamed {
            builder = builder.body(reqwest::Body::wrap(streamed));
        } else if !request.body.is_empty() {
            builder = builder.body(request.body);
        }
        let mut response = match builder.send().await {
            Ok(r) => r,
            Err(e) => return self.send_failed(&e, request.url, request.timeout, started),
        };
        let status = response.status().as_u16();
        if let Err(message) = check_response_headers(
            response.headers(),
            self.max_response_headers,
            self.max_response_header_bytes,
        ) {
            return AttemptOutcome::HeadersTooLarge {
                status: Some(status),
                message,
            };
        }
        let mut body = BodyReader::new(self.max_response_bytes, large, status);
        let too_large = |limit: u64| AttemptOutcome::TooLarge {
            status,
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
        };
        if response
            .content_length()
            .is_some_and(|len| len > body.limit())
        {
            return too_large(body.limit());
        }
        let headers = response
            .headers()
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_string(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect();
        let store_failed = |error: SinkError| AttemptOutcome::StoreFailed {
            status,
            message: error.message,
            full: error.full,
        };
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => match body.push(chunk).await {
                    Ok(()) => {}
                    Err(BodyError::TooLarge { limit }) => return too_large(limit),
                    Err(BodyError::Store(error)) => return store_failed(error),
                },
                Ok(None) => break,
                Err(e) => {
                    return AttemptOutcome::Failed(classify(&e, request.timeout, started));
                }
            }
        }
        match body.finish().await {
            Ok(body) => AttemptOutcome::Response(HttpResponse {
                status,
                headers,
                body,
            }),
            Err(BodyError::TooLarge { limit }) => too_large(limit),
            Err(BodyError::Store(error)) => store_failed(error),
        }
    }
}

impl Worker {
    /// The outcome of a request that got no response: a guard denial at connect time,
    /// a response head the HTTP parser refused as too large, or a transport failure.
    fn send_failed(
        &self,
        error: &reqwest::Error,
        url: &Url,
        timeout: Duration,
        started: Instant,
    ) -> AttemptOutcome {
        let chain = error_chain(error);
        if let Some(denied) = chain.iter().find_map(|e| e.downcast_ref::<Denied>()) {
            return refused(denied, url);
        }
        // hyper's `is_parse_too_large` exists only with its server feature; its
        // message for an over-long head is stable.
        if chain.iter().any(|e| {
            e.downcast_ref::<hyper::Error>()
                .is_some_and(|h| h.is_parse() && h.to_string().contains("too large"))
        }) {
            return AttemptOutcome::HeadersTooLarge {
                status: None,
                message: format!(
                    "the upstream's response head is larger than the HTTP parser accepts (more than {} headers, [outbound] max_headers)",
                    self.max_response_headers
                ),
            };
        }
        AttemptOutcome::Failed(classify(error, timeout, started))
    }
}

/// A destination the guard refused: the caller is told the kind of range only; the
/// address it resolved to, which would map the internal network, goes to the log.
fn refused(denied: &Denied, url: &Url) -> AttemptOutcome {
    tracing::info!(
        host = url.host_str().unwrap_or(""),
        address = %denied.address,
        range = %denied.range,
        "the address guard refused a destination"
    );
    AttemptOutcome::Denied {
        message: denied.to_string(),
    }
}

/// Checks a response's headers against the count and size limits; the error names
/// the limit.
fn check_response_headers(
    headers: &reqwest::header::HeaderMap,
    max_headers: usize,
    max_bytes: usize,
) -> Result<(), String> {
    if headers.len() > max_headers {
        return Err(format!(
            "the upstream sent {} response headers, more than [outbound] max_headers = {max_headers}",
            headers.len()
        ));
    }
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if bytes > max_bytes {
        return Err(format!(
            "the upstream sent {bytes} bytes of response headers, more than [outbound] max_header_bytes = {max_bytes}"
        ));
    }
    Ok(())
}

fn failed_other(message: String) -> AttemptOutcome {
    AttemptOutcome::Failed(TransportFailure {
        kind: FailureKind::Other,
        may_have_reached_upstream: false,
        message,
    })
}

fn fmt_duration(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Maps a reqwest error to a failure kind by walking its source chain.
fn classify(error: &reqwest::Error, timeout: Duration, started: Instant) -> TransportFailure {
    let chain = error_chain(error);
    let connected = !error.is_connect();
    let kind = if error.is_timeout() {
        FailureKind::Timeout
    } else if chain.iter().any(|e| is_tls(*e)) {
        FailureKind::Tls
    } else if chain
        .iter()
        .any(|e| e.is::<DnsError>() || e.to_string().starts_with("dns error"))
    {
        FailureKind::Dns
    } else if let Some(kind) = chain.iter().find_map(|e| io_kind(*e)) {
        match kind {
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::AddrNotAvailable => {
                FailureKind::Connect
            }
            std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof => FailureKind::Reset,
            std::io::ErrorKind::TimedOut => FailureKind::Timeout,
            _ if !connected => FailureKind::Connect,
            _ => FailureKind::Other,
        }
    } else if chain.iter().any(|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(|h| h.is_incomplete_message() || h.is_closed() || h.is_canceled())
    }) {
        FailureKind::Reset
    } else if !connected {
        FailureKind::Connect
    } else {
        FailureKind::Other
    };
    let detail = chain
        .iter()
        .skip(1)
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(": ");
    let message = match kind {
        FailureKind::Timeout => format!(
            "no complete response within {} (after {} ms)",
            fmt_duration(timeout),
            started.elapsed().as_millis()
        ),
        _ if detail.is_empty() => error.to_string(),
        _ => format!("{kind}: {detail}"),
    };
    TransportFailure {
        kind,
        may_have_reached_upstream: connected,
        message,
    }
}

/// The error and its causes, looking inside `io::Error`s too: their `source()` skips the
/// error they wrap, which is where rustls and refused connections report.
fn error_chain(error: &reqwest::Error) -> Vec<&(dyn StdError + 'static)> {
    let mut chain: Vec<&(dyn StdError + 'static)> = Vec::new();
    let mut next: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(current) = next {
        chain.push(current);
        next = match current
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => current.source(),
        };
    }
    chain
}

fn is_tls(error: &(dyn StdError + 'static)) -> bool {
    error.downcast_ref::<rustls::Error>().is_some()
}

fn io_kind(error: &(dyn StdError + 'static)) -> Option<std::io::ErrorKind> {
    error.downcast_ref::<std::io::Error>().map(|io| io.kind())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_classes() {
        assert_eq!(status_class(204), "2xx");
        assert_eq!(status_class(302), "3xx");
        assert_eq!(status_class(429), "4xx");
        assert_eq!(status_class(599), "5xx");
        assert_eq!(status_class(101), "other");
    }

    #[test]
    fn each_outcome_has_one_record_class_and_failure_text() {
        let response = AttemptOutcome::Response(HttpResponse {
            status: 503,
            headers: Vec::new(),
            body: Bytes::new(),
        });
        let failed = AttemptOutcome::Failed(TransportFailure {
            kind: FailureKind::Reset,
            may_have_reached_upstream: true,
            message: "gone".into(),
        });
        let cases = [
            (response, Some(503), None, "5xx"),
            (
                AttemptOutcome::TooLarge {
                    status: 200,
                    limit: 1,
                },
                Some(200),
                None,
                "2xx",
            ),
            (
                AttemptOutcome::HeadersTooLarge {
                    status: None,
                    message: "big".into(),
                },
                None,
                None,
                "other",
            ),
            (failed, None, Some("reset: gone"), "reset"),
            (
                AttemptOutcome::Denied {
                    message: "no".into(),
                },
                None,
                Some("denied: no"),
                "other",
            ),
            (
                AttemptOutcome::Invalid {
                    message: "bad".into(),
                },
                None,
                Some("invalid: bad"),
                "other",
            ),
        ];
        for (outcome, status, failure, class) in cases {
            let record = outcome.record("t".into(), 7);
            assert_eq!(record.status, status, "{outcome:?}");
            assert_eq!(record.failure.as_deref(), failure, "{outcome:?}");
            assert_eq!(record.duration_ms, 7);
            assert_eq!(outcome.class(), class, "{outcome:?}");
        }
    }
}
