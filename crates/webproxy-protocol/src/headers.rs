//! HTTP header maps as they travel in envelopes: a value is one string or several.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One header's value(s). A header sent once is a string; sent several times, an array.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum HeaderValue {
    One(String),
    Many(Vec<String>),
}

impl HeaderValue {
    /// The values in order, one per occurrence of the header.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        let slice: &[String] = match self {
            HeaderValue::One(v) => std::slice::from_ref(v),
            HeaderValue::Many(vs) => vs,
        };
        slice.iter().map(String::as_str)
    }

    fn push(&mut self, value: String) {
        match self {
            HeaderValue::One(first) => {
                *self = HeaderValue::Many(vec![std::mem::take(first), value]);
            }
            HeaderValue::Many(vs) => vs.push(value),
        }
    }
}

/// A header map as envelopes carry it.
pub type Headers = BTreeMap<String, HeaderValue>;

/// Collects `(name, value)` pairs into an envelope header map, names lower-cased, a
/// repeated header becoming an array.
pub fn collect_headers<'a>(pairs: impl IntoIterator<Item = (&'a str, String)>) -> Headers {
    let mut map = Headers::new();
    for (name, value) in pairs {
        match map.get_mut(&name.to_ascii_lowercase()) {
            Some(existing) => existing.push(value),
            None => {
                map.insert(name.to_ascii_lowercase(), HeaderValue::One(value));
            }
        }
    }
    map
}

/// Headers that describe one connection rather than the request (RFC 9110 section 7.6.1),
/// plus those the HTTP client computes itself. They are dropped from requests.
pub fn is_hop_by_hop(name: &str) -> bool {
    const HOP_BY_HOP: [&str; 10] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "content-length",
        "host",
    ];
    HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_headers_become_arrays_and_names_lower_case() {
        let map = collect_headers([
            ("Set-Cookie", "a=1".to_string()),
            ("Content-Type", "text/plain".to_string()),
            ("set-cookie", "b=2".to_string()),
        ]);
        assert_eq!(
            map["set-cookie"],
            HeaderValue::Many(vec!["a=1".into(), "b=2".into()])
        );
        assert_eq!(map["content-type"], HeaderValue::One("text/plain".into()));
    }

    #[test]
    fn hop_by_hop_is_case_insensitive() {
        assert!(is_hop_by_hop("Transfer-Encoding"));
        assert!(is_hop_by_hop("CONNECTION"));
        assert!(!is_hop_by_hop("Content-Type"));
    }
}
