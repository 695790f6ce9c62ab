//! A conversation's origin: the pool stream and stream sequence of the caller's
//! publish, written `<STREAM>:<seq>` (e.g. `WEBPROXY_POOL_DEFAULT:1733025600000123`).

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// The pool stream and sequence that stored a caller's request: one stored request
/// message is one conversation. The caller learns it from the JetStream publish ack;
/// replies carry it in the `Webproxy-Origin` header.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Origin {
    /// The pool stream, e.g. `WEBPROXY_POOL_DEFAULT`.
    pub stream: String,
    /// The request's sequence in that stream.
    pub seq: u64,
}

/// Text that is not `<STREAM>:<seq>`; the message says why.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid origin {text:?}: {why}")]
pub struct InvalidOrigin {
    pub text: String,
    pub why: &'static str,
}

impl Origin {
    pub fn new(stream: impl Into<String>, seq: u64) -> Origin {
        Origin {
            stream: stream.into(),
            seq,
        }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.stream, self.seq)
    }
}

impl FromStr for Origin {
    type Err = InvalidOrigin;

    /// Parses `<STREAM>:<seq>`. The stream must be one subject token of
    /// `[A-Za-z0-9_-]` (as every pool stream name is), so that an origin can name a
    /// subject and never a wildcard; the sequence is decimal digits only.
    fn from_str(text: &str) -> Result<Origin, InvalidOrigin> {
        let invalid = |why| InvalidOrigin {
            text: text.to_string(),
            why,
        };
        let (stream, seq) = text.split_once(':').ok_or(invalid("no ':'"))?;
        if stream.is_empty() || stream.len() > 255 {
            return Err(invalid("the stream must be 1 to 255 characters long"));
        }
        if !stream
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(invalid(
                "the stream may contain only A-Z, a-z, 0-9, '_' and '-'",
            ));
        }
        if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid("the sequence must be decimal digits"));
        }
        let seq = seq
            .parse()
            .map_err(|_| invalid("the sequence is out of range"))?;
        Ok(Origin::new(stream, seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_as_stream_colon_sequence() {
        let origin = Origin::new("WEBPROXY_POOL_DEFAULT", 1_733_025_600_000_123);
        assert_eq!(origin.to_string(), "WEBPROXY_POOL_DEFAULT:1733025600000123");
    }

    #[test]
    fn parses_what_it_formats() {
        for origin in [
            Origin::new("WEBPROXY_POOL_DEFAULT", 1),
            Origin::new("ACME_WP_POOL_A-B", u64::MAX),
        ] {
            assert_eq!(origin.to_string().parse(), Ok(origin));
        }
    }

    #[test]
    fn refuses_what_is_not_stream_colon_sequence() {
        for bad in [
            "",
            "WEBPROXY_POOL_DEFAULT",
            ":1",
            "WEBPROXY_POOL_DEFAULT:",
            "WEBPROXY_POOL_DEFAULT:-1",
            "WEBPROXY_POOL_DEFAULT:+1",
            "WEBPROXY_POOL_DEFAULT: 1",
            "WEBPROXY_POOL_DEFAULT:1x",
            "WEBPROXY_POOL_DEFAULT:18446744073709551616",
            "WEBPROXY_POOL_DEFAULT:1:2",
            "A.B:1",
            "*:1",
            ">:1",
            "A B:1",
        ] {
            let error = bad.parse::<Origin>().expect_err(bad);
            assert_eq!(error.text, bad);
        }
        let long = format!("{}:1", "S".repeat(256));
        assert!(long.parse::<Origin>().is_err());
    }
}
