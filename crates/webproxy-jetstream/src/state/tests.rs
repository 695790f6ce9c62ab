//! Tests of `state`.

use super::*;

fn specs() -> Vec<BucketSpec> {
    let settings = webproxy_config::testing::settings_from("").expect("the defaults");
    Bucket::ALL
        .iter()
        .map(|b| b.spec(&settings.subjects, &settings.streams))
        .collect()
}

#[test]
fn every_bucket_has_a_size_bound() {
    for spec in specs() {
        assert!(spec.max_bytes > 0, "{} has no bound", spec.name);
    }
}

#[test]
fn only_buckets_whose_loss_is_harmless_are_in_memory() {
    let memory: Vec<String> = specs()
        .into_iter()
        .filter(|s| s.storage == stream::StorageType::Memory)
        .map(|s| s.name)
        .collect();
    assert_eq!(memory, ["WEBPROXY_RATE"]);
}

#[test]
fn the_document_and_the_gateway_key_are_never_made_again() {
    let kept: Vec<String> = specs()
        .into_iter()
        .filter(|s| !s.recreate)
        .map(|s| s.name)
        .collect();
    assert_eq!(kept, ["WEBPROXY_CONFIG", "WEBPROXY_GATEWAY_KEY"]);
}

#[test]
fn a_bucket_is_nearly_full_from_90_percent_until_it_falls_below_85() {
    let at = |percent: i64| BucketUse {
        bytes: u64::try_from(percent).expect("a share"),
        max_bytes: 100,
    };
    assert!(!at(89).nearly_full(false));
    assert!(at(90).nearly_full(false));
    assert!(at(100).nearly_full(false));
    assert!(at(86).nearly_full(true), "still nearly full above 85 %");
    assert!(at(85).nearly_full(true));
    assert!(!at(84).nearly_full(true));
    assert_eq!(at(42).ratio(), 0.42);
    let rate = BucketUse {
        bytes: 7_800_000,
        max_bytes: 8 * MIB,
    };
    assert_eq!(
        rate.describe("WEBPROXY_RATE"),
        "bucket WEBPROXY_RATE is 93% full (7.4 MiB of 8.0 MiB): writes to it are refused when it is full; not ready from 90% until below 85%"
    );
}

#[test]
fn a_bucket_without_a_bound_is_never_nearly_full() {
    for max_bytes in [0, -1] {
        let unbounded = BucketUse {
            bytes: 1 << 40,
            max_bytes,
        };
        assert_eq!(unbounded.ratio(), 0.0);
        assert!(!unbounded.nearly_full(true));
    }
}

#[test]
fn settled_progress_records_leave_short_lived_markers() {
    let progress = &specs()[0];
    assert_eq!(progress.marker_ttl, Some(PROGRESS_MARKER_TTL));
    let mut config = stream::Config {
        max_bytes: progress.max_bytes,
        max_age: progress.max_age,
        ..Default::default()
    };
    assert!(
        progress.needs_update(&config),
        "a stream without per-message TTLs is updated"
    );
    config.allow_message_ttl = true;
    assert!(!progress.needs_update(&config));
}
