//! Tests of `liveness`.

use super::*;
use crate::conversation::delivery::DeliveryInfo;
use crate::conversation::delivery::fake::FakeDelivery;

const ACK_WAIT: Duration = Duration::from_secs(15);

fn policy() -> LivenessPolicy {
    LivenessPolicy::for_ack_wait(ACK_WAIT)
}

#[test]
fn the_policy_leaves_room_for_a_lost_confirmation() {
    let p = policy();
    assert_eq!(p.limit, Duration::from_secs(12));
    assert_eq!(p.period, Duration::from_secs(5));
    assert!(p.period * 2 < p.limit, "one lost confirmation is absorbed");
    assert!(p.confirm_within < p.period);
}

#[test]
fn confirmed_progress_keeps_a_delivery_current() {
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let liveness = Liveness::new(ACK_WAIT, t0);
    assert!(liveness.is_current_at(at(11)));
    liveness.confirmed(at(5));
    liveness.confirmed(at(15));
    assert!(liveness.is_current_at(at(26)));
    assert!(
        !liveness.is_current_at(at(27)),
        "12 s since the last confirmed send"
    );
}

#[test]
fn a_confirmation_after_a_broken_interval_does_not_revive_it() {
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let liveness = Liveness::new(ACK_WAIT, t0);
    // sent 13 s after the delivery: the server may have redelivered before it
    liveness.confirmed(at(13));
    assert!(!liveness.is_current_at(at(14)));
    liveness.confirmed(at(15));
    assert!(!liveness.is_current_at(at(16)), "once stale, always stale");
}

#[test]
fn an_open_interval_past_the_limit_is_stale_for_good() {
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let liveness = Liveness::new(ACK_WAIT, t0);
    assert!(!liveness.is_current_at(at(12)));
    // a confirmation of a progress ack sent earlier arriving late changes nothing
    liveness.confirmed(at(5));
    assert!(!liveness.is_current_at(at(13)));
}

#[test]
fn a_shorter_ack_wait_is_judged_from_when_it_is_first_paced_from() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let liveness = Liveness::new(Duration::from_secs(30), t0);
    liveness.confirmed(at(10_000));
    // 2 s pushed at 15 s: the server still holds 30 s, so the open interval
    // stayed within its limit; the 2 s limit (1.6 s) runs from 15 s
    let period = liveness.repace(Duration::from_secs(2), at(15_000));
    assert_eq!(period, Some(Duration::from_secs(2) / 3));
    assert!(liveness.is_current_at(at(16_500)));
    assert!(!liveness.is_current_at(at(16_600)), "1.6 s unconfirmed");
}

#[test]
fn a_shorter_ack_wait_confirmed_keeps_it_current() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let liveness = Liveness::new(Duration::from_secs(30), t0);
    assert!(liveness.repace(Duration::from_secs(2), at(5_000)).is_some());
    liveness.confirmed(at(5_000));
    liveness.confirmed(at(5_600));
    assert!(liveness.is_current_at(at(7_000)));
}

#[test]
fn repacing_a_delivery_past_its_limit_leaves_it_stale() {
    let t0 = Instant::now();
    let liveness = Liveness::new(Duration::from_secs(30), t0);
    let late = t0 + Duration::from_secs(25);
    assert_eq!(liveness.repace(Duration::from_secs(2), late), None);
    assert!(!liveness.is_current_at(late));
}

/// Whether `stale` resolves within `within` (paused time: it advances as needed).
async fn stale_within(
    stale: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    within: Duration,
) -> bool {
    tokio::time::timeout(within, stale.as_mut()).await.is_ok()
}

/// A delivery whose progress acks are answered with `answer`.
fn delivery_answering(answer: Option<ProgressAckError>) -> FakeDelivery {
    let info = DeliveryInfo {
        stream: "S".into(),
        seq: 1,
        delivered: 1,
        published: std::time::SystemTime::now(),
    };
    let mut delivery = FakeDelivery::new("webproxy.request.default", "{}", info);
    delivery.progress_error = answer;
    delivery
}

#[tokio::test(start_paused = true)]
async fn a_progress_ack_no_leader_answers_makes_the_delivery_stale_at_once() {
    let liveness = Liveness::new(ACK_WAIT, Instant::now());
    let stale = liveness.stale();
    tokio::pin!(stale);
    let delivery = delivery_answering(Some(ProgressAckError::NoLeader));
    // The first progress ack goes out a period (5 s) after the delivery, and its
    // "no responders" ends the keeping, long before the 12 s limit.
    let kept = tokio::time::timeout(Duration::from_secs(6), liveness.keep(&delivery, None));
    assert!(kept.await.is_ok(), "the keeper stops");
    assert!(!liveness.is_current());
    assert!(stale_within(&mut stale, Duration::from_millis(1)).await);
    // A confirmation after it (a new leader answering) does not revive it.
    liveness.confirmed(Instant::now());
    assert!(!liveness.is_current());
}

#[tokio::test(start_paused = true)]
async fn a_delivery_held_when_the_leader_stops_serving_the_pull_is_stale() {
    let (epoch, leadership) = watch::channel(0u64);
    let liveness = Liveness::new(ACK_WAIT, Instant::now()).under(leadership);
    let stale = liveness.stale();
    tokio::pin!(stale);
    let delivery = delivery_answering(None);
    let keeper = liveness.keep(&delivery, None);
    tokio::pin!(keeper);
    assert!(
        tokio::time::timeout(Duration::from_secs(8), keeper.as_mut())
            .await
            .is_err(),
        "kept while the leader serves"
    );
    assert!(liveness.is_current());
    epoch.send_modify(|e| *e += 1);
    assert!(
        !liveness.is_current(),
        "stale the moment the epoch moves on"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(1), keeper)
            .await
            .is_ok()
    );
    assert!(stale_within(&mut stale, Duration::from_millis(1)).await);
    // A delivery that arrives under the new epoch is current.
    let (_, leadership) = watch::channel(1u64);
    assert!(
        Liveness::new(ACK_WAIT, Instant::now())
            .under(leadership)
            .is_current()
    );
}

#[test]
fn a_second_delivery_of_a_held_sequence_makes_the_first_stale() {
    use std::sync::Arc;
    let held = HeldDeliveries::default();
    let first = Arc::new(Liveness::new(ACK_WAIT, Instant::now()));
    let other = Arc::new(Liveness::new(ACK_WAIT, Instant::now()));
    assert!(!held.hold(7, &first));
    assert!(!held.hold(8, &other));
    let second = Arc::new(Liveness::new(ACK_WAIT, Instant::now()));
    assert!(held.hold(7, &second));
    assert!(!first.is_current(), "redelivered: the first is stale");
    assert!(second.is_current());
    assert!(other.is_current(), "another sequence is left alone");
    // One that ended is forgotten: a later delivery of its sequence finds none.
    drop(other);
    let again = Arc::new(Liveness::new(ACK_WAIT, Instant::now()));
    assert!(!held.hold(8, &again));
    // Ended ones are swept out as more are held.
    for sequence in 100..300 {
        let ended = Arc::new(Liveness::new(ACK_WAIT, Instant::now()));
        assert!(!held.hold(sequence, &ended));
    }
    let left = held.held.lock().map(|h| h.by_sequence.len()).unwrap_or(0);
    assert!(left < 150, "{left} entries kept for 3 held deliveries");
}

#[tokio::test(start_paused = true)]
async fn a_progress_ack_that_fails_otherwise_is_absorbed_until_the_limit() {
    let liveness = Liveness::new(ACK_WAIT, Instant::now());
    let delivery = delivery_answering(Some(ProgressAckError::Failed("request timed out".into())));
    let kept = tokio::time::timeout(Duration::from_secs(11), liveness.keep(&delivery, None));
    assert!(kept.await.is_err(), "still keeping after two failed acks");
    assert!(liveness.is_current(), "within the 12 s limit");
}

#[tokio::test(start_paused = true)]
async fn stale_resolves_at_the_limit_confirmations_push_back() {
    let t0 = Instant::now();
    let liveness = Liveness::new(ACK_WAIT, t0);
    let stale = liveness.stale();
    tokio::pin!(stale);
    assert!(!stale_within(&mut stale, Duration::from_secs(11)).await);
    liveness.confirmed(t0 + Duration::from_secs(10));
    assert!(!stale_within(&mut stale, Duration::from_millis(10_900)).await);
    assert!(
        stale_within(&mut stale, Duration::from_millis(200)).await,
        "12 s after the last confirmed send"
    );
    assert!(!liveness.is_current());
}

#[tokio::test(start_paused = true)]
async fn stale_comes_sooner_when_a_shorter_ack_wait_is_paced_from() {
    let liveness = Liveness::new(Duration::from_secs(30), Instant::now());
    let stale = liveness.stale();
    tokio::pin!(stale);
    assert!(!stale_within(&mut stale, Duration::from_secs(1)).await);
    assert!(
        liveness
            .repace(Duration::from_secs(2), Instant::now())
            .is_some()
    );
    assert!(!stale_within(&mut stale, Duration::from_millis(1_500)).await);
    assert!(
        stale_within(&mut stale, Duration::from_millis(200)).await,
        "1.6 s after the shorter ack_wait was first paced from, not 24 s"
    );
}

#[test]
fn a_longer_ack_wait_widens_the_open_interval() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let liveness = Liveness::new(Duration::from_secs(2), t0);
    liveness.confirmed(at(600));
    let period = liveness.repace(Duration::from_secs(30), at(1_000));
    assert_eq!(period, Some(Duration::from_secs(10)));
    assert!(liveness.is_current_at(at(20_000)));
    assert_eq!(liveness.repace(Duration::from_secs(30), at(21_000)), None);
}
