//! The `body.get` cursor: where the next chunk of a stored body starts, signed with the
//! object's own cursor key, so that a caller who showed the message id once reads on
//! with the cursor alone and cannot point it at another object or position. Pure.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac as _};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// Where a reader stands in a stored body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Cursor {
    /// The object's bucket and name.
    #[serde(rename = "b")]
    pub(crate) bucket: String,
    #[serde(rename = "n")]
    pub(crate) name: String,
    /// The stream sequence to look for the next chunk from.
    #[serde(rename = "s")]
    pub(crate) next_seq: u64,
    /// The body offset of the next chunk.
    #[serde(rename = "o")]
    pub(crate) offset: u64,
}

/// The most characters of a cursor a request may send.
const MAX_CURSOR_CHARS: usize = 1024;

/// The MAC of `body` under `key`, in hex: 16 bytes are plenty for a value that lives
/// as long as a body.
fn mac(key: &str, body: &str) -> String {
    // HMAC takes a key of any length.
    let mut mac = <Hmac<Sha256>>::new_from_slice(key.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    mac.update(body.as_bytes());
    mac.finalize().into_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Cursor {
    /// The cursor as the answer's header carries it: `<base64url JSON>.<mac>`.
    pub(crate) fn sign(&self, key: &str) -> String {
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(self).unwrap_or_default());
        let mac = mac(key, &body);
        format!("{body}.{mac}")
    }

    /// What a cursor says, unchecked: the object it names must be looked up for the
    /// key that [`Cursor::verify`] then checks it with.
    pub(crate) fn read(text: &str) -> Option<(Cursor, &str, &str)> {
        if text.len() > MAX_CURSOR_CHARS {
            return None;
        }
        let (body, mac) = text.split_once('.')?;
        let json = URL_SAFE_NO_PAD.decode(body).ok()?;
        let cursor = serde_json::from_slice(&json).ok()?;
        Some((cursor, body, mac))
    }

    /// Whether `mac` is the MAC of `body` under `key`, compared in constant time.
    pub(crate) fn verify(key: &str, body: &str, mac_text: &str) -> bool {
        use subtle::ConstantTimeEq as _;
        let expected = mac(key, body);
        expected.as_bytes().ct_eq(mac_text.as_bytes()).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cursor() -> Cursor {
        Cursor {
            bucket: "WEBPROXY_POOL_DEFAULT_BODIES".into(),
            name: "WEBPROXY_POOL_DEFAULT:1:0:1:1".into(),
            next_seq: 42,
            offset: 131_072,
        }
    }

    #[test]
    fn a_signed_cursor_reads_back_and_verifies_under_its_key_only() {
        let signed = cursor().sign("key-1");
        let (read, body, mac) = Cursor::read(&signed).expect("reads");
        assert_eq!(read, cursor());
        assert!(Cursor::verify("key-1", body, mac));
        assert!(!Cursor::verify("key-2", body, mac));
    }

    #[test]
    fn a_cursor_changed_by_the_caller_does_not_verify() {
        let signed = cursor().sign("key-1");
        let (_, _, mac) = Cursor::read(&signed).expect("reads");
        let moved = Cursor {
            offset: 0,
            ..cursor()
        }
        .sign("other");
        let (_, moved_body, _) = Cursor::read(&moved).expect("reads");
        assert!(!Cursor::verify("key-1", moved_body, mac));
        for garbage in ["", "x", "a.b", &"a".repeat(2000)] {
            assert!(Cursor::read(garbage).is_none(), "{garbage}");
        }
    }
}
