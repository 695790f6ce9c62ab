//! webproxy's wire protocol v1: the request, reply and dead-letter envelopes, their
//! validation, and the subject and stream names. Pure types and functions, no I/O.
//!
//! Other teams' clients are written against these shapes, so every field name and
//! every header name here is part of a published contract.

mod envelope;
mod headers;
mod origin;
mod reply;
pub mod schema;
mod subjects;

pub use envelope::{InvalidEnvelope, Method, ParseError, Request, RequestEnvelope, parse_request};
pub use headers::{HeaderValue, Headers, collect_headers, is_hop_by_hop};
pub use origin::Origin;
pub use reply::{
    AttemptRecord, DeadLetter, ErrorBody, ErrorCode, Outcome, Reply, ReplyBody, excerpt,
};
pub use subjects::{
    InvalidName, Subjects, subject_matches, validate_id, validate_pool_name, validate_prefix,
    validate_subject_literal, validate_subject_pattern,
};

/// The protocol version this crate speaks; replies carry it as `"v": 1`.
pub const PROTOCOL_VERSION: u8 = 1;

/// The largest `metadata` value a request may carry, serialized.
pub const MAX_METADATA_BYTES: usize = 64 * 1024;

/// NATS header names that are part of the protocol.
pub mod header {
    /// JetStream's deduplication id. Clients send a fresh random one per conversation
    /// and reuse it only when they retry that same publish.
    pub const MSG_ID: &str = "Nats-Msg-Id";
    /// `response` or `error`, on every reply.
    pub const OUTCOME: &str = "Webproxy-Outcome";
    /// The conversation's generation: 0 for the caller's request, +1 per replay.
    pub const GENERATION: &str = "Webproxy-Generation";
    /// The conversation's origin, `<STREAM>:<seq>`, on replies and dead letters. A
    /// caller keeps only the replies whose origin is its own publish's.
    pub const ORIGIN: &str = "Webproxy-Origin";
    /// The conversation id, on dead letters.
    pub const ID: &str = "Webproxy-Id";
    /// The final error code, on dead letters.
    pub const ERROR_CODE: &str = "Webproxy-Error-Code";
    /// Unix time in milliseconds of the caller's original publish, carried on
    /// every hop so that queue waits count from it.
    pub const FIRST_PUBLISHED: &str = "Webproxy-First-Published";
    /// The attempts made so far (a JSON array of attempt records), on parked retries.
    pub const ATTEMPTS: &str = "Webproxy-Attempts";
    /// Unix time in milliseconds when a parked retry is due.
    pub const DUE: &str = "Webproxy-Due";
}
