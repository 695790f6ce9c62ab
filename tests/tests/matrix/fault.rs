//! The matrix's rows: each fault of issue 29 and what world it needs; how each is done
//! to a running cell is `inject.rs`'s.

use webproxy_tests::ServiceOptions;

/// How far the skewed pod's clock runs ahead: the 5 s.
const CLOCK_AHEAD: &str = "5s";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A single server restarted (SIGTERM, as an orchestrator restarts it, then started
    /// again): memory state (the rate bucket) lost. A crash (SIGKILL) may also lose
    /// the pool consumer's last deliveries, which the server then delivers again while
    /// their first attempts still run: `faults.rs` and `liveness.rs` crash the server,
    /// and assert one reply each.
    Restart,
    /// A 3-node cluster (replicas 3) losing the node that leads the pool stream and
    /// the buckets, every leader put there first by stepdown.
    Leader,
    /// The buckets the feature keeps deleted by hand ([`crate::feature::Feature::buckets`]).
    Deleted,
    /// Two of three nodes stopped for [`API_DOWN`]: no quorum, no JetStream API.
    ApiDown,
    /// One of two pods SIGSTOPped for [`STALL`], then resumed.
    Stalled,
    /// `ack_wait` and `max_in_flight` pushed down, then up, while attempts run.
    Pushed,
    /// One of two pods' clock [`CLOCK_AHEAD`] ahead (the test-only offset), throughout.
    Clock,
}

impl Fault {
    pub fn needs_a_cluster(self) -> bool {
        matches!(self, Fault::Leader | Fault::ApiDown)
    }

    /// The options of the cell's two instances.
    pub fn instance_options(self) -> Vec<ServiceOptions> {
        let skewed = match self {
            Fault::Clock => {
                ServiceOptions::default().env("WEBPROXY_TEST_CLOCK_OFFSET", CLOCK_AHEAD)
            }
            _ => ServiceOptions::default(),
        };
        vec![ServiceOptions::default(), skewed]
    }

    /// Whether the pool's limits must hold under the fault. A stalled pod may still
    /// hold an open HTTP call when the server redelivers its message (docs/flow-control.md), so
    /// that row asserts one reply instead.
    pub fn limits_hold(self) -> bool {
        self != Fault::Stalled
    }
}
