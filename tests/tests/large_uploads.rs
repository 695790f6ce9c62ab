//! Issue 34, point 4: large request bodies. A caller uploads the body in chunks
//! (`<prefix>.body.put.<pool>`, here through the Rust client's `upload`), then names it
//! in the envelope's `body_object`. The service checks its size and digest before any
//! byte goes upstream, binds it to the first envelope that names it, and streams it
//! upstream from storage. Each pool's uploads have their own quota, and an upload no
//! envelope names expires.

use async_nats::jetstream;
use axum::Router;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::routing::post;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE;
use sha2::{Digest as _, Sha256};
use webproxy_client::Request;
use webproxy_protocol::{ErrorCode, Outcome, Subjects, UploadRef};
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, path_rule};
use webproxy_tests::{ServiceOptions, Upstream, wait_for};

const MIB: usize = 1024 * 1024;

fn body_of(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect()
}

/// `POST /sink`: answers the length and hex SHA-256 of the body it received, whatever
/// its size.
fn sink_routes() -> Router {
    Router::new()
        .route(
            "/sink",
            post(|body: Bytes| async move {
                let hash: String = Sha256::digest(&body)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                format!("{} {hash}", body.len())
            }),
        )
        .layer(DefaultBodyLimit::disable())
}

/// Pools `a` and `b`, both sending `/sink` (and `/large`) of the upstream.
async fn harness(env: &[(&str, &str)]) -> Harness {
    let options = env
        .iter()
        .fold(ServiceOptions::default(), |options, (name, value)| {
            options.env(name, value)
        });
    Harness::start_with_options(Upstream::start_with(sink_routes()).await, options, |up| {
        format!(
            "[pools.a]\nmax_in_flight = 4\n\n[pools.b]\nmax_in_flight = 4\n\n{}",
            path_rule("sink", up, "/sink")
        )
    })
    .await
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// POSTs the upload `upload` to `/sink` through `pool`; the reply.
async fn post_upload(h: &Harness, pool: &str, upload: UploadRef) -> webproxy_protocol::Reply {
    let request = Request::new("POST", h.upstream.url("/sink"))
        .pool(pool)
        .body_upload(upload)
        .wait(REPLY_TIMEOUT);
    h.client
        .request(&request)
        .await
        .unwrap_or_else(|e| panic!("no reply: {e}\n{}", h.service.logs()))
}

/// The bytes `name`'s stream holds now, if it exists.
async fn stream_bytes(js: &jetstream::Context, name: &str) -> Option<u64> {
    let mut stream = js.get_stream(name).await.ok()?;
    Some(stream.info().await.ok()?.state.bytes)
}

fn uploads_of(pool: &str) -> String {
    Subjects::object_stream(
        &Subjects::new("webproxy")
            .expect("prefix")
            .pool_upload_bucket(pool),
    )
}

/// A 10 MiB request body, uploaded, arrives upstream whole. The upload's bytes are gone
/// once bound, and the service's copy once the conversation ended in a response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_mib_request_body_arrives_upstream_whole() {
    let h = harness(&[]).await;
    let body = body_of(10 * MIB);
    let upload = h.client.upload("a", &body).await.expect("uploaded");
    assert_eq!(upload.size, body.len() as u64);
    assert_eq!(
        upload.digest,
        format!("SHA-256={}", URL_SAFE.encode(Sha256::digest(&body)))
    );
    let reply = post_upload(&h, "a", upload).await;
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    assert_eq!(
        reply.body.body.as_deref(),
        Some(format!("{} {}", body.len(), hex_sha256(&body)).as_str()),
        "what the upstream received"
    );
    // The upload's bytes are gone; its claim (a header-only message, so that another
    // envelope naming it is refused) stays until upload_max_age.
    let left = stream_bytes(&h.js, &uploads_of("a"))
        .await
        .expect("the upload store");
    assert!(
        left < 1024,
        "the upload's bytes are gone: {left} bytes left"
    );
    let bodies = Subjects::object_stream(
        &Subjects::new("webproxy")
            .expect("prefix")
            .pool_body_bucket("a"),
    );
    // Removed once the reply is settled, which the live reply may outrun: the wait is
    // bounded by REPLY_TIMEOUT.
    wait_for(
        REPLY_TIMEOUT,
        "the service's copy to be removed",
        || async { (stream_bytes(&h.js, &bodies).await == Some(0)).then_some(()) },
    )
    .await;
}

/// A wrong size or digest is `invalid_request`, before any byte goes upstream; so is a
/// second envelope naming an upload the first one bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_digest_or_size_is_refused_before_any_byte_is_sent() {
    let h = harness(&[]).await;
    let body = body_of(MIB + 3);
    let upload = h.client.upload("a", &body).await.expect("uploaded");
    for wrong in [
        UploadRef {
            size: upload.size - 1,
            ..upload.clone()
        },
        UploadRef {
            digest: format!("SHA-256={}", URL_SAFE.encode(Sha256::digest(b"other"))),
            ..upload.clone()
        },
    ] {
        let reply = post_upload(&h, "a", wrong).await;
        let error = reply.error.expect("an error reply");
        assert_eq!(error.code, ErrorCode::InvalidRequest, "{error:?}");
        assert!(
            error.message.contains("nothing was sent"),
            "{}",
            error.message
        );
    }
    assert_eq!(h.upstream.hits(), 0, "no byte went upstream");

    let first = post_upload(&h, "a", upload.clone()).await;
    assert_eq!(first.outcome, Outcome::Response, "{first:?}");
    let second = post_upload(&h, "a", upload).await;
    let error = second.error.expect("the upload is taken");
    assert_eq!(error.code, ErrorCode::InvalidRequest, "{error:?}");
    assert_eq!(h.upstream.hits(), 1);
}

/// Pool a's full upload quota refuses a's next upload (`quota`) and nothing else: b
/// takes uploads, and a's requests still send bodies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pools_full_upload_quota_stops_no_other() {
    let quota = (2 * MIB).to_string();
    let h = harness(&[("WEBPROXY_STREAMS__UPLOAD_MAX_BYTES", &quota)]).await;
    let refused = h
        .client
        .upload("a", &body_of(3 * MIB))
        .await
        .expect_err("over a's quota");
    assert!(refused.to_string().contains("quota"), "{refused}");

    let upload = h
        .client
        .upload("b", &body_of(MIB))
        .await
        .expect("b's upload");
    let reply = post_upload(&h, "b", upload).await;
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    let reply = h
        .client
        .request(
            &Request::new("POST", h.upstream.url("/sink"))
                .pool("a")
                .body("inline")
                .wait(REPLY_TIMEOUT),
        )
        .await
        .expect("a reply");
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
}

/// An upload no envelope names is gone after `upload_max_age` (1 s here; the wait is
/// bounded by [`REPLY_TIMEOUT`]), and an envelope naming it then is told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_upload_expires() {
    let h = harness(&[("WEBPROXY_STREAMS__UPLOAD_MAX_AGE", "1s")]).await;
    let upload = h.client.upload("a", &body_of(MIB)).await.expect("uploaded");
    wait_for(REPLY_TIMEOUT, "the upload to expire", || async {
        (stream_bytes(&h.js, &uploads_of("a")).await == Some(0)).then_some(())
    })
    .await;
    let reply = post_upload(&h, "a", upload).await;
    let error = reply.error.expect("an error reply");
    assert_eq!(error.code, ErrorCode::InvalidRequest, "{error:?}");
    assert!(
        error.message.contains("upload_max_age"),
        "{}",
        error.message
    );
    assert_eq!(h.upstream.hits(), 0);
}

/// deploy/nats/authorization.conf as shipped: an isolated caller uploads under its own
/// caller name and sends the body with a request answered in its own reply space; it
/// cannot upload under another caller's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_caller_uploads_under_its_own_name_only() {
    use webproxy_tests::authorized::{Caller, SERVICE_USER, service_as};
    let nats = webproxy_tests::NatsServer::start_authorized();
    let upstream = Upstream::start_with(sink_routes()).await;
    let config = format!(
        "[streams]\nreply_to_allow = [\"callers.{{caller}}.replies.>\"]\n\n{}",
        path_rule("sink", &upstream, "/sink")
    );
    let service =
        webproxy_tests::Service::start_with(&nats.url(), &config, service_as(SERVICE_USER)).await;
    let caller = Caller::connect(&nats, "caller_a").await;
    let client = webproxy_client::Client::new(caller.nats.clone(), "webproxy")
        .expect("client")
        .with_caller("a")
        .expect("caller name");
    let body = body_of(2 * MIB);
    let upload = client
        .upload("default", &body)
        .await
        .unwrap_or_else(|e| panic!("uploaded: {e}\n{}", service.logs()));
    let id = webproxy_client::new_id();
    let request = Request::new("POST", upstream.url("/sink"))
        .id(&id)
        .reply_to(caller.reply_to(&id))
        .body_upload(upload)
        .wait(REPLY_TIMEOUT);
    let reply = client
        .request(&request)
        .await
        .unwrap_or_else(|e| panic!("no reply: {e}\n{}", service.logs()));
    assert_eq!(
        reply.body.body.as_deref(),
        Some(format!("{} {}", body.len(), hex_sha256(&body)).as_str()),
        "{reply:?}"
    );

    let as_b = webproxy_client::Client::new(caller.nats.clone(), "webproxy")
        .expect("client")
        .with_caller("b")
        .expect("caller name");
    let refused = tokio::time::timeout(REPLY_TIMEOUT, as_b.upload("default", b"not mine"))
        .await
        .expect("refused within the wait");
    assert!(refused.is_err(), "caller a uploaded under b's name");
}
