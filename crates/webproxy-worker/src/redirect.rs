//! Where a redirect leads, decided by pure code: which statuses are followed, the
//! next leg's method, URL and body. Whether the leg may be taken (rules, budget,
//! guard) is decided by the caller.

use url::Url;
use webproxy_protocol::Method;

/// The next leg of a redirect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NextLeg {
    pub(crate) method: Method,
    pub(crate) url: Url,
    /// Whether the body (and its content headers) go along.
    pub(crate) keep_body: bool,
}

/// What a response means for the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Redirect {
    /// Not a redirect to follow: deliver the response.
    None,
    /// Follow to this leg.
    Follow(NextLeg),
    /// A redirect to somewhere webproxy never goes (not http or https).
    Refused(String),
    /// A redirect to an http(s) URL webproxy does not send (user information, an
    /// empty path segment, an encoded `/`, a host ending in a dot): `invalid_request`,
    /// as the same URL from a caller would be.
    Invalid(String),
}

/// The redirect, if any, in a response to `method url`. The next URL is canonical
/// (see [`webproxy_protocol::canonical_url`]), as a caller's is. 301, 302 and 303 turn a
/// request other than GET or HEAD into a GET without a body (303 turns everything
/// but HEAD into GET); 307 and 308 keep method and body. A 3xx without a usable
/// `Location` is delivered as it is.
pub(crate) fn redirect(method: Method, url: &Url, status: u16, location: Option<&str>) -> Redirect {
    if !matches!(status, 301 | 302 | 303 | 307 | 308) {
        return Redirect::None;
    }
    let Some(location) = location.map(str::trim).filter(|l| !l.is_empty()) else {
        return Redirect::None;
    };
    let Ok(next) = url.join(location) else {
        return Redirect::None;
    };
    if !matches!(next.scheme(), "http" | "https") || next.host().is_none() {
        return Redirect::Refused(format!(
            "the upstream redirected to {location:?}, which is not an http or https URL"
        ));
    }
    let next = match webproxy_protocol::canonical_url(next) {
        Ok(next) => next,
        Err(why) => {
            return Redirect::Invalid(format!("the upstream redirected to a URL that {why}"));
        }
    };
    let (method, keep_body) = match status {
        307 | 308 => (method, true),
        303 if method != Method::Head => (Method::Get, false),
        _ if matches!(method, Method::Get | Method::Head) => (method, false),
        _ => (Method::Get, false),
    };
    Redirect::Follow(NextLeg {
        method,
        url: next,
        keep_body,
    })
}

/// Headers that describe a body, dropped with it.
pub(crate) fn is_content_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower.starts_with("content-")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> Url {
        Url::parse(text).expect("url")
    }

    fn follow(method: Method, status: u16, location: &str) -> NextLeg {
        match redirect(
            method,
            &url("http://a.test/x/y?q=1"),
            status,
            Some(location),
        ) {
            Redirect::Follow(leg) => leg,
            other => panic!("{method} {status} {location}: {other:?}"),
        }
    }

    #[test]
    fn only_the_five_redirect_statuses_are_followed() {
        for status in [200, 300, 304, 305, 306, 309, 400] {
            assert_eq!(
                redirect(Method::Get, &url("http://a.test/"), status, Some("/b")),
                Redirect::None,
                "{status}"
            );
        }
        for status in [301, 302, 303, 307, 308] {
            assert!(matches!(
                redirect(Method::Get, &url("http://a.test/"), status, Some("/b")),
                Redirect::Follow(_)
            ));
        }
    }

    #[test]
    fn methods_and_bodies_per_status() {
        for status in [301, 302] {
            let leg = follow(Method::Post, status, "/b");
            assert_eq!((leg.method, leg.keep_body), (Method::Get, false));
            let leg = follow(Method::Delete, status, "/b");
            assert_eq!((leg.method, leg.keep_body), (Method::Get, false));
            let leg = follow(Method::Head, status, "/b");
            assert_eq!((leg.method, leg.keep_body), (Method::Head, false));
        }
        let leg = follow(Method::Put, 303, "/b");
        assert_eq!((leg.method, leg.keep_body), (Method::Get, false));
        let leg = follow(Method::Head, 303, "/b");
        assert_eq!((leg.method, leg.keep_body), (Method::Head, false));
        for status in [307, 308] {
            let leg = follow(Method::Post, status, "/b");
            assert_eq!((leg.method, leg.keep_body), (Method::Post, true));
        }
    }

    #[test]
    fn locations_resolve_against_the_current_url() {
        assert_eq!(
            follow(Method::Get, 302, "z").url.as_str(),
            "http://a.test/x/z"
        );
        assert_eq!(
            follow(Method::Get, 302, "/z").url.as_str(),
            "http://a.test/z"
        );
        assert_eq!(
            follow(Method::Get, 302, "//b.test/z").url.as_str(),
            "http://b.test/z"
        );
        assert_eq!(
            follow(Method::Get, 302, "https://B.test:443/z#frag")
                .url
                .as_str(),
            "https://b.test/z"
        );
        // The URL parser normalises the leg as it did the first URL.
        assert_eq!(
            follow(Method::Get, 302, "http://2130706433/").url.as_str(),
            "http://127.0.0.1/"
        );
    }

    #[test]
    fn unusable_or_foreign_locations() {
        let base = url("http://a.test/");
        assert_eq!(redirect(Method::Get, &base, 302, None), Redirect::None);
        assert_eq!(
            redirect(Method::Get, &base, 302, Some("  ")),
            Redirect::None
        );
        assert_eq!(
            redirect(Method::Get, &base, 302, Some("http://[::1")),
            Redirect::None
        );
        for location in [
            "file:///etc/passwd",
            "gopher://a.test/",
            "data:text/plain,x",
        ] {
            assert!(
                matches!(
                    redirect(Method::Get, &base, 302, Some(location)),
                    Redirect::Refused(_)
                ),
                "{location}"
            );
        }
    }

    #[test]
    fn legs_are_canonical_and_refused_like_a_callers_url() {
        assert_eq!(
            follow(Method::Get, 302, "/%61dmin/").url.as_str(),
            "http://a.test/admin/"
        );
        for location in [
            "http://u:p@a.test/",
            "https://user@b.test/x",
            "//a.test//admin",
            "/x/%2Fadmin",
            "http://a.test./",
        ] {
            match redirect(Method::Get, &url("http://a.test/"), 302, Some(location)) {
                Redirect::Invalid(why) => {
                    assert!(!why.contains("u:p"), "{why}");
                }
                other => panic!("{location}: {other:?}"),
            }
        }
    }

    #[test]
    fn content_headers() {
        assert!(is_content_header("Content-Type"));
        assert!(is_content_header("content-encoding"));
        assert!(!is_content_header("Accept"));
    }
}
