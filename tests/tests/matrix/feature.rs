//! The matrix's columns: each feature's cluster document, its load's shape, its pool's
//! limits, and the reply each conversation ends with. What a feature does in a running
//! cell is `scene.rs`'s.

use std::time::Duration;

use webproxy_tests::Upstream;
use webproxy_tests::caller::{origin_rule, path_rule};

use crate::observe::Stored;

/// The pool every feature's conversations end in.
pub const POOL: &str = "partner";

/// The pools' `ack_wait` (the cluster part's `[service] ack_wait`): short, so that a
/// stalled pod's messages come back soon.
pub const ACK_WAIT: Duration = Duration::from_secs(3);

/// The pool `default`, where [`Feature::Moved`]'s conversations arrive.
pub const ARRIVAL_POOL: &str = "default";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    Plain,
    Rate,
    Paused,
    Breaker,
    Adaptive,
    Parked,
    Moved,
    Replay,
    Config,
    /// A `webproxy gateway` in front of the pool (`Cell::gateway`). The load is keyed
    /// HTTP requests, each recorded (a 202) and then sent again with its key and held
    /// by the gateway through the fault. After it, each one's record must still name
    /// its conversation: the gateway's API gives the stored reply, and a repeat with
    /// the key gets the same id and reply with no second upstream call. The stalled
    /// row stalls a `serve` instance, as in every column: the gateway holds no
    /// JetStream delivery, so `ack_wait` means nothing to it, and the row's danger (a
    /// redelivered attempt, a second body) is the service's, which the gateway must
    /// not turn into a second answer.
    Gateway,
    /// Large response bodies (issue 34): each request sets `large_body`, published with
    /// a capability `Nats-Msg-Id`, and its upstream streams a few MiB slowly
    /// (`/large/{n}`, [`crate::upstream::LARGE_STREAMS`]), so the fault comes while
    /// bodies stream into the pool's body store; the load waits until instance 0, the
    /// one the stalled row stops, has one under way, sending another round of the load
    /// if one is answered first (`large::load`). After the fault each reply must
    /// name a body that reads back whole with its digest, each conversation must have
    /// one stored reply, and once what the fault left behind has settled the store
    /// must hold exactly the bodies the replies name: no orphan chunk, metadata or
    /// receipt (`large.rs`).
    Large,
    /// Cancels (issue 35), recorded just before the fault. The upstream holds every
    /// call (`/hold/{n}`): the first [`Feature::max_in_flight`] conversations are in
    /// flight, the rest wait behind the limit, and instance 0 (the one the stalled row
    /// stops) holds one of those in flight. Half of them are cancelled through
    /// `Client::cancel`, each answered `recorded`: every one in flight, so the stalled
    /// pod is stopped right after a cancel of an attempt it holds, and one waiting.
    /// The fault comes right after the last answer, racing the instances that act on
    /// the cancels; once it is over and the cancelled attempts are dropped, the
    /// upstream lets the rest through. After it each conversation must have one stored
    /// reply, `cancelled` for a cancelled one (held at the upstream, none could finish
    /// first) and the response for the rest; a cancelled one called the upstream at
    /// most once, or never if it was waiting; and once every instance is idle the
    /// cancels bucket must hold no record of the load (`cancel.rs`).
    Cancel,
}

/// The length of [`Feature::Large`]'s `n`th body: a few MiB, each conversation's a
/// different length, so that a reply naming another conversation's body shows.
pub fn large_size(n: usize) -> usize {
    3 * 1024 * 1024 + n * 4099
}

/// The rate of [`Feature::Rate`]'s pool, per second, and its burst.
pub const RATE: u32 = 5;
pub const BURST: u32 = 1;

impl Feature {
    /// The pool's `max_in_flight`.
    pub fn max_in_flight(self) -> u32 {
        match self {
            Feature::Breaker | Feature::Parked | Feature::Replay => 4,
            Feature::Adaptive => 6,
            _ => 3,
        }
    }

    /// How many conversations the load sends.
    pub fn count(self) -> usize {
        match self {
            Feature::Paused
            | Feature::Breaker
            | Feature::Parked
            | Feature::Large
            | Feature::Cancel => 8,
            Feature::Replay => 6,
            _ => 12,
        }
    }

    /// The upstream path of the load's `n`th conversation.
    pub fn path(self, n: usize) -> String {
        match self {
            Feature::Rate => "/delay/50".into(),
            Feature::Paused => "/delay/100".into(),
            Feature::Breaker | Feature::Replay => format!("/mend/{n}"),
            Feature::Parked => format!("/flaky/{n}"),
            Feature::Gateway => format!("/slow/{n}"),
            Feature::Large => format!("/large/{}", large_size(n)),
            Feature::Cancel => format!("/hold/{n}"),
            _ => "/delay/400".into(),
        }
    }

    /// The pool the conversations are sent to.
    pub fn sent_to(self) -> &'static str {
        match self {
            Feature::Moved => ARRIVAL_POOL,
            _ => POOL,
        }
    }

    /// The buckets (their names after `KV_WEBPROXY_`) that the feature keeps, which
    /// the `deleted` row deletes.
    pub fn buckets(self) -> &'static [&'static str] {
        match self {
            Feature::Plain | Feature::Breaker => &["INSTANCES", "POOL_STATE"],
            Feature::Rate => &["RATE"],
            Feature::Paused | Feature::Adaptive => &["POOL_STATE"],
            Feature::Parked | Feature::Moved | Feature::Replay => &["PROGRESS"],
            Feature::Config => &["CONFIG"],
            // Its key's loss is `gateway_state.rs`'s (the key is never made again).
            Feature::Gateway => &["GATEWAY"],
            // Its body store holds the bodies themselves, not state: the deleted row
            // does not run it (tests/fault_matrix.toml says why).
            Feature::Large => &[],
            // Deleted right after the cancels were recorded: those not yet acted on
            // are lost, as `webproxy-jetstream`'s `state.rs` says a lost bucket loses
            // them (`cancel.rs` asserts what still holds).
            Feature::Cancel => &["CANCELS"],
        }
    }

    /// The cluster document: `ack_wait`, and the pool's `max_in_flight` less `lower`.
    pub fn document(self, upstream: &Upstream, ack_wait: Duration, lower: u32) -> String {
        let pool = match self {
            Feature::Rate => format!("rate = \"{RATE}/s\"\nburst = {BURST}\n"),
            Feature::Adaptive => "adaptive = true\nmin_in_flight = 1\n".into(),
            Feature::Breaker => "[pools.partner.breaker]\nmin_attempts = 5\nfailure_ratio = 0.5\nwindow = \"1m\"\nopen_for = \"2s\"\nmax_open_for = \"4s\"\n".into(),
            Feature::Moved => format!("\n[pools.{ARRIVAL_POOL}]\nmax_in_flight = 4\n"),
            _ => String::new(),
        };
        let rule = match self {
            Feature::Breaker | Feature::Adaptive => origin_rule("matrix", upstream, "/"),
            _ => path_rule("matrix", upstream, "/"),
        };
        let rule_keys = match self {
            Feature::Breaker => "max_retries = 50\nretry_delay = \"200ms\"\nbackoff_factor = 1.0\n",
            Feature::Parked => "max_retries = 3\nretry_delay = \"2s\"\n",
            Feature::Replay => {
                "max_retries = 0\n[[request_rules.response_rules]]\nstatus = \"503\"\naction = \"error\"\n"
            }
            // The load is held at the upstream through the fault and its recovery (a
            // minute at most): an attempt that timed out would park and call again.
            Feature::Cancel => "timeout = \"5m\"\n",
            _ => "",
        };
        format!(
            "[outbound]\nallow_private_networks = true\n\n[service]\nack_wait = \"{}ms\"\n\n[pools.{POOL}]\nmax_in_flight = {}\n{pool}\n{rule}pool = \"{POOL}\"\n{rule_keys}",
            ack_wait.as_millis(),
            self.max_in_flight() - lower
        )
    }

    /// Whether a stored reply is the one the conversation should end with; for
    /// [`Feature::Large`], one that names a stored body; for [`Feature::Cancel`],
    /// `cancelled` as well (which conversation ends which way is `cancel.rs`'s).
    pub fn answered(self, reply: &Stored) -> bool {
        let generation = if self == Feature::Replay { "1" } else { "0" };
        let cancelled = self == Feature::Cancel && reply.json["error"]["code"] == "cancelled";
        reply.generation == generation
            && (reply.status == Some(200) || cancelled)
            && (self != Feature::Large || reply.json["body_object"].is_object())
    }
}
