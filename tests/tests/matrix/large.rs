//! The large body column's own part of a cell (issue 34, point 7): when its load is
//! where the fault should hit it, and what must hold of its bodies after the fault:
//! each reply's body reads back whole with its digest, each conversation has one
//! stored reply, and the body store settles to exactly what the replies name.

use std::time::{Duration, Instant};

use webproxy_client::Submitted;
use webproxy_protocol::{BodyObject, Origin};
use webproxy_tests::bodies::{
    assert_reads_back, delivery_of, digest_of, store_subjects, subjects_of,
};
use webproxy_tests::{large_body, wait_for};

use crate::cell::Cell;
use crate::fault::Fault;
use crate::feature::{Feature, POOL, large_size};
use crate::observe::{self, ANSWERED, Stored};

/// How many rounds of [`Feature::count`] conversations the load may send before
/// instance 0 has had a body under way. Nothing steers a delivery to a pod: the other
/// one can take every conversation of a round (it pulled first, and each of its acks
/// frees the slot it pulls into next), and a round is answered within seconds. One
/// round is enough nearly always; four all missing instance 0 means it takes nothing.
const ROUNDS: usize = 4;

/// How long the deliveries may take to settle once every conversation is answered,
/// and the body store then to hold only what the replies name: a pod the stalled row
/// stopped wakes still streaming a body whose message another pod has answered, finds
/// its delivery stale or the reply stored, and removes what it stored; that takes a
/// second or two. Generous for a loaded machine, and far below the bodies' TTL
/// (`reply_max_age` plus the attempt's timeout, an hour and more), so the TTL never
/// clears an orphan within it.
const SETTLED: Duration = Duration::from_secs(30);

/// The pause between two reads of the store while it settles.
const SETTLE_POLL: Duration = Duration::from_millis(200);

fn bucket(cell: &Cell) -> String {
    cell.client.subjects().pool_body_bucket(POOL)
}

/// Sends the load, a round of conversations at a time, and returns all of them once
/// the load is [`under_way`]: a round answered before that is followed by another.
pub async fn load(cell: &Cell) -> Vec<Submitted> {
    let feature = Feature::Large;
    let mut conversations = Vec::new();
    for round in 1..=ROUNDS {
        let first = conversations.len();
        for n in first..first + feature.count() {
            conversations.push(cell.submit(feature.sent_to(), &feature.path(n)).await);
        }
        let round_conversations = &conversations[first..];
        let hit = wait_for(
            ANSWERED,
            "instance 0 with a body under way, or the round answered",
            || async {
                if under_way(cell).await {
                    return Some(true);
                }
                answered(cell, round_conversations).await.then_some(false)
            },
        )
        .await;
        if hit {
            return conversations;
        }
        println!(
            "round {round}: its {} conversations were answered before instance 0 had a body under way",
            feature.count()
        );
    }
    panic!(
        "instance 0 had no body under way in {ROUNDS} rounds of the load\n{}",
        cell.logs()
    );
}

/// Whether each of `conversations` has its reply stored.
async fn answered(cell: &Cell, conversations: &[Submitted]) -> bool {
    for conversation in conversations {
        if observe::stored_replies(&cell.client, &cell.js, conversation).await == 0 {
            return false;
        }
    }
    true
}

/// Whether the load is where the fault should hit it: the body store holds some of a
/// body, and instance 0 (the one the stalled row stops) holds a delivery. Its bodies
/// stream for about 2 s each, so the fault that comes next finds it mid-stream.
pub async fn under_way(cell: &Cell) -> bool {
    let storing = store_subjects(&cell.js, &bucket(cell))
        .await
        .is_some_and(|held| !held.is_empty());
    // Asked last: the fault follows this answer within milliseconds.
    storing
        && cell
            .in_flight(0)
            .await
            .is_some_and(|in_flight| in_flight >= 1.0)
}

/// The body `stored` names, for the load's `n`th conversation: the conversation's own
/// (its name starts with the origin), of `n`'s length and digest, and read back whole
/// as any Object Store client reads it.
pub async fn assert_whole(
    cell: &Cell,
    n: usize,
    conversation: &Submitted,
    stored: &Stored,
) -> BodyObject {
    let object: BodyObject = serde_json::from_value(stored.json["body_object"].clone())
        .unwrap_or_else(|e| panic!("conversation {n}'s body_object: {e}: {}", stored.json));
    let size = large_size(n);
    assert!(
        object
            .name
            .starts_with(&format!("{}:", conversation.origin)),
        "conversation {n} ({}) names another conversation's body: {object:?}",
        conversation.origin
    );
    assert_eq!(object.size, size as u64, "conversation {n}'s body size");
    assert_eq!(
        object.digest,
        digest_of(&large_body(size)),
        "conversation {n}'s body digest"
    );
    let store = cell
        .js
        .get_object_store(&object.bucket)
        .await
        .unwrap_or_else(|e| panic!("the body store {}: {e}\n{}", object.bucket, cell.logs()));
    assert_reads_back(&store, &object.name, size).await;
    object
}

/// What must hold of the load's bodies after the fault: each conversation has one
/// stored reply, which names its body, whole; and once the deliveries the fault left
/// behind have settled (every instance idle, within [`SETTLED`]), the store holds
/// exactly those bodies
/// (each one's chunks and metadata, and its conversation's receipt), nothing of a body
/// a killed, stalled or failed attempt began. In the stalled row at least one body
/// must have been finished by a redelivery: instance 0 was stopped holding one.
pub async fn kept(cell: &Cell, conversations: &[Submitted], stored: &[Stored]) {
    let mut objects = Vec::with_capacity(conversations.len());
    for (n, (conversation, stored)) in conversations.iter().zip(stored).enumerate() {
        assert_eq!(
            observe::stored_replies(&cell.client, &cell.js, conversation).await,
            1,
            "conversation {n} ({}): stored replies",
            conversation.origin
        );
        objects.push(assert_whole(cell, n, conversation, stored).await);
    }
    let redelivered = objects
        .iter()
        .filter(|object| delivery_of(object).is_some_and(|d| d > 1))
        .count();
    println!(
        "{redelivered} of {} bodies were finished by a redelivery",
        objects.len()
    );
    if cell.fault == Fault::Stalled {
        assert!(
            redelivered >= 1,
            "instance 0 was stopped holding a body, yet no body was finished by a redelivery: {objects:?}"
        );
    }

    let bucket = bucket(cell);
    let store = cell
        .js
        .get_object_store(&bucket)
        .await
        .expect("the body store");
    let named: Vec<(&Origin, &BodyObject)> = conversations
        .iter()
        .map(|conversation| &conversation.origin)
        .zip(&objects)
        .collect();
    let expected = subjects_of(&store, &named).await;
    let started = Instant::now();
    // Settled: no instance handles a delivery any more (a woken pod's stale one
    // included), so nothing writes to the store or removes from it.
    cell.wait_idle(SETTLED).await;
    let mut held = None;
    let settled = tokio::time::timeout(SETTLED, async {
        loop {
            held = store_subjects(&cell.js, &bucket).await;
            if held.as_ref() == Some(&expected) {
                return;
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    })
    .await;
    assert!(
        settled.is_ok(),
        "the body store did not come to hold only what the replies name within {SETTLED:?}\nheld: {held:#?}\nnamed: {expected:#?}\n{}",
        cell.logs()
    );
    println!(
        "the body store held only the {} named bodies {:?} after every conversation was answered",
        objects.len(),
        started.elapsed()
    );
}
