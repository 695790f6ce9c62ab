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

fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escape = "\\.+*?()|[]{}^$".contains(c);
            escape.then_some('\\').into_iter().chain(std::iter::once(c))
        })
        .collect()
}
