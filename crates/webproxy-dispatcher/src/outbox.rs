//! The messages the dispatcher publishes (replies and dead letters), built by pure code
//! that keeps each within the server's `max_payload`.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use serde_json::value::RawValue;
use webproxy_protocol::{
    AttemptRecord, DeadLetter, ErrorBody, ErrorCode, Reply, ReplyBody, collect_headers,
};
use webproxy_worker::HttpResponse;

/// Room kept for NATS headers (message id, outcome, generation, trace context) when a
/// payload is checked against `max_payload`.
pub const HEADER_ALLOWANCE: usize = 4 * 1024;

/// Room kept in a reply envelope beside the base64 body: echoed metadata (at most
/// 64 KiB), the response headers and the envelope's own fields.
pub const REPLY_ENVELOPE_ALLOWANCE: usize = 96 * 1024;

/// The largest `max_response_bytes` whose base64 encoding still fits in a reply.
pub fn max_response_bytes_for(max_payload: usize) -> usize {
    max_payload.saturating_sub(REPLY_ENVELOPE_ALLOWANCE + HEADER_ALLOWANCE) / 4 * 3
}

/// What a conversation's reply says, before it is encoded.
#[derive(Debug)]
pub struct ReplyContext<'a> {
    pub id: &'a str,
    pub attempts: u32,
    pub duration_ms: u64,
    pub metadata: Option<&'a RawValue>,
}

/// A reply, encoded.
#[derive(Debug, Clone)]
pub struct EncodedReply {
    pub payload: Bytes,
    /// The error the reply carries, if it is an error reply.
    pub error: Option<ErrorBody>,
}

fn encode(reply: &Reply) -> Bytes {
    // A Reply holds only strings, numbers and raw JSON, which always serialize.
    Bytes::from(serde_json::to_vec(reply).unwrap_or_default())
}

/// An error reply.
pub fn error_reply(context: &ReplyContext<'_>, error: ErrorBody) -> EncodedReply {
    let reply = Reply::error(
        context.id.to_string(),
        error.clone(),
        context.attempts,
        context.duration_ms,
        context.metadata.map(RawValue::to_owned),
    );
    EncodedReply {
        payload: encode(&reply),
        error: Some(error),
    }
}

/// A response reply, or `response_too_large` without the body when the encoded reply
/// would not fit in `max_payload`.
pub fn response_reply(
    context: &ReplyContext<'_>,
    response: &HttpResponse,
    max_payload: usize,
) -> EncodedReply {
    let headers = collect_headers(
        response
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.clone())),
    );
    let reply = Reply::response(
        context.id.to_string(),
        response.status,
        headers,
        ReplyBody::encode(response.body.to_vec()),
        context.attempts,
        context.duration_ms,
        context.metadata.map(RawValue::to_owned),
    );
    let payload = encode(&reply);
    if payload.len() + HEADER_ALLOWANCE > max_payload {
        let error = ErrorBody {
            code: ErrorCode::ResponseTooLarge,
            message: format!(
                "the upstream answered {} with {} bytes of body and headers, too large for a reply within the server's max_payload of {max_payload} bytes",
                response.status,
                payload.len()
            ),
            status: Some(response.status),
        };
        return error_reply(context, error);
    }
    EncodedReply {
        payload,
        error: None,
    }
}

/// A dead letter for a conversation that ended in `error`. The original payload is kept
/// as `envelope` when it is a JSON object and as `payload_base64` otherwise; when it
/// would make the dead letter exceed `max_payload`, a base64 prefix of it is kept and
/// the letter says `truncated`.
pub fn dead_letter(
    pool: &str,
    id: Option<&str>,
    generation: u64,
    error: ErrorBody,
    payload: &[u8],
    attempts: Vec<AttemptRecord>,
    max_payload: usize,
) -> Bytes {
    let envelope = std::str::from_utf8(payload)
        .ok()
        .filter(|text| text.trim_start().starts_with('{'))
        .and_then(|text| RawValue::from_string(text.to_string()).ok());
    let mut letter = DeadLetter {
        pool: pool.to_string(),
        id: id.map(str::to_string),
        generation,
        error,
        payload_base64: match envelope {
            Some(_) => None,
            None => Some(BASE64.encode(payload)),
        },
        envelope,
        attempts,
        truncated: false,
    };
    let encoded = serde_json::to_vec(&letter).unwrap_or_default();
    let budget = max_payload.saturating_sub(HEADER_ALLOWANCE);
    if encoded.len() <= budget {
        return Bytes::from(encoded);
    }
    let overhead = encoded.len()
        - letter.envelope.as_ref().map_or(0, |e| e.get().len())
        - letter.payload_base64.as_ref().map_or(0, String::len);
    // Room for the `payload_base64` and `truncated` fields that replace `envelope`.
    let keep = budget.saturating_sub(overhead + 64) / 4 * 3;
    letter.envelope = None;
    letter.payload_base64 = Some(BASE64.encode(&payload[..keep.min(payload.len())]));
    letter.truncated = true;
    Bytes::from(serde_json::to_vec(&letter).unwrap_or_default())
}

/// `invalid_request` with a message naming the field.
pub fn invalid_request(field: &str, message: &str) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::InvalidRequest,
        message: format!("invalid field `{field}`: {message}"),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use webproxy_protocol::Outcome;

    use super::*;

    fn context() -> ReplyContext<'static> {
        ReplyContext {
            id: "a",
            attempts: 1,
            duration_ms: 3,
            metadata: None,
        }
    }

    fn response(body: Vec<u8>) -> HttpResponse {
        HttpResponse {
            status: 200,
            headers: vec![("x-a".into(), "1".into()), ("x-a".into(), "2".into())],
            body: body.into(),
        }
    }

    #[test]
    fn derived_response_limit_fits_one_mebibyte() {
        let max = max_response_bytes_for(1024 * 1024);
        assert!(max > 650 * 1024, "{max}");
        assert!(max / 3 * 4 + REPLY_ENVELOPE_ALLOWANCE + HEADER_ALLOWANCE <= 1024 * 1024);
    }

    #[test]
    fn response_reply_fits_or_becomes_too_large() {
        let fits = response_reply(&context(), &response(b"ok".to_vec()), 1024 * 1024);
        assert!(fits.error.is_none());
        let reply: Reply = serde_json::from_slice(&fits.payload).expect("json");
        assert_eq!(reply.outcome, Outcome::Response);
        assert_eq!(reply.body.body.as_deref(), Some("ok"));

        let big = response_reply(&context(), &response(vec![b'x'; 10_000]), 8 * 1024);
        assert_eq!(
            big.error.as_ref().map(|e| e.code),
            Some(ErrorCode::ResponseTooLarge)
        );
        assert!(big.payload.len() < 8 * 1024);
    }

    #[test]
    fn dead_letter_keeps_envelope_or_payload() {
        let letter: DeadLetter = serde_json::from_slice(&dead_letter(
            "default",
            Some("a"),
            0,
            invalid_request("method", "is required"),
            br#"{"id":"a"}"#,
            Vec::new(),
            1024 * 1024,
        ))
        .expect("json");
        assert_eq!(
            letter.envelope.map(|e| e.get().to_string()).as_deref(),
            Some(r#"{"id":"a"}"#)
        );
        assert!(!letter.truncated);

        let letter: DeadLetter = serde_json::from_slice(&dead_letter(
            "default",
            None,
            0,
            invalid_request("payload", "not json"),
            &[0xff, 0x00],
            Vec::new(),
            1024 * 1024,
        ))
        .expect("json");
        assert_eq!(letter.payload_base64.as_deref(), Some("/wA="));
    }

    #[test]
    fn oversized_dead_letter_is_truncated_to_fit() {
        let payload = format!(r#"{{"id":"a","body":"{}"}}"#, "x".repeat(100_000));
        let encoded = dead_letter(
            "default",
            Some("a"),
            0,
            invalid_request("method", "is required"),
            payload.as_bytes(),
            Vec::new(),
            32 * 1024,
        );
        assert!(
            encoded.len() <= 32 * 1024 - HEADER_ALLOWANCE,
            "{}",
            encoded.len()
        );
        let letter: DeadLetter = serde_json::from_slice(&encoded).expect("json");
        assert!(letter.truncated);
        assert!(letter.envelope.is_none());
        assert!(letter.payload_base64.is_some());
    }
}
