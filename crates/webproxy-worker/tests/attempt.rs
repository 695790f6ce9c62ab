//! One attempt against real loopback servers: each outcome kind the worker reports.

use std::time::Duration;

use axum::Router;
use axum::routing::{any, get};
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use url::Url;
use webproxy_worker::{AttemptOutcome, AttemptRequest, FailureKind, Worker, WorkerConfig};

async fn serve(app: Router) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn worker(max_response_bytes: usize) -> Worker {
    Worker::new(&WorkerConfig { max_response_bytes }).expect("client")
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
