//! webproxy's wire protocol v1: the request, reply and dead-letter envelopes, their
//! validation, and the subject and stream names. Pure types and functions, no I/O.
//!
//! Other teams' clients are written against these shapes, so every field name and
//! every header name here is part of a published contract.

mod body_get;
mod cancel;
mod capability;
mod envelope;
mod headers;
mod name;
mod origin;
mod reply;
pub mod schema;
mod subjects;
mod upload;

pub use body_get::{BodyGetCode, BodyGetError, BodyGetRequest, body_header};
pub use cancel::{
    AdminCancelRequest, CancelAnswer, CancelError, CancelErrorCode, CancelRequest, CancelState,
};
pub use capability::{capability_sha256, hex_sha256, is_capability};
pub use envelope::{
    InvalidEnvelope, Method, ParseError, Request, RequestEnvelope, canonical_url, parse_request,
    path_parameter,
};
pub use headers::{HeaderValue, Headers, collect_headers, is_hop_by_hop};
pub use name::InvalidName;
pub use origin::Origin;
pub use reply::{
    AttemptRecord, BodyObject, DeadLetter, ErrorBody, ErrorCode, Outcome, Reply, ReplyBody,
    excerpt, quote,
};
pub use subjects::{
    CALLER_PLACEHOLDER, DEFAULT_REPLY_TO_ALLOW, SERVICE_INBOX, Subjects, subject_matches,
    validate_caller, validate_id, validate_pool_name, validate_prefix, validate_subject_literal,
    validate_subject_pattern,
};
pub use upload::{
    BodyPutAnswer, BodyPutError, BodyPutRequest, UploadRef, is_digest, is_upload_name,
};

/// The protocol version this crate speaks; replies carry it as `"v": 1`.
pub const PROTOCOL_VERSION: u8 = 1;

/// The largest `metadata` value a request may carry, serialized.
pub const MAX_METADATA_BYTES: usize = 64 * 1024;

/// NATS header names that are part of the protocol.
pub mod header {
    /// JetStream's deduplication id. Clients send a fresh random one per conversation
    /// and reuse it only when they retry that same publish. The service puts the stored
    /// reply's, `<STREAM>:<seq>:<generation>:reply`, on the copy to a custom `reply_to`
    /// too, so a caller's own stream there stores each reply once.
    pub const MSG_ID: &str = "Nats-Msg-Id";
    /// `response` or `error`, on every reply.
    pub const OUTCOME: &str = "Webproxy-Outcome";
    /// The conversation's generation: 0 for the caller's request, +1 per replay.
    pub const GENERATION: &str = "Webproxy-Generation";
    /// The conversation's origin, `<STREAM>:<seq>`, on replies and dead letters. A
    /// caller keeps only the replies whose origin is its own publish's.
    pub const ORIGIN: &str = "Webproxy-Origin";
    /// On a stored reply: the `reply_to` the request named, the only subject the
    /// service ever copies that stored reply to again.
    pub const REPLY_TO: &str = "Webproxy-Reply-To";
    /// On a stored reply: the step of the delivery that stored it (0 for the caller's
    /// own message, 1 and on for hops). Only a redelivery of that same step copies the
    /// stored reply again; an earlier step's late redelivery does not.
    pub const STEP: &str = "Webproxy-Step";
    /// The conversation id, on dead letters.
    pub const ID: &str = "Webproxy-Id";
    /// The final error code, on dead letters.
    pub const ERROR_CODE: &str = "Webproxy-Error-Code";
    /// The service's own hop state (origin, generation, step, attempts, times), on its
    /// hop and retry subjects only. Ignored on a caller's request subject.
    pub const HOP: &str = "Webproxy-Hop";
    /// On a stored body and a stored reply: the SHA-256 of the `Nats-Msg-Id` the
    /// request was published with, the capability a caller shows to read the body
    /// through the service or to cancel the conversation.
    pub const MSG_ID_SHA256: &str = "Webproxy-Msg-Id-Sha256";
    /// The prefix of every header the protocol defines: a caller's are ignored.
    pub const PREFIX: &str = "Webproxy-";
}
