//! Self-test of the fixture library, so a broken fixture fails here with a
//! clear name instead of as a confusing failure in some webproxy test.

use std::time::Duration;

use async_nats::jetstream;
use webproxy_tests::{NatsServer, Upstream, fails_once_routes, http_client, wait_for, wait_until};

const TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::test]
async fn nats_jetstream_survives_restart_on_the_same_port() {
    let mut nats = NatsServer::start();
    let port = nats.port();
    assert_eq!(nats.url(), format!("nats://127.0.0.1:{port}"));

    let client = nats.client().await;
    let js = jetstream::new(client.clone());
    js.create_stream(jetstream::stream::Config {
        name: "FIXTURE".to_owned(),
        subjects: vec!["fixture.>".to_owned()],
        ..Default::default()
    })
    .await
    .expect("create stream");
    let ack = js
        .publish("fixture.one", "hello".into())
        .await
        .expect("publish")
        .await
        .expect("publish ack");
    let stream = js.get_stream("FIXTURE").await.expect("get stream");
    let message = stream
        .get_raw_message(ack.sequence)
        .await
        .expect("read message back");
    assert_eq!(message.payload.as_ref(), b"hello");
    assert!(
        nats.store_dir()
            .read_dir()
            .expect("store dir")
            .next()
            .is_some(),
        "JetStream wrote nothing to {}",
        nats.store_dir().display()
    );

    nats.restart();
    assert_eq!(nats.port(), port, "restart must keep the port");

    // A fresh client, and the stored message survived the SIGKILL.
    let fresh = jetstream::new(nats.client().await);
    let mut stream = fresh.get_stream("FIXTURE").await.expect("stream survives");
    assert_eq!(stream.info().await.expect("stream info").state.messages, 1);
    let message = stream
        .get_last_raw_message_by_subject("fixture.one")
        .await
        .expect("message survives");
    assert_eq!(message.payload.as_ref(), b"hello");

    // The original client reconnects by itself because the port is the same.
    wait_until(TIMEOUT, "the first client to reconnect", || {
        let js = js.clone();
        async move { js.get_stream("FIXTURE").await.is_ok() }
    })
    .await;
}

#[tokio::test]
async fn nats_start_with_applies_extra_config() {
    let nats = NatsServer::start_with("authorization { token: \"s3cret\" }");
    assert!(
        async_nats::connect(nats.url()).await.is_err(),
        "the server should reject clients without the token"
    );
    let client = nats
        .client_with(|| async_nats::ConnectOptions::with_token("s3cret".to_owned()))
        .await;
    client.flush().await.expect("flush with token");
}

#[tokio::test]
async fn nats_kill_stops_the_server() {
    let mut nats = NatsServer::start();
    let client = nats.client().await;
    nats.kill();
    wait_until(TIMEOUT, "the client to notice the server is gone", || {
        let state = client.connection_state();
        async move { state != async_nats::connection::State::Connected }
    })
    .await;
}

#[tokio::test]
async fn upstream_counts_hits_and_concurrency() {
    let upstream = Upstream::start().await;
    let http = http_client();

    let requests = (0..5).map(|_| http.get(upstream.url("/delay/100")).send());
    for response in futures::future::join_all(requests).await {
        let response = response.expect("GET /delay/100");
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.expect("body"), "ok");
    }
    assert_eq!(upstream.hits(), 5);
    assert_eq!(upstream.hits_for("/delay/100"), 5);
    assert_eq!(upstream.hit_times("/delay/100").len(), 5);
    assert!(
        upstream.max_concurrent() >= 2,
        "5 concurrent requests to a 100 ms handler overlapped at most {} at a time",
        upstream.max_concurrent()
    );

    let response = http
        .get(upstream.url("/status/503"))
        .send()
        .await
        .expect("GET /status/503");
    assert_eq!(response.status(), 503);
    assert_eq!(response.text().await.expect("body"), "status 503");
    assert_eq!(upstream.hits(), 6);
    assert_eq!(upstream.hits_for("/echo"), 0);
}

#[tokio::test]
async fn upstream_default_routes() {
    let upstream = Upstream::start().await;
    let http = http_client();

    let echo = http
        .post(upstream.url("/echo?a=1&b=2"))
        .header("x-test", "one")
        .header("x-test", "two")
        .body("héllo")
        .send()
        .await
        .expect("POST /echo");
    assert_eq!(echo.headers()["content-type"], "application/json");
    let echo: serde_json::Value =
        serde_json::from_slice(&echo.bytes().await.expect("echo body")).expect("echo JSON");
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["path"], "/echo");
    assert_eq!(echo["query"], "a=1&b=2");
    assert_eq!(echo["headers"]["x-test"], serde_json::json!(["one", "two"]));
    assert_eq!(echo["body"], "héllo");
    assert_eq!(echo["body_len"], "héllo".len());

    let binary = http
        .get(upstream.url("/binary"))
        .send()
        .await
        .expect("GET /binary");
    assert_eq!(binary.headers()["content-type"], "application/octet-stream");
    assert_eq!(
        binary.bytes().await.expect("body").as_ref(),
        [0, 1, 2, 255, 254]
    );

    let multi = http
        .get(upstream.url("/multi"))
        .send()
        .await
        .expect("GET /multi");
    let values: Vec<_> = multi.headers().get_all("x-multi").iter().collect();
    assert_eq!(values, ["a", "b"]);
    assert_eq!(multi.headers()["x-single"], "one");
    assert_eq!(multi.text().await.expect("body"), "multi");

    // /hang must hold the request until the client gives up.
    let hung = http
        .get(upstream.url("/hang"))
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(hung.is_err_and(|error| error.is_timeout()));
    assert_eq!(upstream.hits_for("/hang"), 1);
}

#[tokio::test]
async fn upstream_custom_router_is_counted() {
    let router = axum::Router::new().route("/custom", axum::routing::get(|| async { "custom" }));
    let upstream = Upstream::start_with(router).await;
    let body = http_client()
        .get(upstream.url("/custom"))
        .send()
        .await
        .expect("GET /custom")
        .text()
        .await
        .expect("body");
    assert_eq!(body, "custom");
    assert_eq!(upstream.hits_for("/custom"), 1);
}

/// Each key fails once and only once, whatever the other keys did.
#[tokio::test]
async fn upstream_fails_once_per_key() {
    let upstream = Upstream::start_with(fails_once_routes()).await;
    let http = http_client();
    let status = |path: &str| {
        let request = http.get(upstream.url(path)).send();
        async move { request.await.expect("GET /fails-once").status().as_u16() }
    };
    assert_eq!(status("/fails-once/a").await, 503);
    assert_eq!(status("/fails-once/b").await, 503);
    assert_eq!(status("/fails-once/a").await, 200);
    assert_eq!(status("/fails-once/b").await, 200);
    assert_eq!(status("/fails-once/a").await, 200);
    assert_eq!(upstream.hits_for("/fails-once/a"), 3);
}

#[tokio::test]
async fn wait_helpers_poll_until_ready() {
    let mut calls = 0;
    let value = wait_for(TIMEOUT, "the third call", || {
        calls += 1;
        let seen = calls;
        async move { (seen >= 3).then_some(seen) }
    })
    .await;
    assert_eq!(value, 3);
}

#[tokio::test]
#[should_panic(expected = "timed out after 100ms waiting for never")]
async fn wait_until_panics_at_the_bound() {
    wait_until(Duration::from_millis(100), "never", || async { false }).await;
}
