//! Request rules in TOML that open a fixture upstream to the service.

use crate::Upstream;

/// A request rule that accepts everything under `upstream`, in TOML.
pub fn accept_rule(name: &str, upstream: &Upstream) -> String {
    path_rule(name, upstream, "/")
}

/// A request rule that accepts every URL of `upstream` starting with `path`, in TOML;
/// further keys of the rule (`pool`, `max_retries`, ...) may follow it.
pub fn path_rule(name: &str, upstream: &Upstream, path: &str) -> String {
    format!(
        "[[request_rules]]\nname = \"{name}\"\nurl_pattern = '^{}'\n",
        regex_escape(&upstream.url(path))
    )
}

/// [`path_rule`] bound to `upstream`'s origin (`origin`, with `allow_http`, since
/// fixture upstreams speak plain HTTP on loopback): the kind of rule whose attempts a
/// pool's breaker and adaptive limit count.
pub fn origin_rule(name: &str, upstream: &Upstream, path: &str) -> String {
    format!(
        "{}origin = \"{}\"\nallow_http = true\n",
        path_rule(name, upstream, path),
        upstream.url("")
    )
}

fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escape = "\\.+*?()|[]{}^$".contains(c);
            escape.then_some('\\').into_iter().chain(std::iter::once(c))
        })
        .collect()
}
