//! Tests of `config_store`.

use super::*;

#[test]
fn the_note_is_one_comment_line_before_the_document() {
    let note = PushNote {
        user: "alice".into(),
        message: "deny example.org\nfor the incident".into(),
    };
    let document = "[pools.a]\nmax_in_flight = 3\n";
    let text = stored_text(&note, document);
    assert_eq!(text.lines().count(), 3, "{text}");
    assert!(text.starts_with("# webproxy-push: {"), "{text}");
    assert_eq!(strip_note(&text), (Some(note.clone()), document));
    // The stored value is a TOML document with the same content.
    let stored: toml::Table = toml::from_str(&text).expect("TOML");
    assert_eq!(
        stored,
        toml::from_str::<toml::Table>(document).expect("TOML")
    );
    // Pushing a saved value again replaces its note rather than stacking them.
    let again = stored_text(&PushNote::default(), &text);
    assert_eq!(strip_note(&again), (Some(PushNote::default()), document));
}

#[test]
fn a_value_without_a_note_is_all_document() {
    for text in [
        "",
        "[pools.a]\n",
        "# a comment\n[pools.a]\n",
        "# webproxy-push: not json\n[pools.a]\n",
    ] {
        assert_eq!(strip_note(text), (None, text));
    }
}

mod seeding {
    use super::*;
    use webproxy_testkit::NatsServer;

    /// Many seeds at once, over and over: exactly one writes each time, and every other
    /// one finds what it wrote.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_seeds_write_once() {
        let nats = NatsServer::start();
        let js = jetstream::new(nats.client().await);
        for round in 0..50 {
            let kv = js
                .create_key_value(kv::Config {
                    bucket: format!("SEED{round}"),
                    history: crate::state::CONFIG_HISTORY,
                    ..Default::default()
                })
                .await
                .expect("bucket");
            let store = ConfigStore {
                kv,
                bucket: format!("SEED{round}"),
            };
            if round % 2 == 1 {
                // A deleted document is an empty bucket too.
                store
                    .put(&PushNote::default(), "old", None)
                    .await
                    .expect("put");
                store.kv.delete(DOCUMENT_KEY).await.expect("delete");
            }
            let seeds = futures::future::join_all((0..4).map(|i| {
                let store = store.clone();
                async move { store.seed(&PushNote::default(), &format!("seed {i}")).await }
            }))
            .await;
            let written: Vec<u64> = seeds
                .iter()
                .filter_map(|s| match s {
                    Ok(Seeded::Written(revision)) => Some(*revision),
                    _ => None,
                })
                .collect();
            assert_eq!(written.len(), 1, "round {round}: {seeds:?}");
            for seed in &seeds {
                match seed {
                    Ok(Seeded::Found(found)) => assert_eq!(found.revision, written[0]),
                    Ok(Seeded::Written(_)) => {}
                    Err(e) => panic!("round {round}: {e}"),
                }
            }
        }
    }
}
