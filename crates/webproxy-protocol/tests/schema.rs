//! The JSON Schemas checked in under `schema/` are exactly what the protocol types
//! generate, so a field changed in code without regenerating them fails here.
//! `UPDATE_SCHEMA=1` (or `just schema`) rewrites the files instead.

use std::fs;
use std::path::PathBuf;

use regex::Regex;
use serde_json::Value;
use webproxy_protocol::schema::{ID_PATTERN, SCHEMA_FILES, request_schema, to_file_text};
use webproxy_protocol::{Method, ParseError, Subjects, parse_request, validate_id};

fn schema_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../schema")
}

#[test]
fn checked_in_schemas_match_the_types() {
    let update = std::env::var("UPDATE_SCHEMA").is_ok_and(|v| v == "1");
    let mut stale = Vec::new();
    for (name, generate) in SCHEMA_FILES {
        let path = schema_dir().join(name);
        let generated = to_file_text(&generate());
        if update {
            fs::write(&path, &generated)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
            continue;
        }
        let checked_in = fs::read_to_string(&path).unwrap_or_default();
        if checked_in != generated {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "schema/{stale:?} differ from what the protocol types generate; \
         run `just schema` (UPDATE_SCHEMA=1) and commit the result"
    );
}

fn property(name: &str) -> Value {
    let schema = request_schema();
    schema
        .get("properties")
        .and_then(|p| p.get(name))
        .cloned()
        .unwrap_or_else(|| panic!("request schema has no property {name}"))
}

fn pattern_of(name: &str) -> Regex {
    let pattern = property(name)["pattern"]
        .as_str()
        .unwrap_or_else(|| panic!("{name} has no pattern"))
        .to_string();
    Regex::new(&pattern).unwrap_or_else(|e| panic!("{name}'s pattern: {e}"))
}

#[test]
fn method_pattern_accepts_exactly_the_methods_in_any_case() {
    let pattern = pattern_of("method");
    for method in Method::ALL {
        let upper = method.as_str();
        let lower = upper.to_ascii_lowercase();
        let mixed: String = upper
            .chars()
            .enumerate()
            .map(|(i, c)| {
                if i % 2 == 0 {
                    c
                } else {
                    c.to_ascii_lowercase()
                }
            })
            .collect();
        for name in [upper, &lower, &mixed] {
            assert!(pattern.is_match(name), "{name}");
            assert_eq!(Method::parse(name), Some(method));
        }
    }
    for name in ["BREW", "GETS", "", "TRACE", " GET"] {
        assert!(!pattern.is_match(name), "{name:?}");
        assert_eq!(Method::parse(name), None, "{name:?}");
    }
}

#[test]
fn id_pattern_agrees_with_validate_id() {
    let pattern = Regex::new(ID_PATTERN).expect("id pattern");
    assert_eq!(property("id")["pattern"], ID_PATTERN);
    let long = "a".repeat(128);
    let too_long = "a".repeat(129);
    for id in [
        "order-42_A",
        "a",
        long.as_str(),
        too_long.as_str(),
        "",
        "a.b",
        "a*",
        "a>",
        "a b",
        "a:b",
        "ü",
    ] {
        assert_eq!(pattern.is_match(id), validate_id(id).is_ok(), "{id:?}");
    }
}

#[test]
fn required_fields_are_the_parsers() {
    let schema = request_schema();
    assert_eq!(
        schema.get("required"),
        Some(&serde_json::json!(["id", "method", "url"]))
    );
}

/// `schema/examples.json` says what the service accepts and rejects; the clients'
/// tests check the same cases against the schema, so here they are checked against
/// the parser itself.
#[test]
fn examples_agree_with_the_parser() {
    let path = schema_dir().join("examples.json");
    let text = fs::read_to_string(&path).expect("schema/examples.json");
    let examples: Value = serde_json::from_str(&text).expect("examples json");
    let subjects = Subjects::new("webproxy").expect("prefix");
    let valid = examples["valid"].as_array().expect("valid cases");
    assert!(!valid.is_empty());
    for envelope in valid {
        let payload = serde_json::to_vec(envelope).expect("serialize");
        if let Err(e) = parse_request(&payload, &subjects, None) {
            panic!("{envelope} is rejected: {e}");
        }
    }
    let invalid = examples["invalid"].as_array().expect("invalid cases");
    assert!(!invalid.is_empty());
    for case in invalid {
        let payload = serde_json::to_vec(&case["envelope"]).expect("serialize");
        match parse_request(&payload, &subjects, None) {
            Err(ParseError::Invalid(e)) => assert_eq!(e.field, case["field"], "{case}"),
            other => panic!("{case}: expected an invalid field, got {other:?}"),
        }
    }
}
