//! Taking a request back: a core NATS request to `<prefix>.cancel` (a caller, showing
//! the message id it published with) or `<prefix>.admin.cancel` (an operator, by origin
//! alone), answered with what became of the cancel. The conversation's outcome still
//! arrives as its reply: `cancelled`, or the response of an attempt that finished first.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A caller's request on `<prefix>.cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CancelRequest {
    /// The request envelope's id.
    pub id: String,
    /// The conversation's origin, `<STREAM>:<seq>`.
    pub origin: String,
    /// The `Nats-Msg-Id` the request was published with: the capability.
    pub msg_id: String,
}

/// An operator's request on `<prefix>.admin.cancel`: the origin alone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AdminCancelRequest {
    /// The conversation's origin, `<STREAM>:<seq>`.
    pub origin: String,
}

/// What became of a cancel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CancelState {
    /// Recorded: the conversation's next delivery ends it, an attempt in flight is
    /// dropped, and its reply says `cancelled` (or is the response of an attempt that
    /// finished first).
    Recorded,
    /// The conversation has its final reply already, which stays as it is.
    Finished,
    /// No such conversation, or a message id that is not the publisher's: one answer
    /// for both, byte for byte.
    Unknown,
}

impl CancelState {
    pub fn as_str(self) -> &'static str {
        match self {
            CancelState::Recorded => "recorded",
            CancelState::Finished => "finished",
            CancelState::Unknown => "unknown",
        }
    }
}

/// Why a cancel got no answer of its state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CancelErrorCode {
    /// The request is not JSON of the documented shape.
    InvalidRequest,
    /// The service is answering as many cancels as it may: ask again.
    Busy,
    /// The service could not look up or record the cancel: nothing was recorded, ask
    /// again.
    Internal,
}

impl CancelErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            CancelErrorCode::InvalidRequest => "invalid_request",
            CancelErrorCode::Busy => "busy",
            CancelErrorCode::Internal => "internal",
        }
    }
}

/// Why a cancel got no answer of its state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CancelError {
    pub code: CancelErrorCode,
    pub message: String,
}

/// The answer to a cancel: its `cancel` state, or an `error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CancelAnswer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<CancelState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CancelError>,
}

impl CancelAnswer {
    /// The answer naming `state`.
    pub fn state(state: CancelState) -> CancelAnswer {
        CancelAnswer {
            cancel: Some(state),
            error: None,
        }
    }

    /// The answer that refuses with `code`.
    pub fn error(code: CancelErrorCode, message: impl Into<String>) -> CancelAnswer {
        CancelAnswer {
            cancel: None,
            error: Some(CancelError {
                code,
                message: message.into(),
            }),
        }
    }

    /// The answer's bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_the_documented_bytes() {
        assert_eq!(
            CancelAnswer::state(CancelState::Unknown).encode(),
            br#"{"cancel":"unknown"}"#
        );
        assert_eq!(
            CancelAnswer::state(CancelState::Recorded).encode(),
            br#"{"cancel":"recorded"}"#
        );
        let refused = CancelAnswer::error(CancelErrorCode::Busy, "ask again").encode();
        assert_eq!(
            refused,
            br#"{"error":{"code":"busy","message":"ask again"}}"#
        );
    }
}
