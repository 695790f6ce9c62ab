//! The ids the gateway mints (pure but for the random ones): `gw-` and 32 hex
//! characters, random without a client key, else an HMAC under the gateway key of
//! the route, the token identity and the client key, so ids are neither guessable
//! nor shared across routes and tokens. A keyed id is bound to its request by the
//! request's [`Fingerprint`]. Tokens are compared in constant time.

use hmac::{Hmac, Mac as _};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;
use webproxy_protocol::Headers;

type HmacSha256 = Hmac<Sha256>;

/// Every minted id starts with this.
pub(crate) const PREFIX: &str = "gw-";

/// The token identity of a route without a token.
pub(crate) const ANONYMOUS: &str = "anonymous";

/// The gateway's HMAC key. Compared only with other keys the gateway read (a rotation
/// is told from a re-read), never with anything a caller sends.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    pub(crate) fn new(bytes: impl Into<Vec<u8>>) -> Key {
        Key(bytes.into())
    }

    /// HMAC-SHA256 of the length-prefixed `fields`, so no two field lists give
    /// the same input.
    fn mac(&self, fields: &[&[u8]]) -> [u8; 32] {
        // HMAC takes a key of any length.
        let mut mac = HmacSha256::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!());
        for field in fields {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
        mac.finalize().into_bytes().into()
    }

    /// The id of the conversation a client key names on a route for a token identity.
    pub(crate) fn id_for(&self, route: &str, identity: &str, client_key: &str) -> String {
        let mac = self.mac(&[
            b"id",
            route.as_bytes(),
            identity.as_bytes(),
            client_key.as_bytes(),
        ]);
        format!("{PREFIX}{}", hex(&mac[..16]))
    }

    /// The `Nats-Msg-Id` of a keyed id's publish of `request`: derived (the same
    /// request retried within the duplicate window is stored once) but not the id
    /// itself, which the HTTP client and reply subscribers see, so no one can publish
    /// first under it. Another request under the same id is another message, so it
    /// is never taken for the first one's duplicate.
    pub(crate) fn msg_id_for(&self, id: &str, request: &Fingerprint) -> String {
        let fields = [
            b"msg-id".as_slice(),
            id.as_bytes(),
            request.method.as_bytes(),
            request.url.as_bytes(),
            request.headers.as_bytes(),
            request.body.as_bytes(),
        ];
        hex(&self.mac(&fields)[..16])
    }

    /// What binds a keyed id to its request: an HMAC of each part that reaches the
    /// upstream. Keyed, so the record lets no reader of the bucket test a guess of a
    /// body or URL. `headers` are the ones the envelope carries (no hop-by-hop or
    /// trace headers, no token, no deadline), less `key_header`, whose value is
    /// already in the id.
    pub(crate) fn fingerprint(
        &self,
        method: &str,
        url: &str,
        headers: &Headers,
        key_header: &str,
        body: BodyPart<'_>,
    ) -> Fingerprint {
        let mut fields: Vec<&[u8]> = vec![b"request-headers"];
        for (name, value) in headers.iter().filter(|(name, _)| *name != key_header) {
            for value in value.values() {
                fields.extend([name.as_bytes(), value.as_bytes()]);
            }
        }
        let part = |fields: &[&[u8]]| hex(&self.mac(fields));
        Fingerprint {
            method: part(&[b"request-method", method.as_bytes()]),
            url: part(&[b"request-url", url.as_bytes()]),
            headers: part(&fields),
            body: match body {
                BodyPart::Inline(body) => part(&[b"request-body", body]),
                BodyPart::Uploaded { digest } => part(&[b"request-body-digest", digest.as_bytes()]),
            },
        }
    }

    /// The identity of a route's token: an HMAC of its value, so a token's
    /// identity is stable across gateways and never shows the token.
    pub(crate) fn identity(&self, token: Option<&str>) -> String {
        match token {
            Some(token) => format!("t{}", hex(&self.mac(&[b"token", token.as_bytes()])[..12])),
            None => ANONYMOUS.into(),
        }
    }
}

/// A request's body as it travels: in the envelope, or uploaded (named by its digest,
/// since the gateway never holds it whole). The same request always travels the same
/// way, since which way is chosen by its size.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BodyPart<'a> {
    Inline(&'a [u8]),
    Uploaded { digest: &'a str },
}

/// The parts of a keyed request, each an HMAC-SHA256 in hex ([`Key::fingerprint`]),
/// kept in the id's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Fingerprint {
    pub(crate) method: String,
    pub(crate) url: String,
    pub(crate) headers: String,
    pub(crate) body: String,
}

/// How a request stands to the record of its keyed id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Binding {
    /// The request the id was first used with: its answer is this one's.
    Same,
    /// Another request: the first part that differs, in the order method, URL,
    /// headers, body. Only the first is named, so an answer tells a caller probing
    /// someone else's key about a later part only once it has every earlier one.
    Differs(&'static str),
    /// The record holds no fingerprint (written by a gateway before the binding):
    /// nothing says it is the same request.
    Unbound,
}

/// How `request` stands to `recorded`, the fingerprint in its id's record.
pub(crate) fn binding(recorded: Option<&Fingerprint>, request: &Fingerprint) -> Binding {
    let Some(recorded) = recorded else {
        return Binding::Unbound;
    };
    let parts = [
        ("method", &recorded.method, &request.method),
        ("URL", &recorded.url, &request.url),
        ("headers", &recorded.headers, &request.headers),
        ("body", &recorded.body, &request.body),
    ];
    match parts.into_iter().find(|(_, first, this)| first != this) {
        Some((part, _, _)) => Binding::Differs(part),
        None => Binding::Same,
    }
}

/// A random id, for a request without a client key.
pub(crate) fn random_id() -> Result<String, getrandom::Error> {
    Ok(format!("{PREFIX}{}", random_hex()?))
}

/// 32 hex characters, 128 bits from the operating system's CSPRNG.
pub(crate) fn random_hex() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)?;
    Ok(hex(&bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `given` is `expected`, in time that depends on neither (both hashed
/// first, so not even the length shows).
pub(crate) fn token_matches(given: &str, expected: &str) -> bool {
    let given = Sha256::digest(given.as_bytes());
    let expected = Sha256::digest(expected.as_bytes());
    given.ct_eq(&expected).into()
}

/// The token in a header's value: `Bearer <token>` (scheme in any case), or for a
/// header of the route's own, the whole value too.
pub(crate) fn presented(value: &str, proxy_credential: bool) -> Option<&str> {
    let value = value.trim();
    match value.split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => Some(token.trim()),
        _ if !proxy_credential => Some(value),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_ids_differ_by_route_identity_key_and_gateway_key() {
        let key = Key::new(b"k".to_vec());
        let id = key.id_for("/a", "t1", "order-1");
        assert!(
            id.starts_with(PREFIX) && id.len() == PREFIX.len() + 32,
            "{id}"
        );
        assert!(webproxy_protocol::validate_id(&id).is_ok());
        assert_eq!(id, key.id_for("/a", "t1", "order-1"));
        for other in [
            key.id_for("/b", "t1", "order-1"),
            key.id_for("/a", "t2", "order-1"),
            key.id_for("/a", "t1", "order-2"),
            key.id_for("/a", "t1o", "rder-1"),
            Key::new(b"j".to_vec()).id_for("/a", "t1", "order-1"),
        ] {
            assert_ne!(id, other);
        }
        let request = key.fingerprint(
            "POST",
            "https://h/p",
            &Headers::new(),
            "k",
            BodyPart::Inline(b"b"),
        );
        assert_ne!(key.msg_id_for(&id, &request), id);
        assert_ne!(key.identity(Some("a")), key.identity(Some("b")));
        assert_eq!(key.identity(None), ANONYMOUS);
    }

    fn headers(pairs: &[(&str, &str)]) -> Headers {
        webproxy_protocol::collect_headers(pairs.iter().map(|(n, v)| (*n, (*v).to_string())))
    }

    #[test]
    fn a_request_is_bound_to_its_method_url_headers_and_body() {
        let key = Key::new(b"k".to_vec());
        let print = |method, url, headers: &[(&str, &str)], body: &[u8]| {
            key.fingerprint(
                method,
                url,
                &self::headers(headers),
                "idempotency-key",
                BodyPart::Inline(body),
            )
        };
        let first = print("POST", "https://h/pay", &[("a", "1")], b"card=4242");
        let same = print(
            "POST",
            "https://h/pay",
            &[("a", "1"), ("idempotency-key", "another spelling")],
            b"card=4242",
        );
        assert_eq!(binding(Some(&first), &same), Binding::Same);
        let cases = [
            (
                print("GET", "https://h/pay", &[("a", "1")], b"card=4242"),
                "method",
            ),
            (
                print("POST", "https://h/x", &[("a", "1")], b"card=4242"),
                "URL",
            ),
            (
                print("POST", "https://h/pay", &[("a", "2")], b"card=4242"),
                "headers",
            ),
            (
                print(
                    "POST",
                    "https://h/pay",
                    &[("a", "1"), ("a", "1")],
                    b"card=4242",
                ),
                "headers",
            ),
            (print("POST", "https://h/pay", &[], b"card=4242"), "headers"),
            (
                print("POST", "https://h/pay", &[("a", "1")], b"card=4243"),
                "body",
            ),
            // Fields are length-prefixed: moving bytes between them changes the print.
            (
                print("POST", "https://h/pay", &[("a1", "")], b"card=4242"),
                "headers",
            ),
            (print("GET", "https://h/x", &[], b""), "method"),
        ];
        assert_ne!(
            key.msg_id_for("gw-1", &first),
            key.msg_id_for("gw-1", &cases[0].0),
            "another request under the same id is another message"
        );
        for (other, part) in cases {
            assert_eq!(
                binding(Some(&first), &other),
                Binding::Differs(part),
                "{part}"
            );
        }
        assert_eq!(binding(None, &first), Binding::Unbound);
        assert_eq!(
            key.msg_id_for("gw-1", &first),
            key.msg_id_for("gw-1", &same)
        );
        let other_key = Key::new(b"j".to_vec()).fingerprint(
            "POST",
            "https://h/pay",
            &headers(&[("a", "1")]),
            "idempotency-key",
            BodyPart::Inline(b"card=4242"),
        );
        assert_ne!(other_key.body, first.body, "keyed: a bare hash would match");
        // An uploaded body is bound by its digest, never equal to an inline one's.
        let uploaded = |digest| {
            key.fingerprint(
                "POST",
                "https://h/pay",
                &headers(&[("a", "1")]),
                "idempotency-key",
                BodyPart::Uploaded { digest },
            )
        };
        assert_eq!(
            binding(Some(&uploaded("SHA-256=a")), &uploaded("SHA-256=a")),
            Binding::Same
        );
        assert_eq!(
            binding(Some(&uploaded("SHA-256=a")), &uploaded("SHA-256=b")),
            Binding::Differs("body")
        );
        assert_ne!(uploaded("card=4242").body, first.body);
    }

    #[test]
    fn random_ids_are_valid_and_distinct() {
        let a = random_id().expect("random");
        assert!(webproxy_protocol::validate_id(&a).is_ok());
        assert_ne!(a, random_id().expect("random"));
    }

    #[test]
    fn tokens_come_as_bearer_or_whole_in_a_routes_own_header() {
        assert_eq!(presented("Bearer abc", true), Some("abc"));
        assert_eq!(presented("bearer  abc ", true), Some("abc"));
        assert_eq!(presented("abc", true), None);
        assert_eq!(presented("Basic abc", true), None);
        assert_eq!(presented("abc", false), Some("abc"));
        assert_eq!(presented("Bearer abc", false), Some("abc"));
        assert!(token_matches("abc", "abc"));
        assert!(!token_matches("abd", "abc"));
        assert!(!token_matches("", "abc"));
    }
}
