//! Fuzzes envelope parsing: any payload either parses into a request that upholds
//! the envelope's invariants or is refused, and never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use webproxy_protocol::{ParseError, Subjects, parse_request, validate_id};

fuzz_target!(|payload: &[u8]| {
    let Ok(subjects) = Subjects::new("webproxy") else {
        return;
    };
    match parse_request(payload, &subjects, None) {
        Ok(request) => {
            assert!(validate_id(&request.id).is_ok());
            assert!(matches!(request.url.scheme(), "http" | "https"));
            assert!(request.url.host().is_some());
            // No `.;` or `..;` segment, which Tomcat-like upstreams read as a dot segment.
            for segment in request.url.path().split('/') {
                let upper = segment.to_ascii_uppercase();
                let cut = [upper.find(';'), upper.find("%3B")].into_iter().flatten().min();
                if let Some(at) = cut {
                    assert!(!matches!(&upper[..at], "." | ".."), "{segment}");
                }
            }
            if let Some(reply_to) = &request.reply_to {
                assert!(subjects.check_reply_to(reply_to, &request.id, None).is_ok());
                assert!(!reply_to.starts_with("$JS."));
            }
            for (name, value) in &request.headers {
                assert!(!webproxy_protocol::is_hop_by_hop(name));
                assert!(!value.contains(['\r', '\n', '\0']));
            }
        }
        Err(ParseError::Invalid(invalid)) => {
            if let Some(id) = &invalid.id {
                assert!(validate_id(id).is_ok());
            }
        }
        Err(ParseError::Undecodable { .. }) => {}
    }
});
