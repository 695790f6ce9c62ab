//! A conversation's origin: the pool stream and stream sequence of the caller's
//! publish. One stored request message is one conversation, so every piece of state the
//! service keeps is keyed on the origin (and the generation), never on the
//! caller-chosen id.

use std::fmt;
use std::str::FromStr;

use crate::name::InvalidName;

/// `<STREAM>:<seq>`, e.g. `WEBPROXY_POOL_DEFAULT:1733025600000123`. A caller learns it
/// from the JetStream publish ack (`stream`, `seq`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Origin {
    pub stream: String,
    pub seq: u64,
}

impl Origin {
    pub fn new(stream: impl Into<String>, seq: u64) -> Origin {
        Origin {
            stream: stream.into(),
            seq,
        }
    }

    /// The progress record's key for `generation`: `<STREAM>.<seq>.<generation>`, in
    /// the characters KV keys allow.
    pub fn record_key(&self, generation: u64) -> String {
        format!("{}.{}.{generation}", self.stream, self.seq)
    }

    /// The id shared by everything one generation of this conversation stores:
    /// `<STREAM>:<seq>:<generation>`. It is the `Idempotency-Key` sent upstream and the
    /// stem of the reply and dead-letter message ids.
    pub fn generation_key(&self, generation: u64) -> String {
        format!("{self}:{generation}")
    }

    /// The message id of `generation`'s stored reply, `<STREAM>:<seq>:<generation>:reply`,
    /// the same on every copy that carries one (the stored reply, a `reply_to` copy).
    pub fn reply_msg_id(&self, generation: u64) -> String {
        format!("{}:reply", self.generation_key(generation))
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.stream, self.seq)
    }
}

/// A stream name as JetStream allows it and a subject token can carry it.
fn valid_stream_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl FromStr for Origin {
    type Err = InvalidName;

    fn from_str(text: &str) -> Result<Origin, InvalidName> {
        let (stream, seq) = text
            .rsplit_once(':')
            .ok_or_else(|| InvalidName(format!("origin {text:.64?} is not <STREAM>:<seq>")))?;
        if !valid_stream_name(stream) {
            return Err(InvalidName(format!(
                "origin stream {stream:.64?} is not a stream name"
            )));
        }
        let seq = seq.parse::<u64>().ok().filter(|s| *s > 0).ok_or_else(|| {
            InvalidName(format!(
                "origin sequence {seq:.32?} is not a positive number"
            ))
        })?;
        Ok(Origin::new(stream, seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_form_round_trips() {
        let origin = Origin::new("WEBPROXY_POOL_DEFAULT", 1_733_025_600_000_123);
        assert_eq!(origin.to_string(), "WEBPROXY_POOL_DEFAULT:1733025600000123");
        assert_eq!(origin.to_string().parse::<Origin>(), Ok(origin.clone()));
        assert_eq!(
            origin.record_key(2),
            "WEBPROXY_POOL_DEFAULT.1733025600000123.2"
        );
        assert_eq!(
            origin.generation_key(0),
            "WEBPROXY_POOL_DEFAULT:1733025600000123:0"
        );
    }

    #[test]
    fn malformed_origins_are_refused() {
        for bad in [
            "", "S", "S:", ":1", "S:0", "S:-1", "S:x", "A.B:1", "A B:1", "S:1:2",
        ] {
            assert!(bad.parse::<Origin>().is_err(), "{bad}");
        }
    }
}
