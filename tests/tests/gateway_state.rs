//! The gateway's cluster state (issue 29, point 1, for `<PREFIX>_GATEWAY_KEY` and
//! `<PREFIX>_GATEWAY`): a lost key is never made again behind the operators' back (the
//! gateway turns `/readyz` 503, naming the bucket and the commands, and refuses what
//! needs the key until `webproxy gateway key restore` or `rotate`), and a lost records
//! bucket is made again by the next request. Real `serve` and `gateway` binaries
//! against a real nats-server.
//!
//! Bounds: the issue's 10 s for `/readyz`; generous ones elsewhere (a loaded 2-core
//! machine runs several services per test).

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use reqwest::Response;
use serde_json::Value;
use webproxy_tests::caller::accept_rule;
use webproxy_tests::{
    Gateway, NatsServer, Service, ServiceOptions, Upstream, http_client, run_webproxy,
};

/// The issue's bound: a lost key turns `/readyz` 503 within 10 s.
const NOT_READY: Duration = Duration::from_secs(10);

/// A key put back is read by the gateway within 2 s (its poll); generous for a loaded
/// machine.
const READY_AGAIN: Duration = Duration::from_secs(10);

const KEY_STREAM: &str = "KV_WEBPROXY_GATEWAY_KEY";
const KEY_BUCKET: &str = "WEBPROXY_GATEWAY_KEY";
const RECORDS_STREAM: &str = "KV_WEBPROXY_GATEWAY";

const TOKEN: &str = "alpha-secret";

/// A nats-server, an upstream, the service, and a gateway with one route `/a` whose
/// token is [`TOKEN`]: its identity, and every keyed id, is an HMAC under the key.
struct Scene {
    nats: NatsServer,
    upstream: Upstream,
    _service: Service,
    gateway: Gateway,
    js: jetstream::Context,
}

impl Scene {
    async fn start() -> Scene {
        let nats = NatsServer::start();
        let upstream = Upstream::start().await;
        let service = Service::start(&nats, &accept_rule("local", &upstream)).await;
        let gateway = Gateway::start_with(
            &nats,
            &format!(
                "[[gateway.routes]]\npath = \"/a\"\nupstream = \"{}\"\ntoken = {{ env = \"GW_TOKEN\" }}\n",
                upstream.url("/")
            ),
            ServiceOptions::default().env("GW_TOKEN", TOKEN),
        )
        .await;
        let js = jetstream::new(nats.client().await);
        Scene {
            nats,
            upstream,
            _service: service,
            gateway,
            js,
        }
    }

    /// `POST /a/echo?n=<n>` with the token and `Idempotency-Key: <key>`, and with
    /// `Prefer: respond-async` when `async_`: answered 202 only once the id is recorded.
    async fn keyed(&self, key: &str, n: u32, async_: bool) -> Response {
        let mut request = http_client()
            .post(self.gateway.url(&format!("/a/echo?n={n}")))
            .header("Proxy-Authorization", format!("Bearer {TOKEN}"))
            .header("Idempotency-Key", key)
            .body("order");
        if async_ {
            request = request.header("Prefer", "respond-async");
        }
        request.send().await.expect("the gateway answers")
    }

    /// `webproxy gateway key <args>` against this server: its output, which must
    /// succeed.
    async fn key_command(&self, args: &[&str]) -> String {
        let output = self.key_command_output(args).await;
        assert!(output.status.success(), "{args:?}: {output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    async fn key_command_output(&self, args: &[&str]) -> std::process::Output {
        let url = self.nats.url();
        let mut all = vec!["gateway", "key"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--nats", &url]);
        run_webproxy(&all).await
    }

    /// Deletes the key's bucket by hand, and waits for `/readyz` to say so.
    async fn lose_the_key(&self) -> String {
        self.js
            .delete_stream(KEY_STREAM)
            .await
            .expect("delete the key's bucket");
        let lost = Instant::now();
        let body = self.gateway.not_ready_naming(NOT_READY, KEY_BUCKET).await;
        println!("/readyz 503 after {:?}: {body}", lost.elapsed());
        body
    }
}

fn id_of(response: &Response) -> String {
    response
        .headers()
        .get("webproxy-id")
        .and_then(|v| v.to_str().ok())
        .expect("Webproxy-Id")
        .to_string()
}

/// Point 1, "Recreation", for the key: a deleted key bucket under a running gateway
/// turns `/readyz` 503 within 10 s, naming the bucket and the commands, and keyed
/// requests are refused `key_lost`; no key is written behind the operators' back.
/// `webproxy gateway key restore` with the key `export` saved makes it ready again,
/// and an id minted before the loss is still served: its reply to its token, and the
/// same conversation to a retry with its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_gateway_key_is_never_made_again_and_a_restored_one_serves_ids_minted_before() {
    let scene = Scene::start().await;
    let first = scene.keyed("order-1", 1, false).await;
    assert_eq!(first.status(), 200);
    let id = id_of(&first);
    let dir = tempfile::tempdir().expect("a directory");
    let saved = dir.path().join("gateway.key");
    let saved = saved.to_str().expect("a UTF-8 path");
    scene.key_command(&["export", "--to", saved]).await;

    let body = scene.lose_the_key().await;
    for command in [
        "webproxy gateway key restore --from FILE",
        "webproxy gateway key rotate",
    ] {
        assert!(body.contains(command), "{body}");
    }
    let refused = scene.keyed("order-2", 2, false).await;
    assert_eq!(refused.status(), 503);
    let refusal: Value =
        serde_json::from_slice(&refused.bytes().await.expect("a body")).expect("JSON");
    assert_eq!(refusal["error"]["code"], "key_lost", "{refusal}");
    // Nothing makes the bucket again: watched over two of the gateway's polls.
    let watch_until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < watch_until {
        assert!(
            scene.js.get_stream(KEY_STREAM).await.is_err(),
            "the key's bucket was made again\n{}",
            scene.gateway.logs()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(scene.gateway.readiness().await.0, 503);

    scene.key_command(&["restore", "--from", saved]).await;
    scene.gateway.wait_ready(READY_AGAIN).await;
    let served = http_client()
        .get(scene.gateway.url(&format!("/_webproxy/replies/{id}")))
        .header("Proxy-Authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(served.status(), 200, "{}", scene.gateway.logs());
    let again = scene.keyed("order-1", 1, false).await;
    assert_eq!((again.status().as_u16(), id_of(&again)), (200, id));
    assert_eq!(
        scene.upstream.hits_for("/echo"),
        1,
        "the retry with the key was a second conversation"
    );
}

/// Point 1, "Recreation", for the key: `webproxy gateway key rotate` ends a loss with a
/// new key (the same idempotency key then names another id); a key that is there is
/// replaced only with `--yes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_makes_a_gateway_whose_key_was_lost_ready_with_a_new_key() {
    let scene = Scene::start().await;
    let before = scene.keyed("order-1", 1, false).await;
    assert_eq!(before.status(), 200);
    scene.lose_the_key().await;

    scene.key_command(&["rotate"]).await;
    scene.gateway.wait_ready(READY_AGAIN).await;
    let after = scene.keyed("order-1", 1, false).await;
    assert_eq!(after.status(), 200, "{}", scene.gateway.logs());
    assert_ne!(id_of(&after), id_of(&before), "the same key as before");

    let exported = scene.key_command(&["export"]).await;
    let refused = scene.key_command_output(&["rotate"]).await;
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--yes"),
        "{refused:?}"
    );
    assert_eq!(scene.key_command(&["export"]).await, exported);
    scene.key_command(&["rotate", "--yes"]).await;
    assert_ne!(scene.key_command(&["export"]).await, exported);
}

/// Point 1, "Recreation", for the records: the records bucket deleted under a running
/// gateway is made again by the first request after the loss (it was answered 500
/// `unrecorded` until a restart), so idempotency holds again at once: that request
/// is recorded (a 202), and its retry with the same key joins its conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_records_bucket_deleted_under_a_running_gateway_is_made_again_by_the_next_request() {
    let scene = Scene::start().await;
    assert_eq!(scene.keyed("order-1", 1, false).await.status(), 200);
    scene
        .js
        .delete_stream(RECORDS_STREAM)
        .await
        .expect("delete the records bucket");

    let first = scene.keyed("order-2", 2, true).await;
    assert_eq!(first.status(), 202, "{}", scene.gateway.logs());
    let retry = scene.keyed("order-2", 2, false).await;
    assert_eq!(retry.status(), 200);
    assert_eq!(id_of(&retry), id_of(&first));
    assert_eq!(
        scene.upstream.hits_for("/echo"),
        2,
        "a second upstream call"
    );
    assert!(scene.js.get_stream(RECORDS_STREAM).await.is_ok());
    assert_eq!(scene.gateway.readiness().await.0, 200);
}

/// Point 1, "When full": buckets made by an earlier release without a bound are
/// brought to their declared one when the gateway opens them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_existing_buckets_are_brought_to_their_declared_bound() {
    let nats = NatsServer::start();
    let js = jetstream::new(nats.client().await);
    for bucket in ["WEBPROXY_GATEWAY", KEY_BUCKET] {
        js.create_key_value(kv::Config {
            bucket: bucket.into(),
            history: 1,
            ..Default::default()
        })
        .await
        .expect("a bucket without a bound");
    }
    js.get_key_value(KEY_BUCKET)
        .await
        .expect("the key's bucket")
        .put("hmac", "an earlier release's key".into())
        .await
        .expect("the key");
    let upstream = Upstream::start().await;
    let _gateway = Gateway::start(
        &nats,
        &format!(
            "[[gateway.routes]]\npath = \"/a\"\nupstream = \"{}\"\n",
            upstream.url("/")
        ),
    )
    .await;
    for stream in [RECORDS_STREAM, KEY_STREAM] {
        let info = js
            .get_stream(stream)
            .await
            .expect("the bucket's stream")
            .cached_info()
            .clone();
        assert!(info.config.max_bytes > 0, "{stream} has no bound");
    }
}

/// How long the gateway takes to show its buckets' use: it reads them every 5 s, plus
/// a margin for a loaded machine.
const BUCKET_USE_SHOWN: Duration = Duration::from_secs(15);

/// Point 1, "When full", for the gateway's buckets: the gateway exports their use
/// (`webproxy_state_bucket_used_ratio{bucket="gateway_key"}`) and turns `/readyz` 503,
/// naming the bucket, from 90 % of its bound, before a full bucket refuses the key's
/// rotation; back to 200 once it falls below 85 %. The key bucket (1 MiB) is filled by
/// hand under keys the gateway never reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nearly_full_gateway_bucket_is_gauged_and_turns_the_gateway_not_ready() {
    let scene = Scene::start().await;
    let ratio = r#"webproxy_state_bucket_used_ratio{bucket="gateway_key"}"#;
    webproxy_tests::wait_until(BUCKET_USE_SHOWN, "the key bucket's use, low", || async {
        scene.gateway.metric(ratio).await.is_some_and(|r| r < 0.1)
    })
    .await;
    let mut stream = scene
        .js
        .get_stream(KEY_STREAM)
        .await
        .expect("the key bucket");
    let bound = stream.info().await.expect("its info").config.max_bytes;
    let fill = usize::try_from(bound).expect("a bound") / 100 * 95;
    let pieces = fill.div_ceil(256 * 1024);
    let kv = scene
        .js
        .get_key_value(KEY_BUCKET)
        .await
        .expect("the key bucket");
    for n in 0..pieces {
        kv.put(format!("filler.{n}"), vec![b'x'; fill / pieces].into())
            .await
            .expect("a filler value");
    }
    let body = scene
        .gateway
        .not_ready_naming(BUCKET_USE_SHOWN, KEY_BUCKET)
        .await;
    assert!(body.contains("% full"), "{body}");
    let used = scene.gateway.metric(ratio).await.expect("the ratio gauge");
    assert!((0.9..1.0).contains(&used), "the gauge reads {used}");

    stream
        .purge()
        .filter(format!("$KV.{KEY_BUCKET}.filler.>"))
        .await
        .expect("purge the filler");
    scene.gateway.wait_ready(BUCKET_USE_SHOWN).await;
}
