//! One attempt against real loopback servers: each outcome kind the worker reports.

use std::time::Duration;

use axum::Router;
use axum::routing::{any, get};
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use url::Url;
use webproxy_worker::{
    AttemptOutcome, AttemptRequest, FailureKind, GuardPolicy, Worker, WorkerConfig,
};

async fn serve(app: Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A worker that may reach the loopback upstreams these tests start.
fn worker(max_response_bytes: usize) -> Worker {
    let mut config = WorkerConfig::new(max_response_bytes);
    config.guard.allow_private_networks = true;
    Worker::new(&config).expect("client")
}

async fn attempt(worker: &Worker, method: &str, url: &str, timeout: Duration) -> AttemptOutcome {
    let url = Url::parse(url).expect("url");
    worker
        .attempt(AttemptRequest {
            method,
            url: &url,
            headers: &[("X-Test".into(), "1".into())],
            body: Bytes::from_static(b"payload"),
            timeout,
        })
        .await
}

fn failure(outcome: AttemptOutcome) -> webproxy_worker::TransportFailure {
    match outcome {
        AttemptOutcome::Failed(f) => f,
        other => panic!("expected a transport failure, got {other:?}"),
    }
}

#[tokio::test]
async fn response_with_headers_and_body() {
    let base = serve(Router::new().route(
        "/echo",
        any(|headers: axum::http::HeaderMap, body: Bytes| async move {
            let x = headers
                .get("x-test")
                .map(|v| v.to_str().unwrap_or("").to_string())
                .unwrap_or_default();
            let mut out = axum::http::HeaderMap::new();
            for value in [x, "again".to_string()] {
                if let Ok(value) = value.parse() {
                    out.append("x-seen", value);
                }
            }
            (axum::http::StatusCode::CREATED, out, body)
        }),
    ))
    .await;
    match attempt(
        &worker(1024),
        "POST",
        &format!("{base}/echo"),
        Duration::from_secs(5),
    )
    .await
    {
        AttemptOutcome::Response(r) => {
            assert_eq!(r.status, 201);
            assert_eq!(r.body.as_ref(), b"payload");
            let seen: Vec<_> = r.headers.iter().filter(|(n, _)| n == "x-seen").collect();
            assert_eq!(seen.len(), 2);
            assert_eq!(r.header("x-seen"), Some("1"));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn refused_connection_is_connect_and_never_reached() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let f = failure(
        attempt(
            &worker(1024),
            "GET",
            &format!("http://{addr}/"),
            Duration::from_secs(5),
        )
        .await,
    );
    assert_eq!(f.kind, FailureKind::Connect, "{f:?}");
    assert!(!f.may_have_reached_upstream);
}

#[tokio::test]
async fn slow_upstream_times_out() {
    let base = serve(Router::new().route(
        "/slow",
        get(|| async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            "late"
        }),
    ))
    .await;
    let f = failure(
        attempt(
            &worker(1024),
            "GET",
            &format!("{base}/slow"),
            Duration::from_millis(200),
        )
        .await,
    );
    assert_eq!(f.kind, FailureKind::Timeout, "{f:?}");
    assert!(f.may_have_reached_upstream);
}

#[tokio::test]
async fn oversized_body_is_too_large() {
    let base = serve(Router::new().route("/big", get(|| async { "x".repeat(2048) }))).await;
    match attempt(
        &worker(1024),
        "GET",
        &format!("{base}/big"),
        Duration::from_secs(5),
    )
    .await
    {
        AttemptOutcome::TooLarge { status, limit } => {
            assert_eq!(status, 200);
            assert_eq!(limit, 1024);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn connection_closed_mid_request_is_reset() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = [0u8; 1024];
            let _ = socket.read(&mut buf).await;
            let _ = socket
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
                .await;
            drop(socket);
        }
    });
    let f = failure(
        attempt(
            &worker(1024),
            "GET",
            &format!("http://{addr}/"),
            Duration::from_secs(5),
        )
        .await,
    );
    assert_eq!(f.kind, FailureKind::Reset, "{f:?}");
    assert!(f.may_have_reached_upstream);
}

#[tokio::test]
async fn tls_to_a_plain_server_is_tls() {
    let base = serve(Router::new().route("/", get(|| async { "plain" }))).await;
    let url = base.replace("http://", "https://");
    let f = failure(attempt(&worker(1024), "GET", &url, Duration::from_secs(5)).await);
    assert_eq!(f.kind, FailureKind::Tls, "{f:?}");
}

/// A server on one port of 127.0.0.1, 127.0.0.2, 127.0.0.3 and [::1] (loopback only)
/// that counts connections, so a denial that still connected shows.
async fn counting_server() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let first = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = first.local_addr().expect("addr").port();
    let mut listeners = vec![first];
    for host in ["127.0.0.2", "127.0.0.3", "[::1]"] {
        listeners.push(
            TcpListener::bind(format!("{host}:{port}"))
                .await
                .unwrap_or_else(|e| panic!("bind {host}:{port}: {e}")),
        );
    }
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for listener in listeners {
        let seen = count.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut buf = [0u8; 4096];
                let _ = socket.read(&mut buf).await;
                let _ = socket
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
            }
        });
    }
    (port, count)
}

fn guarded(guard: GuardPolicy) -> Worker {
    let mut config = WorkerConfig::new(1024);
    config.guard = guard;
    Worker::new(&config).expect("client")
}

#[tokio::test]
async fn guard_denies_literals_and_resolved_names_without_connecting() {
    let (port, count) = counting_server().await;
    let worker = guarded(GuardPolicy::default());
    for host in ["127.0.0.1", "localhost", "2130706433", "0.0.0.0"] {
        let outcome = attempt(
            &worker,
            "GET",
            &format!("http://{host}:{port}/"),
            Duration::from_secs(5),
        )
        .await;
        match outcome {
            AttemptOutcome::Denied { message } => {
                assert!(
                    message.contains("destination not allowed"),
                    "{host}: {message}"
                );
                assert!(!message.contains("127.0.0"), "{host}: {message}");
            }
            other => panic!("{host}: expected Denied, got {other:?}"),
        }
    }
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn guard_allow_cidrs_open_exactly_the_listed_address() {
    let (port, count) = counting_server().await;
    let worker = guarded(GuardPolicy {
        allow: vec!["127.0.0.2/32".parse().expect("cidr")],
        ..GuardPolicy::default()
    });
    let open = attempt(
        &worker,
        "GET",
        &format!("http://127.0.0.2:{port}/"),
        Duration::from_secs(5),
    )
    .await;
    assert!(
        matches!(open, AttemptOutcome::Response(ref r) if r.status == 200),
        "{open:?}"
    );
    let closed = attempt(
        &worker,
        "GET",
        &format!("http://127.0.0.3:{port}/"),
        Duration::from_secs(5),
    )
    .await;
    assert!(
        matches!(closed, AttemptOutcome::Denied { .. }),
        "{closed:?}"
    );
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn too_many_response_headers_is_headers_too_large() {
    let base = serve(Router::new().route(
        "/many",
        get(|| async {
            let mut headers = axum::http::HeaderMap::new();
            for i in 0..20 {
                headers.insert(
                    axum::http::HeaderName::try_from(format!("x-h{i}")).expect("name"),
                    axum::http::HeaderValue::from_static("v"),
                );
            }
            (headers, "many")
        }),
    ))
    .await;
    let mut config = WorkerConfig::new(1024);
    config.guard.allow_private_networks = true;
    config.max_response_headers = 10;
    let worker = Worker::new(&config).expect("client");
    let outcome = attempt(
        &worker,
        "GET",
        &format!("{base}/many"),
        Duration::from_secs(5),
    )
    .await;
    assert!(
        matches!(outcome, AttemptOutcome::HeadersTooLarge { .. }),
        "{outcome:?}"
    );

    let mut config = WorkerConfig::new(1024);
    config.guard.allow_private_networks = true;
    config.max_response_header_bytes = 40;
    let worker = Worker::new(&config).expect("client");
    match attempt(
        &worker,
        "GET",
        &format!("{base}/many"),
        Duration::from_secs(5),
    )
    .await
    {
        AttemptOutcome::HeadersTooLarge { status, message } => {
            assert_eq!(status, Some(200));
            assert!(message.contains("max_header_bytes"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}
