//! Between HTTP and the protocol (pure): which request headers go into the envelope
//! and which the gateway takes for itself, and how a reply becomes an HTTP answer
//! (an error outcome's status, and its small JSON body).

use axum::http::HeaderMap;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::json;
use webproxy_protocol::{
    CancelState, ErrorCode, Headers, Outcome, Reply, collect_headers, is_hop_by_hop,
};

/// The caller's deadline, an RFC 3339 date-time; it becomes the envelope's `deadline`.
pub(crate) const DEADLINE: &str = "webproxy-deadline";
/// The answer's conversation id, attempts and outcome, on every answer.
pub(crate) const ID: &str = "webproxy-id";
pub(crate) const ATTEMPTS: &str = "webproxy-attempts";
pub(crate) const OUTCOME: &str = "webproxy-outcome";
/// `Webproxy-Outcome` of a 202: the conversation goes on.
pub(crate) const PENDING: &str = "pending";
/// W3C trace context: it travels on the NATS message, where the service reads it.
const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// An HTTP request's headers, split: those for the envelope and what the gateway
/// reads itself.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Split {
    pub(crate) headers: Headers,
    pub(crate) deadline: Option<String>,
    /// `traceparent` and `tracestate`, for the NATS message.
    pub(crate) trace: Vec<(String, String)>,
    /// `Prefer: respond-async`: answer 202 at once.
    pub(crate) respond_async: bool,
}

/// Splits `headers`. Not forwarded: hop-by-hop headers (and those `Connection`
/// names), `Host`, `Proxy-Authorization`, the route's token header, the deadline,
/// the trace context (it goes on the NATS message) and a `Prefer` asking for
/// `respond-async`. A value that is not text is refused (400).
pub(crate) fn split(headers: &HeaderMap, token_header: &str) -> Result<Split, String> {
    let connection: Vec<String> = headers
        .get_all("connection")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    let mut split = Split::default();
    let mut kept = Vec::new();
    for (name, value) in headers {
        let name = name.as_str();
        let value = value
            .to_str()
            .map_err(|_| format!("the value of header {name} is not visible ASCII text"))?;
        if is_hop_by_hop(name)
            || name == "proxy-authorization"
            || name == token_header
            || connection.iter().any(|c| c == name)
        {
            continue;
        }
        if name == DEADLINE {
            let parsed =
                time::OffsetDateTime::parse(value, &time::format_description::well_known::Rfc3339);
            if parsed.is_err() {
                return Err(format!(
                    "Webproxy-Deadline {value:?} is not an RFC 3339 date-time"
                ));
            }
            split.deadline = Some(value.to_string());
        } else if TRACE_HEADERS.contains(&name) {
            split.trace.push((name.to_string(), value.to_string()));
        } else if name == "prefer" && prefers_async(value) {
            split.respond_async = true;
        } else {
            kept.push((name, value.to_string()));
        }
    }
    split.headers = collect_headers(kept);
    Ok(split)
}

/// Whether a `Prefer` value holds the preference `respond-async` (RFC 7240).
fn prefers_async(value: &str) -> bool {
    value.split(',').any(|preference| {
        preference
            .split(';')
            .next()
            .is_some_and(|token| token.trim().eq_ignore_ascii_case("respond-async"))
    })
}

/// An HTTP answer, before it is written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
    /// The size of a stored body (a reply's `body_object`), which the gateway streams
    /// from the store in place of `body`.
    pub(crate) stored: Option<u64>,
    /// `Webproxy-Outcome`: `response`, `error` or `pending`.
    pub(crate) outcome: &'static str,
    /// The metrics label: `response`, the error code, or the gateway's own code.
    pub(crate) label: &'static str,
    pub(crate) attempts: u32,
}

/// The status an error outcome is answered with.
pub(crate) fn error_status(code: ErrorCode, status: Option<u16>) -> u16 {
    match code {
        ErrorCode::Denied => 403,
        ErrorCode::InvalidRequest => 400,
        ErrorCode::Expired => 504,
        ErrorCode::UpstreamError | ErrorCode::TransportError | ErrorCode::ResponseTooLarge => 502,
        ErrorCode::RetriesExhausted => status.filter(|s| (100..=999).contains(s)).unwrap_or(502),
        ErrorCode::QueueFull => 503,
        // What Google's APIs and nginx answer a request its client took back with.
        ErrorCode::Cancelled => CANCELLED_STATUS,
        ErrorCode::Internal => 500,
    }
}

/// The status of a `cancelled` outcome: 499, "client closed request".
pub(crate) const CANCELLED_STATUS: u16 = 499;

/// A reply, answered as the original request is: a response with the upstream's
/// status, headers (less hop-by-hop ones) and body; an error with its status and
/// `{"error": {"code", "message"}}`.
pub(crate) fn from_reply(reply: &Reply) -> Answer {
    match (reply.outcome, &reply.error) {
        (Outcome::Response, _) => {
            let headers = reply
                .headers
                .iter()
                .flatten()
                .filter(|(name, _)| !is_hop_by_hop(name) && !name.starts_with("webproxy-"))
                .flat_map(|(name, value)| value.values().map(|v| (name.clone(), v.to_string())))
                .collect();
            // The service writes valid base64; a body that is not is answered as
            // the gateway's own error below rather than sent garbled.
            let stored = reply.body_object.as_ref().map(|object| object.size);
            match reply.body.decode() {
                Ok(body) => Answer {
                    status: reply.status.unwrap_or(502),
                    headers,
                    body,
                    stored,
                    outcome: "response",
                    label: "response",
                    attempts: reply.attempts,
                },
                Err(e) => {
                    let mut answer = gateway_error(
                        500,
                        "internal",
                        &format!("the reply's body_base64 is not base64: {e}"),
                    );
                    answer.attempts = reply.attempts;
                    answer
                }
            }
        }
        (Outcome::Error, error) => {
            let (code, message, status) = match error {
                Some(e) => (e.code, e.message.as_str(), e.status),
                None => (ErrorCode::Internal, "an error reply without an error", None),
            };
            Answer {
                status: error_status(code, status),
                headers: json_content(),
                body: error_body(code.as_str(), message),
                stored: None,
                outcome: "error",
                label: code.as_str(),
                attempts: reply.attempts,
            }
        }
    }
}

/// An answer the gateway makes itself, before or instead of a reply: `code` names
/// what went wrong (and is its metrics label).
pub(crate) fn gateway_error(status: u16, code: &'static str, message: &str) -> Answer {
    Answer {
        status,
        headers: json_content(),
        body: error_body(code, message),
        stored: None,
        outcome: "error",
        label: code,
        attempts: 0,
    }
}

/// The 202 of a conversation that goes on: `Location` is where its reply will be.
pub(crate) fn pending(id: &str) -> Answer {
    let location = format!("{}{id}", super::REPLIES_PATH);
    let mut headers = json_content();
    headers.push(("location".into(), location.clone()));
    Answer {
        status: 202,
        headers,
        body: json!({"id": id, "location": location})
            .to_string()
            .into_bytes(),
        stored: None,
        outcome: PENDING,
        label: "accepted",
        attempts: 0,
    }
}

/// The answer once the wait is over: the reply when there is one; without one, the
/// 202 when the id is recorded, and `unrecorded` (500) when its record could not be
/// written, since `/_webproxy/replies/<id>` would never serve that id.
pub(crate) fn settled(id: &str, recorded: bool, reply: Option<&Reply>) -> Answer {
    match (reply, recorded) {
        (Some(reply), _) => from_reply(reply),
        (None, true) => pending(id),
        (None, false) => gateway_error(
            500,
            "unrecorded",
            "the request was published and its conversation goes on, but its id could not \
             be recorded, so /_webproxy/replies cannot serve it; a retry with the same \
             idempotency key joins the conversation, one without a key publishes again",
        ),
    }
}

/// `Webproxy-Outcome` of a `DELETE /_webproxy/replies/<id>` the service took: the
/// body says what became of the cancel, and the conversation's own outcome is read
/// at `Location`.
pub(crate) const CANCEL: &str = "cancel";

/// The answer to a cancel the service took, with `Location` where the conversation's
/// reply is read: `recorded` is 202 (the reply, `cancelled` or the response of an
/// attempt that finished first, is yet to come), `finished` 200 (the reply stands as
/// it was). `None` for `unknown`, which is answered as an id the gateway does not
/// have.
pub(crate) fn cancel_taken(id: &str, state: CancelState) -> Option<Answer> {
    let (status, label) = match state {
        CancelState::Recorded => (202, "cancel_recorded"),
        CancelState::Finished => (200, "cancel_finished"),
        CancelState::Unknown => return None,
    };
    let mut headers = json_content();
    headers.push(("location".into(), format!("{}{id}", super::REPLIES_PATH)));
    Some(Answer {
        status,
        headers,
        body: json!({"cancel": state.as_str()}).to_string().into_bytes(),
        stored: None,
        outcome: CANCEL,
        label,
        attempts: 0,
    })
}

fn json_content() -> Vec<(String, String)> {
    vec![("content-type".into(), "application/json".into())]
}

fn error_body(code: &str, message: &str) -> Vec<u8> {
    json!({"error": {"code": code, "message": message}})
        .to_string()
        .into_bytes()
}

/// The envelope body: always base64, so its size is known before publishing
/// (`4 * ceil(n / 3)` bytes, never a JSON escape's six per byte).
pub(crate) fn body_base64(body: &[u8]) -> Option<String> {
    (!body.is_empty()).then(|| BASE64.encode(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use webproxy_protocol::{ErrorBody, HeaderValue as Value, ReplyBody};

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn the_gateways_own_and_hop_by_hop_headers_are_not_forwarded() {
        let split = split(
            &headers(&[
                ("host", "gw"),
                ("connection", "keep-alive, x-conn"),
                ("x-conn", "1"),
                ("keep-alive", "5"),
                ("proxy-authorization", "Bearer t"),
                ("x-token", "t"),
                ("authorization", "Basic dTpw"),
                ("soapaction", "\"urn:get\""),
                ("x-multi", "a"),
                ("x-multi", "b"),
                ("webproxy-deadline", "2030-01-01T00:00:00Z"),
                (
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                ),
                ("prefer", "respond-async, wait=5"),
                ("content-length", "3"),
            ]),
            "x-token",
        )
        .expect("split");
        assert_eq!(
            split.headers.keys().collect::<Vec<_>>(),
            ["authorization", "soapaction", "x-multi"]
        );
        assert_eq!(
            split.headers["x-multi"],
            Value::Many(vec!["a".into(), "b".into()])
        );
        assert_eq!(split.deadline.as_deref(), Some("2030-01-01T00:00:00Z"));
        assert_eq!(split.trace.len(), 1);
        assert!(split.respond_async);
    }

    #[test]
    fn a_bad_deadline_is_refused() {
        assert!(split(&headers(&[("webproxy-deadline", "tomorrow")]), "x").is_err());
        let plain = split(&headers(&[("prefer", "return=minimal")]), "x").expect("split");
        assert!(!plain.respond_async);
        assert!(plain.headers.contains_key("prefer"));
    }

    #[test]
    fn a_cancelled_conversation_is_499() {
        assert_eq!(error_status(ErrorCode::Cancelled, None), 499);
        assert_eq!(error_status(ErrorCode::Cancelled, Some(200)), 499);
    }

    #[test]
    fn a_cancel_taken_is_202_recorded_or_200_finished_and_unknown_is_left_to_the_caller() {
        for (state, status, body) in [
            (CancelState::Recorded, 202, r#"{"cancel":"recorded"}"#),
            (CancelState::Finished, 200, r#"{"cancel":"finished"}"#),
        ] {
            let answer = cancel_taken("gw-1", state).expect("taken");
            assert_eq!(answer.status, status);
            assert_eq!(answer.body, body.as_bytes());
            assert_eq!(answer.outcome, CANCEL);
            assert!(
                answer
                    .headers
                    .contains(&("location".into(), "/_webproxy/replies/gw-1".into()))
            );
        }
        assert_eq!(cancel_taken("gw-1", CancelState::Unknown), None);
    }

    #[test]
    fn every_outcome_maps_to_its_status() {
        let cases = [
            (ErrorCode::Denied, None, 403),
            (ErrorCode::InvalidRequest, None, 400),
            (ErrorCode::Expired, None, 504),
            (ErrorCode::UpstreamError, Some(500), 502),
            (ErrorCode::TransportError, None, 502),
            (ErrorCode::RetriesExhausted, Some(503), 503),
            (ErrorCode::RetriesExhausted, None, 502),
            (ErrorCode::ResponseTooLarge, None, 502),
            (ErrorCode::QueueFull, None, 503),
            (ErrorCode::Internal, None, 500),
        ];
        for (code, status, expected) in cases {
            let reply = Reply::error(
                "gw-1".into(),
                ErrorBody {
                    code,
                    message: "m".into(),
                    status,
                },
                2,
                1,
                None,
            );
            let answer = from_reply(&reply);
            assert_eq!(answer.status, expected, "{code}");
            assert_eq!(answer.label, code.as_str());
            assert_eq!(answer.attempts, 2);
            let body: serde_json::Value = serde_json::from_slice(&answer.body).expect("json");
            assert_eq!(body["error"]["code"], code.as_str());
            assert_eq!(body["error"]["message"], "m");
        }
    }

    #[test]
    fn without_a_reply_only_a_recorded_id_is_a_202() {
        assert_eq!(settled("gw-1", true, None), pending("gw-1"));
        let unrecorded = settled("gw-1", false, None);
        assert_eq!(unrecorded.status, 500);
        assert_eq!(unrecorded.label, "unrecorded");
        assert!(
            !unrecorded
                .headers
                .iter()
                .any(|(name, _)| name == "location")
        );
        let reply = Reply::response(
            "gw-1".into(),
            204,
            Headers::new(),
            ReplyBody::encode(Vec::new()),
            1,
            1,
            None,
        );
        for recorded in [true, false] {
            assert_eq!(settled("gw-1", recorded, Some(&reply)), from_reply(&reply));
        }
    }

    #[test]
    fn a_response_keeps_its_status_headers_and_body() {
        let mut reply_headers = Headers::new();
        reply_headers.insert("content-type".into(), Value::One("text/xml".into()));
        reply_headers.insert("content-length".into(), Value::One("5".into()));
        reply_headers.insert(
            "set-cookie".into(),
            Value::Many(vec!["a=1".into(), "b=2".into()]),
        );
        let reply = Reply::response(
            "gw-1".into(),
            201,
            reply_headers,
            ReplyBody::encode(vec![0, 255]),
            1,
            1,
            None,
        );
        let answer = from_reply(&reply);
        assert_eq!(answer.status, 201);
        assert_eq!(answer.body, vec![0, 255]);
        assert_eq!(
            answer.headers,
            [
                ("content-type".to_string(), "text/xml".to_string()),
                ("set-cookie".into(), "a=1".into()),
                ("set-cookie".into(), "b=2".into()),
            ]
        );
    }

    #[test]
    fn a_stored_body_is_answered_by_its_size_in_place_of_a_body() {
        let mut reply = Reply::response(
            "gw-1".into(),
            200,
            Headers::new(),
            ReplyBody::default(),
            1,
            1,
            None,
        );
        assert_eq!(from_reply(&reply).stored, None);
        reply.body_object = Some(webproxy_protocol::BodyObject {
            bucket: "b".into(),
            name: "n".into(),
            size: 5_000_000,
            digest: "SHA-256=x".into(),
        });
        let answer = from_reply(&reply);
        assert_eq!((answer.status, answer.stored), (200, Some(5_000_000)));
        assert!(answer.body.is_empty());
    }
}
