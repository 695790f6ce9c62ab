//! Response rules, retries on parked backoff, deadlines and queue timeouts, end to end.
//!
//! Time bounds here are generous on purpose: CI is a loaded 2-core machine. Lower bounds
//! check that a wait happened at all (a schedule that ignores the delay fails them);
//! upper bounds only catch a wait that is far too long.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{any, get};
use webproxy_protocol::{ErrorCode, HeaderValue, Outcome};
use webproxy_tests::caller::{Harness, accept_rule, envelope, next_message, to};
use webproxy_tests::{Upstream, default_routes};

/// Upstream routes for retry tests, beside the default ones:
/// - `/flaky/{n}`: 503 for the first `n` calls, then 200 `ok`
/// - `/retry-after`: 503 with `Retry-After: 1`
/// - `/fault/{text}`: 500 with body `<Fault>{text}</Fault>`
async fn upstream() -> Upstream {
    let calls = Arc::new(AtomicUsize::new(0));
    let flaky = any(move |axum::extract::Path(n): axum::extract::Path<usize>| {
        let calls = calls.clone();
        async move {
            if calls.fetch_add(1, Ordering::SeqCst) < n {
                (StatusCode::SERVICE_UNAVAILABLE, "busy")
            } else {
                (StatusCode::OK, "ok")
            }
        }
    });
    let router = Router::new()
        .route("/flaky/{n}", flaky)
        .route(
            "/retry-after",
            get(|| async {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [("retry-after", "1")],
                    "later",
                )
            }),
        )
        .route(
            "/fault/{text}",
            any(
                |axum::extract::Path(text): axum::extract::Path<String>| async move {
                    (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("<Fault>{text}</Fault>"),
                    )
                },
            ),
        );
    Upstream::start_with(default_routes().merge(router)).await
}

/// One rule accepting the upstream with the given extra rule keys.
fn rule(up: &Upstream, extra: &str) -> String {
    format!("{}{extra}\n", accept_rule("local", up))
}

fn gaps(times: &[Instant]) -> Vec<Duration> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test]
async fn flaky_endpoint_is_retried_on_schedule() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        rule(
            up,
            "max_retries = 3\nretry_delay = \"300ms\"\nbackoff_factor = 2.0",
        )
    })
    .await;
    let reply = h
        .request(&envelope("GET", &h.upstream.url("/flaky/2")))
        .await;
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    assert_eq!(reply.status, Some(200));
    assert_eq!(reply.attempts, 3);
    let gaps = gaps(&h.upstream.hit_times("/flaky/2"));
    assert_eq!(gaps.len(), 2);
    // About 300 ms and 600 ms; the upper bounds allow for a slow machine.
    assert!(
        gaps[0] >= Duration::from_millis(280) && gaps[0] < Duration::from_millis(1500),
        "{gaps:?}"
    );
    assert!(
        gaps[1] >= Duration::from_millis(570) && gaps[1] < Duration::from_millis(2000),
        "{gaps:?}"
    );
}

#[tokio::test]
async fn always_failing_endpoint_exhausts_retries_and_is_dead_lettered() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        rule(up, "max_retries = 2\nretry_delay = \"100ms\"")
    })
    .await;
    let request = envelope("POST", &h.upstream.url("/status/503"));
    let reply = h.request(&request).await;
    let error = reply.error.expect("error");
    assert_eq!(error.code, ErrorCode::RetriesExhausted);
    assert_eq!(error.status, Some(503));
    assert_eq!(reply.attempts, 3);
    assert_eq!(h.upstream.hits_for("/status/503"), 3);
    let letters = h.wait_dead_letters(1).await;
    let letter = &letters[0].1;
    assert_eq!(letter.id.as_deref(), Some(request.id.as_str()));
    assert_eq!(letter.error.code, ErrorCode::RetriesExhausted);
    assert_eq!(letter.attempts.len(), 3);
    assert!(letter.attempts.iter().all(|a| a.status == Some(503)));
    assert!(letter.envelope.is_some());
}

#[tokio::test]
async fn closed_port_and_timeouts_are_retried_then_exhausted() {
    let (_reserved, closed) = webproxy_tests::closed_port();
    let closed_url = format!("http://127.0.0.1:{closed}/nothing");
    let h = Harness::start_with_upstream(upstream().await, |up| {
        format!(
            "{}[[request_rules]]\nname = \"closed\"\nurl_pattern = '^http://127\\.0\\.0\\.1:{closed}/'\nmax_retries = 2\nretry_delay = \"50ms\"\n",
            rule(up, "max_retries = 2\nretry_delay = \"50ms\"\ntimeout = \"200ms\"")
        )
    })
    .await;
    let refused = h.request(&envelope("POST", &closed_url)).await;
    let error = refused.error.expect("error");
    assert_eq!(error.code, ErrorCode::RetriesExhausted, "{error:?}");
    assert_eq!(error.status, None);
    assert!(error.message.contains("connect"), "{}", error.message);
    assert_eq!(refused.attempts, 3);

    let slow = h
        .request(&envelope("GET", &h.upstream.url("/delay/2000")))
        .await;
    let error = slow.error.expect("error");
    assert_eq!(error.code, ErrorCode::RetriesExhausted, "{error:?}");
    assert!(error.message.contains("timeout"), "{}", error.message);
    assert_eq!(slow.attempts, 3);
    assert_eq!(h.upstream.hits_for("/delay/2000"), 3);
}

#[tokio::test]
async fn post_that_times_out_is_retried_only_when_safe() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        rule(
            up,
            "max_retries = 2\nretry_delay = \"50ms\"\ntimeout = \"200ms\"",
        )
    })
    .await;
    let post = h
        .request(&envelope("POST", &h.upstream.url("/delay/1500")))
        .await;
    let error = post.error.expect("error");
    assert_eq!(error.code, ErrorCode::TransportError, "{error:?}");
    assert!(
        error.message.contains("may have reached the upstream"),
        "{}",
        error.message
    );
    assert_eq!(post.attempts, 1);
    assert_eq!(h.upstream.hits_for("/delay/1500"), 1);

    let mut keyed = envelope("POST", &h.upstream.url("/delay/1600"));
    keyed
        .headers
        .insert("Idempotency-Key".into(), HeaderValue::One("k-1".into()));
    let reply = h.request(&keyed).await;
    assert_eq!(
        reply.error.map(|e| e.code),
        Some(ErrorCode::RetriesExhausted)
    );
    assert_eq!(h.upstream.hits_for("/delay/1600"), 3);

    let get = h
        .request(&envelope("GET", &h.upstream.url("/delay/1700")))
        .await;
    assert_eq!(get.error.map(|e| e.code), Some(ErrorCode::RetriesExhausted));
    assert_eq!(h.upstream.hits_for("/delay/1700"), 3);
}

#[tokio::test]
async fn retry_after_stretches_a_short_delay() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        rule(up, "max_retries = 1\nretry_delay = \"100ms\"")
    })
    .await;
    let reply = h
        .request(&envelope("GET", &h.upstream.url("/retry-after")))
        .await;
    assert_eq!(
        reply.error.map(|e| e.code),
        Some(ErrorCode::RetriesExhausted)
    );
    let gaps = gaps(&h.upstream.hit_times("/retry-after"));
    assert_eq!(gaps.len(), 1);
    assert!(gaps[0] >= Duration::from_millis(980), "{gaps:?}");
}

#[tokio::test]
async fn response_rules_classify_statuses_and_bodies() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        format!(
            "{}\n[[response_rules]]\nstatus = \"418\"\naction = \"error\"\n\n[[response_rules]]\nstatus = \"500\"\naction = \"retry\"\nbody_pattern = 'ConcurrentRequestLimit'\n\n[[response_rules]]\nstatus = \"500-599\"\naction = \"error\"\n",
            rule(up, "max_retries = 1\nretry_delay = \"50ms\"")
        )
    })
    .await;
    let teapot = h
        .request(&envelope("GET", &h.upstream.url("/status/418")))
        .await;
    let error = teapot.error.expect("error");
    assert_eq!(error.code, ErrorCode::UpstreamError);
    assert_eq!(error.status, Some(418));
    assert!(error.message.contains("status 418"), "{}", error.message);

    let limited = h
        .request(&envelope(
            "GET",
            &h.upstream.url("/fault/ExceededConcurrentRequestLimitFault"),
        ))
        .await;
    assert_eq!(
        limited.error.map(|e| e.code),
        Some(ErrorCode::RetriesExhausted)
    );
    assert_eq!(
        h.upstream
            .hits_for("/fault/ExceededConcurrentRequestLimitFault"),
        2
    );

    let permanent = h
        .request(&envelope("GET", &h.upstream.url("/fault/InvalidLogin")))
        .await;
    assert_eq!(
        permanent.error.map(|e| e.code),
        Some(ErrorCode::UpstreamError)
    );
    assert_eq!(h.upstream.hits_for("/fault/InvalidLogin"), 1);

    // Not matched by any configured rule: delivered, although the defaults would retry.
    let too_many = h
        .request(&envelope("GET", &h.upstream.url("/status/429")))
        .await;
    assert_eq!(too_many.outcome, Outcome::Response);
    assert_eq!(too_many.status, Some(429));
}

#[tokio::test]
async fn a_rules_own_response_rules_replace_the_global_ones() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        let base = up.url("/").replace('.', "\\.");
        format!(
            "[[response_rules]]\nstatus = \"503\"\naction = \"error\"\n\n\
             [[request_rules]]\nname = \"own\"\nurl_pattern = '^{base}flaky/'\nmax_retries = 2\nretry_delay = \"50ms\"\n\
             [[request_rules.response_rules]]\nstatus = \"503\"\naction = \"retry\"\n\n\
             [[request_rules]]\nname = \"global\"\nurl_pattern = '^{base}'\n"
        )
    })
    .await;
    let own = h
        .request(&envelope("GET", &h.upstream.url("/flaky/1")))
        .await;
    assert_eq!(own.status, Some(200), "{own:?}");
    assert_eq!(own.attempts, 2);
    let global = h
        .request(&envelope("GET", &h.upstream.url("/status/503")))
        .await;
    assert_eq!(global.error.map(|e| e.code), Some(ErrorCode::UpstreamError));
}

#[tokio::test]
async fn a_past_deadline_expires_without_calling_the_upstream() {
    let h = Harness::start_with_upstream(upstream().await, |up| rule(up, "")).await;
    let mut request = envelope("GET", &h.upstream.url("/echo"));
    request.deadline = Some("2020-01-01T00:00:00Z".into());
    let reply = h.request(&request).await;
    assert_eq!(reply.error.map(|e| e.code), Some(ErrorCode::Expired));
    assert_eq!(reply.attempts, 0);
    assert_eq!(h.upstream.hits(), 0);
    assert_eq!(
        h.wait_dead_letters(1).await[0].1.error.code,
        ErrorCode::Expired
    );
}

#[tokio::test]
async fn queue_timeout_expires_a_request_stuck_behind_a_busy_pool() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        format!(
            "[pools.default]\nmax_in_flight = 1\nqueue_timeout = \"500ms\"\n\n{}",
            rule(up, "")
        )
    })
    .await;
    let slow = envelope("GET", &h.upstream.url("/delay/2000"));
    h.client
        .submit(&to("default", &slow))
        .await
        .expect("submit");
    webproxy_tests::wait_until(
        Duration::from_secs(10),
        "the slow request to start",
        || async { h.upstream.hits_for("/delay/2000") == 1 },
    )
    .await;
    let waiting = h.request(&envelope("GET", &h.upstream.url("/echo"))).await;
    let error = waiting.error.expect("expired");
    assert_eq!(error.code, ErrorCode::Expired);
    assert!(error.message.contains("queue_timeout"), "{}", error.message);
    assert_eq!(h.upstream.hits_for("/echo"), 0);
}

/// A request waiting out its backoff holds no slot: with one slot, twenty healthy
/// requests get through while a failing one is parked.
#[tokio::test]
async fn a_parked_retry_does_not_block_its_pool() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        format!(
            "[pools.default]\nmax_in_flight = 1\n\n{}",
            rule(up, "max_retries = 3\nretry_delay = \"2s\"")
        )
    })
    .await;
    let failing = envelope("GET", &h.upstream.url("/status/503"));
    h.client
        .submit(&to("default", &failing))
        .await
        .expect("submit");
    webproxy_tests::wait_until(
        Duration::from_secs(10),
        "the first failing attempt",
        || async { h.upstream.hits_for("/status/503") == 1 },
    )
    .await;
    let started = Instant::now();
    let h = &h;
    let replies = futures::future::join_all((0..20).map(|_| {
        let request = envelope("GET", &h.upstream.url("/echo"));
        async move { h.request(&request).await }
    }))
    .await;
    let elapsed = started.elapsed();
    assert!(replies.iter().all(|r| r.status == Some(200)), "{replies:?}");
    assert!(
        elapsed < Duration::from_secs(3),
        "20 requests took {elapsed:?}"
    );
    // The failing request was still waiting for its second attempt meanwhile.
    assert_eq!(h.upstream.hits_for("/status/503"), 1);
}

async fn webproxy(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(webproxy_tests::webproxy_bin())
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .await
        .expect("run webproxy")
}

#[tokio::test]
async fn dead_letters_are_listed_and_replayed_as_a_new_generation() {
    let h = Harness::start_with_upstream(upstream().await, |up| rule(up, "max_retries = 0")).await;
    let request = envelope("GET", &h.upstream.url("/flaky/1"));
    let failed = h.request_answer(&request).await;
    assert_eq!(
        failed.reply.error.map(|e| e.code),
        Some(ErrorCode::RetriesExhausted)
    );
    h.wait_dead_letters(1).await;

    let nats = h.nats.url();
    let listed = webproxy(&["dead", "list", "--nats", &nats, "--json"]).await;
    assert!(listed.status.success(), "{listed:?}");
    // One JSON array of letters.
    let letters: Vec<serde_json::Value> =
        serde_json::from_slice(&listed.stdout).expect("one JSON array");
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0]["id"], request.id.as_str());
    assert_eq!(letters[0]["error"]["code"], "retries_exhausted");
    assert_eq!(letters[0]["pool"], "default");
    let other_pool =
        webproxy(&["dead", "list", "--nats", &nats, "--pool", "other", "--json"]).await;
    assert!(other_pool.status.success(), "{other_pool:?}");
    let none: Vec<serde_json::Value> =
        serde_json::from_slice(&other_pool.stdout).expect("one JSON array");
    assert!(none.is_empty(), "{other_pool:?}");

    let mut replies =
        h.js.client()
            .subscribe(format!("webproxy.reply.{}", request.id))
            .await
            .expect("subscribe");
    let replayed = webproxy(&["dead", "replay", "--nats", &nats, "--id", &request.id]).await;
    assert!(replayed.status.success(), "{replayed:?}");
    let message = next_message(
        &mut replies,
        Duration::from_secs(20),
        "a reply to the replay",
    )
    .await;
    let reply: webproxy_protocol::Reply = serde_json::from_slice(&message.payload).expect("reply");
    assert_eq!(reply.status, Some(200), "{reply:?}");
    assert_eq!(reply.attempts, 1);
    let generation = message
        .headers
        .as_ref()
        .and_then(|hd| hd.get(webproxy_protocol::header::GENERATION))
        .map(|v| v.as_str().to_string());
    assert_eq!(generation.as_deref(), Some("1"));
    // A live subscriber can see the reply a moment before the stream has stored it.
    webproxy_tests::wait_until(
        Duration::from_secs(10),
        "the replay's reply to be stored",
        || async {
            let stored = h
                .client
                .reply(&request.id, &failed.origin)
                .await
                .expect("lookup");
            stored.is_some_and(|r| r.status == Some(200))
        },
    )
    .await;
    // The dead letter stays as an audit trail.
    assert_eq!(h.dead_letters().await.len(), 1);
}
