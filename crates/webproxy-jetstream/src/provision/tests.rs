//! Provisioning against a real nats-server, and the pure configurations it writes.

use webproxy_config::testing::settings_from;

use super::*;

#[test]
fn a_limit_change_names_each_limit_with_its_old_value() {
    let from = PoolSpec {
        max_in_flight: 2,
        max_waiting: None,
        ack_wait: Duration::from_secs(15),
    };
    let to = PoolSpec {
        max_waiting: Some(1),
        ack_wait: Duration::from_secs(90),
        ..from
    };
    assert_eq!(
        to.changes_from(&from),
        "max_waiting 1 (was unlimited), ack_wait 1m 30s (was 15s)"
    );
    assert_eq!(
        from.changes_from(&PoolSpec {
            max_in_flight: 3,
            ..from
        }),
        "max_in_flight 2 (was 3)"
    );
    assert_eq!(from.changes_from(&from), "");
}

#[test]
fn fences_are_on_file_and_a_memory_fence_is_moved() {
    let settings = settings_from("").expect("the defaults");
    let file = stream::StorageType::File;
    let memory = stream::StorageType::Memory;
    for fence in [
        pool_fence_config(&settings, "default"),
        replies_fence_config(&settings),
    ] {
        assert_eq!(fence.storage, file, "{}", fence.name);
        assert_eq!(fence.max_messages, 1, "{}", fence.name);
    }
    assert_eq!(fence_step(None, file), FenceStep::CreateOrUpdate);
    assert_eq!(fence_step(Some(file), file), FenceStep::CreateOrUpdate);
    assert_eq!(fence_step(Some(memory), file), FenceStep::Move);
}

#[test]
fn the_shared_streams_of_layout_2_are_retired_once() {
    let retired = "webproxy.retired.dead";
    let shared = vec!["webproxy.dead.>".to_string()];
    for layout in [&[][..], &[(LAYOUT_KEY, "2")][..]] {
        assert_eq!(
            retirement(&shared, &metadata(layout), retired),
            Retirement::Retire
        );
    }
    assert_eq!(
        retirement(
            &[retired.to_string()],
            &metadata(&[(LAYOUT_KEY, "3")]),
            retired
        ),
        Retirement::Done
    );
    // Marked layout 3 but still capturing (an update lost half-way): retired again.
    assert_eq!(
        retirement(&shared, &metadata(&[(LAYOUT_KEY, "3")]), retired),
        Retirement::Retire
    );
    assert!(matches!(
        retirement(&shared, &metadata(&[(LAYOUT_KEY, "4")]), retired),
        Retirement::Refuse(LayoutRefusal::NewerLayout { .. })
    ));
}

#[test]
fn each_pool_has_its_own_replies_and_dead_letter_streams() {
    let settings = settings_from("[pools.a]\nmax_in_flight = 1\n[pools.b]\nmax_in_flight = 1\n")
        .expect("settings");
    let replies = pool_replies_stream_config(&settings, "a");
    assert_eq!(replies.name, "WEBPROXY_POOL_A_REPLIES");
    assert_eq!(replies.subjects, ["webproxy.reply.*.WEBPROXY_POOL_A.*"]);
    assert_eq!(replies.max_bytes, settings.streams.reply_max_bytes);
    assert_eq!(replies.max_age, settings.streams.reply_max_age);
    assert_eq!(replies.discard, stream::DiscardPolicy::Old);
    let dead = pool_dead_stream_config(&settings, "b");
    assert_eq!(dead.name, "WEBPROXY_POOL_B_DEAD");
    assert_eq!(
        dead.subjects,
        ["webproxy.dead.b", "webproxy.dead.b.superseded"]
    );
    assert_eq!(dead.max_bytes, settings.streams.dead_max_bytes);
    assert_eq!(dead.max_age, settings.streams.dead_max_age);
}

#[test]
fn versions() {
    assert!(server_version_supported("2.11.0"));
    assert!(!server_version_supported("2.10.29"));
    assert!(server_version_supported("2.15.1"));
    assert!(server_version_supported("v3.0.0"));
    assert!(server_version_supported("2.11.0-beta.1"));
    assert!(!server_version_supported("2.9.10"));
    assert!(!server_version_supported("1.4.1"));
    assert!(!server_version_supported("garbage"));
}

fn metadata(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn layouts_are_read_from_metadata() {
    assert_eq!(layout(&metadata(&[])), Some(1), "absent is layout 1");
    assert_eq!(layout(&metadata(&[("_nats.ver", "2.15.1")])), Some(1));
    assert_eq!(layout(&metadata(&[(LAYOUT_KEY, "2")])), Some(2));
    assert_eq!(layout(&metadata(&[(LAYOUT_KEY, "17")])), Some(17));
    assert_eq!(layout(&metadata(&[(LAYOUT_KEY, "two")])), None);
    assert_eq!(layout(&metadata(&[(LAYOUT_KEY, "")])), None);
}

#[test]
fn with_layout_keeps_every_other_key() {
    let before = metadata(&[("_nats.ver", "2.15.1"), (LAYOUT_KEY, "1"), ("team", "x")]);
    let after = with_layout(&before);
    assert_eq!(layout(&after), Some(LAYOUT));
    assert_eq!(after.get("_nats.ver").map(String::as_str), Some("2.15.1"));
    assert_eq!(after.get("team").map(String::as_str), Some("x"));
}

#[test]
fn removal_marks() {
    assert!(marked_removing(&metadata(&[(REMOVING_KEY, "true")])));
    assert!(!marked_removing(&metadata(&[(REMOVING_KEY, "false")])));
    assert!(!marked_removing(&metadata(&[])));
}

#[test]
fn older_layouts_migrate_newer_ones_are_left_alone() {
    assert_eq!(examine(&metadata(&[])), Examined::Migrate { from: 1 });
    assert_eq!(
        examine(&metadata(&[(LAYOUT_KEY, "1")])),
        Examined::Migrate { from: 1 }
    );
    assert_eq!(
        examine(&metadata(&[(LAYOUT_KEY, "2")])),
        Examined::Migrate { from: 2 }
    );
    assert_eq!(examine(&metadata(&[(LAYOUT_KEY, "3")])), Examined::Current);
    assert_eq!(
        examine(&metadata(&[(LAYOUT_KEY, "4")])),
        Examined::Refuse(LayoutRefusal::NewerLayout {
            found: "4".into(),
            own: LAYOUT
        })
    );
    // A layout that cannot be read is no reason to rewrite the stream either.
    assert!(matches!(
        examine(&metadata(&[(LAYOUT_KEY, "x")])),
        Examined::Refuse(LayoutRefusal::NewerLayout { .. })
    ));
    // A removal in progress wins over any layout.
    for layout in ["1", "2", "3", "4"] {
        assert_eq!(
            examine(&metadata(&[(LAYOUT_KEY, layout), (REMOVING_KEY, "true")])),
            Examined::Refuse(LayoutRefusal::Removing)
        );
    }
}

#[test]
fn refusals_are_found_in_provision_errors() {
    let error = refused("stream S".into(), LayoutRefusal::Removing);
    assert_eq!(error.refusal(), Some(&LayoutRefusal::Removing));
    assert!(error.to_string().contains("stream S"), "{error}");
    let other = provision_error("stream S", "timed out");
    assert_eq!(other.refusal(), None);
}

#[test]
fn a_server_without_room_for_a_stream_is_told_what_to_change() {
    let no_room: jetstream::Error = serde_json::from_value(serde_json::json!({
        "code": 500,
        "err_code": 10047,
        "description": "insufficient storage resources available",
    }))
    .expect("a JetStream API error");
    let error = provision_error(
        "stream S",
        jetstream::context::CreateStreamError::new(
            jetstream::context::CreateStreamErrorKind::JetStream(no_room),
        ),
    );
    let text = error.to_string();
    assert!(text.contains("max_file_store"), "{text}");
    assert!(
        text.contains("reply_max_bytes and dead_max_bytes"),
        "{text}"
    );
    let timed_out = provision_error("stream S", "timed out").to_string();
    assert!(!timed_out.contains("max_file_store"), "{timed_out}");
}
