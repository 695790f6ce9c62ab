//! Operability end to end: the caller's trace continues through webproxy to the
//! upstream and the reply (with and without export, never with an empty `tracestate`),
//! spans reach an in-process OTLP receiver (HTTP or gRPC) with the right parents, when
//! the configuration or the standard OTEL_* environment alone asks for it,
//! `/metrics` counts a known workload in the OpenMetrics format, and the log format
//! follows `[log] format`, JSON lines carrying the caller's trace id.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use serde_json::Value;
use webproxy_protocol::Reply;
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, accept_rule, envelope, next_message};
use webproxy_tests::{NatsServer, Service, Upstream, http_client, wait_until};

const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `(trace id, span id)` of a `traceparent` value.
fn parse_traceparent(value: &str) -> (String, String) {
    let parts: Vec<&str> = value.split('-').collect();
    assert_eq!(parts.len(), 4, "traceparent {value:?}");
    (parts[1].to_string(), parts[2].to_string())
}

/// Publishes `envelope` with the given NATS headers and returns the reply message.
async fn send_with_headers(
    nats: &async_nats::Client,
    request: &webproxy_protocol::RequestEnvelope,
    headers: HeaderMap,
) -> async_nats::Message {
    let mut replies = nats
        .subscribe(format!("webproxy.reply.{}", request.id))
        .await
        .expect("subscribe");
    let publish = jetstream::message::PublishMessage::build()
        .payload(serde_json::to_vec(request).expect("json").into())
        .headers(headers)
        .message_id(&request.id);
    jetstream::new(nats.clone())
        .send_publish("webproxy.request.default", publish)
        .await
        .expect("publish")
        .await
        .expect("stored");
    next_message(&mut replies, REPLY_TIMEOUT, "a reply in time").await
}

fn caller_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        "traceparent",
        format!("00-{TRACE_ID}-{CALLER_SPAN}-01").as_str(),
    );
    headers
}

fn upstream_traceparent(reply: &async_nats::Message) -> String {
    let reply: Reply = serde_json::from_slice(&reply.payload).expect("reply");
    let echo: Value =
        serde_json::from_str(reply.body.body.as_deref().expect("body")).expect("echo");
    echo["headers"]["traceparent"][0]
        .as_str()
        .unwrap_or_else(|| panic!("the upstream got no traceparent: {echo}"))
        .to_string()
}

fn reply_traceparent(reply: &async_nats::Message) -> String {
    reply
        .headers
        .as_ref()
        .and_then(|h| h.get("traceparent"))
        .map(|v| v.as_str().to_string())
        .expect("the reply carries a traceparent")
}

/// What a collector received: each span with its resource's `service.name`.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<(String, Span)>>>);

impl Received {
    fn spans(&self) -> Vec<Span> {
        self.lock().iter().map(|(_, span)| span.clone()).collect()
    }

    fn service_names(&self) -> Vec<String> {
        self.lock().iter().map(|(name, _)| name.clone()).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, Span)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn add(&self, request: ExportTraceServiceRequest) {
        let mut received = self.lock();
        for resource_spans in request.resource_spans {
            let service_name = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref()?.value.as_ref())
                .map(|v| match v {
                    AnyValue::StringValue(name) => name.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                received.extend(scope.spans.into_iter().map(|s| (service_name.clone(), s)));
            }
        }
    }
}

async fn otlp_receiver(State(received): State<Received>, body: Bytes) -> Vec<u8> {
    if let Ok(request) = ExportTraceServiceRequest::decode(body) {
        received.add(request);
    }
    ExportTraceServiceResponse::default().encode_to_vec()
}

/// Stops `service`, which flushes its batch exporter, and waits (10 s: the flush is
/// one local request) until `received` holds what `enough` asks for.
async fn stop_and_collect(
    service: &mut Service,
    received: &Received,
    what: &str,
    enough: impl Fn(&[Span]) -> bool,
) -> Vec<Span> {
    service.terminate();
    service
        .wait_exit(Duration::from_secs(20))
        .await
        .expect("exited");
    wait_until(Duration::from_secs(10), what, || async {
        enough(&received.spans())
    })
    .await;
    received.spans()
}

/// An OTLP/HTTP collector: `POST /v1/traces` with protobuf.
async fn http_collector(received: &Received) -> Upstream {
    Upstream::start_with(
        Router::new()
            .route("/v1/traces", post(otlp_receiver))
            .with_state(received.clone()),
    )
    .await
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.add(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP/gRPC collector serving the trace service until the test ends; its URL.
async fn grpc_collector(received: &Received) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the gRPC collector");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(received.clone()))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_trace_continues_to_the_upstream_the_reply_and_the_exporter() {
    let received = Received::default();
    let collector = http_collector(&received).await;
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let config = format!(
        "[telemetry]\notlp_endpoint = \"{}\"\nservice_name = \"webproxy-test\"\n\n{}",
        collector.url(""),
        accept_rule("local", &upstream)
    );
    let mut service = Service::start(&nats, &config).await;
    let client = nats.client().await;
    let request = envelope("GET", &upstream.url("/echo"));
    let reply = send_with_headers(&client, &request, caller_headers()).await;

    let (upstream_trace, attempt_span) = parse_traceparent(&upstream_traceparent(&reply));
    assert_eq!(upstream_trace, TRACE_ID);
    assert_ne!(attempt_span, CALLER_SPAN);
    let (reply_trace, request_span) = parse_traceparent(&reply_traceparent(&reply));
    assert_eq!(reply_trace, TRACE_ID);

    let spans: Vec<Span> =
        stop_and_collect(&mut service, &received, "spans at the collector", |spans| {
            spans.len() >= 2
        })
        .await
        .into_iter()
        .filter(|s| hex(&s.trace_id) == TRACE_ID)
        .collect();
    for span in &spans {
        let attributes: Vec<String> = span
            .attributes
            .iter()
            .map(|a| {
                format!(
                    "{}={:?}",
                    a.key,
                    a.value.as_ref().and_then(|v| v.value.as_ref())
                )
            })
            .collect();
        println!(
            "span {:?} trace={} id={} parent={} {}",
            span.name,
            hex(&span.trace_id),
            hex(&span.span_id),
            hex(&span.parent_span_id),
            attributes.join(" ")
        );
    }
    let request_spans: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "webproxy request")
        .collect();
    assert_eq!(request_spans.len(), 1, "{spans:#?}");
    assert_eq!(hex(&request_spans[0].parent_span_id), CALLER_SPAN);
    assert_eq!(hex(&request_spans[0].span_id), request_span);
    let attempt = spans
        .iter()
        .find(|s| hex(&s.span_id) == attempt_span)
        .unwrap_or_else(|| panic!("no exported span {attempt_span}: {spans:#?}"));
    assert_eq!(hex(&attempt.parent_span_id), request_span);
    let attribute = |span: &Span, key: &str| {
        span.attributes
            .iter()
            .find(|a| a.key == key)
            .and_then(|a| a.value.as_ref())
            .map(|v| format!("{:?}", v.value))
    };
    assert!(
        attribute(attempt, "id").is_some_and(|v| v.contains(&request.id)),
        "{attempt:#?}"
    );
    assert!(
        attribute(attempt, "http.response.status_code").is_some_and(|v| v.contains("200")),
        "{attempt:#?}"
    );
    assert!(
        attribute(request_spans[0], "queue_wait_ms").is_some(),
        "{:#?}",
        request_spans[0]
    );
}

/// Sends one traced request through a service that has no `[telemetry]` section, only
/// the standard variables `env` and `OTEL_SERVICE_NAME`, stops it, and checks that
/// `received` got its spans under that service name.
async fn export_configured_by_the_environment_alone(received: &Received, env: &[(&str, &str)]) {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let options = env.iter().fold(
        webproxy_tests::ServiceOptions::default().env("OTEL_SERVICE_NAME", "webproxy-from-env"),
        |options, (name, value)| options.env(name, value),
    );
    let mut service =
        Service::start_with(&nats.url(), &accept_rule("local", &upstream), options).await;
    let reply = send_with_headers(
        &nats.client().await,
        &envelope("GET", &upstream.url("/echo")),
        caller_headers(),
    )
    .await;
    assert_eq!(parse_traceparent(&upstream_traceparent(&reply)).0, TRACE_ID);
    let spans = stop_and_collect(
        &mut service,
        received,
        "the request span at the collector",
        |spans| {
            spans
                .iter()
                .any(|s| s.name == "webproxy request" && hex(&s.trace_id) == TRACE_ID)
        },
    )
    .await;
    let names = received.service_names();
    assert!(
        names.iter().all(|name| name == "webproxy-from-env"),
        "OTEL_SERVICE_NAME must name every exported span's service: {names:?}"
    );
    assert!(spans.len() >= 2, "{spans:#?}");
}

/// What the OpenTelemetry Operator injects is enough: `OTEL_EXPORTER_OTLP_ENDPOINT`
/// (the signal path appended, as specified for HTTP) switches export on, and
/// `OTEL_SERVICE_NAME` names the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_alone_switches_otlp_http_export_on() {
    let received = Received::default();
    let collector = http_collector(&received).await;
    export_configured_by_the_environment_alone(
        &received,
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.url(""))],
    )
    .await;
}

/// `OTEL_EXPORTER_OTLP_PROTOCOL=grpc` exports over gRPC to the environment's endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_alone_switches_otlp_grpc_export_on() {
    let received = Received::default();
    let collector = grpc_collector(&received).await;
    export_configured_by_the_environment_alone(
        &received,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &collector),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ],
    )
    .await;
}

/// W3C lets an empty `tracestate` be left out, and some receivers reject it: a caller
/// without one causes none upstream or on the reply, and a caller's vendor state is
/// passed on.
#[tokio::test]
async fn no_empty_tracestate_reaches_the_upstream_or_the_reply() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let client = h.js.client();
    let upstream_tracestate = |reply: &async_nats::Message| {
        let reply: Reply = serde_json::from_slice(&reply.payload).expect("reply");
        let echo: Value =
            serde_json::from_str(reply.body.body.as_deref().expect("body")).expect("echo");
        echo["headers"].get("tracestate").cloned()
    };
    let reply_tracestate = |reply: &async_nats::Message| {
        reply
            .headers
            .as_ref()
            .and_then(|h| h.get("tracestate"))
            .map(|v| v.as_str().to_string())
    };

    let without = send_with_headers(
        &client,
        &envelope("GET", &h.upstream.url("/echo")),
        caller_headers(),
    )
    .await;
    assert_eq!(
        parse_traceparent(&upstream_traceparent(&without)).0,
        TRACE_ID
    );
    assert_eq!(upstream_tracestate(&without), None);
    assert_eq!(reply_tracestate(&without), None);

    let mut headers = caller_headers();
    headers.insert("tracestate", "vendor=abc");
    let with =
        send_with_headers(&client, &envelope("GET", &h.upstream.url("/echo")), headers).await;
    assert_eq!(
        upstream_tracestate(&with),
        Some(serde_json::json!(["vendor=abc"]))
    );
    assert_eq!(reply_tracestate(&with).as_deref(), Some("vendor=abc"));
}

#[tokio::test]
async fn context_propagates_without_an_exporter_and_a_new_trace_starts_without_one() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let client = h.js.client();
    let with = send_with_headers(
        &client,
        &envelope("GET", &h.upstream.url("/echo")),
        caller_headers(),
    )
    .await;
    assert_eq!(parse_traceparent(&upstream_traceparent(&with)).0, TRACE_ID);
    assert_eq!(parse_traceparent(&reply_traceparent(&with)).0, TRACE_ID);

    let without = send_with_headers(
        &client,
        &envelope("GET", &h.upstream.url("/echo")),
        HeaderMap::new(),
    )
    .await;
    let (new_trace, _) = parse_traceparent(&upstream_traceparent(&without));
    assert_ne!(new_trace, TRACE_ID);
    assert_ne!(new_trace, "0".repeat(32));
    assert_eq!(parse_traceparent(&reply_traceparent(&without)).0, new_trace);
}

#[tokio::test]
async fn metrics_count_a_known_workload() {
    let h = Harness::start(|up| {
        let base = up.url("/").replace('.', "\\.");
        format!(
            "[pools.p1]\nmax_in_flight = 1\n\n\
             [[request_rules]]\nname = \"blocked\"\nurl_pattern = '^{base}blocked'\naction = \"deny\"\n\n\
             [[request_rules]]\nname = \"flaky\"\nurl_pattern = '^{base}status/503'\nmax_retries = 1\nretry_delay = \"50ms\"\n\n\
             [[request_rules]]\nname = \"moved\"\nurl_pattern = '^{base}multi'\npool = \"p1\"\n\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    for path in ["/echo", "/echo", "/blocked", "/status/503", "/multi"] {
        h.request(&envelope("GET", &h.upstream.url(path))).await;
    }
    h.request(&envelope("GET", "http://127.0.0.1:9/no-rule"))
        .await;
    let invalid = webproxy_client::new_id();
    h.publish_raw(
        "default",
        &invalid,
        format!(r#"{{"id":"{invalid}","method":"BREW","url":"http://x/"}}"#),
    )
    .await;
    h.wait_dead_letters(4).await;

    let http = http_client();
    let url = format!("{}/metrics", h.service.health_url());
    let expected = [
        r#"webproxy_requests_total{pool="default",rule="local",outcome="response",code="none"} 2"#,
        r#"webproxy_requests_total{pool="default",rule="blocked",outcome="error",code="denied"} 1"#,
        r#"webproxy_requests_total{pool="default",rule="none",outcome="error",code="denied"} 1"#,
        r#"webproxy_requests_total{pool="default",rule="none",outcome="error",code="invalid_request"} 1"#,
        r#"webproxy_requests_total{pool="default",rule="flaky",outcome="error",code="retries_exhausted"} 1"#,
        r#"webproxy_requests_total{pool="p1",rule="moved",outcome="response",code="none"} 1"#,
        r#"webproxy_attempts_total{pool="default",rule="local",result="2xx"} 2"#,
        r#"webproxy_attempts_total{pool="default",rule="flaky",result="5xx"} 2"#,
        r#"webproxy_attempt_duration_seconds_count{pool="default",rule="local"} 2"#,
        r#"webproxy_dead_letters_total{pool="default",code="denied"} 2"#,
        r#"webproxy_dead_letters_total{pool="default",code="retries_exhausted"} 1"#,
        r#"webproxy_dead_letters_total{pool="default",code="invalid_request"} 1"#,
        r#"webproxy_in_flight{pool="default"} 0"#,
        r#"webproxy_pool_max_in_flight{pool="p1"} 1"#,
        r#"webproxy_pool_max_in_flight{pool="default"} "#,
        r#"webproxy_queue_wait_seconds_bucket{le="1310.72",pool="default"} "#,
        "webproxy_nats_connected 1",
        "webproxy_build_info{version=",
    ];
    // The invalid request's counters land just after its dead letter is stored.
    let text =
        webproxy_tests::wait_for(Duration::from_secs(10), "the expected metrics", || async {
            let text = http
                .get(&url)
                .send()
                .await
                .expect("scrape")
                .text()
                .await
                .expect("body");
            expected
                .iter()
                .all(|line| text.contains(line))
                .then_some(text)
        })
        .await;
    assert!(
        !text.contains("127.0.0.1"),
        "a URL leaked into a label:\n{text}"
    );
    // prometheus_client writes OpenMetrics, and the content type says so.
    let scrape = http.get(&url).send().await.expect("scrape");
    assert_eq!(
        scrape.headers()["content-type"],
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(
        scrape.text().await.expect("body").ends_with("# EOF\n"),
        "OpenMetrics ends with # EOF"
    );
    assert!(
        text.contains("webproxy_pool_waiting{pool=\"p1\"}"),
        "{text}"
    );
    assert!(
        text.contains("webproxy_queue_wait_seconds_bucket"),
        "{text}"
    );
}

#[tokio::test]
async fn log_format_follows_the_config_and_json_lines_carry_the_callers_trace() {
    for (format, json) in [("json", true), ("text", false)] {
        let h = Harness::start(|up| {
            format!(
                "[log]\nformat = \"{format}\"\n\n{}",
                accept_rule("local", up)
            )
        })
        .await;
        let request = envelope("GET", &h.upstream.url("/echo"));
        send_with_headers(&h.js.client(), &request, caller_headers()).await;
        wait_until(
            Duration::from_secs(10),
            "the outcome to be logged",
            || async { h.service.logs().contains("conversation finished") },
        )
        .await;
        let logs = h.service.logs();
        let outcome = logs
            .lines()
            .find(|l| l.contains("conversation finished"))
            .expect("an outcome line");
        if json {
            for line in logs.lines().filter(|l| !l.trim().is_empty()) {
                serde_json::from_str::<Value>(line)
                    .unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            }
            let event: Value = serde_json::from_str(outcome).expect("json");
            assert_eq!(event["id"], request.id.as_str());
            assert_eq!(event["pool"], "default");
            assert_eq!(event["outcome"], "response");
            // The caller's trace, and the id of a span of webproxy's own in it.
            assert_eq!(event["trace_id"], TRACE_ID, "{outcome}");
            let span_id = event["span_id"].as_str().expect("a span_id");
            assert_eq!(span_id.len(), 16, "{outcome}");
            assert_ne!(span_id, CALLER_SPAN);
            // Lines outside any conversation carry none.
            assert!(
                logs.lines()
                    .filter(|l| !l.trim().is_empty())
                    .any(|l| !l.contains("\"trace_id\"")),
                "{logs}"
            );
        } else {
            assert!(serde_json::from_str::<Value>(outcome).is_err(), "{outcome}");
            assert!(outcome.contains(&format!("id={}", request.id)), "{outcome}");
        }
    }
}

/// Spans are filtered apart from logs: at log level `warn` the caller's trace still
/// reaches the upstream and the reply.
#[tokio::test]
async fn a_quiet_log_level_does_not_stop_propagation() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let _service = Service::start_with(
        &nats.url(),
        &accept_rule("local", &upstream),
        webproxy_tests::ServiceOptions::default().env("RUST_LOG", "warn"),
    )
    .await;
    let client = nats.client().await;
    let reply = send_with_headers(
        &client,
        &envelope("GET", &upstream.url("/echo")),
        caller_headers(),
    )
    .await;
    assert_eq!(parse_traceparent(&upstream_traceparent(&reply)).0, TRACE_ID);
    assert_eq!(parse_traceparent(&reply_traceparent(&reply)).0, TRACE_ID);
}
