//! Which route a request path takes, and the upstream URL it becomes (pure): a
//! request to `<path><rest>` goes to `<upstream><rest>` with its query string, and
//! the joined URL must stay under the upstream.

use url::Url;

use crate::config::gateway::Route;

/// The route whose `path` is the longest prefix of `path` on a segment boundary (the
/// rest is empty, starts with `/`, or the route's path ends with `/`), and the rest.
pub(crate) fn find<'a, 'p>(routes: &'a [Route], path: &'p str) -> Option<(&'a Route, &'p str)> {
    routes
        .iter()
        .filter_map(|route| {
            let rest = path.strip_prefix(route.path.as_str())?;
            let boundary = rest.is_empty() || rest.starts_with('/') || route.path.ends_with('/');
            boundary.then_some((route, rest))
        })
        .max_by_key(|(route, _)| route.path.len())
}

/// The upstream URL for `rest` (the request path after the route's) and `query`, in
/// the canonical form the service matches rules against; or why it is refused (400).
/// Refused: an encoded separator (`%2F`, `%5C`) or a backslash anywhere in `rest`,
/// a `.;` or `..;` segment in any spelling (the canonical URL refuses it: Tomcat
/// reads `/pub/..;/admin` as `/admin`, outside the route's upstream), and a join
/// that, once `..` and `%2e%2e` segments are resolved, leaves the upstream's origin
/// or path. A `;` elsewhere in the path stays: whether it may be sent is the request
/// rule's (`allow_path_parameters`), which the service applies (400 from its
/// `invalid_request`).
pub(crate) fn target(route: &Route, rest: &str, query: Option<&str>) -> Result<Url, String> {
    let lower = rest.to_ascii_lowercase();
    if lower.contains("%2f") || lower.contains("%5c") || rest.contains('\\') {
        return Err("the path holds an encoded separator (%2F or %5C) or a backslash".into());
    }
    let base = route.upstream.as_str();
    let mut joined = match (base.ends_with('/'), rest.strip_prefix('/')) {
        (true, Some(stripped)) => format!("{base}{stripped}"),
        _ => format!("{base}{rest}"),
    };
    if let Some(query) = query {
        joined.push('?');
        joined.push_str(query);
    }
    let url = Url::parse(&joined)
        .map_err(|e| format!("the joined URL does not parse: {e}"))
        .and_then(|url| {
            webproxy_protocol::canonical_url(url).map_err(|e| format!("the joined URL {e}"))
        })?;
    if url.origin() != route.upstream.origin() || !under(route.upstream.path(), url.path()) {
        return Err(format!(
            "the path leaves the route's upstream (a .. segment): {} is not under {}",
            url.path(),
            route.upstream.path()
        ));
    }
    Ok(url)
}

/// Whether `path` is `base` or below it.
fn under(base: &str, path: &str) -> bool {
    match path.strip_prefix(base) {
        Some(rest) => rest.is_empty() || base.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(path: &str, upstream: &str) -> Route {
        Route {
            path: path.into(),
            upstream: Url::parse(upstream).expect("url"),
            pool: "default".into(),
            token: None,
            token_header: "proxy-authorization".into(),
            large_bodies: false,
        }
    }

    #[test]
    fn the_longest_path_on_a_segment_boundary_wins() {
        let routes = [route("/api", "http://a/"), route("/api/v2", "http://b/")];
        let found = |path| find(&routes, path).map(|(r, rest)| (r.path.as_str(), rest));
        assert_eq!(found("/api/x"), Some(("/api", "/x")));
        assert_eq!(found("/api"), Some(("/api", "")));
        assert_eq!(found("/api/v2/x"), Some(("/api/v2", "/x")));
        assert_eq!(found("/apix"), None);
        assert_eq!(found("/other"), None);
        let root = [route("/", "http://a/")];
        assert_eq!(find(&root, "/x").map(|(_, rest)| rest), Some("x"));
    }

    #[test]
    fn rest_and_query_join_the_upstream() {
        let r = route("/api", "http://up:8080/base");
        let url = |rest, query| target(&r, rest, query).map(|u| u.to_string());
        assert_eq!(
            url("/a/b", Some("q=1&r=2")).as_deref(),
            Ok("http://up:8080/base/a/b?q=1&r=2")
        );
        assert_eq!(url("", None).as_deref(), Ok("http://up:8080/base"));
        assert_eq!(url("/a/../b", None).as_deref(), Ok("http://up:8080/base/b"));
        let slash = route("/api/", "http://up/base/");
        assert_eq!(
            target(&slash, "x", None).map(|u| u.to_string()).as_deref(),
            Ok("http://up/base/x")
        );
    }

    #[test]
    fn escapes_from_the_upstream_are_refused() {
        let r = route("/api", "http://up/base");
        for rest in [
            "/../admin",
            "/a/../../admin",
            "/%2e%2e/admin",
            "/.%2E/admin",
            "/..%2Fadmin",
            "/..%2fadmin",
            "/..%5cadmin",
            "/..\\admin",
            "x",
        ] {
            assert!(target(&r, rest, None).is_err(), "{rest}");
        }
        for rest in [
            "/..;/admin",
            "/%2e%2e;/admin",
            "/..%3B/admin",
            "/..%3b/admin",
            "/.%2E%3bx/admin",
            "/.;/admin",
        ] {
            let e = target(&r, rest, None).expect_err(rest);
            assert!(e.contains("';' parameter"), "{rest}: {e}");
        }
        // A parameter that is not a dot segment is the rule's to allow or refuse.
        assert_eq!(
            target(&r, "/admin;jsessionid=x/users", None)
                .map(|u| u.to_string())
                .as_deref(),
            Ok("http://up/base/admin;jsessionid=x/users")
        );
        // `x` joined to `/base` is `/basex`: beside the upstream's path, not under it.
        let root = route("/api", "http://up/");
        assert!(target(&root, "/../../etc", None).is_ok_and(|u| u.path() == "/etc"));
    }
}
