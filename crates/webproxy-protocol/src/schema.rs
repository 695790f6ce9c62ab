//! JSON Schemas (draft 2020-12) of the request, reply and dead-letter envelopes,
//! generated from this crate's types so that the files under `schema/` cannot drift
//! from the code that reads and writes the envelopes.
//!
//! Field-level constraints that serde's types cannot say (the id's characters, the
//! method names, the reply subject's rules) are written here, next to each other, and
//! derived from the same constants the parser uses wherever one exists.

use schemars::generate::{Contract, SchemaSettings};
use schemars::transform::RecursiveTransform;
use schemars::{Schema, SchemaGenerator, json_schema};
use serde_json::{Value, json};

use crate::{DeadLetter, MAX_METADATA_BYTES, Method, PROTOCOL_VERSION, Reply, RequestEnvelope};

/// A conversation id, as [`crate::validate_id`] checks it.
pub const ID_PATTERN: &str = "^[A-Za-z0-9_-]{1,128}$";

/// A schema's generator.
pub type Generate = fn() -> Schema;

/// The checked-in schema files under `schema/`, by file name, with their generators.
pub const SCHEMA_FILES: [(&str, Generate); 3] = [
    ("request.schema.json", request_schema),
    ("reply.schema.json", reply_schema),
    ("dead-letter.schema.json", dead_letter_schema),
];

/// The request envelope a caller publishes to `<prefix>.request.<pool>`.
pub fn request_schema() -> Schema {
    // The service reads requests, so optional means "may be left out".
    let mut schema = generator(Contract::Deserialize).into_root_schema_for::<RequestEnvelope>();
    schema.insert(
        "title".into(),
        json!("webproxy request envelope (protocol v1)"),
    );
    schema.insert(
        "description".into(),
        json!(
            "What a caller publishes with JetStream to <prefix>.request.<pool>, with the \
             header Nats-Msg-Id set to `id`. Optional fields are left out rather than null. \
             Unknown fields are ignored."
        ),
    );
    schema.insert(
        "not".into(),
        json!({
            "description": "`body`, `body_base64` and `body_object` are mutually exclusive.",
            "anyOf": [
                {"required": ["body", "body_base64"]},
                {"required": ["body", "body_object"]},
                {"required": ["body_base64", "body_object"]}
            ]
        }),
    );
    schema
}

/// The final reply stored on `<prefix>.reply.<id>`.
pub fn reply_schema() -> Schema {
    // The service writes replies, so required means "always present".
    let mut schema = generator(Contract::Serialize).into_root_schema_for::<Reply>();
    schema.insert(
        "title".into(),
        json!("webproxy reply envelope (protocol v1)"),
    );
    schema.insert(
        "description".into(),
        json!(
            "The one final reply of a conversation, stored on <prefix>.reply.<id> and copied \
             to the request's reply_to. A response carries status, headers and a body (or, \
             for a request that set large_body, the body_object naming a stored body); an \
             error carries error."
        ),
    );
    schema.insert(
        "if".into(),
        json!({"properties": {"outcome": {"const": "response"}}}),
    );
    schema.insert(
        "then".into(),
        json!({
            "required": ["status", "headers"],
            "oneOf": [
                {"required": ["body"]},
                {"required": ["body_base64"]},
                {"required": ["body_object"]}
            ]
        }),
    );
    schema.insert("else".into(), json!({"required": ["error"]}));
    schema
}

/// The dead letter stored on `<prefix>.dead.<pool>` for every conversation that ends
/// in an error and every payload that cannot be decoded.
pub fn dead_letter_schema() -> Schema {
    let mut schema = generator(Contract::Serialize).into_root_schema_for::<DeadLetter>();
    schema.insert("title".into(), json!("webproxy dead letter (protocol v1)"));
    schema.insert(
        "description".into(),
        json!(
            "A failed conversation or undecodable payload, stored on <prefix>.dead.<pool>. \
             It keeps the original request as `envelope` when it was a JSON object and as \
             `payload_base64` otherwise, or a base64 prefix of it with `truncated` when the \
             whole would not fit."
        ),
    );
    schema.insert(
        "not".into(),
        json!({"required": ["envelope", "payload_base64"]}),
    );
    schema
}

/// A schema as it is checked in: pretty JSON with a final newline.
pub fn to_file_text(schema: &Schema) -> String {
    // A Schema is a JSON value, which always serializes.
    let mut text = serde_json::to_string_pretty(schema).unwrap_or_default();
    text.push('\n');
    text
}

fn generator(contract: Contract) -> SchemaGenerator {
    let mut settings = SchemaSettings::draft2020_12();
    settings.contract = contract;
    settings
        .transforms
        .push(Box::new(RecursiveTransform(omitted_not_null)));
    settings.into_generator()
}

/// Every optional field of the envelopes is skipped when it is `None` rather than
/// written as `null`, so an optional property's schema drops the `null` schemars gives
/// an `Option`. A `null` where the field is required (none today) is left alone.
fn omitted_not_null(schema: &mut Schema) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let required: Vec<String> = object
        .get("required")
        .and_then(Value::as_array)
        .map(|names| {
            names
                .iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let Some(properties) = object.get_mut("properties").and_then(Value::as_object_mut) else {
        return;
    };
    for (name, property) in properties.iter_mut() {
        if required.contains(name) {
            continue;
        }
        let Some(property) = property.as_object_mut() else {
            continue;
        };
        if let Some(Value::Array(types)) = property.get_mut("type") {
            types.retain(|t| t != "null");
            if let [only] = types.as_slice() {
                let only = only.clone();
                property.insert("type".into(), only);
            }
        }
        if let Some(Value::Array(alternatives)) = property.get("anyOf") {
            let rest: Vec<Value> = alternatives
                .iter()
                .filter(|alt| alt.get("type").and_then(Value::as_str) != Some("null"))
                .cloned()
                .collect();
            if let [only] = rest.as_slice() {
                let only = only.clone();
                property.remove("anyOf");
                if let Value::Object(fields) = only {
                    property.extend(fields);
                }
            } else {
                property.insert("anyOf".into(), Value::Array(rest));
            }
        }
    }
}

pub(crate) fn version(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "The protocol version; may be left out.",
        "const": PROTOCOL_VERSION,
    })
}

pub(crate) fn reply_version(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "The protocol version.",
        "const": PROTOCOL_VERSION,
    })
}

pub(crate) fn id(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "The conversation id: one subject token. Unique for at least the \
                        duplicate window (2 minutes), in practice for the reply retention.",
        "type": "string",
        "pattern": ID_PATTERN,
    })
}

pub(crate) fn method(_: &mut SchemaGenerator) -> Schema {
    // JSON Schema regexes (ECMA-262) have no case-insensitive flag, so each letter is
    // a class of both cases.
    let alternatives: Vec<String> = Method::ALL
        .iter()
        .map(|m| {
            m.as_str()
                .chars()
                .map(|c| format!("[{}{}]", c, c.to_ascii_lowercase()))
                .collect()
        })
        .collect();
    json_schema!({
        "description": "The HTTP method, in any case.",
        "type": "string",
        "pattern": format!("^({})$", alternatives.join("|")),
    })
}

pub(crate) fn url(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "An absolute http or https URL without user information. The service \
                        normalises it with the WHATWG URL parser and decodes percent-escaped \
                        unreserved characters in the path; rules match and the service sends \
                        the normalised form. A path with an empty segment (`//`) or an encoded \
                        `/` or `\\` (`%2F`, `%5C`), a `.;` or `..;` segment (raw or encoded, \
                        e.g. `%2e%2e;`, `..%3B`), and a host ending in a dot, are refused. A \
                        `;` in the path (raw or `%3B`) is refused unless the matching request \
                        rule sets `allow_path_parameters`.",
        "type": "string",
        "format": "uri",
        "pattern": "^[Hh][Tt][Tt][Pp][Ss]?://",
    })
}

pub(crate) fn request_headers(_: &mut SchemaGenerator) -> Schema {
    // The parser's rules: a name is an HTTP token (RFC 9110), a value has no CR, LF or NUL.
    let value = json!({"type": "string", "pattern": "^[^\\r\\n\\u0000]*$"});
    json_schema!({
        "description": "Request headers: a value is a string, or an array of strings for a \
                        header sent several times. Hop-by-hop headers, Host and Content-Length \
                        are dropped.",
        "type": "object",
        "propertyNames": {"pattern": "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"},
        "additionalProperties": {
            "anyOf": [value, {"type": "array", "items": value}]
        },
    })
}

pub(crate) fn text_body(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "A UTF-8 text body. At most one of body and body_base64.",
        "type": "string",
    })
}

pub(crate) fn base64_body(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "A binary body in standard, padded base64. At most one of body and \
                        body_base64.",
        "type": "string",
        "contentEncoding": "base64",
        "pattern": "^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
    })
}

pub(crate) fn reply_to(_: &mut SchemaGenerator) -> Schema {
    // A literal subject: dot-separated non-empty tokens without wildcards, white space or
    // control characters, outside the server's reserved prefixes. The deployment's own
    // prefix depends on configuration, so it is only described.
    json_schema!({
        "description": "A core-NATS subject that also gets a copy of the reply. A literal \
                        subject that does not start with `$` (server subjects), outside \
                        webproxy's own inboxes (`_WEBPROXY_INBOX.`) and the deployment's own \
                        prefix (`webproxy.` by default), except <prefix>.reply.<id> itself, \
                        and inside the caller's reply space: an `_INBOX.` subject when the \
                        service sets no `[streams] reply_to_allow`, else one of those \
                        patterns, `{caller}` read as the caller name of the request subject \
                        <prefix>.request.<pool>.<caller>. The copy carries the header Nats-Msg-Id \
                        <STREAM>:<seq>:<generation>:reply, the stored reply's, so that a \
                        stream capturing the subject stores each reply once.",
        "type": "string",
        "pattern": "^(?!\\$|_WEBPROXY_INBOX(\\.|$))[^.*>\\s\\u0000-\\u001f\\u007f-\\u009f]+(\\.[^.*>\\s\\u0000-\\u001f\\u007f-\\u009f]+)*$",
    })
}

pub(crate) fn timeout_ms(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "Per-attempt timeout in milliseconds, clamped to the matched rule's timeout.",
        "type": "integer",
        "minimum": 1,
    })
}

pub(crate) fn deadline(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": "An RFC 3339 date-time after which the request is not attempted \
                        (an `expired` error instead).",
        "type": "string",
        "format": "date-time",
    })
}

pub(crate) fn metadata(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "description": format!(
            "Any JSON value, at most {MAX_METADATA_BYTES} bytes serialized, echoed byte for \
             byte in the reply."
        ),
    })
}

/// Any JSON, for raw JSON fields echoed as they came.
pub(crate) fn any_json(_: &mut SchemaGenerator) -> Schema {
    json_schema!(true)
}
