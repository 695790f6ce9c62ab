//! What a cell's callers saw and what the server stored: every live copy of every
//! reply (on `webproxy.reply.<id>` and on the conversation's `reply_to`), and the
//! checks every cell makes of them, of the stored replies and of the dead letters.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt as _;
use serde_json::Value;
use webproxy_client::{Client, Submitted};
use webproxy_protocol::{DeadLetter, Outcome};
use webproxy_tests::wait_for;

/// Where each conversation's `reply_to` copy goes: `REPLY_TO.<id>`, an `_INBOX.`
/// subject, the only kind a service without `reply_to_allow` accepts.
pub const REPLY_TO: &str = "_INBOX.matrix.replies";

/// How long every conversation may take to be answered once its fault is over and
/// its feature let it go: a redelivery after a stall or a node loss takes an `ack_wait`
/// or two (3 s each) and elections a few seconds more; a loaded 2-core machine runs
/// two cells at once.
pub const ANSWERED: Duration = Duration::from_secs(90);

/// A live copy: where it came (`reply.<id>` or the `reply_to`), its generation and
/// its payload.
#[derive(Debug, Clone)]
struct Copy {
    on_reply_to: bool,
    generation: String,
    payload: Bytes,
}

/// Every live copy seen so far, by conversation id.
#[derive(Clone, Default)]
pub struct Observed(Arc<Mutex<BTreeMap<String, Vec<Copy>>>>);

impl Observed {
    /// Subscribes to every live reply and every `reply_to` copy; call it before the
    /// first request is published.
    pub async fn subscribe(nats: &async_nats::Client) -> Observed {
        let observed = Observed::default();
        for (subject, on_reply_to) in [
            ("webproxy.reply.*".to_owned(), false),
            (format!("{REPLY_TO}.*"), true),
        ] {
            let mut messages = nats.subscribe(subject).await.expect("subscribe");
            let sink = observed.clone();
            tokio::spawn(async move {
                while let Some(message) = messages.next().await {
                    let id = message
                        .subject
                        .rsplit('.')
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    let generation = message
                        .headers
                        .as_ref()
                        .and_then(|h| h.get("Webproxy-Generation"))
                        .map(|v| v.as_str().to_string())
                        .unwrap_or_default();
                    sink.lock().entry(id).or_default().push(Copy {
                        on_reply_to,
                        generation,
                        payload: message.payload,
                    });
                }
            });
        }
        nats.flush().await.expect("flush the subscriptions");
        observed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<Copy>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A stored reply: its generation and body.
#[derive(Debug)]
pub struct Stored {
    pub generation: String,
    pub json: Value,
    pub outcome: Outcome,
    pub status: Option<u16>,
}

/// Waits, up to [`ANSWERED`], until every conversation has a stored reply that
/// `answered` accepts (the newest generation's, a replay's included), and returns them
/// in `conversations`' order.
pub async fn wait_answered(
    client: &Client,
    conversations: &[Submitted],
    answered: impl Fn(&Stored) -> bool,
    logs: impl Fn() -> String,
) -> Vec<Stored> {
    let mut stored = Vec::with_capacity(conversations.len());
    for conversation in conversations {
        // The last stored reply seen, for the failure's message: an unexpected ending
        // says why.
        let mut last = None;
        let found = tokio::time::timeout(ANSWERED, async {
            loop {
                if let Ok(Some(message)) = client
                    .reply_message(&conversation.id, &conversation.origin)
                    .await
                {
                    let reply = decode(&message.payload);
                    let generation = message
                        .headers
                        .get("Webproxy-Generation")
                        .map(|v| v.as_str().to_string())
                        .unwrap_or_default();
                    let reply = Stored {
                        generation,
                        outcome: serde_json::from_value(reply["outcome"].clone())
                            .expect("an outcome"),
                        status: reply["status"].as_u64().and_then(|s| u16::try_from(s).ok()),
                        json: reply,
                    };
                    if answered(&reply) {
                        return reply;
                    }
                    last = Some(reply.json);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        match found {
            Ok(reply) => stored.push(reply),
            Err(_) => panic!(
                "conversation {} ({}) not answered as expected within {ANSWERED:?}; its stored reply: {}\n{}",
                conversation.id,
                conversation.origin,
                last.map_or_else(|| "none".to_string(), |reply| reply.to_string()),
                logs()
            ),
        }
    }
    stored
}

fn decode(payload: &[u8]) -> Value {
    serde_json::from_slice(payload).expect("a reply is JSON")
}

/// One distinct body per generation on `reply.<id>` and the `reply_to`, and the stored
/// generation's copies equal to the stored reply.
pub fn assert_one_body_per_generation(
    observed: &Observed,
    conversations: &[Submitted],
    stored: &[Stored],
) {
    let seen = observed.lock();
    for (conversation, stored) in conversations.iter().zip(stored) {
        let copies = seen.get(&conversation.id).cloned().unwrap_or_default();
        let mut bodies: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
        for copy in &copies {
            bodies
                .entry(copy.generation.as_str())
                .or_default()
                .insert(decode(&copy.payload).to_string());
        }
        for (generation, distinct) in &bodies {
            assert_eq!(
                distinct.len(),
                1,
                "conversation {} saw {} different live bodies for generation {generation}: {distinct:?}",
                conversation.id,
                distinct.len()
            );
        }
        for copy in copies.iter().filter(|c| c.generation == stored.generation) {
            assert_eq!(
                decode(&copy.payload),
                stored.json,
                "conversation {}: a live copy (on the reply_to: {}) differs from the stored reply",
                conversation.id,
                copy.on_reply_to
            );
        }
    }
}

/// No dead letter stands, unsuperseded, for a generation that was answered with a
/// response: a letter is kept only for a generation that ended in an error.
pub async fn assert_no_letter_for_a_response(
    js: &jetstream::Context,
    conversations: &[Submitted],
    stored: &[Stored],
) {
    let letters = wait_for(ANSWERED, "the dead letters", || dead_letters(js)).await;
    for (conversation, stored) in conversations.iter().zip(stored) {
        if stored.outcome != Outcome::Response {
            continue;
        }
        let origin = conversation.origin.to_string();
        let standing: Vec<_> = letters
            .iter()
            .filter(|l| {
                l.origin.as_deref() == Some(origin.as_str())
                    && l.generation.to_string() == stored.generation
            })
            .collect();
        assert!(
            standing.is_empty(),
            "conversation {} was answered with a response, yet a dead letter stands: {standing:?}",
            conversation.id
        );
    }
}

/// Every dead letter not marked superseded, read until JetStream answers (within
/// [`ANSWERED`]).
pub async fn standing_letters(js: &jetstream::Context) -> Vec<DeadLetter> {
    wait_for(ANSWERED, "the dead letters", || dead_letters(js)).await
}

/// How many stored replies `conversation` has, every generation's, on its own subject
/// in its pool's replies stream.
pub async fn stored_replies(
    client: &Client,
    js: &jetstream::Context,
    conversation: &Submitted,
) -> usize {
    let subjects = client.subjects();
    let stream = js
        .get_stream(subjects.replies_stream_of(&conversation.origin))
        .await
        .expect("the pool's replies stream");
    let mut counts = stream
        .info_with_subjects(subjects.stored_reply(&conversation.id, &conversation.origin))
        .await
        .expect("the replies stream's subjects");
    let mut replies = 0;
    while let Some(entry) = counts.next().await {
        replies += entry.expect("a subject").1;
    }
    replies
}

/// Every dead letter not marked superseded; `None` while JetStream cannot answer.
async fn dead_letters(js: &jetstream::Context) -> Option<Vec<DeadLetter>> {
    let mut letters = Vec::new();
    // Each pool's letters are in a stream of its own.
    for name in webproxy_tests::try_dead_streams(js).await? {
        let stream = js.get_stream(&name).await.ok()?;
        let state = stream.get_info().await.ok()?.state;
        for seq in state.first_sequence..=state.last_sequence {
            let Ok(message) = stream.get_raw_message(seq).await else {
                continue;
            };
            if message.subject.ends_with(".superseded") {
                continue;
            }
            letters.push(serde_json::from_slice(&message.payload).expect("a dead letter"));
        }
    }
    Some(letters)
}
