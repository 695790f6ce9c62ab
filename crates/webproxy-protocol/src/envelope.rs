//! The request envelope: parsing and validation of what callers publish.
//!
//! Parsing is field by field over a JSON object rather than one derived struct, so that
//! an invalid envelope still yields its `id` and `reply_to` (to answer the caller) and
//! an error message that names the offending field.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use thiserror::Error;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use url::Url;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::headers::{Headers, is_hop_by_hop};
use crate::reply::{MAX_QUOTED_CHARS, quote};
use crate::subjects::{Subjects, validate_id};
use crate::{MAX_METADATA_BYTES, PROTOCOL_VERSION};

/// The HTTP methods webproxy sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Method {
    Get,
    Head,
    Post,
    Put,
    Patch,
    Delete,
    Options,
}

impl Method {
    pub const ALL: [Method; 7] = [
        Method::Get,
        Method::Head,
        Method::Post,
        Method::Put,
        Method::Patch,
        Method::Delete,
        Method::Options,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Head => "HEAD",
            Method::Post => "POST",
            Method::Put => "PUT",
            Method::Patch => "PATCH",
            Method::Delete => "DELETE",
            Method::Options => "OPTIONS",
        }
    }

    /// Parses a method name in any case.
    pub fn parse(s: &str) -> Option<Method> {
        Method::ALL
            .into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(s))
    }

    /// Whether repeating the request has the same effect as sending it once
    /// (RFC 9110 section 9.2.2), so that an attempt that may have reached the upstream
    /// can be repeated.
    pub fn is_idempotent(self) -> bool {
        !matches!(self, Method::Post | Method::Patch)
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request envelope as a caller writes it: the unvalidated wire shape. The service
/// reads envelopes with [`parse_request`]; clients build and serialize this.
///
/// The `schemars` attributes give each field the constraints `parse_request` enforces,
/// for the published JSON Schema (see `schema.rs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RequestEnvelope {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::version")]
    pub v: Option<u8>,
    #[schemars(schema_with = "crate::schema::id")]
    pub id: String,
    #[schemars(schema_with = "crate::schema::method")]
    pub method: String,
    #[schemars(schema_with = "crate::schema::url")]
    pub url: String,
    #[serde(default, skip_serializing_if = "Headers::is_empty")]
    #[schemars(schema_with = "crate::schema::request_headers")]
    pub headers: Headers,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::text_body")]
    pub body: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::base64_body")]
    pub body_base64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::reply_to")]
    pub reply_to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::timeout_ms")]
    pub timeout_ms: Option<u64>,
    // RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::deadline")]
    pub deadline: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::metadata")]
    pub metadata: Option<Value>,
    /// Opts in to a response body above the inline limit, stored and named by the
    /// reply's `body_object`. Needs the request published with a `Nats-Msg-Id` of 128
    /// random bits: 32 or more hex digits, or a UUID.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub large_body: bool,
    /// An uploaded request body (`<prefix>.body.put.<pool>`) in place of `body` /
    /// `body_base64`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_object: Option<crate::UploadRef>,
}

/// A validated request envelope.
#[derive(Debug, Clone)]
pub struct Request {
    pub id: String,
    pub method: Method,
    /// As normalised by the WHATWG URL parser; this is what rules match and what is sent.
    pub url: Url,
    /// Header pairs in envelope order, hop-by-hop headers removed.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// A custom reply subject, when the caller gave one other than the default.
    pub reply_to: Option<String>,
    pub timeout: Option<Duration>,
    pub deadline: Option<OffsetDateTime>,
    /// Echoed verbatim in the reply.
    pub metadata: Option<Box<RawValue>>,
    /// The caller accepts a stored body (`body_object`) above the inline limit.
    pub large_body: bool,
    /// The uploaded request body, when the envelope names one; `body` is then empty.
    pub upload: Option<crate::UploadRef>,
}

/// Why a payload is not a valid request.
#[derive(Debug, Clone, Error)]
pub enum ParseError {
    /// Not a JSON object: nothing in it can be answered.
    #[error("payload is not a JSON object: {reason}")]
    Undecodable { reason: String },
    /// A JSON object with an invalid field.
    #[error("invalid field `{}`: {}", .0.field, .0.message)]
    Invalid(Box<InvalidEnvelope>),
}

/// An envelope with an invalid field. `id` and `reply_to` are set when they are
/// themselves valid, so the caller can still be answered.
#[derive(Debug, Clone)]
pub struct InvalidEnvelope {
    pub field: &'static str,
    pub message: String,
    pub id: Option<String>,
    pub reply_to: Option<String>,
    /// The raw `id` value when it was a string, valid or not, for the reply body.
    pub raw_id: Option<String>,
    pub metadata: Option<Box<RawValue>>,
}

/// Parses and validates a request envelope published under `subjects`' prefix by
/// `caller`, the name its request subject gave (none for `<prefix>.request.<pool>`),
/// whose reply space bounds `reply_to`.
pub fn parse_request(
    payload: &[u8],
    subjects: &Subjects,
    caller: Option<&str>,
) -> Result<Request, ParseError> {
    // Fields stay raw until read, so `metadata` is echoed byte for byte.
    let raw: BTreeMap<String, &RawValue> = match serde_json::from_slice(payload) {
        Ok(raw) => raw,
        Err(e) => {
            let reason = match serde_json::from_slice::<Value>(payload) {
                Ok(other) => format!("expected a JSON object, found {}", json_kind(&other)),
                Err(_) => format!("not valid JSON: {e}"),
            };
            return Err(ParseError::Undecodable { reason });
        }
    };
    let object: Map<String, Value> = raw
        .iter()
        .filter(|(name, _)| name.as_str() != "metadata")
        .map(|(name, value)| {
            let value = serde_json::from_str(value.get()).unwrap_or(Value::Null);
            (name.clone(), value)
        })
        .collect();
    let metadata = parse_metadata(raw.get("metadata").copied());
    // An invalid id is echoed in the reply only as far as an error text quotes values.
    let raw_id = object
        .get("id")
        .and_then(Value::as_str)
        .map(|id| id.chars().take(MAX_QUOTED_CHARS).collect::<String>());
    let valid_id = raw_id.clone().filter(|id| validate_id(id).is_ok());
    // reply_to is checked against the id's own default subject; with no valid id only
    // a subject outside the reserved prefixes can be used.
    let reply_to_check =
        parse_reply_to(&object, subjects, valid_id.as_deref().unwrap_or(""), caller);
    let fail = |field: &'static str, message: String| {
        ParseError::Invalid(Box::new(InvalidEnvelope {
            field,
            message,
            id: valid_id.clone(),
            reply_to: reply_to_check.clone().ok().flatten(),
            raw_id: raw_id.clone(),
            metadata: metadata.clone().ok().flatten(),
        }))
    };

    let id = match object.get("id") {
        None => return Err(fail("id", "is required".into())),
        Some(Value::String(id)) => {
            validate_id(id).map_err(|e| fail("id", e.to_string()))?;
            id.clone()
        }
        Some(other) => {
            return Err(fail(
                "id",
                format!("must be a string, found {}", json_kind(other)),
            ));
        }
    };
    match object.get("v") {
        None => {}
        Some(Value::Number(n)) if n.as_u64() == Some(u64::from(PROTOCOL_VERSION)) => {}
        Some(other) => {
            return Err(fail(
                "v",
                format!("must be the number {PROTOCOL_VERSION}, found {other}"),
            ));
        }
    }
    let reply_to = reply_to_check.clone().map_err(|m| fail("reply_to", m))?;
    let metadata = metadata.clone().map_err(|m| fail("metadata", m))?;
    let method = match object.get("method") {
        None => return Err(fail("method", "is required".into())),
        Some(Value::String(m)) => Method::parse(m).ok_or_else(|| {
            fail(
                "method",
                format!(
                    "{} is not one of GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS",
                    quote(m)
                ),
            )
        })?,
        Some(other) => {
            return Err(fail(
                "method",
                format!("must be a string, found {}", json_kind(other)),
            ));
        }
    };
    let url = match object.get("url") {
        None => return Err(fail("url", "is required".into())),
        Some(Value::String(u)) => parse_url(u).map_err(|m| fail("url", m))?,
        Some(other) => {
            return Err(fail(
                "url",
                format!("must be a string, found {}", json_kind(other)),
            ));
        }
    };
    let headers = parse_headers(object.get("headers")).map_err(|m| fail("headers", m))?;
    let body = match (object.get("body"), object.get("body_base64")) {
        (Some(_), Some(_)) => {
            return Err(fail(
                "body",
                "`body` and `body_base64` are mutually exclusive".into(),
            ));
        }
        (Some(Value::String(text)), None) => text.as_bytes().to_vec(),
        (Some(other), None) => {
            return Err(fail(
                "body",
                format!("must be a string, found {}", json_kind(other)),
            ));
        }
        (None, Some(Value::String(b64))) => BASE64
            .decode(b64)
            .map_err(|e| fail("body_base64", format!("is not valid base64: {e}")))?,
        (None, Some(other)) => {
            return Err(fail(
                "body_base64",
                format!("must be a string, found {}", json_kind(other)),
            ));
        }
        (None, None) => Vec::new(),
    };
    let timeout = match object.get("timeout_ms") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_u64() {
            Some(ms) if ms > 0 => Some(Duration::from_millis(ms)),
            _ => {
                return Err(fail(
                    "timeout_ms",
                    format!("must be a positive whole number of milliseconds, found {n}"),
                ));
            }
        },
        Some(other) => {
            return Err(fail(
                "timeout_ms",
                format!("must be a number, found {}", json_kind(other)),
            ));
        }
    };
    let deadline = match object.get("deadline") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(OffsetDateTime::parse(d, &Rfc3339).map_err(|e| {
            fail(
                "deadline",
                format!("{} is not an RFC 3339 date-time: {e}", quote(d)),
            )
        })?),
        Some(other) => {
            return Err(fail(
                "deadline",
                format!("must be an RFC 3339 string, found {}", json_kind(other)),
            ));
        }
    };
    let upload = match object.get("body_object") {
        None | Some(Value::Null) => None,
        Some(value) => {
            if !body.is_empty() || object.contains_key("body") || object.contains_key("body_base64")
            {
                return Err(fail(
                    "body_object",
                    "`body_object` and `body`/`body_base64` are mutually exclusive".into(),
                ));
            }
            let upload: crate::UploadRef = serde_json::from_value(value.clone()).map_err(|e| {
                fail(
                    "body_object",
                    format!("must be {{\"upload\", \"size\", \"digest\"}}: {e}"),
                )
            })?;
            if !crate::is_upload_name(&upload.upload) {
                return Err(fail(
                    "body_object",
                    "`upload` must be 32 lowercase hex digits, the name it was uploaded under"
                        .into(),
                ));
            }
            if !crate::is_digest(&upload.digest) {
                return Err(fail(
                    "body_object",
                    "`digest` must be SHA-256= and the SHA-256 in padded base64url".into(),
                ));
            }
            Some(upload)
        }
    };
    let large_body = match object.get("large_body") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(opt_in)) => *opt_in,
        Some(other) => {
            return Err(fail(
                "large_body",
                format!("must be a boolean, found {}", json_kind(other)),
            ));
        }
    };
    Ok(Request {
        id,
        method,
        url,
        headers,
        body,
        reply_to,
        timeout,
        deadline,
        metadata,
        large_body,
        upload,
    })
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `Ok(None)` when absent or the id's own default subject.
/// The longest custom `reply_to` subject.
pub const MAX_REPLY_TO_BYTES: usize = 256;

fn parse_reply_to(
    object: &Map<String, Value>,
    subjects: &Subjects,
    id: &str,
    caller: Option<&str>,
) -> Result<Option<String>, String> {
    match object.get("reply_to") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(subject)) => {
            // The stored reply carries it as a header: bounded like every other value.
            if subject.len() > MAX_REPLY_TO_BYTES {
                return Err(format!(
                    "must be at most {MAX_REPLY_TO_BYTES} bytes, got {}",
                    subject.len()
                ));
            }
            subjects
                .check_reply_to(subject, id, caller)
                .map_err(|e| e.to_string())?;
            if !id.is_empty() && *subject == subjects.reply(id) {
                Ok(None)
            } else {
                Ok(Some(subject.clone()))
            }
        }
        Some(other) => Err(format!("must be a string, found {}", json_kind(other))),
    }
}

fn parse_metadata(raw: Option<&RawValue>) -> Result<Option<Box<RawValue>>, String> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    if raw.get().len() > MAX_METADATA_BYTES {
        return Err(format!(
            "is {} bytes serialized, more than the limit of {MAX_METADATA_BYTES}",
            raw.get().len()
        ));
    }
    Ok(Some(raw.to_owned()))
}

fn parse_url(text: &str) -> Result<Url, String> {
    let url =
        Url::parse(text).map_err(|e| format!("{} is not an absolute URL: {e}", quote(text)))?;
    canonical_url(url)
}

/// The URL webproxy matches against the rules and sends, from one the WHATWG parser
/// produced (a caller's, or a redirect's `Location` joined to the hop's URL), or why
/// it is refused. The rules, the guard and the upstream must all read the same URL:
///
/// - http or https with a host; no user information (`https://u:p@host/`), which the
///   HTTP client would turn into a second `Authorization` header;
/// - no host ending in a dot (`api.partner.com.`), which names the same host in a form
///   that no anchored pattern expects;
/// - no empty path segment (`//`) and no encoded `/` or `\` (`%2F`, `%5C`), which
///   upstreams split differently from the matcher;
/// - percent-escaped unreserved characters in the path (`/%61dmin/`) are decoded, and
///   the hex digits of the other escapes upper-cased, so a pattern sees one spelling;
/// - no `.;` or `..;` segment (a `.` or `..` with a `;` parameter, raw or `%3B`, after
///   the decoding above: `%2e%2e;`, `..%3b`), which Tomcat, Jetty and Spring read as a
///   dot segment: `/public/..;/admin` is `/admin` to them and under `/public/` to a
///   pattern. A `;` elsewhere in the path is the rule's to allow ([`path_parameter`]);
/// - no fragment, which HTTP never sends and a pattern must not see either.
///
/// The result parses back to itself, so what was matched is what is sent. The message
/// never repeats the URL, which may carry credentials.
pub fn canonical_url(mut url: Url) -> Result<Url, String> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "scheme {} is not http or https",
            quote(url.scheme())
        ));
    }
    match url.host() {
        None => return Err("has no host".into()),
        Some(url::Host::Domain(domain)) if domain.ends_with('.') => {
            return Err(format!(
                "host {} ends with a dot; name the host without it",
                quote(domain)
            ));
        }
        Some(_) => {}
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(
            "has user information (user:password@host), which webproxy does not send; \
             put credentials in a header, or let a request rule inject them"
                .into(),
        );
    }
    if url.path().contains("//") {
        return Err("has an empty path segment (//)".into());
    }
    url.set_fragment(None);
    let path = decode_unreserved(url.path())?;
    if path != url.path() {
        url.set_path(&path);
        if url.path() != path {
            return Err("has a path that changes when its escapes are decoded".into());
        }
    }
    if let Some(segment) = dot_parameter_segment(url.path()) {
        return Err(format!(
            "has a '.' or '..' path segment with a ';' parameter (segment {segment}, \
             such as '..;' or '..%3B'), which Tomcat, Jetty and Spring read as a dot \
             segment, so the upstream would read another path than the rules matched"
        ));
    }
    match Url::parse(url.as_str()) {
        Ok(again) if again == url => Ok(url),
        _ => Err("does not parse back to itself once normalised".into()),
    }
}

/// The segments of a canonical path (after the leading `/`), numbered from 1, each
/// split at its first path parameter: `;` or its escape, which canonical paths spell
/// `%3B` (hex upper-cased). `(number, before, parameter)`, `parameter` false when the
/// segment has none.
fn segments(path: &str) -> impl Iterator<Item = (usize, &str, bool)> {
    path.strip_prefix('/')
        .unwrap_or(path)
        .split('/')
        .enumerate()
        .map(|(i, segment)| {
            let cut = [segment.find(';'), segment.find("%3B")]
                .into_iter()
                .flatten()
                .min();
            match cut {
                Some(at) => (i + 1, &segment[..at], true),
                None => (i + 1, segment, false),
            }
        })
}

/// The number of the first segment of a canonical path that is `.` or `..` with a path
/// parameter (`..;`, `.;x`, `..%3B`), if one is.
fn dot_parameter_segment(path: &str) -> Option<usize> {
    segments(path)
        .find(|(_, before, parameter)| *parameter && matches!(*before, "." | ".."))
        .map(|(number, _, _)| number)
}

/// The number of the first segment of a canonical URL's path holding a `;`, raw or as
/// `%3B`, if one does: Tomcat, Jetty and Spring drop what follows it as a path
/// parameter (`/admin;jsessionid=x/users` is `/admin/users` to them), so a rule must
/// allow it (`allow_path_parameters`) before webproxy sends it. The query is not the
/// path: a `;` there is the upstream's.
pub fn path_parameter(url: &Url) -> Option<usize> {
    segments(url.path())
        .find(|(_, _, parameter)| *parameter)
        .map(|(number, _, _)| number)
}

/// `path` with percent-escaped unreserved characters (RFC 3986: letters, digits,
/// `-`, `.`, `_`, `~`) decoded and the hex digits of every other escape upper-cased;
/// an encoded `/` or `\` is an error.
fn decode_unreserved(path: &str) -> Result<String, String> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok().map(|b| (b, hex)));
        match escaped {
            Some((b'/' | b'\\', hex)) => {
                return Err(format!("has an encoded '/' or '\\' (%{hex}) in its path"));
            }
            Some((b, _)) if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => {
                out.push(char::from(b));
                i += 3;
            }
            Some((_, hex)) => {
                out.push('%');
                out.push_str(&hex.to_ascii_uppercase());
                i += 3;
            }
            None => {
                out.push(char::from(bytes[i]));
                i += 1;
            }
        }
    }
    Ok(out)
}

fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn check_header_value(name: &str, value: &str) -> Result<(), String> {
    if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        Err(format!(
            "the value of {} contains CR, LF or NUL",
            quote(name)
        ))
    } else {
        Ok(())
    }
}

fn parse_headers(value: Option<&Value>) -> Result<Vec<(String, String)>, String> {
    let object = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(object)) => object,
        Some(other) => return Err(format!("must be an object, found {}", json_kind(other))),
    };
    let mut pairs = Vec::with_capacity(object.len());
    for (name, value) in object {
        if !is_token(name) {
            return Err(format!("{} is not a valid header name", quote(name)));
        }
        let values: Vec<&str> = match value {
            Value::String(v) => vec![v.as_str()],
            Value::Array(items) => items
                .iter()
                .map(|item| {
                    item.as_str().ok_or_else(|| {
                        format!(
                            "the values of {} must be strings, found {}",
                            quote(name),
                            json_kind(item)
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
            other => {
                return Err(format!(
                    "the value of {} must be a string or an array of strings, found {}",
                    quote(name),
                    json_kind(other)
                ));
            }
        };
        for v in values {
            check_header_value(name, v)?;
            if !is_hop_by_hop(name) {
                pairs.push((name.clone(), v.to_string()));
            }
        }
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Custom reply subjects under `app.` are every caller's.
    fn subjects() -> Subjects {
        Subjects::new("webproxy")
            .expect("valid prefix")
            .with_reply_to_allow(&["app.>".into()])
            .expect("valid pattern")
    }

    fn parse(json: &str) -> Result<Request, ParseError> {
        parse_request(json.as_bytes(), &subjects(), None)
    }

    fn invalid_field(json: &str) -> (&'static str, String, Option<String>, Option<String>) {
        match parse(json) {
            Err(ParseError::Invalid(e)) => (e.field, e.message, e.id, e.reply_to),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn full_envelope() {
        let req = parse(
            r#"{"v":1,"id":"order-42","method":"post","url":"HTTPS://API.Example.com:443/orders?x=1",
                "headers":{"Content-Type":"application/json","X-Multi":["a","b"],"Connection":"close"},
                "body":"{\"qty\": 1}","reply_to":"app.replies.42","timeout_ms":5000,
                "deadline":"2026-11-30T12:00:00Z","metadata":{"order":42, "b":[1, 2]},"extra":true}"#,
        )
        .expect("valid");
        assert_eq!(req.id, "order-42");
        assert_eq!(req.method, Method::Post);
        assert_eq!(req.url.as_str(), "https://api.example.com/orders?x=1");
        assert_eq!(
            req.headers,
            vec![
                ("Content-Type".to_string(), "application/json".to_string()),
                ("X-Multi".to_string(), "a".to_string()),
                ("X-Multi".to_string(), "b".to_string()),
            ]
        );
        assert_eq!(req.body, br#"{"qty": 1}"#);
        assert_eq!(req.reply_to.as_deref(), Some("app.replies.42"));
        assert_eq!(req.timeout, Some(Duration::from_millis(5000)));
        assert!(req.deadline.is_some());
        assert_eq!(
            req.metadata.map(|m| m.get().to_string()),
            Some(r#"{"order":42, "b":[1, 2]}"#.to_string())
        );
    }

    #[test]
    fn minimal_envelope_and_binary_body() {
        let req = parse(
            r#"{"id":"a","method":"GET","url":"http://127.0.0.1:8080/x","body_base64":"AAH/"}"#,
        )
        .expect("valid");
        assert_eq!(req.body, vec![0, 1, 255]);
        assert!(req.reply_to.is_none());
        assert!(req.metadata.is_none());
    }

    #[test]
    fn large_body_is_an_opt_in_boolean() {
        let plain = parse(r#"{"id":"a","method":"GET","url":"http://h/"}"#).expect("valid");
        assert!(!plain.large_body);
        let opted = parse(r#"{"id":"a","method":"GET","url":"http://h/","large_body":true}"#)
            .expect("valid");
        assert!(opted.large_body);
        let (field, message, id, _) =
            invalid_field(r#"{"id":"a","method":"GET","url":"http://h/","large_body":"yes"}"#);
        assert_eq!(field, "large_body");
        assert!(message.contains("boolean"), "{message}");
        assert_eq!(id.as_deref(), Some("a"));
        // Clients write it only when set, so an envelope without it is as before.
        let envelope = RequestEnvelope {
            id: "a".into(),
            method: "GET".into(),
            url: "http://h/".into(),
            ..Default::default()
        };
        let text = serde_json::to_string(&envelope).expect("json");
        assert!(!text.contains("large_body"), "{text}");
    }

    #[test]
    fn body_object_names_an_upload_in_place_of_a_body() {
        let digest = "SHA-256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU=";
        let upload = "0123456789abcdef0123456789abcdef";
        let named = parse(&format!(
            r#"{{"id":"a","method":"POST","url":"http://h/","body_object":{{"upload":"{upload}","size":7,"digest":"{digest}"}}}}"#
        ))
        .expect("valid");
        let named = named.upload.expect("an upload");
        assert_eq!((named.upload.as_str(), named.size), (upload, 7));
        for (bad, says) in [
            (
                format!(
                    r#""body":"x","body_object":{{"upload":"{upload}","size":7,"digest":"{digest}"}}"#
                ),
                "mutually exclusive",
            ),
            (
                format!(r#""body_object":{{"upload":"../x","size":7,"digest":"{digest}"}}"#),
                "32 lowercase hex",
            ),
            (
                format!(r#""body_object":{{"upload":"{upload}","size":7,"digest":"md5"}}"#),
                "SHA-256=",
            ),
            (r#""body_object":{"upload":1}"#.to_string(), "must be"),
        ] {
            let (field, message, _, _) = invalid_field(&format!(
                r#"{{"id":"a","method":"POST","url":"http://h/",{bad}}}"#
            ));
            assert_eq!(field, "body_object", "{bad}");
            assert!(message.contains(says), "{bad}: {message}");
        }
    }

    #[test]
    fn default_reply_subject_given_explicitly_is_no_custom_reply_to() {
        let req =
            parse(r#"{"id":"a","method":"GET","url":"http://h/","reply_to":"webproxy.reply.a"}"#)
                .expect("valid");
        assert!(req.reply_to.is_none());
    }

    #[test]
    fn undecodable_payloads() {
        for payload in ["", "not json", "[1,2]", "\"id\"", "42", "{\"id\": \"a\""] {
            assert!(
                matches!(parse(payload), Err(ParseError::Undecodable { .. })),
                "{payload:?}"
            );
        }
    }

    #[test]
    fn each_invalid_field_is_named() {
        let cases: [(&str, &str); 21] = [
            (r#"{"method":"GET","url":"http://h/"}"#, "id"),
            (r#"{"id":7,"method":"GET","url":"http://h/"}"#, "id"),
            (r#"{"id":"a.b","method":"GET","url":"http://h/"}"#, "id"),
            (
                r#"{"id":"a","v":"1","method":"GET","url":"http://h/"}"#,
                "v",
            ),
            (r#"{"id":"a","v":2,"method":"GET","url":"http://h/"}"#, "v"),
            (r#"{"id":"a","url":"http://h/"}"#, "method"),
            (r#"{"id":"a","method":"BREW","url":"http://h/"}"#, "method"),
            (r#"{"id":"a","method":"GET"}"#, "url"),
            (r#"{"id":"a","method":"GET","url":"/relative"}"#, "url"),
            (r#"{"id":"a","method":"GET","url":"ftp://h/"}"#, "url"),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","headers":[]}"#,
                "headers",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","headers":{"X":1}}"#,
                "headers",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","headers":{"X":"a\nb"}}"#,
                "headers",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","headers":{"X Y":"a"}}"#,
                "headers",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","body":"x","body_base64":"eA=="}"#,
                "body",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","body_base64":"!!"}"#,
                "body_base64",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","reply_to":"webproxy.request.default"}"#,
                "reply_to",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","reply_to":"x.*"}"#,
                "reply_to",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","timeout_ms":-5}"#,
                "timeout_ms",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","deadline":"tomorrow"}"#,
                "deadline",
            ),
            (
                r#"{"id":"a","method":"GET","url":"http://h/","metadata":"__BIG__"}"#,
                "metadata",
            ),
        ];
        let big = "m".repeat(MAX_METADATA_BYTES + 1);
        for (json, expected) in cases {
            let json = json.replace("__BIG__", &big);
            let (field, message, _, _) = invalid_field(&json);
            assert_eq!(field, expected, "{json}: {message}");
        }
    }

    #[test]
    fn invalid_envelope_keeps_what_is_needed_to_answer() {
        let (_, _, id, reply_to) =
            invalid_field(r#"{"id":"a","method":"BREW","url":"http://h/","reply_to":"app.r"}"#);
        assert_eq!(id.as_deref(), Some("a"));
        assert_eq!(reply_to.as_deref(), Some("app.r"));
        let (_, _, id, reply_to) =
            invalid_field(r#"{"id":"a b","method":"GET","url":"http://h/","reply_to":"app.r"}"#);
        assert_eq!(id, None);
        assert_eq!(reply_to.as_deref(), Some("app.r"));
        let (_, _, _, reply_to) = invalid_field(
            r#"{"id":"a b","method":"GET","url":"http://h/","reply_to":"webproxy.reply.x"}"#,
        );
        assert_eq!(reply_to, None);
    }

    fn url_of(text: &str) -> Result<String, String> {
        parse_url(text).map(|u| u.to_string())
    }

    #[test]
    fn urls_with_user_information_are_refused() {
        for text in [
            "https://u:p@api.partner.com/",
            "https://u@api.partner.com/",
            "https://:p@api.partner.com/",
            "http://evil.example@api.partner.com/",
        ] {
            let e = url_of(text).expect_err(text);
            assert!(e.contains("user information"), "{text}: {e}");
            assert!(
                !e.contains("api.partner.com"),
                "the message repeats the URL: {e}"
            );
        }
        // An empty userinfo is dropped by the parser: nothing is left to send.
        assert_eq!(
            url_of("https://@api.partner.com/").as_deref(),
            Ok("https://api.partner.com/")
        );
    }

    #[test]
    fn unreserved_escapes_in_the_path_are_decoded_and_others_upper_cased() {
        for (text, sent) in [
            ("https://a.test/%61dmin/", "https://a.test/admin/"),
            (
                "https://a.test/%41%44MIN/%7e%2d%2E%5f",
                "https://a.test/ADMIN/~-._",
            ),
            ("https://a.test/a%2Eb/c", "https://a.test/a.b/c"),
            (
                "https://a.test/caf%c3%a9?q=%61",
                "https://a.test/caf%C3%A9?q=%61",
            ),
            ("https://a.test/%20x%3f", "https://a.test/%20x%3F"),
            // Escaped dot segments are resolved by the parser before anything else.
            ("https://a.test/x/%2e%2e/admin", "https://a.test/admin"),
            ("https://a.test/100%", "https://a.test/100%"),
            // The fragment is never sent, so it is not matched either.
            (
                "https://a.test/x#https://api.partner.com/",
                "https://a.test/x",
            ),
        ] {
            assert_eq!(url_of(text).as_deref(), Ok(sent), "{text}");
        }
    }

    #[test]
    fn empty_segments_encoded_slashes_and_trailing_dot_hosts_are_refused() {
        for (text, why) in [
            ("https://a.test//admin", "empty path segment"),
            ("https://a.test/x//y", "empty path segment"),
            ("https://a.test/x/%2Fadmin", "%2F"),
            ("https://a.test/x%2fy", "%2f"),
            ("https://a.test/x%5Cy", "%5C"),
            ("https://api.partner.com./", "ends with a dot"),
            ("https://api.partner.com.:443/", "ends with a dot"),
        ] {
            let e = url_of(text).expect_err(text);
            assert!(e.contains(why), "{text}: {e}");
        }
        // Only the path counts: the same characters in the query are the upstream's.
        assert!(url_of("https://a.test/x?next=//b%2Fc").is_ok());
    }

    #[test]
    fn dot_segments_with_a_parameter_are_refused_in_every_spelling() {
        for (text, segment) in [
            ("https://a.test/public/..;/admin/users", 2),
            ("https://a.test/public/.;/admin", 2),
            ("https://a.test/..;jsessionid=x/admin", 1),
            ("https://a.test/public/%2e%2e;/admin", 2),
            ("https://a.test/public/%2E%2E;/admin", 2),
            ("https://a.test/public/..%3b/admin", 2),
            ("https://a.test/public/..%3B/admin", 2),
            ("https://a.test/public/%2e%2e%3b/admin", 2),
            ("https://a.test/public/.%2e%3Bx/admin", 2),
            ("https://a.test/a/b/%2e;", 3),
            ("https://a.test/public/..;", 2),
        ] {
            let e = url_of(text).expect_err(text);
            assert!(e.contains("';' parameter"), "{text}: {e}");
            assert!(e.contains(&format!("segment {segment}")), "{text}: {e}");
            assert!(!e.contains("a.test"), "the message repeats the URL: {e}");
        }
        // Not dot segments: kept (a rule decides on their ';'), and so is the query.
        for text in [
            "https://a.test/public/...;/admin",
            "https://a.test/public/x..;/admin",
            "https://a.test/public/..x;/admin",
            "https://a.test/public/a;b/admin",
            "https://a.test/public/?p=..;/admin",
        ] {
            assert!(url_of(text).is_ok(), "{text}");
        }
    }

    #[test]
    fn path_parameters_are_found_raw_or_escaped_in_any_case() {
        let parameter = |text: &str| path_parameter(&parse_url(text).expect(text));
        assert_eq!(
            parameter("https://a.test/admin;jsessionid=x/users"),
            Some(1)
        );
        assert_eq!(parameter("https://a.test/x/admin%3B/users"), Some(2));
        assert_eq!(parameter("https://a.test/x/admin%3bjsessionid=x"), Some(2));
        assert_eq!(parameter("https://a.test/x/y/;"), Some(3));
        assert_eq!(parameter("https://a.test/admin/users"), None);
        assert_eq!(parameter("https://a.test/admin?a=1;b=2"), None);
        assert_eq!(parameter("https://a.test/admin%3A/users"), None);
        assert_eq!(
            parameter("https://a.test/a%253B"),
            None,
            "an escaped %, not a ';'"
        );
    }

    #[test]
    fn canonical_urls_parse_back_to_themselves() {
        for text in [
            "HTTPS://API.Example.com:443/a/%62/./c/../d?x=%2F#f",
            "http://2130706433/%7euser",
            "http://[::ffff:127.0.0.1]:8080/",
        ] {
            let url = parse_url(text).expect(text);
            assert_eq!(
                Url::parse(url.as_str()).expect("again"),
                url,
                "{text} -> {url}"
            );
            assert_eq!(canonical_url(url.clone()).as_ref(), Ok(&url));
        }
    }

    #[test]
    fn idempotent_methods() {
        assert!(Method::Get.is_idempotent());
        assert!(Method::Put.is_idempotent());
        assert!(Method::Delete.is_idempotent());
        assert!(!Method::Post.is_idempotent());
        assert!(!Method::Patch.is_idempotent());
    }
}
