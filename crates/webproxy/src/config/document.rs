//! The cluster document: the cluster part of the configuration as one TOML text with
//! the file's shape (`[outbound]`, `[service]` with only `ack_wait` and `max_deliver`,
//! `[pools.*]`, `[[request_rules]]`, `[[response_rules]]`), as `webproxy config push`
//! writes it into the bucket and `serve` reads it with `[config] source = "kv"`.
//! Parsed over the compiled-in defaults of those sections, unknown keys refused, and
//! validated by `webproxy_config::Settings::new`, as the file's part is. A document
//! names its secrets' sources, never a secret.

use std::collections::BTreeSet;

use anyhow::Context as _;
use figment::Figment;
use figment::providers::{Format as _, Serialized, Toml};
use figment::value::Value;
use webproxy_config::{ConfigError, StreamsConfig, element_key};

use crate::config::schema::ClusterDocument;

/// The compiled-in defaults of the document's sections: what a document leaves out.
fn defaults() -> anyhow::Result<ClusterDocument> {
    let defaults: crate::config::schema::Config = crate::config::load::figment(None)?
        .extract()
        .context("the compiled-in defaults do not parse")?;
    Ok(defaults.document())
}

/// Parses a document over the defaults; an error names the key. Literal secrets are
/// refused before anything else, so that no error message repeats one.
pub(crate) fn parse(text: &str) -> anyhow::Result<ClusterDocument> {
    let figment = Figment::from(Serialized::defaults(defaults()?)).merge(Toml::string(text));
    if let Ok(rules) = Figment::from(Toml::string(text)).find_value("request_rules") {
        refuse_literal_secrets(&rules)?;
    }
    figment
        .extract()
        .map_err(|e| anyhow::anyhow!(crate::config::load::describe(e, &[], &figment)))
}

/// Parses a document and validates it with the process's `[streams]`, exactly as
/// `serve` validates the file's cluster part (the checks across the two parts
/// included).
pub(crate) fn validate(
    text: &str,
    streams: &StreamsConfig,
) -> anyhow::Result<(ClusterDocument, webproxy_config::Settings)> {
    let document = parse(text)?;
    let settings = webproxy_config::Settings::new(streams.clone(), document.clone().into())?;
    Ok((document, settings))
}

/// A document's text: what `serve` seeds an empty bucket with.
pub(crate) fn to_text(document: &ClusterDocument) -> anyhow::Result<String> {
    toml::to_string(document).context("cannot write the cluster part as TOML")
}

/// `inject_headers` values must be `{ env = ... }` or `{ file = ... }`, resolved on
/// each pod: a bucket is read by everyone who may read the configuration. A `prefix`
/// may hold only an authorization scheme and one space (`"Bearer "`), since anything
/// longer could be a secret spelled out.
fn refuse_literal_secrets(rules: &Value) -> Result<(), ConfigError> {
    let Some(rules) = rules.as_array() else {
        return Ok(());
    };
    for (index, rule) in rules.iter().enumerate() {
        let Some(rule) = rule.as_dict() else { continue };
        let Some(headers) = rule.get("inject_headers").and_then(Value::as_dict) else {
            continue;
        };
        let name = rule.get("name").and_then(Value::as_str);
        let rule_key = element_key("request_rules", index, name);
        for (header, source) in headers {
            let key = format!("{rule_key}.inject_headers.{header}");
            let Some(source) = source.as_dict() else {
                return Err(ConfigError::new(
                    key,
                    "is a literal value; a cluster document holds no secrets: write { env = \"VARIABLE\" } or { file = \"/path\" }, which each instance resolves",
                ));
            };
            if let Some(prefix) = source.get("prefix").and_then(Value::as_str)
                && !is_scheme_prefix(prefix)
            {
                return Err(ConfigError::new(
                    format!("{key}.prefix"),
                    "may hold only an authorization scheme and one space (\"Bearer \"); the rest of the value comes from env or file",
                ));
            }
        }
    }
    Ok(())
}

/// Empty, or a token (RFC 9110) of at most 20 characters followed by one space.
fn is_scheme_prefix(prefix: &str) -> bool {
    if prefix.is_empty() {
        return true;
    }
    let Some(scheme) = prefix.strip_suffix(' ') else {
        return false;
    };
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    !scheme.is_empty() && scheme.len() <= 20 && scheme.chars().all(token)
}

/// The pools `current` has and `pushed` leaves out: they keep being served until
/// `webproxy pools remove` deletes them.
pub(crate) fn removed_pools(current: &ClusterDocument, pushed: &ClusterDocument) -> Vec<String> {
    let kept: BTreeSet<&String> = pushed.pools.keys().collect();
    current
        .pools
        .keys()
        .filter(|pool| *pool != "default" && !kept.contains(pool))
        .cloned()
        .collect()
}

/// A unified diff, `old` to `new`, with three lines of context; empty when equal.
pub(crate) fn unified_diff(old: &str, new: &str, old_name: &str, new_name: &str) -> String {
    if old == new {
        return String::new();
    }
    similar::TextDiff::from_lines(old, new)
        .unified_diff()
        .context_radius(3)
        .header(old_name, new_name)
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use webproxy_config::ClusterConfig;

    fn error_of(text: &str) -> String {
        format!("{:#}", parse(text).expect_err("refused"))
    }

    #[test]
    fn a_document_takes_the_defaults_for_what_it_leaves_out() {
        let document = parse("[pools.partner]\nmax_in_flight = 4\n").expect("valid");
        assert_eq!(document.pools["partner"].max_in_flight, 4);
        assert_eq!(document.pools["default"].max_in_flight, 256);
        assert_eq!(document.service.ack_wait, Duration::from_secs(15));
        assert_eq!(document.service.max_deliver, 5);
        assert!(document.request_rules.is_empty());
    }

    #[test]
    fn unknown_keys_and_process_keys_are_refused_by_name() {
        assert!(
            error_of("[pools.a]\nmax_in_flihgt = 3").contains("pools.a.max_in_flihgt"),
            "{}",
            error_of("[pools.a]\nmax_in_flihgt = 3")
        );
        for (text, key) in [
            (
                "[service]\nshutdown_grace = \"5s\"",
                "service.shutdown_grace",
            ),
            (
                "[service]\nsecret_poll_interval = \"5s\"",
                "service.secret_poll_interval",
            ),
            ("[nats]\nurl = \"nats://x\"", "nats"),
            ("[streams]\nreplicas = 3", "streams"),
            ("[outbound]\nmax_headers = \"many\"", "outbound.max_headers"),
        ] {
            let error = error_of(text);
            assert!(error.contains(key), "{key}: {error}");
        }
    }

    #[test]
    fn a_document_is_checked_with_the_process_streams() {
        let streams = |duplicate_window: &str| -> StreamsConfig {
            let config: crate::config::schema::Config = crate::config::load::figment(None)
                .expect("defaults")
                .merge(Toml::string(&format!(
                    "[streams]\nduplicate_window = \"{duplicate_window}\""
                )))
                .extract()
                .expect("config");
            config.streams
        };
        let slow = "[service]\nack_wait = \"90s\"\nmax_deliver = 5\n";
        let error = validate(slow, &streams("2m")).expect_err("2m < 2 x 90s");
        assert!(
            error.to_string().contains("streams.duplicate_window"),
            "{error}"
        );
        assert!(validate(slow, &streams("3m")).is_ok());
        let unknown_pool =
            "[[request_rules]]\nname = \"x\"\nurl_pattern = \"^https://x/\"\npool = \"nope\"\n";
        let error = format!(
            "{:#}",
            validate(unknown_pool, &streams("2m")).expect_err("pool")
        );
        assert!(error.contains("request_rules[0] (x).pool"), "{error}");
    }

    #[test]
    fn literal_secrets_are_refused_without_being_repeated() {
        let rule = |headers: &str| {
            format!(
                "[[request_rules]]\nname = \"partner\"\nurl_pattern = '^https://p\\.example/'\norigin = \"https://p.example\"\n[request_rules.inject_headers]\n{headers}\n"
            )
        };
        let literal = error_of(&rule("Authorization = \"Bearer sk_live_123\""));
        assert!(
            literal.contains("request_rules[0] (partner).inject_headers.Authorization"),
            "{literal}"
        );
        assert!(!literal.contains("sk_live_123"), "{literal}");
        let in_prefix = error_of(&rule(
            "Authorization = { env = \"T\", prefix = \"Bearer sk_live_123 \" }",
        ));
        assert!(
            in_prefix.contains("inject_headers.Authorization.prefix"),
            "{in_prefix}"
        );
        assert!(!in_prefix.contains("sk_live_123"), "{in_prefix}");
        for fine in [
            "Authorization = { env = \"T\", prefix = \"Bearer \" }",
            "X-Api-Key = { file = \"/run/key\" }",
        ] {
            assert!(parse(&rule(fine)).is_ok(), "{fine}");
        }
    }

    #[test]
    fn only_a_scheme_and_a_space_make_a_prefix() {
        for fine in ["", "Bearer ", "Basic ", "Token ", "SSWS "] {
            assert!(is_scheme_prefix(fine), "{fine:?}");
        }
        for refused in [
            "Bearer",
            "Bearer  ",
            "Bearer abc ",
            "sk_live_0123456789abcdef ",
            " ",
            "a=b; ",
        ] {
            assert!(!is_scheme_prefix(refused), "{refused:?}");
        }
    }

    #[test]
    fn the_seeded_text_parses_back_to_the_same_document() {
        let text = "[outbound]\nallow_private_networks = true\n[service]\nack_wait = \"2s\"\nmax_deliver = 3\n[pools.partner]\nmax_in_flight = 4\nqueue_timeout = \"30s\"\n[[request_rules]]\nname = \"partner\"\nurl_pattern = '^https://p\\.example/'\npool = \"partner\"\norigin = \"https://p.example\"\nmax_retries = 1\nidempotency_header = true\n[request_rules.inject_headers]\nAuthorization = { env = \"T\", prefix = \"Bearer \" }\n[[request_rules.response_rules]]\nstatus = \"503\"\naction = \"retry\"\n[[response_rules]]\nstatus = \"500-599\"\naction = \"error\"\n";
        let document = parse(text).expect("valid");
        let written = to_text(&document).expect("TOML");
        assert!(written.starts_with("[outbound]\n"), "{written}");
        let again = parse(&written).expect("the written text parses");
        assert_eq!(to_text(&again).expect("TOML"), written);
        assert_eq!(
            format!("{:?}", ClusterConfig::from(again)),
            format!("{:?}", ClusterConfig::from(document))
        );
    }

    #[test]
    fn removed_pools_are_named_but_default_never() {
        let current = parse("[pools.a]\n[pools.b]\n").expect("valid");
        let pushed = parse("[pools.b]\n[pools.c]\n").expect("valid");
        assert_eq!(removed_pools(&current, &pushed), vec!["a".to_string()]);
        assert!(removed_pools(&pushed, &pushed).is_empty());
    }

    #[test]
    fn the_diff_is_unified_with_context() {
        let diff = unified_diff("a\nb\nc\n", "a\nB\nc\n", "revision 3", "new.toml");
        assert!(diff.starts_with("--- revision 3\n+++ new.toml\n"), "{diff}");
        assert!(diff.contains("-b\n+B\n"), "{diff}");
        assert!(unified_diff("a\n", "a\n", "x", "y").is_empty());
    }
}
