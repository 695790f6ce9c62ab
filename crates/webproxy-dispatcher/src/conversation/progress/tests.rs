//! Tests of `progress`.

use std::time::SystemTime;

use super::*;
use crate::conversation::hop::AttemptHistory;

fn record(step: u32, taken_by: Option<u64>) -> Record {
    let caller = HopState::first(Origin::new("S", 1), SystemTime::UNIX_EPOCH, None);
    let mut hop = caller.next(AttemptHistory::default(), None);
    hop.step = step;
    Record {
        kind: HopKind::Park,
        subject: "webproxy.retry.default.t".into(),
        msg_id: "park:t".into(),
        hop,
        taken_by,
    }
}

#[test]
fn the_current_untaken_step_is_taken_once() {
    assert_eq!(
        claim(&record(1, None), 1, 10),
        StepClaim::Current { take: true }
    );
    // the same hop message redelivered after a crash carries on
    assert_eq!(
        claim(&record(1, Some(10)), 1, 10),
        StepClaim::Current { take: false }
    );
    // a second copy of the hop (another stream sequence) does not
    assert_eq!(claim(&record(1, Some(10)), 1, 11), StepClaim::Stale);
}

#[test]
fn an_earlier_step_republishes_an_untaken_hop_or_does_nothing() {
    // the caller's message redelivered after its park's ack was lost
    assert_eq!(claim(&record(1, None), 0, 1), StepClaim::Republish);
    assert_eq!(claim(&record(1, Some(10)), 0, 1), StepClaim::Stale);
    // a hop of step 1 redelivered once step 2 is recorded
    assert_eq!(claim(&record(2, None), 1, 10), StepClaim::Republish);
    assert_eq!(claim(&record(2, Some(12)), 1, 10), StepClaim::Stale);
}

#[test]
fn replay_markers_are_valid_keys_apart_from_records() {
    let origin = Origin::new("WEBPROXY_POOL_DEFAULT", 1_733_025_600_000_123);
    let key = replayed_key(&origin, 2);
    assert_eq!(key, "replayed.WEBPROXY_POOL_DEFAULT.1733025600000123.2");
    assert!(
        key.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-/_=.".contains(c)),
        "{key}"
    );
    // Never a record's key, whatever the stream is called: one token more.
    assert_eq!(key.split('.').count(), 4);
    assert_eq!(origin.record_key(2).split('.').count(), 3);
}

#[test]
fn records_round_trip() {
    let record = record(3, Some(7));
    let back: Record = serde_json::from_slice(&encode(&record)).expect("json");
    assert_eq!(back, record);
}
