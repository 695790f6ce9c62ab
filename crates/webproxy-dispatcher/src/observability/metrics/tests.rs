//! Tests of `metrics`.

use super::*;

#[test]
fn exposition_has_the_agreed_names_and_labels() {
    let metrics = Metrics::new("1.2.3");
    metrics.request_finished("default", "orders", None);
    metrics.request_finished("default", "none", Some("denied"));
    metrics.attempt("default", "orders", "5xx", Duration::from_millis(20));
    metrics.queue_wait("default", Duration::from_millis(5));
    metrics.dead_letter("default", "denied");
    let gauges = Gauges::default();
    gauges.add(&["default".to_string()]);
    let pool = gauges.pool("default").expect("pool");
    let _busy = pool.start();
    pool.set_queued(7, 2);
    pool.set_max_in_flight(16);
    let health = Health::new();
    health.set_nats_connected(true);
    metrics.set_config_revision(12);
    metrics.config_refused();
    metrics.breaker_transition("default", "open");
    metrics.set_pool_effective_limit("default", 9);
    metrics.set_state_bucket_use(
        "rate",
        Some(BucketUse {
            bytes: 768,
            max_bytes: 1024,
        }),
    );
    metrics.set_state_bucket_use("progress", None);
    assert_eq!(metrics.config_revision(), 12);
    let text = metrics.render(&gauges, &health);
    for line in [
        r#"webproxy_requests_total{pool="default",rule="orders",outcome="response",code="none"} 1"#,
        r#"webproxy_requests_total{pool="default",rule="none",outcome="error",code="denied"} 1"#,
        r#"webproxy_attempts_total{pool="default",rule="orders",result="5xx"} 1"#,
        r#"webproxy_attempt_duration_seconds_count{pool="default",rule="orders"} 1"#,
        r#"webproxy_queue_wait_seconds_count{pool="default"} 1"#,
        r#"webproxy_in_flight{pool="default"} 1"#,
        r#"webproxy_pool_waiting{pool="default"} 7"#,
        r#"webproxy_pool_parked{pool="default"} 2"#,
        r#"webproxy_pool_max_in_flight{pool="default"} 16"#,
        r#"webproxy_dead_letters_total{pool="default",code="denied"} 1"#,
        "webproxy_nats_connected 1",
        "webproxy_config_revision 12",
        "webproxy_config_refused_total 1",
        r#"webproxy_breaker_transitions_total{pool="default",to="open"} 1"#,
        r#"webproxy_pool_effective_limit{pool="default"} 9"#,
        r#"webproxy_build_info{version="1.2.3"} 1"#,
        r#"webproxy_state_bucket_bytes{bucket="rate"} 768"#,
        r#"webproxy_state_bucket_used_ratio{bucket="rate"} 0.75"#,
        r#"webproxy_state_bucket_bytes{bucket="progress"} 0"#,
        r#"webproxy_state_bucket_used_ratio{bucket="progress"} 0.0"#,
        "webproxy_clock_skew_seconds ",
    ] {
        assert!(text.contains(line), "missing {line}\n{text}");
    }
    assert!(text.contains("aggregate with max"), "{text}");
}

/// A 14 min wait lands below `+Inf`; HTTP attempts keep their buckets.
#[test]
fn queue_wait_buckets_reach_fifteen_minutes() {
    let last = queue_wait_buckets().last().expect("buckets");
    assert!(last >= 15.0 * 60.0, "last bucket {last}");
    let metrics = Metrics::new("1.2.3");
    metrics.queue_wait("default", Duration::from_secs(14 * 60));
    metrics.attempt("default", "r", "2xx", Duration::from_millis(20));
    let text = metrics.render(&Gauges::default(), &Health::new());
    for line in [
        r#"webproxy_queue_wait_seconds_bucket{le="655.36",pool="default"} 0"#,
        r#"webproxy_queue_wait_seconds_bucket{le="1310.72",pool="default"} 1"#,
        r#"webproxy_attempt_duration_seconds_bucket{le="65.536",pool="default",rule="r"} 1"#,
    ] {
        assert!(text.contains(line), "missing {line}\n{text}");
    }
}
