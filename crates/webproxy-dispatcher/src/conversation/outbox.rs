//! The messages the dispatcher publishes (replies and dead letters), built by pure code
//! that keeps each within the server's `max_payload`.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use serde_json::value::RawValue;
use webproxy_protocol::hex_sha256 as sha256_hex;
use webproxy_protocol::{
    BodyObject, DeadLetter, ErrorBody, ErrorCode, Origin, Reply, ReplyBody, collect_headers,
    excerpt,
};
use webproxy_worker::HttpResponse;

use crate::conversation::hop::AttemptHistory;

/// Room kept for NATS headers (message id, outcome, generation, trace context) when a
/// payload is checked against `max_payload`.
pub(crate) const HEADER_ALLOWANCE: usize = 4 * 1024;

/// Room kept in a reply envelope beside the base64 body: echoed metadata (at most
/// 64 KiB), the response headers and the envelope's own fields.
pub(crate) const REPLY_ENVELOPE_ALLOWANCE: usize = 96 * 1024;

/// The largest `max_response_bytes` whose base64 encoding still fits in a reply.
pub(crate) fn max_response_bytes_for(max_payload: usize) -> usize {
    max_payload.saturating_sub(REPLY_ENVELOPE_ALLOWANCE + HEADER_ALLOWANCE) / 4 * 3
}

/// What a conversation's reply says, before it is encoded.
#[derive(Debug)]
pub(crate) struct ReplyContext<'a> {
    pub(crate) id: &'a str,
    pub(crate) attempts: u32,
    pub(crate) duration_ms: u64,
    pub(crate) metadata: Option<&'a RawValue>,
    /// The server's `max_payload`: every reply is built to fit it.
    pub(crate) max_payload: usize,
}

/// The most characters of an error message: its quoted values are cut already, and
/// this bounds what they are quoted in.
pub(crate) const MAX_ERROR_MESSAGE_CHARS: usize = 1000;

/// `error` with its message cut to [`MAX_ERROR_MESSAGE_CHARS`].
fn bounded(mut error: ErrorBody) -> ErrorBody {
    if let Some((cut, _)) = error.message.char_indices().nth(MAX_ERROR_MESSAGE_CHARS) {
        error.message.truncate(cut);
        error.message.push('…');
    }
    error
}

/// A reply, encoded.
#[derive(Debug, Clone)]
pub(crate) struct EncodedReply {
    pub(crate) payload: Bytes,
    /// The error the reply carries, if it is an error reply.
    pub(crate) error: Option<ErrorBody>,
}

fn encode(reply: &Reply) -> Bytes {
    // A Reply holds only strings, numbers and raw JSON, which always serialize.
    Bytes::from(serde_json::to_vec(reply).unwrap_or_default())
}

/// An error reply. One that would still not fit `max_payload` (echoed metadata near
/// its limit on a small server) is replaced by [`minimal_reply`].
pub(crate) fn error_reply(context: &ReplyContext<'_>, error: ErrorBody) -> EncodedReply {
    let error = bounded(error);
    let reply = Reply::error(
        context.id.to_string(),
        error.clone(),
        context.attempts,
        context.duration_ms,
        context.metadata.map(RawValue::to_owned),
    );
    let payload = encode(&reply);
    if payload.len() + HEADER_ALLOWANCE > context.max_payload {
        return minimal_reply(context, error.code);
    }
    EncodedReply {
        payload,
        error: Some(error),
    }
}

/// The smallest error reply: the id (at most a few hundred characters), the code and a
/// fixed message, no metadata. What replaces any reply that cannot be published.
pub(crate) fn minimal_reply(context: &ReplyContext<'_>, code: ErrorCode) -> EncodedReply {
    let error = ErrorBody {
        code,
        message: format!(
            "the full {} reply did not fit within the server's max_payload; see the dead letter",
            code.as_str()
        ),
        status: None,
    };
    let reply = Reply::error(
        context.id.to_string(),
        error.clone(),
        context.attempts,
        context.duration_ms,
        None,
    );
    EncodedReply {
        payload: encode(&reply),
        error: Some(error),
    }
}

/// A response reply, or `response_too_large` without the body when the encoded reply
/// would not fit in `max_payload`.
pub(crate) fn response_reply(context: &ReplyContext<'_>, response: &HttpResponse) -> EncodedReply {
    reply_of(context, response, None)
}

/// The reply of a response whose body is `stored`: the reply names the object (the
/// bytes in `response` are only the stored body's prefix).
pub(crate) fn stored_response_reply(
    context: &ReplyContext<'_>,
    response: &HttpResponse,
    stored: BodyObject,
) -> EncodedReply {
    reply_of(context, response, Some(stored))
}

fn reply_of(
    context: &ReplyContext<'_>,
    response: &HttpResponse,
    stored: Option<BodyObject>,
) -> EncodedReply {
    let max_payload = context.max_payload;
    let headers = collect_headers(
        response
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.clone())),
    );
    let body = match stored {
        Some(_) => ReplyBody::default(),
        None => ReplyBody::encode(response.body.to_vec()),
    };
    let mut reply = Reply::response(
        context.id.to_string(),
        response.status,
        headers,
        body,
        context.attempts,
        context.duration_ms,
        context.metadata.map(RawValue::to_owned),
    );
    reply.body_object = stored;
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

/// What a dead letter records.
#[derive(Debug)]
pub(crate) struct LetterParts<'a> {
    pub(crate) pool: &'a str,
    pub(crate) id: Option<&'a str>,
    pub(crate) origin: Option<&'a Origin>,
    pub(crate) caller: Option<&'a str>,
    pub(crate) msg_id_sha256: Option<&'a str>,
    pub(crate) generation: u64,
    pub(crate) error: ErrorBody,
    pub(crate) payload: &'a [u8],
    pub(crate) attempts: &'a AttemptHistory,
}

/// The most of a payload that is not a JSON object a dead letter keeps: enough to
/// see what it was, while a flood of large undecodable payloads costs the dead-letter
/// stream 4 KiB each rather than up to `max_payload`.
pub(crate) const UNDECODABLE_KEPT: usize = 4 * 1024;

/// A dead letter for a conversation that ended in `error`. The original payload is kept
/// as `envelope` when it is a JSON object (whole: `dead replay` republishes it); when it
/// is not, its first [`UNDECODABLE_KEPT`] bytes are kept as `payload_base64`, with its
/// length and SHA-256. When the letter would exceed `max_payload`, a base64 prefix of
/// the payload is kept; either cut makes the letter say `truncated`.
pub(crate) fn dead_letter(parts: LetterParts<'_>, max_payload: usize) -> Bytes {
    let payload = parts.payload;
    let envelope = std::str::from_utf8(payload)
        .ok()
        .filter(|text| text.trim_start().starts_with('{'))
        .and_then(|text| RawValue::from_string(text.to_string()).ok());
    let undecodable = envelope.is_none();
    let kept = if undecodable {
        &payload[..payload.len().min(UNDECODABLE_KEPT)]
    } else {
        payload
    };
    let mut letter = DeadLetter {
        pool: parts.pool.to_string(),
        id: parts.id.map(str::to_string),
        generation: parts.generation,
        origin: parts.origin.map(Origin::to_string),
        caller: parts.caller.map(str::to_string),
        msg_id_sha256: parts.msg_id_sha256.map(str::to_string),
        error: bounded(parts.error),
        payload_base64: undecodable.then(|| BASE64.encode(kept)),
        payload_len: undecodable.then(|| length(payload)),
        payload_sha256: undecodable.then(|| sha256_hex(payload)),
        envelope,
        attempts: parts.attempts.kept.clone(),
        attempts_dropped: parts.attempts.dropped,
        truncated: kept.len() < payload.len(),
    };
    let encoded = serde_json::to_vec(&letter).unwrap_or_default();
    let budget = max_payload.saturating_sub(HEADER_ALLOWANCE);
    if encoded.len() <= budget {
        return Bytes::from(encoded);
    }
    // What identifies the payload once only its start is kept, counted in the
    // overhead below.
    letter.payload_len = Some(length(payload));
    letter.payload_sha256 = Some(sha256_hex(payload));
    let encoded = serde_json::to_vec(&letter).unwrap_or_default();
    let overhead = encoded.len()
        - letter.envelope.as_ref().map_or(0, |e| e.get().len())
        - letter.payload_base64.as_ref().map_or(0, String::len);
    // Room for the `payload_base64` and `truncated` fields that replace `envelope`.
    let keep = budget.saturating_sub(overhead + 64) / 4 * 3;
    letter.envelope = None;
    letter.payload_base64 = Some(BASE64.encode(&kept[..keep.min(kept.len())]));
    letter.truncated = true;
    Bytes::from(serde_json::to_vec(&letter).unwrap_or_default())
}

fn length(payload: &[u8]) -> u64 {
    u64::try_from(payload.len()).unwrap_or(u64::MAX)
}

/// `invalid_request` with a message naming the field.
pub(crate) fn invalid_request(field: &str, message: &str) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::InvalidRequest,
        message: format!("invalid field `{field}`: {message}"),
        status: None,
    }
}

/// How much of an upstream body an error message quotes.
pub(crate) const BODY_EXCERPT_BYTES: usize = 256;

/// The error for a response whose body exceeds `limit` bytes: `max_large_body` for a
/// request that set `large_body`, else `max_response_bytes`.
pub(crate) fn too_large(status: u16, limit: usize, large_body: bool) -> ErrorBody {
    let key = if large_body {
        "max_large_body"
    } else {
        "max_response_bytes"
    };
    ErrorBody {
        code: ErrorCode::ResponseTooLarge,
        message: format!(
            "the upstream answered {status} with a body larger than {limit} bytes ([outbound] {key})"
        ),
        status: Some(status),
    }
}

/// The error for a response that a response rule classifies as an error.
pub(crate) fn upstream_error(response: &HttpResponse) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::UpstreamError,
        message: format!(
            "the upstream answered {}: {}",
            response.status,
            excerpt(&response.body, BODY_EXCERPT_BYTES)
        ),
        status: Some(response.status),
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
            max_payload: 1024 * 1024,
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
        let fits = response_reply(&context(), &response(b"ok".to_vec()));
        assert!(fits.error.is_none());
        let reply: Reply = serde_json::from_slice(&fits.payload).expect("json");
        assert_eq!(reply.outcome, Outcome::Response);
        assert_eq!(reply.body.body.as_deref(), Some("ok"));

        let small = ReplyContext {
            max_payload: 8 * 1024,
            ..context()
        };
        let big = response_reply(&small, &response(vec![b'x'; 10_000]));
        assert_eq!(
            big.error.as_ref().map(|e| e.code),
            Some(ErrorCode::ResponseTooLarge)
        );
        assert!(big.payload.len() < 8 * 1024);
    }

    fn parts<'a>(
        id: Option<&'a str>,
        error: ErrorBody,
        payload: &'a [u8],
        attempts: &'a AttemptHistory,
    ) -> LetterParts<'a> {
        LetterParts {
            pool: "default",
            id,
            origin: None,
            caller: None,
            msg_id_sha256: None,
            generation: 0,
            error,
            payload,
            attempts,
        }
    }

    #[test]
    fn dead_letter_keeps_envelope_or_payload() {
        let none = AttemptHistory::default();
        let origin = Origin::new("WEBPROXY_POOL_DEFAULT", 9);
        let letter: DeadLetter = serde_json::from_slice(&dead_letter(
            LetterParts {
                origin: Some(&origin),
                ..parts(
                    Some("a"),
                    invalid_request("method", "is required"),
                    br#"{"id":"a"}"#,
                    &none,
                )
            },
            1024 * 1024,
        ))
        .expect("json");
        assert_eq!(
            letter.envelope.map(|e| e.get().to_string()).as_deref(),
            Some(r#"{"id":"a"}"#)
        );
        assert_eq!(letter.origin.as_deref(), Some("WEBPROXY_POOL_DEFAULT:9"));
        assert!(!letter.truncated);

        let letter: DeadLetter = serde_json::from_slice(&dead_letter(
            parts(
                None,
                invalid_request("payload", "not json"),
                &[0xff, 0x00],
                &none,
            ),
            1024 * 1024,
        ))
        .expect("json");
        assert_eq!(letter.payload_base64.as_deref(), Some("/wA="));
        assert_eq!(letter.payload_len, Some(2));
        assert!(!letter.truncated);
    }

    /// Issue 30, point 4: a flood of large undecodable payloads costs the dead-letter
    /// stream 4 KiB a letter; the letter still identifies the payload.
    #[test]
    fn an_undecodable_payload_keeps_its_first_4_kib_its_length_and_hash() {
        let none = AttemptHistory::default();
        let payload = vec![0xffu8; 1024 * 1024];
        let encoded = dead_letter(
            parts(
                None,
                invalid_request("payload", "not json"),
                &payload,
                &none,
            ),
            8 * 1024 * 1024,
        );
        assert!(encoded.len() < 8 * 1024, "{} bytes", encoded.len());
        let letter: DeadLetter = serde_json::from_slice(&encoded).expect("json");
        let kept = BASE64
            .decode(letter.payload_base64.as_deref().expect("kept"))
            .expect("base64");
        assert_eq!(kept, payload[..UNDECODABLE_KEPT]);
        assert_eq!(letter.payload_len, Some(1024 * 1024));
        assert_eq!(letter.payload_sha256, Some(sha256_hex(&payload)));
        assert_eq!(letter.payload_sha256.as_deref().map(str::len), Some(64));
        assert!(letter.truncated);
        // A request that parsed as an object (denied, say) keeps its whole envelope,
        // which `dead replay --include-denied` republishes.
        let big = format!(r#"{{"id":"a","body":"{}"}}"#, "x".repeat(100_000));
        let letter: DeadLetter = serde_json::from_slice(&dead_letter(
            parts(
                Some("a"),
                invalid_request("method", "bad"),
                big.as_bytes(),
                &none,
            ),
            1024 * 1024,
        ))
        .expect("json");
        assert_eq!(
            letter.whole_request().map(|e| e.get().len()),
            Some(big.len())
        );
        assert_eq!(letter.payload_len, None);
    }

    #[test]
    fn oversized_dead_letter_is_truncated_to_fit() {
        let payload = format!(r#"{{"id":"a","body":"{}"}}"#, "x".repeat(100_000));
        // an error text that quotes a huge value is cut as well
        let error = invalid_request("method", &"\"".repeat(300_000));
        let none = AttemptHistory::default();
        let encoded = dead_letter(
            parts(Some("a"), error, payload.as_bytes(), &none),
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

    #[test]
    fn an_error_reply_always_fits() {
        let metadata =
            RawValue::from_string(format!("\"{}\"", "m".repeat(60_000))).expect("json string");
        let tight = ReplyContext {
            metadata: Some(&metadata),
            max_payload: 32 * 1024,
            ..context()
        };
        let reply = error_reply(&tight, invalid_request("method", &"\"".repeat(300_000)));
        assert!(reply.payload.len() + HEADER_ALLOWANCE <= 32 * 1024);
        assert_eq!(reply.error.map(|e| e.code), Some(ErrorCode::InvalidRequest));
        // with room, the error text is kept, cut to its bound
        let roomy = error_reply(&context(), invalid_request("method", &"x".repeat(5000)));
        let message = roomy.error.map(|e| e.message).unwrap_or_default();
        assert_eq!(message.chars().count(), MAX_ERROR_MESSAGE_CHARS + 1);
    }
}
