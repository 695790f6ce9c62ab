//! The caller's capability: the `Nats-Msg-Id` it published a request with, when that
//! is 128 random bits only the publisher knows. The service never keeps the id itself,
//! only its SHA-256, and asks for the id again before it acts for a caller on a
//! conversation it did not start (reading a stored body, and the cancel to come).

use sha2::{Digest as _, Sha256};

/// Whether `msg_id` can be a capability: 32 or more hexadecimal digits (what the
/// clients send: 128 bits from the operating system), or a UUID in its usual form.
/// Shorter or structured ids are guessable, so they open nothing.
pub fn is_capability(msg_id: &str) -> bool {
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    let uuid = || {
        let groups: Vec<&str> = msg_id.split('-').collect();
        groups.len() == 5
            && groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
            && groups.iter().all(|g| hex(g))
    };
    (msg_id.len() >= 32 && msg_id.len() <= 128 && hex(msg_id)) || uuid()
}

/// The SHA-256 (lowercase hex) the service keeps of a capability, or none when
/// `msg_id` is not one.
pub fn capability_sha256(msg_id: &str) -> Option<String> {
    is_capability(msg_id).then(|| hex_sha256(msg_id.as_bytes()))
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn hex_sha256(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    Sha256::digest(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut text, b| {
            let _ = write!(text, "{b:02x}");
            text
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_long_random_looking_ids_are_capabilities() {
        assert!(is_capability("0123456789abcdef0123456789ABCDEF"));
        assert!(is_capability("6f1c0a52-3d0e-4b8e-9d7a-2f5c9e1b7a10"));
        for guessable in [
            "",
            "order-42",
            "0123456789abcdef0123456789abcde",
            "0123456789abcdef0123456789abcdeg",
            "6f1c0a52-3d0e-4b8e-9d7a",
            "STREAM:12:0:reply",
        ] {
            assert!(!is_capability(guessable), "{guessable}");
        }
    }

    #[test]
    fn the_service_keeps_the_hash_never_the_id() {
        let id = "0123456789abcdef0123456789abcdef";
        let kept = capability_sha256(id).expect("a capability");
        assert_eq!(kept.len(), 64);
        assert!(!kept.contains(id));
        assert_eq!(kept, hex_sha256(id.as_bytes()));
        assert_eq!(capability_sha256("short"), None);
    }
}
