//! The error a configuration that cannot run gives: the key it concerns and why; and
//! the one way every message writes a key (`request_rules[0] (local-echo).timeout`).

use thiserror::Error;

/// A configuration that cannot run; the message names the key.
#[derive(Debug, Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    /// The error for `key`, saying what is wrong with it.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// An element of a configuration array as every message names it (pure): `array[index]`,
/// then ` (name)` when the element has a name (a request rule's), so that the reader
/// finds it in the file by either: `request_rules[0] (local-echo)`,
/// `response_rules[1]`.
pub fn element_key(array: &str, index: usize, name: Option<&str>) -> String {
    match name.filter(|name| !name.is_empty()) {
        Some(name) => format!("{array}[{index}] ({name})"),
        None => format!("{array}[{index}]"),
    }
}

/// A key given as its path's segments (figment's, where an array's index is a
/// segment of digits: `["request_rules", "0", "timeout"]`) in the one form messages
/// use (pure): tables' keys joined by `.`, an index as [`element_key`] writes it, the
/// element's name from `name_of` (given the segments up to the index):
/// `request_rules[0] (local-echo).timeout`, `pools.partner.max_in_flight`.
pub fn key_path<S: AsRef<str>>(path: &[S], name_of: impl Fn(&[&str]) -> Option<String>) -> String {
    let segments: Vec<&str> = path.iter().map(AsRef::as_ref).collect();
    let mut key = String::new();
    for (at, segment) in segments.iter().enumerate() {
        let index = segment
            .parse::<usize>()
            .ok()
            .filter(|_| at > 0 && segment.bytes().all(|b| b.is_ascii_digit()));
        match index {
            Some(index) => key = element_key(&key, index, name_of(&segments[..=at]).as_deref()),
            None if key.is_empty() => key.push_str(segment),
            None => {
                key.push('.');
                key.push_str(segment);
            }
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of `request_rules[0]` and `[2]`, as a configuration would give them.
    fn rule_name(path: &[&str]) -> Option<String> {
        match path {
            ["request_rules", "0"] => Some("local-echo".into()),
            ["request_rules", "2"] => Some("api".into()),
            _ => None,
        }
    }

    #[test]
    fn keys_are_written_one_way() {
        let cases: [(&[&str], &str); 7] = [
            (
                &["request_rules", "0", "timeout"],
                "request_rules[0] (local-echo).timeout",
            ),
            (
                &["pools", "partner", "max_in_flight"],
                "pools.partner.max_in_flight",
            ),
            (
                &["request_rules", "2", "response_rules", "1", "status"],
                "request_rules[2] (api).response_rules[1].status",
            ),
            // An element without a name is its index alone.
            (&["request_rules", "1", "pool"], "request_rules[1].pool"),
            (&["response_rules", "3"], "response_rules[3]"),
            (&["service"], "service"),
            (&[], ""),
        ];
        for (path, written) in cases {
            assert_eq!(key_path(path, rule_name), written, "{path:?}");
        }
    }

    #[test]
    fn an_element_is_named_when_it_has_a_name() {
        assert_eq!(
            element_key("request_rules", 0, Some("local-echo")),
            "request_rules[0] (local-echo)"
        );
        assert_eq!(
            element_key("request_rules", 4, Some("")),
            "request_rules[4]"
        );
        assert_eq!(
            element_key("outbound.dns_servers", 1, None),
            "outbound.dns_servers[1]"
        );
    }
}
