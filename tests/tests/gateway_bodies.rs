//! Issue 34, point 6: the gateway opts its `large_bodies` routes' callers in to bodies
//! of any size, both ways. A request body over the inline limit (sent with
//! `Content-Length` or chunked) streams into the pool's upload store as it arrives; a
//! response body over it is stored by the service and streamed back from the store,
//! with its `Content-Length`, to the caller that waits and to one that polls. A route
//! without `large_bodies` answers as before.

use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::routing::post;
use reqwest::StatusCode;
use sha2::{Digest as _, Sha256};
use webproxy_tests::caller::path_rule;
use webproxy_tests::{
    Gateway, NatsServer, Service, Upstream, http_client, large_body, large_routes,
};

const MIB: usize = 1024 * 1024;

/// Generous: 40 MiB cross the upstream, NATS and the gateway on a loaded 2-core machine.
const ANSWER: Duration = Duration::from_secs(60);

/// `POST /sink`: the length and hex SHA-256 of the body it received, whatever its size.
fn routes() -> Router {
    large_routes()
        .route(
            "/sink",
            post(|body: Bytes| async move { format!("{} {}", body.len(), hex_sha256(&body)) }),
        )
        .layer(DefaultBodyLimit::disable())
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A nats-server, the upstream, the service and a gateway with two routes to it:
/// `/big` with `large_bodies`, `/plain` without. Both processes take `max_large_body`
/// of 41 MiB.
struct Scene {
    _nats: NatsServer,
    _upstream: Upstream,
    service: Service,
    gateway: Gateway,
}

impl Scene {
    async fn start() -> Scene {
        let nats = NatsServer::start();
        let upstream = Upstream::start_with(routes()).await;
        let outbound = "[outbound]\nmax_large_body = 42991616\n";
        let service = Service::start(
            &nats,
            &format!(
                "{outbound}\n{}\n{}",
                path_rule("large", &upstream, "/large/"),
                path_rule("sink", &upstream, "/sink")
            ),
        )
        .await;
        let up = upstream.url("/");
        let gateway = Gateway::start(
            &nats,
            &format!(
                "[[gateway.routes]]\npath = \"/big\"\nupstream = \"{up}\"\nlarge_bodies = true\n\n\
                 [[gateway.routes]]\npath = \"/plain\"\nupstream = \"{up}\"\n\n{outbound}"
            ),
        )
        .await;
        Scene {
            _nats: nats,
            _upstream: upstream,
            service,
            gateway,
        }
    }

    /// `POST path` written by hand with `Transfer-Encoding: chunked`, `body` in
    /// `piece`-byte chunks, on a fresh connection; the whole answer as text.
    async fn post_chunked(&self, path: &str, body: &[u8], piece: usize) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.gateway.port()))
            .await
            .expect("connect to the gateway");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        );
        tcp.write_all(head.as_bytes()).await.expect("the head");
        for chunk in body.chunks(piece) {
            tcp.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                .await
                .expect("a chunk's size");
            tcp.write_all(chunk).await.expect("a chunk");
            tcp.write_all(b"\r\n").await.expect("a chunk's end");
        }
        tcp.write_all(b"0\r\n\r\n").await.expect("the last chunk");
        let mut answer = Vec::new();
        tokio::time::timeout(ANSWER, tcp.read_to_end(&mut answer))
            .await
            .expect("answered in time")
            .expect("read the answer");
        String::from_utf8_lossy(&answer).into_owned()
    }

    fn logs(&self) -> String {
        format!(
            "gateway:\n{}\nservice:\n{}",
            self.gateway.logs(),
            self.service.logs()
        )
    }

    async fn get(&self, path: &str) -> reqwest::Response {
        http_client()
            .get(self.gateway.url(path))
            .timeout(ANSWER)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}\n{}", self.logs()))
    }

    async fn post(&self, path: &str, body: reqwest::Body) -> reqwest::Response {
        http_client()
            .post(self.gateway.url(path))
            .timeout(ANSWER)
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}\n{}", self.logs()))
    }
}

/// Asserts `response` is `status` with a body that names `what`.
async fn assert_refused(
    scene: &Scene,
    response: reqwest::Response,
    status: StatusCode,
    what: &str,
) {
    assert_eq!(response.status(), status, "{}", scene.logs());
    let text = response.text().await.expect("body");
    assert!(text.contains(what), "{text}");
}

/// Asserts `response` is 200 with exactly `expected` as its body and its length in
/// `Content-Length`.
async fn assert_whole(scene: &Scene, response: reqwest::Response, expected: &[u8]) {
    assert_eq!(response.status(), StatusCode::OK, "{}", scene.logs());
    assert_eq!(
        response.content_length(),
        Some(expected.len() as u64),
        "Content-Length"
    );
    let body = response.bytes().await.expect("the whole body");
    assert_eq!(body.len(), expected.len());
    assert!(body == expected, "the bytes differ");
}

/// 5 MiB and 40 MiB responses arrive whole through a `large_bodies` route, waited for
/// and polled, and a small one as before; past `max_large_body` the answer is
/// `response_too_large` naming it, never a body cut short; the route without
/// `large_bodies` answers a large one `response_too_large` as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_responses_stream_back_whole_waited_for_or_polled() {
    let scene = Scene::start().await;
    for size in [1000, 5 * MIB, 40 * MIB] {
        let response = scene.get(&format!("/big/large/{size}")).await;
        assert_whole(&scene, response, &large_body(size)).await;
    }
    // A poll streams the stored body as the wait does.
    let accepted = http_client()
        .get(scene.gateway.url(&format!("/big/large/{}", 5 * MIB)))
        .header("prefer", "respond-async")
        .send()
        .await
        .expect("202");
    assert_eq!(accepted.status(), StatusCode::ACCEPTED, "{}", scene.logs());
    let location = accepted
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .expect("Location")
        .to_string();
    let polled = webproxy_tests::wait_for(ANSWER, "the polled reply", || async {
        let response = scene.get(&location).await;
        (response.status() != StatusCode::ACCEPTED).then_some(response)
    })
    .await;
    assert_whole(&scene, polled, &large_body(5 * MIB)).await;
    // Without large_bodies: as before.
    let plain = scene.get(&format!("/plain/large/{}", 5 * MIB)).await;
    assert_refused(&scene, plain, StatusCode::BAD_GATEWAY, "response_too_large").await;
    // Over max_large_body, through the large route: too large, not cut short.
    let over = scene.get(&format!("/big/large/{}", 42 * MIB)).await;
    assert_refused(&scene, over, StatusCode::BAD_GATEWAY, "max_large_body").await;
}

/// A 10 MiB request body arrives upstream whole, sent with `Content-Length` and sent
/// chunked; over `max_large_body` it is 413 naming the key; on the route without
/// `large_bodies`, a body over `max_request_bytes` is 413 as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_request_bodies_stream_upstream_whole_with_a_length_or_chunked() {
    let scene = Scene::start().await;
    let body = large_body(10 * MIB);
    let expected = format!("{} {}", body.len(), hex_sha256(&body));
    let sized = scene.post("/big/sink", body.clone().into()).await;
    assert_eq!(sized.status(), StatusCode::OK, "{}", scene.logs());
    assert_eq!(sized.text().await.expect("body"), expected);
    let chunked = scene.post_chunked("/big/sink", &body, 100_000).await;
    assert!(
        chunked.starts_with("HTTP/1.1 200 ") && chunked.ends_with(&format!("\r\n\r\n{expected}")),
        "{chunked}\n{}",
        scene.logs()
    );
    // A small body still travels inline, and arrives as well.
    let small = scene.post("/big/sink", b"hello".to_vec().into()).await;
    assert_eq!(
        small.text().await.expect("body"),
        format!("5 {}", hex_sha256(b"hello"))
    );

    let over = scene.post("/big/sink", large_body(42 * MIB).into()).await;
    assert_refused(
        &scene,
        over,
        StatusCode::PAYLOAD_TOO_LARGE,
        "outbound.max_large_body",
    )
    .await;
    let plain = scene.post("/plain/sink", large_body(2 * MIB).into()).await;
    assert_refused(
        &scene,
        plain,
        StatusCode::PAYLOAD_TOO_LARGE,
        "outbound.max_request_bytes",
    )
    .await;
}
