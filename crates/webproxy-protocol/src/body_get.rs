//! Reading a stored body through the service, for callers that cannot read the body
//! store themselves: a core NATS request to `<prefix>.body.get`, answered with the
//! body's next chunk as raw bytes, or with an error.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A request on `<prefix>.body.get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BodyGetRequest {
    /// The request envelope's id.
    pub id: String,
    /// The conversation's origin, `<STREAM>:<seq>`.
    pub origin: String,
    /// The `Nats-Msg-Id` the request was published with: the capability.
    pub msg_id: String,
    /// The previous answer's `Webproxy-Body-Cursor`; absent for the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
}

/// Why a `body.get` request got no chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BodyGetCode {
    /// The request is not JSON of the documented shape, or a cursor was tampered with.
    InvalidRequest,
    /// No stored body for this id, origin and message id: unknown, not finished, not a
    /// stored body, or a message id that is not the publisher's. One answer for all.
    NotFound,
    /// The body was stored and has expired.
    Expired,
    /// The service is answering as many `body.get` requests as it may: ask again.
    Busy,
    /// The service could not read the store.
    Internal,
}

impl BodyGetCode {
    pub fn as_str(self) -> &'static str {
        match self {
            BodyGetCode::InvalidRequest => "invalid_request",
            BodyGetCode::NotFound => "not_found",
            BodyGetCode::Expired => "expired",
            BodyGetCode::Busy => "busy",
            BodyGetCode::Internal => "internal",
        }
    }
}

/// The payload of an answer that carries no chunk (its `Webproxy-Body-Error` header
/// holds the code too).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BodyGetError {
    pub code: BodyGetCode,
    pub message: String,
}

/// Header names of `body.get` answers.
pub mod body_header {
    /// The body's whole length in bytes, on every chunk.
    pub const SIZE: &str = "Webproxy-Body-Size";
    /// Where this chunk starts in the body.
    pub const OFFSET: &str = "Webproxy-Body-Offset";
    /// The body's digest, `SHA-256=<base64url>`, on every chunk.
    pub const DIGEST: &str = "Webproxy-Body-Digest";
    /// What to send as `cursor` for the next chunk; absent on the last.
    pub const CURSOR: &str = "Webproxy-Body-Cursor";
    /// On an answer without a chunk: its code (`not_found`, `expired`, ...).
    pub const ERROR: &str = "Webproxy-Body-Error";
}
