//! A conversation's hop state and the message ids the service publishes under: parsed
//! and formatted here, by pure code, and nowhere else.
//!
//! Hop state travels only on the service's own subjects (`hop.<pool>.<token>` and
//! `retry.<pool>.<token>`), which callers cannot publish to. On a caller's request
//! subject every `Webproxy-*` header is ignored: that message is step 0 of generation 0
//! of the conversation whose origin is its own stream sequence.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use webproxy_protocol::{AttemptRecord, Origin};

/// How many of the first attempts a history keeps once it is long.
const FIRST_KEPT: usize = 2;
/// How many of the latest attempts a history keeps.
const LAST_KEPT: usize = 8;
/// The most characters of a failure text one attempt record keeps.
pub(crate) const MAX_FAILURE_CHARS: usize = 300;
/// An upper bound on the encoded hop header: `FIRST_KEPT + LAST_KEPT` records of at
/// most a bounded failure text each, and the fixed fields. A request envelope that
/// would not fit `max_payload` beside it is `invalid_request`, so every hop fits.
pub(crate) const MAX_HOP_HEADER_BYTES: usize = 8 * 1024;

/// The attempts of a conversation: the first few and the latest few, with the number
/// left out between them, so the history stays bounded however many retries there are.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AttemptHistory {
    #[serde(default)]
    pub(crate) kept: Vec<AttemptRecord>,
    #[serde(default)]
    pub(crate) dropped: u32,
}

impl AttemptHistory {
    /// Adds the latest attempt, its failure text cut, dropping the oldest of the
    /// latest few when the history is full.
    pub(crate) fn push(&mut self, mut record: AttemptRecord) {
        if let Some(failure) = &mut record.failure
            && let Some((cut, _)) = failure.char_indices().nth(MAX_FAILURE_CHARS)
        {
            failure.truncate(cut);
            failure.push('…');
        }
        self.kept.push(record);
        if self.kept.len() > FIRST_KEPT + LAST_KEPT {
            self.kept.remove(FIRST_KEPT);
            self.dropped = self.dropped.saturating_add(1);
        }
    }

    /// Every attempt made, counted with those left out.
    pub(crate) fn count(&self) -> u32 {
        u32::try_from(self.kept.len())
            .unwrap_or(u32::MAX)
            .saturating_add(self.dropped)
    }

    pub(crate) fn last(&self) -> Option<&AttemptRecord> {
        self.kept.last()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }
}

/// Where a conversation stands, as its next hop carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HopState {
    #[serde(with = "origin_text")]
    pub(crate) origin: Origin,
    pub(crate) generation: u64,
    /// 0 for the caller's own message; each park, move or replay takes the next.
    pub(crate) step: u32,
    /// Unix milliseconds of the caller's publish: queue waits and `duration_ms` count
    /// from it.
    pub(crate) first_published_ms: u64,
    /// Unix milliseconds when a parked retry is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) due_ms: Option<u64>,
    #[serde(default)]
    pub(crate) attempts: AttemptHistory,
    /// The caller name of the request subject the caller published on, if it had one:
    /// its `reply_to` is checked against that caller's reply space on every hop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) caller: Option<String>,
    /// The SHA-256 of the caller's `Nats-Msg-Id`, when it was a capability
    /// (`webproxy_protocol::capability_sha256`): what a caller shows to act on the
    /// conversation later, kept through every hop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) msg_id_sha256: Option<String>,
}

mod origin_text {
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};
    use webproxy_protocol::Origin;

    pub(super) fn serialize<S: Serializer>(origin: &Origin, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(origin)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Origin, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(D::Error::custom)
    }
}

/// A hop header that is not what the service writes: on a service-only subject, that
/// is a bug, never something to reset to defaults.
#[derive(Debug, Error, PartialEq, Eq)]
pub(crate) enum HopError {
    #[error("the {header} header is missing")]
    Missing { header: &'static str },
    #[error("the {header} header is malformed: {reason}")]
    Malformed {
        header: &'static str,
        reason: String,
    },
}

impl HopState {
    /// The state of a caller's own message: step 0 of generation 0, published by the
    /// caller its request subject names.
    pub(crate) fn first(origin: Origin, published: SystemTime, caller: Option<&str>) -> HopState {
        HopState {
            origin,
            generation: 0,
            step: 0,
            first_published_ms: unix_ms(published),
            due_ms: None,
            attempts: AttemptHistory::default(),
            caller: caller.map(str::to_owned),
            msg_id_sha256: None,
        }
    }

    /// Reads the hop header of a message on a service-only subject.
    pub(crate) fn parse(header: Option<&str>) -> Result<HopState, HopError> {
        let name = webproxy_protocol::header::HOP;
        let text = header.ok_or(HopError::Missing { header: name })?;
        serde_json::from_str(text).map_err(|e| HopError::Malformed {
            header: name,
            reason: e.to_string(),
        })
    }

    /// The header value [`HopState::parse`] reads back.
    pub(crate) fn format(&self) -> String {
        // Strings, numbers and records only: serializing cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub(crate) fn first_published(&self) -> SystemTime {
        from_unix_ms(self.first_published_ms)
    }

    pub(crate) fn due(&self) -> Option<SystemTime> {
        self.due_ms.map(from_unix_ms)
    }

    /// The next hop of this conversation: the following step, with the history so far.
    pub(crate) fn next(&self, attempts: AttemptHistory, due: Option<SystemTime>) -> HopState {
        HopState {
            step: self.step + 1,
            due_ms: due.map(unix_ms),
            attempts,
            ..self.clone()
        }
    }
}

/// The headers layout 1 (webproxy before the conversation core) wrote on a retry it
/// parked on `<prefix>.retry.<pool>`, with the envelope as the payload.
pub(crate) mod layout1 {
    /// The generation, decimal.
    pub(crate) const GENERATION: &str = "Webproxy-Generation";
    /// The attempts so far: a JSON array of attempt records; absent when empty.
    pub(crate) const ATTEMPTS: &str = "Webproxy-Attempts";
    /// The caller's publish, Unix milliseconds.
    pub(crate) const FIRST_PUBLISHED: &str = "Webproxy-First-Published";
    /// When the retry is due, Unix milliseconds.
    pub(crate) const DUE: &str = "Webproxy-Due";
}

impl HopState {
    /// The state of a retry that layout 1 parked, read from its headers (`header`
    /// looks one up by name), and when it is due. The caller's own message is gone,
    /// so `origin` is the parked message's own: the conversation goes on from there
    /// as step 0, and its park is the next step. Layout 1 always wrote the
    /// generation, the first publish and the due time on a park; a missing or
    /// malformed one is an error, never a default.
    pub(crate) fn from_layout1<'h>(
        origin: Origin,
        header: impl Fn(&str) -> Option<&'h str>,
    ) -> Result<(HopState, SystemTime), HopError> {
        fn number(header: &'static str, value: Option<&str>) -> Result<u64, HopError> {
            let value = value.ok_or(HopError::Missing { header })?;
            value
                .trim()
                .parse()
                .map_err(|e: std::num::ParseIntError| HopError::Malformed {
                    header,
                    reason: e.to_string(),
                })
        }
        let generation = number(layout1::GENERATION, header(layout1::GENERATION))?;
        let first_published_ms =
            number(layout1::FIRST_PUBLISHED, header(layout1::FIRST_PUBLISHED))?;
        let due = number(layout1::DUE, header(layout1::DUE))?;
        let records: Vec<AttemptRecord> = match header(layout1::ATTEMPTS) {
            None => Vec::new(),
            Some(text) => serde_json::from_str(text).map_err(|e| HopError::Malformed {
                header: layout1::ATTEMPTS,
                reason: e.to_string(),
            })?,
        };
        let mut attempts = AttemptHistory::default();
        for record in records {
            attempts.push(record);
        }
        let state = HopState {
            origin,
            generation,
            step: 0,
            first_published_ms,
            due_ms: None,
            attempts,
            // Layout 1 had no caller names, nor capabilities.
            caller: None,
            msg_id_sha256: None,
        };
        Ok((state, from_unix_ms(due)))
    }
}

/// What a hop the service publishes into a pool stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum HopKind {
    /// A retry parked on `retry.<pool>.<token>` until it is due.
    Park,
    /// A request moved to its rule's pool, on `hop.<pool>.<token>`.
    Move,
    /// A dead letter replayed as a new generation, on `hop.<pool>.<token>`.
    Replay,
}

impl HopKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            HopKind::Park => "park",
            HopKind::Move => "move",
            HopKind::Replay => "replay",
        }
    }
}

/// The message id of a hop: `<kind>:<token>`. The token is random and known only to
/// the service, so a caller, who can publish into the pool stream, cannot pre-empt it.
pub(crate) fn hop_msg_id(kind: HopKind, token: &str) -> String {
    format!("{}:{token}", kind.as_str())
}

/// The message id of a parked retry released when due: `due:<token>`, its park's token.
pub(crate) fn due_msg_id(token: &str) -> String {
    format!("due:{token}")
}

/// The message id of a conversation's dead letter: `<STREAM>:<seq>:<generation>:dead`.
pub(crate) fn dead_msg_id(origin: &Origin, generation: u64) -> String {
    format!("{}:dead", origin.generation_key(generation))
}

/// The message id of the mark that supersedes a conversation's dead letter:
/// `<STREAM>:<seq>:<generation>:superseded`.
pub(crate) fn superseded_msg_id(origin: &Origin, generation: u64) -> String {
    format!("{}:superseded", origin.generation_key(generation))
}

/// A fresh hop token: 128 bits from the operating system's CSPRNG, as 32 hex digits.
pub(crate) fn new_token() -> String {
    let mut bytes = [0u8; 16];
    // Linux's getrandom(2) does not fail once the pool is seeded at boot; a token that
    // a caller could guess would let it pre-empt hops, so there is no weaker fallback.
    getrandom::fill(&mut bytes).expect("the operating system's random generator works");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The token of a service-only subject: its last token.
pub(crate) fn subject_token(subject: &str) -> Option<&str> {
    subject.rsplit_once('.').map(|(_, token)| token)
}

/// A duration in whole milliseconds, the unit of hop state, records and spans.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Unix milliseconds, the form times take in hop state.
pub(crate) fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, millis)
}

/// The inverse of [`unix_ms`].
pub(crate) fn from_unix_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: u64) -> AttemptRecord {
        AttemptRecord {
            at: format!("2026-12-01T00:00:{:02}Z", n % 60),
            status: Some(503),
            failure: None,
            duration_ms: n,
        }
    }

    fn state() -> HopState {
        HopState::first(
            Origin::new("WEBPROXY_POOL_DEFAULT", 42),
            from_unix_ms(1_700_000_000_000),
            None,
        )
    }

    #[test]
    fn hop_state_round_trips() {
        let mut attempts = AttemptHistory::default();
        attempts.push(record(1));
        let next = state().next(attempts, Some(from_unix_ms(1_700_000_001_000)));
        assert_eq!(next.step, 1);
        assert_eq!(next.due(), Some(from_unix_ms(1_700_000_001_000)));
        let header = next.format();
        assert!(
            header.contains(r#""origin":"WEBPROXY_POOL_DEFAULT:42""#),
            "{header}"
        );
        assert_eq!(HopState::parse(Some(&header)), Ok(next));
        // A hop keeps the caller name of the request subject; none is left out.
        assert!(!header.contains("caller"), "{header}");
        let named = HopState::first(Origin::new("S", 1), from_unix_ms(0), Some("a"))
            .next(AttemptHistory::default(), None);
        assert_eq!(named.caller.as_deref(), Some("a"));
        assert_eq!(HopState::parse(Some(&named.format())), Ok(named));
    }

    #[test]
    fn malformed_hop_state_is_an_error_not_a_default() {
        assert_eq!(
            HopState::parse(None),
            Err(HopError::Missing {
                header: "Webproxy-Hop"
            })
        );
        for bad in [
            "",
            "{}",
            "[]",
            r#"{"origin":"nope","generation":0,"step":1,"first_published_ms":0}"#,
            r#"{"origin":"S:1","generation":-1,"step":1,"first_published_ms":0}"#,
        ] {
            assert!(
                matches!(HopState::parse(Some(bad)), Err(HopError::Malformed { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn attempt_history_keeps_first_and_last_and_counts_the_rest() {
        let mut history = AttemptHistory::default();
        for n in 1..=25 {
            history.push(record(n));
        }
        assert_eq!(history.count(), 25);
        assert_eq!(history.kept.len(), FIRST_KEPT + LAST_KEPT);
        assert_eq!(history.dropped, 15);
        let kept: Vec<u64> = history.kept.iter().map(|r| r.duration_ms).collect();
        assert_eq!(kept, [1, 2, 18, 19, 20, 21, 22, 23, 24, 25]);
        assert_eq!(history.last().map(|r| r.duration_ms), Some(25));
    }

    #[test]
    fn hop_header_is_bounded_whatever_the_failures() {
        let mut state = state();
        for n in 0..1000 {
            let mut r = record(n);
            r.status = None;
            r.failure = Some("\"\\".repeat(10_000));
            state.attempts.push(r);
        }
        let header = state.format();
        assert!(header.len() <= MAX_HOP_HEADER_BYTES, "{}", header.len());
        assert_eq!(state.attempts.count(), 1000);
    }

    #[test]
    fn a_layout1_park_becomes_the_state_before_its_park() {
        let attempts = serde_json::to_string(&[record(1), record(2)]).expect("json");
        let park: std::collections::HashMap<&str, String> = [
            ("Webproxy-Id", "order-42"),
            ("Webproxy-Generation", "1"),
            ("Webproxy-First-Published", "1700000000000"),
            ("Webproxy-Due", "1700000002000"),
            ("Webproxy-Attempts", attempts.as_str()),
        ]
        .into_iter()
        .map(|(name, value)| (name, value.to_string()))
        .collect();
        let read = |headers: &std::collections::HashMap<&str, String>| {
            HopState::from_layout1(origin(), |name| headers.get(name).map(String::as_str))
        };
        fn origin() -> Origin {
            Origin::new("WEBPROXY_POOL_DEFAULT", 7)
        }
        let (state, due) = read(&park).expect("a layout 1 park");
        assert_eq!(state.origin, origin());
        assert_eq!(state.generation, 1);
        assert_eq!(state.step, 0);
        assert_eq!(state.first_published(), from_unix_ms(1_700_000_000_000));
        assert_eq!(state.attempts.count(), 2);
        assert_eq!(due, from_unix_ms(1_700_000_002_000));
        // The park it becomes is step 1, due then, with the history.
        let next = state.next(state.attempts.clone(), Some(due));
        assert_eq!((next.step, next.due()), (1, Some(due)));

        // No attempts header: an empty history, as layout 1 wrote it.
        let mut without = park.clone();
        without.remove("Webproxy-Attempts");
        assert!(read(&without).expect("no attempts").0.attempts.is_empty());

        // Missing or malformed: an error naming the header.
        let mut missing = park.clone();
        missing.remove("Webproxy-Generation");
        assert_eq!(
            read(&missing).map(|_| ()),
            Err(HopError::Missing {
                header: "Webproxy-Generation"
            })
        );
        for (name, bad) in [
            ("Webproxy-Due", "soon"),
            ("Webproxy-First-Published", "-1"),
            ("Webproxy-Attempts", "{not json"),
        ] {
            let mut broken = park.clone();
            broken.insert(name, bad.to_string());
            let result = read(&broken);
            assert!(
                matches!(result, Err(HopError::Malformed { header, .. }) if header == name),
                "{name}: {result:?}"
            );
        }
    }

    #[test]
    fn message_ids() {
        let origin = Origin::new("WEBPROXY_POOL_DEFAULT", 42);
        assert_eq!(origin.reply_msg_id(1), "WEBPROXY_POOL_DEFAULT:42:1:reply");
        assert_eq!(dead_msg_id(&origin, 0), "WEBPROXY_POOL_DEFAULT:42:0:dead");
        assert_eq!(hop_msg_id(HopKind::Park, "ab"), "park:ab");
        assert_eq!(hop_msg_id(HopKind::Move, "ab"), "move:ab");
        assert_eq!(hop_msg_id(HopKind::Replay, "ab"), "replay:ab");
        assert_eq!(due_msg_id("ab"), "due:ab");
    }

    #[test]
    fn tokens_are_random_subject_tokens() {
        let a = new_token();
        let b = new_token();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert_eq!(
            subject_token(&format!("webproxy.hop.default.{a}")),
            Some(a.as_str())
        );
    }
}
