//! The reply envelope (one final answer per conversation) and the dead-letter record.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::PROTOCOL_VERSION;
use crate::headers::Headers;

/// How a conversation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Response,
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Response => "response",
            Outcome::Error => "error",
        }
    }
}

/// The closed set of error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidRequest,
    Denied,
    Expired,
    UpstreamError,
    RetriesExhausted,
    TransportError,
    ResponseTooLarge,
    /// The pool a rule moved the request to already holds `max_waiting` requests.
    QueueFull,
    /// Taken back by a cancel before it finished; an attempt in flight was dropped.
    Cancelled,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::Denied => "denied",
            ErrorCode::Expired => "expired",
            ErrorCode::UpstreamError => "upstream_error",
            ErrorCode::RetriesExhausted => "retries_exhausted",
            ErrorCode::TransportError => "transport_error",
            ErrorCode::ResponseTooLarge => "response_too_large",
            ErrorCode::QueueFull => "queue_full",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::Internal => "internal",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error outcome's details.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
}

/// A response body as it travels: UTF-8 text as `body`, anything else as `body_base64`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct ReplyBody {
    /// The body when it is UTF-8 text (an empty body is `""`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// Any other body, in standard base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
}

impl ReplyBody {
    /// Text when the bytes are valid UTF-8 (an empty body is `""`), base64 otherwise.
    pub fn encode(bytes: Vec<u8>) -> ReplyBody {
        match String::from_utf8(bytes) {
            Ok(text) => ReplyBody {
                body: Some(text),
                body_base64: None,
            },
            Err(e) => ReplyBody {
                body: None,
                body_base64: Some(BASE64.encode(e.as_bytes())),
            },
        }
    }

    /// The body's bytes, whichever way it was encoded.
    pub fn decode(&self) -> Result<Vec<u8>, base64::DecodeError> {
        match (&self.body, &self.body_base64) {
            (Some(text), _) => Ok(text.as_bytes().to_vec()),
            (None, Some(b64)) => BASE64.decode(b64),
            (None, None) => Ok(Vec::new()),
        }
    }
}

/// Where a response body too large to travel inline is stored: an object of a
/// JetStream Object Store bucket, in the layout every Object Store client reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BodyObject {
    /// The Object Store bucket (the pool's body store; a moved conversation's is the
    /// pool it ran in).
    pub bucket: String,
    /// The object's name in the bucket.
    pub name: String,
    /// The body's length in bytes.
    pub size: u64,
    /// `SHA-256=` and the body's SHA-256 in padded base64url, as Object Store writes it.
    pub digest: String,
}

/// The final reply of a conversation.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Reply {
    #[schemars(schema_with = "crate::schema::reply_version")]
    pub v: u8,
    /// The request's id (for an `invalid_request` reply, the id as it was given).
    pub id: String,
    pub outcome: Outcome,
    /// The upstream's HTTP status, on a response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// The response headers, names lower case; a repeated header is an array.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<Headers>,
    #[serde(flatten)]
    pub body: ReplyBody,
    /// In place of `body`/`body_base64`: where a stored body is, for a request that
    /// set `large_body` and got a body above the inline limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_object: Option<BodyObject>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    /// HTTP attempts started, a refused connection included.
    pub attempts: u32,
    /// Milliseconds from the caller's publish to this reply: time waiting in the pool
    /// and between retries included, not only the HTTP attempts.
    pub duration_ms: u64,
    /// The request's `metadata`, byte for byte.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_json")]
    pub metadata: Option<Box<RawValue>>,
}

impl Reply {
    /// A `response` reply.
    pub fn response(
        id: String,
        status: u16,
        headers: Headers,
        body: ReplyBody,
        attempts: u32,
        duration_ms: u64,
        metadata: Option<Box<RawValue>>,
    ) -> Reply {
        Reply {
            v: PROTOCOL_VERSION,
            id,
            outcome: Outcome::Response,
            status: Some(status),
            headers: Some(headers),
            body,
            body_object: None,
            error: None,
            attempts,
            duration_ms,
            metadata,
        }
    }

    /// An `error` reply.
    pub fn error(
        id: String,
        error: ErrorBody,
        attempts: u32,
        duration_ms: u64,
        metadata: Option<Box<RawValue>>,
    ) -> Reply {
        Reply {
            v: PROTOCOL_VERSION,
            id,
            outcome: Outcome::Error,
            status: None,
            headers: None,
            body: ReplyBody::default(),
            body_object: None,
            error: Some(error),
            attempts,
            duration_ms,
            metadata,
        }
    }
}

/// One attempt in a conversation's history, as dead letters record it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AttemptRecord {
    /// RFC 3339 start time.
    pub at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// The transport failure kind and message, when there was no HTTP status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Milliseconds this attempt took.
    pub duration_ms: u64,
}

/// What is copied to `<prefix>.dead.<pool>` when a conversation ends in an error or a
/// payload cannot be decoded.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct DeadLetter {
    pub pool: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default)]
    pub generation: u64,
    /// The conversation's origin, `<STREAM>:<seq>`: what `dead replay` starts the next
    /// generation from. Absent only for payloads that never were a conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
    /// The caller name of the request subject it was published on
    /// (`<prefix>.request.<pool>.<caller>`), when it had one: a replay keeps it, so that
    /// its `reply_to` is checked against the same caller's reply space.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// The SHA-256 (hex) of the `Nats-Msg-Id` the request was published with, when it
    /// was a capability: a replay keeps it, so the replayed conversation's stored body
    /// still asks for the caller's message id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub msg_id_sha256: Option<String>,
    pub error: ErrorBody,
    /// The original request, when the payload was a JSON object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::any_json")]
    pub envelope: Option<Box<RawValue>>,
    /// The original payload, when it was not a JSON object: its first 4 KiB at most
    /// (`truncated` says when that is not all of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
    /// The original payload's length in bytes, when it was not a JSON object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_len: Option<u64>,
    /// The original payload's SHA-256 (lowercase hex), when it was not a JSON object:
    /// what identifies it when only its start is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_sha256: Option<String>,
    /// The attempts made, the first and the last few when there were many.
    #[serde(default)]
    pub attempts: Vec<AttemptRecord>,
    /// How many attempts between the first and the last few `attempts` leaves out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempts_dropped: u32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

impl DeadLetter {
    /// The caller's request, when the letter holds it whole: what a replay
    /// republishes. A truncated letter's envelope is not the request.
    pub fn whole_request(&self) -> Option<&RawValue> {
        self.envelope.as_deref().filter(|_| !self.truncated)
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The most characters of a caller's or upstream's value that an error message quotes.
pub const MAX_QUOTED_CHARS: usize = 200;

/// A value as an error message quotes it: Debug-quoted and cut to
/// [`MAX_QUOTED_CHARS`] characters, so that no input can make an error text (and the
/// reply and dead letter carrying it) outgrow the payload limit.
pub fn quote(value: &str) -> String {
    match value.char_indices().nth(MAX_QUOTED_CHARS) {
        None => format!("{value:?}"),
        Some((cut, _)) => format!("{:?}…", &value[..cut]),
    }
}

/// The start of a response body for an error message: at most `max` bytes, cut on a
/// character boundary, lossy for non-UTF-8 bytes.
pub fn excerpt(body: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(max)]);
    let mut text = text.into_owned();
    if body.len() > max {
        text.push('…');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_whole_envelope_is_the_request() {
        let mut letter: DeadLetter = serde_json::from_str(
            r#"{"pool":"p","error":{"code":"internal","message":"m"},"envelope":{"url":"u"}}"#,
        )
        .expect("a dead letter");
        assert_eq!(
            letter.whole_request().map(RawValue::get),
            Some(r#"{"url":"u"}"#)
        );
        letter.truncated = true;
        assert!(letter.whole_request().is_none());
        letter.truncated = false;
        letter.envelope = None;
        assert!(letter.whole_request().is_none());
    }

    #[test]
    fn body_encoding() {
        let text = ReplyBody::encode(b"hello".to_vec());
        assert_eq!(text.body.as_deref(), Some("hello"));
        let empty = ReplyBody::encode(Vec::new());
        assert_eq!(empty.body.as_deref(), Some(""));
        let binary = ReplyBody::encode(vec![0xff, 0, 1]);
        assert_eq!(binary.body_base64.as_deref(), Some("/wAB"));
        assert_eq!(binary.decode().expect("base64"), vec![0xff, 0, 1]);
    }

    #[test]
    fn reply_json_shape() {
        let reply = Reply::error(
            "order-42".into(),
            ErrorBody {
                code: ErrorCode::Denied,
                message: "no".into(),
                status: None,
            },
            0,
            1,
            serde_json::value::to_raw_value(&serde_json::json!({"order": 42})).ok(),
        );
        let json = serde_json::to_string(&reply).expect("serializes");
        assert_eq!(
            json,
            r#"{"v":1,"id":"order-42","outcome":"error","error":{"code":"denied","message":"no"},"attempts":0,"duration_ms":1,"metadata":{"order":42}}"#
        );
        let back: Reply = serde_json::from_str(&json).expect("parses");
        assert_eq!(back.error.map(|e| e.code), Some(ErrorCode::Denied));
    }

    #[test]
    fn quote_cuts_long_values() {
        assert_eq!(quote("GET"), r#""GET""#);
        let long = "\"".repeat(300_000);
        let quoted = quote(&long);
        // each `"` is escaped as two characters, plus the quotes and the ellipsis
        assert!(quoted.len() <= 2 * MAX_QUOTED_CHARS + 8, "{}", quoted.len());
        assert!(quoted.ends_with('…'));
    }

    #[test]
    fn excerpt_cuts_and_marks() {
        assert_eq!(excerpt(b"short", 10), "short");
        assert_eq!(excerpt(b"0123456789abc", 10), "0123456789…");
    }
}
