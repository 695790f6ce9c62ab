//! The fault matrix of issue 29: every fault of `tests/fault_matrix.toml` against every
//! feature, each cell one test of the same shape (`cell::run`): the feature's load under
//! way, the fault injected, then the checks every cell makes (every conversation
//! answered; one distinct body per generation on `reply.<id>` and the `reply_to`, equal
//! to the stored one; no unsuperseded dead letter for a conversation answered with a
//! response; what the feature must still hold of them, such as the gateway's
//! idempotency records, the large bodies' store or the cancels' endings and bucket;
//! the feature working again within its stated time; the pool's limits never
//! exceeded). Real `webproxy serve` (and
//! `webproxy gateway`) processes against real nats-servers.
//!
//! The cells are `#[ignore]`d: `just test-faults` runs them (several at once), so `just
//! test` does not run them twice. A cell takes 10 to 40 s: nats-servers (three for the
//! cluster rows) and two service processes start, a fault lasts seconds, and the
//! checks wait for every answer.

mod cancel;
mod cell;
mod fault;
mod feature;
mod inject;
mod large;
mod observe;
mod scene;
mod upstream;

use cell::Cell;
use fault::Fault;
use feature::Feature;
use observe::ANSWERED;

/// A cell: the feature's load under way, the fault, the feature's conversations let
/// go, then the checks every cell makes.
pub async fn run(fault: Fault, feature: Feature) {
    let mut cell = Cell::start(fault, feature).await;
    let conversations = feature.load(&cell).await;
    let during = feature.during(&cell, &conversations).await;
    fault.inject(&mut cell).await;
    feature.let_go(&cell, during).await;

    let stored = observe::wait_answered(
        &cell.client,
        &conversations,
        |reply| feature.answered(reply),
        || cell.logs(),
    )
    .await;
    observe::assert_one_body_per_generation(&cell.observed, &conversations, &stored);
    observe::assert_no_letter_for_a_response(&cell.js, &conversations, &stored).await;
    feature.kept(&cell, &conversations, &stored).await;
    feature.works_again(&cell).await;
    if fault.limits_hold() {
        feature.assert_limits(&cell);
    }
    println!(
        "{fault:?} × {feature:?}: {} conversations answered once (within {ANSWERED:?}), at most {} at the upstream at once",
        conversations.len(),
        cell.upstream.max_concurrent()
    );
}

/// One `#[ignore]`d test per cell, named `<fault>_<feature>`.
macro_rules! cells {
    ($($name:ident: $fault:ident, $feature:ident;)*) => {
        $(
            #[doc = concat!("The cell ", stringify!($fault), " × ", stringify!($feature), ".")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[ignore = "the fault matrix: `just test-faults` runs it"]
            async fn $name() {
                run(Fault::$fault, Feature::$feature).await;
            }
        )*
    };
}

cells! {
    restart_plain: Restart, Plain;
    restart_rate: Restart, Rate;
    restart_paused: Restart, Paused;
    restart_breaker: Restart, Breaker;
    restart_adaptive: Restart, Adaptive;
    restart_parked: Restart, Parked;
    restart_moved: Restart, Moved;
    restart_replay: Restart, Replay;
    restart_config: Restart, Config;
    restart_gateway: Restart, Gateway;
    leader_plain: Leader, Plain;
    leader_rate: Leader, Rate;
    leader_paused: Leader, Paused;
    leader_breaker: Leader, Breaker;
    leader_adaptive: Leader, Adaptive;
    leader_parked: Leader, Parked;
    leader_moved: Leader, Moved;
    leader_replay: Leader, Replay;
    leader_config: Leader, Config;
    leader_gateway: Leader, Gateway;
    deleted_plain: Deleted, Plain;
    deleted_rate: Deleted, Rate;
    deleted_paused: Deleted, Paused;
    deleted_breaker: Deleted, Breaker;
    deleted_adaptive: Deleted, Adaptive;
    deleted_parked: Deleted, Parked;
    deleted_moved: Deleted, Moved;
    deleted_replay: Deleted, Replay;
    api_down_plain: ApiDown, Plain;
    api_down_rate: ApiDown, Rate;
    api_down_paused: ApiDown, Paused;
    api_down_breaker: ApiDown, Breaker;
    api_down_adaptive: ApiDown, Adaptive;
    api_down_parked: ApiDown, Parked;
    api_down_moved: ApiDown, Moved;
    api_down_replay: ApiDown, Replay;
    api_down_config: ApiDown, Config;
    api_down_gateway: ApiDown, Gateway;
    stalled_plain: Stalled, Plain;
    stalled_rate: Stalled, Rate;
    stalled_paused: Stalled, Paused;
    stalled_breaker: Stalled, Breaker;
    stalled_adaptive: Stalled, Adaptive;
    stalled_parked: Stalled, Parked;
    stalled_moved: Stalled, Moved;
    stalled_replay: Stalled, Replay;
    stalled_config: Stalled, Config;
    stalled_gateway: Stalled, Gateway;
    pushed_plain: Pushed, Plain;
    pushed_rate: Pushed, Rate;
    pushed_paused: Pushed, Paused;
    pushed_breaker: Pushed, Breaker;
    pushed_adaptive: Pushed, Adaptive;
    pushed_parked: Pushed, Parked;
    pushed_moved: Pushed, Moved;
    pushed_replay: Pushed, Replay;
    pushed_gateway: Pushed, Gateway;
    clock_plain: Clock, Plain;
    clock_rate: Clock, Rate;
    clock_paused: Clock, Paused;
    clock_breaker: Clock, Breaker;
    clock_adaptive: Clock, Adaptive;
    clock_parked: Clock, Parked;
    clock_moved: Clock, Moved;
    clock_replay: Clock, Replay;
    clock_config: Clock, Config;
    clock_gateway: Clock, Gateway;
    restart_large: Restart, Large;
    leader_large: Leader, Large;
    api_down_large: ApiDown, Large;
    stalled_large: Stalled, Large;
    pushed_large: Pushed, Large;
    clock_large: Clock, Large;
    restart_cancel: Restart, Cancel;
    leader_cancel: Leader, Cancel;
    deleted_cancel: Deleted, Cancel;
    api_down_cancel: ApiDown, Cancel;
    stalled_cancel: Stalled, Cancel;
    pushed_cancel: Pushed, Cancel;
    clock_cancel: Clock, Cancel;
}
