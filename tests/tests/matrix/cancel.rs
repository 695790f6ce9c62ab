//! The cancel column's own part of a cell (issue 35): which of the load's
//! conversations are cancelled, when the load is where the cancels should hit it, the
//! cancels themselves (the fault follows the last answer), what lets the load go
//! after the fault, and what must hold after it: one stored reply each, `cancelled`
//! for a cancelled conversation and the response for the rest, no second upstream
//! call for a cancelled one (none for one that was waiting), and a cancels bucket
//! that keeps no record of a settled conversation.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use futures::TryStreamExt as _;
use webproxy_client::Submitted;
use webproxy_protocol::{CancelState, Outcome};
use webproxy_tests::wait_until;

use crate::cell::Cell;
use crate::fault::Fault;
use crate::feature::{Feature, POOL};
use crate::observe::{self, Stored, wait_answered};
use crate::upstream::held_body;

/// How long the cancelled attempts may take to be dropped at the upstream once the
/// fault is over. An instance drops one the moment its watch of the cancels bucket
/// brings the cancel; after an outage or a restart the watch is followed again
/// within its check (5 s) and reads the bucket's history, and after a stall the woken
/// pod finds its delivery stale or the cancel brought. Seconds; generous for a
/// loaded machine running two cells.
const DROPPED: Duration = Duration::from_secs(60);

/// How long the cancels bucket may take to lose the load's records once every
/// instance is idle. A record is removed when its generation settles, right after the
/// reply is stored; one whose removal failed in the fault is removed by the
/// redelivery that finds the reply stored. Idle means every settle is done, so this
/// only covers the test's own read of a bucket elected again after a fault.
const SETTLED: Duration = Duration::from_secs(30);

/// How long every instance may take to be idle once each conversation is answered: a
/// pod the stalled row stopped wakes holding deliveries another pod answered, and
/// lets them go within an `ack_wait` or two.
const IDLE: Duration = Duration::from_secs(30);

/// How long a cancel may be asked again after a fault: its lookups answer `internal`
/// while the JetStream API elects its leaders again.
const CANCEL_WORKS_AGAIN: Duration = Duration::from_secs(60);

/// The conversations in flight when the cancels come: the first `max_in_flight` the
/// pool delivers, which are the first published (one consumer, in stream order).
fn in_flight_at_cancel() -> usize {
    Feature::Cancel.max_in_flight() as usize
}

/// The waiting conversation that is cancelled: two behind the limit, so that the
/// slots the cancelled attempts free deliver it between two that are not cancelled.
const WAITING_CANCELLED: usize = 5;

/// Whether the load's `n`th conversation is cancelled: every one in flight (so the
/// attempts instance 0 holds are among them) and one waiting, half of the load.
pub fn cancelled(n: usize) -> bool {
    n < in_flight_at_cancel() || n == WAITING_CANCELLED
}

/// The `/hold/{key}` key of the load's `n`th conversation.
fn key(n: usize) -> String {
    n.to_string()
}

/// Whether the load is where the cancels should hit it: exactly the first
/// `max_in_flight` conversations held at the upstream, the rest waiting, and instance
/// 0 (the one the stalled row stops) holding one of them.
pub async fn under_way(cell: &Cell) -> bool {
    let held = (0..in_flight_at_cancel()).all(|n| cell.upstream.holding(&key(n)) == 1)
        && cell.upstream.holding_any() == in_flight_at_cancel();
    held && cell
        .in_flight(0)
        .await
        .is_some_and(|in_flight| in_flight >= 1.0)
}

/// Cancels half of the load, each answered `recorded`: the waiting one first, so that
/// no slot a dropped attempt frees can deliver it before its cancel is recorded, then
/// those in flight; the fault follows the last answer.
pub async fn cancel(cell: &Cell, conversations: &[Submitted]) {
    let waiting = (0..conversations.len()).filter(|&n| cancelled(n) && n >= in_flight_at_cancel());
    let in_flight = (0..in_flight_at_cancel()).filter(|&n| cancelled(n));
    for n in waiting.chain(in_flight) {
        let conversation = &conversations[n];
        let answer = cell
            .client
            .cancel(&conversation.id, &conversation.origin, &conversation.msg_id)
            .await;
        assert!(
            matches!(answer, Ok(CancelState::Recorded)),
            "the cancel of conversation {n} ({}) answered {answer:?}\n{}",
            conversation.origin,
            cell.logs()
        );
    }
}

/// Once the fault is over: waits until no cancelled conversation is held at the
/// upstream (each in-flight attempt dropped, none of a waiting one made), then lets
/// the rest through. In the deleted row the cancels not yet acted on are lost with
/// their bucket, so their attempts may be held for good: the upstream lets go at once.
pub async fn let_go(cell: &Cell) {
    if cell.fault != Fault::Deleted {
        let count = cell.feature.count();
        wait_until(DROPPED, "the cancelled attempts dropped", || async {
            (0..count)
                .filter(|&n| cancelled(n))
                .all(|n| cell.upstream.holding(&key(n)) == 0)
        })
        .await;
    }
    cell.upstream.release();
}

/// How a conversation's cancelled reply says it ended, for the cell's summary.
fn ending_of(reply: &Stored) -> &'static str {
    let message = reply.json["error"]["message"].as_str().unwrap_or_default();
    if message.contains("dropped") {
        "its attempt dropped in flight"
    } else if message.contains("earlier delivery") {
        "by a delivery made again"
    } else {
        "before any attempt"
    }
}

/// What must hold of the load after the fault: each conversation has one stored
/// reply; a cancelled one ends `cancelled` with a dead letter saying so, having called
/// the upstream once if it was in flight and never if it was waiting; the rest end
/// with the response; and once every instance is idle, the cancels bucket holds no
/// record of the load. In the deleted row a cancel may be lost with its bucket: a
/// cancelled conversation may then end with the response, and a waiting one may have
/// called the upstream once.
pub async fn kept(cell: &Cell, conversations: &[Submitted], stored: &[Stored]) {
    let lost_allowed = cell.fault == Fault::Deleted;
    let letters = observe::standing_letters(&cell.js).await;
    let mut endings = std::collections::BTreeMap::<&str, usize>::new();
    for (n, (conversation, stored)) in conversations.iter().zip(stored).enumerate() {
        let what = format!("conversation {n} ({})", conversation.origin);
        assert_eq!(
            observe::stored_replies(&cell.client, &cell.js, conversation).await,
            1,
            "{what}: stored replies\n{}",
            cell.logs()
        );
        let calls = cell.upstream.hits_for(&Feature::Cancel.path(n));
        let response = stored.status == Some(200)
            && stored.json["body"].as_str() == Some(held_body(&key(n)).as_str());
        if !cancelled(n) {
            assert!(
                response,
                "{what} was not cancelled, yet ended {}",
                stored.json
            );
            continue;
        }
        let was_in_flight = n < in_flight_at_cancel();
        let most_calls = usize::from(was_in_flight || lost_allowed);
        assert!(
            calls <= most_calls,
            "{what} was cancelled {}, yet called the upstream {calls} times\n{}",
            if was_in_flight {
                "in flight"
            } else {
                "waiting"
            },
            cell.logs()
        );
        if lost_allowed && response {
            *endings
                .entry("with the response, its cancel lost")
                .or_default() += 1;
            continue;
        }
        assert!(
            stored.outcome == Outcome::Error && stored.json["error"]["code"] == "cancelled",
            "{what} was cancelled, yet ended {}\n{}",
            stored.json,
            cell.logs()
        );
        let origin = conversation.origin.to_string();
        assert!(
            letters
                .iter()
                .any(|letter| letter.origin.as_deref() == Some(origin.as_str())
                    && letter.generation == 0
                    && letter.error.code.as_str() == "cancelled"),
            "{what} ended cancelled with no dead letter saying so"
        );
        *endings.entry(ending_of(stored)).or_default() += 1;
    }
    println!("the cancelled conversations ended: {endings:?} (ending: count)");

    // Idle: every delivery the fault left behind is settled (a woken pod's stale one
    // included), so no settle is still to remove a record.
    cell.wait_idle(IDLE).await;
    let load: BTreeSet<String> = conversations
        .iter()
        .map(|conversation| conversation.origin.record_key(0))
        .collect();
    let started = Instant::now();
    let mut held = None;
    let settled = tokio::time::timeout(SETTLED, async {
        loop {
            held = recorded(cell).await;
            if held
                .as_ref()
                .is_some_and(|held| held.intersection(&load).next().is_none())
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(
        settled.is_ok(),
        "the cancels bucket still held records of settled conversations after {SETTLED:?}: {held:?}\n{}",
        cell.logs()
    );
    println!(
        "the cancels bucket held no record of the load {:?} after every instance was idle",
        started.elapsed()
    );
}

/// The keys of the cancels bucket (its purged keys left out); `None` while it cannot
/// be read. A bucket not made again yet, after the deleted row, holds none.
async fn recorded(cell: &Cell) -> Option<BTreeSet<String>> {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::GetStreamErrorKind;
    let bucket = cell.client.subjects().cancel_bucket();
    if let Err(e) = cell.js.get_stream(format!("KV_{bucket}")).await {
        let gone = matches!(e.kind(), GetStreamErrorKind::JetStream(e)
            if e.error_code() == ErrorCode::STREAM_NOT_FOUND);
        return (gone && cell.fault == Fault::Deleted).then(BTreeSet::new);
    }
    let store = cell.js.get_key_value(&bucket).await.ok()?;
    store.keys().await.ok()?.try_collect().await.ok()
}

/// A cancel after the fault works: a fresh conversation held at the upstream
/// (`/hang` never answers) is cancelled in flight, answered `recorded` (asked again
/// while the cancel's lookups answer `internal` after the fault), ends `cancelled`
/// having called the upstream once, and its record is removed. After the deleted
/// row this shows the bucket made again and followed.
pub async fn works_again(cell: &Cell, within: Duration) {
    let fresh = cell.submit(POOL, "/hang").await;
    wait_until(within, "the fresh conversation at the upstream", || async {
        cell.upstream.hits_for("/hang") >= 1
    })
    .await;
    let started = Instant::now();
    let deadline = started + CANCEL_WORKS_AGAIN;
    loop {
        match cell
            .client
            .cancel(&fresh.id, &fresh.origin, &fresh.msg_id)
            .await
        {
            Ok(CancelState::Recorded) => break,
            Ok(other) => panic!(
                "the fresh conversation's cancel answered {other:?}\n{}",
                cell.logs()
            ),
            Err(e) if Instant::now() > deadline => panic!(
                "the fresh conversation's cancel still failing after {CANCEL_WORKS_AGAIN:?}: {e}\n{}",
                cell.logs()
            ),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    let answered = tokio::time::timeout(
        within,
        wait_answered(
            &cell.client,
            std::slice::from_ref(&fresh),
            |reply| reply.json["error"]["code"] == "cancelled",
            || cell.logs(),
        ),
    )
    .await;
    assert!(
        answered.is_ok(),
        "the fresh conversation was not answered cancelled within {within:?}\n{}",
        cell.logs()
    );
    assert_eq!(
        cell.upstream.hits_for("/hang"),
        1,
        "the fresh conversation's calls"
    );
    println!(
        "a fresh conversation cancelled in flight after the fault ended cancelled {:?} after the cancel was asked",
        started.elapsed()
    );
    let key = fresh.origin.record_key(0);
    wait_until(
        within,
        "the fresh conversation's cancel removed",
        || async {
            recorded(cell)
                .await
                .is_some_and(|held| !held.contains(&key))
        },
    )
    .await;
}
