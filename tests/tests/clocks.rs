//! Issue 29, point 9: no decision depends on two clocks agreeing beyond a tolerance
//! (1 s). A pod whose clock runs 5 s ahead (`WEBPROXY_TEST_CLOCK_OFFSET`, honoured only
//! with the dispatcher's `test-hooks`) measures its skew against the NATS server's,
//! exports it, logs it once, and judges `queue_timeout` by the server's time. The rate
//! limit under the same fault is `flow.rs`'s
//! `a_rate_holds_when_one_pods_clock_runs_5_s_ahead`.

use std::time::Duration;

use webproxy_protocol::Outcome;
use webproxy_tests::caller::{Harness, accept_rule, envelope};
use webproxy_tests::{ServiceOptions, Upstream, wait_for};

/// How far the skewed pod's clock runs ahead of the server's.
const AHEAD: &str = "5s";

/// The gauge of the measured skew, in seconds.
const SKEW: &str = "webproxy_clock_skew_seconds";

/// What the pod logs when its skew is beyond the tolerance.
const WARNING: &str = "ahead of the NATS server's";

/// The gauges' refresh, which reads the server's clock: every 5 s.
const READING_EVERY: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_clock_runs_ahead_does_not_expire_fresh_requests() {
    let h = Harness::start_with_options(
        Upstream::start().await,
        ServiceOptions::default().env("WEBPROXY_TEST_CLOCK_OFFSET", AHEAD),
        |up| {
            format!(
                "[pools.default]\nqueue_timeout = \"3s\"\n\n{}",
                accept_rule("up", up)
            )
        },
    )
    .await;
    // Measured before the first message is judged: ready means measured.
    let skew = wait_for(Duration::from_secs(10), "the skew gauge", || async {
        h.service.metric(SKEW).await
    })
    .await;
    assert!((4.5..5.5).contains(&skew), "skew gauge {skew}");
    // Each request waited milliseconds: by the pod's clock it waited 5 s, more than
    // the pool's queue_timeout of 3 s; by the server's, it did not.
    for _ in 0..3 {
        let reply = h.request(&envelope("GET", &h.upstream.url("/echo"))).await;
        assert_eq!(reply.outcome, Outcome::Response, "{:?}", reply.error);
        assert_eq!(reply.status, Some(200));
    }
    assert_eq!(h.upstream.hits_for("/echo"), 3);
    // Not waiting for a condition: two more readings of the same skew pass, and the
    // pod says nothing more about it.
    tokio::time::sleep(READING_EVERY * 2).await;
    let logs = h.service.logs();
    assert_eq!(logs.matches(WARNING).count(), 1, "{logs}");
    assert!(h.service.metric(SKEW).await.is_some_and(|s| s > 4.5));
}
