//! Large request bodies: uploaded in chunks with core NATS requests to
//! `<prefix>.body.put.<pool>[.<caller>]`, then named by the envelope's `body_object`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A request on `<prefix>.body.put.<pool>[.<caller>]`: the next bytes of an upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BodyPutRequest {
    /// The upload's name: 32 random lowercase hex digits the caller draws.
    pub upload: String,
    /// Where these bytes start: the size the upload has so far.
    pub offset: u64,
    /// The bytes, in standard base64.
    pub data_base64: String,
}

/// The answer to a `body.put` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BodyPutAnswer {
    pub upload: String,
    /// The bytes the upload holds now: where the next request's `offset` starts. A
    /// request whose bytes were stored before (a retry) is answered with it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<BodyPutError>,
}

/// Why a `body.put` request stored nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BodyPutError {
    /// `invalid_request`, `offset` (not where the upload ends: `size` says where),
    /// `bound` (an envelope took it already), `quota` (the pool's upload store is full),
    /// `unknown_pool`, `internal`.
    pub code: String,
    pub message: String,
}

/// An uploaded request body, as the envelope's `body_object` names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UploadRef {
    /// The upload's name (32 lowercase hex digits).
    pub upload: String,
    /// Its length in bytes, checked before anything is sent.
    pub size: u64,
    /// `SHA-256=` and its SHA-256 in padded base64url, checked before anything is sent.
    pub digest: String,
}

/// Whether `name` is an upload's name: 32 lowercase hex digits.
pub fn is_upload_name(name: &str) -> bool {
    name.len() == 32 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `digest` has the form `SHA-256=<44 characters of padded base64url>`.
pub fn is_digest(digest: &str) -> bool {
    digest.strip_prefix("SHA-256=").is_some_and(|b64| {
        b64.len() == 44
            && b64.ends_with('=')
            && b64[..43]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_digests_have_one_form() {
        assert!(is_upload_name("0123456789abcdef0123456789abcdef"));
        assert!(!is_upload_name("0123456789ABCDEF0123456789abcdef"));
        assert!(!is_upload_name("up.0123456789abcdef0123456789abcd"));
        assert!(is_digest(
            "SHA-256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU="
        ));
        assert!(!is_digest(
            "SHA-256=47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="
        ));
        assert!(!is_digest("sha256:abc"));
    }
}
