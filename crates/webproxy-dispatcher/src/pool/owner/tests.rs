//! Tests of `owner`.

use super::*;

#[test]
fn a_round_takes_the_lease_or_renews_it() {
    assert_eq!(lease_write(None, Purpose::Round), Some(LeaseWrite::Create));
    assert_eq!(
        lease_write(Some(7), Purpose::Round),
        Some(LeaseWrite::Update(7))
    );
}

#[test]
fn a_consumer_write_is_preceded_by_a_renewal_at_the_held_revision() {
    assert_eq!(
        lease_write(Some(7), Purpose::BeforeWrite),
        Some(LeaseWrite::Update(7))
    );
}

#[test]
fn a_lease_not_held_is_never_taken_between_a_round_and_its_write() {
    assert_eq!(lease_write(None, Purpose::BeforeWrite), None);
}

#[test]
fn only_a_successful_lease_write_allows_a_consumer_write() {
    assert_eq!(Renewal::of(true, true), Renewal::Kept);
    assert_eq!(Renewal::of(false, true), Renewal::Took);
    assert_eq!(Renewal::of(true, false), Renewal::Lost);
    assert_eq!(Renewal::of(false, false), Renewal::HeldElsewhere);
    assert!(Renewal::Kept.holding());
    assert!(Renewal::Took.holding());
    assert!(!Renewal::Lost.holding());
    assert!(!Renewal::HeldElsewhere.holding());
}

fn s(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[test]
fn an_increase_applies_at_once() {
    assert!(may_apply(s(30), s(2), &[Some(s(2)), None]));
    assert!(may_apply(s(30), s(30), &[]));
}

#[test]
fn a_decrease_waits_for_every_live_instance_to_pace_from_it() {
    assert!(!may_apply(s(2), s(30), &[Some(s(2)), Some(s(30))]));
    assert!(may_apply(s(2), s(30), &[Some(s(2)), Some(s(1))]));
}

#[test]
fn an_instance_that_does_not_say_what_it_paces_from_is_waited_for() {
    assert!(!may_apply(s(2), s(30), &[Some(s(2)), None]));
}

#[test]
fn with_no_live_instance_a_decrease_applies() {
    assert!(may_apply(s(2), s(30), &[]));
}
