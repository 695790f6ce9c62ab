//! Loads the configuration in figment layers, lowest first: the compiled-in
//! `config/default.toml`, the `--config` file, then `WEBPROXY_` environment variables
//! with `__` between levels.

use std::path::Path;

use crate::config::{Config, Settings};
use anyhow::{Context as _, bail};
use figment::Figment;
use figment::providers::{Env, Format as _, Toml};
use serde::Serialize;
use webproxy_dispatcher::RuleAction;

/// Every key with its default, commented.
pub const DEFAULT_CONFIG: &str = include_str!("../../../config/default.toml");

/// The layers, unvalidated.
pub fn figment(path: Option<&Path>) -> anyhow::Result<Figment> {
    let mut figment = Figment::from(Toml::string(DEFAULT_CONFIG));
    if let Some(path) = path {
        if !path.is_file() {
            bail!(
                "config file {} does not exist or is not a file",
                path.display()
            );
        }
        figment = figment.merge(Toml::file_exact(path));
    }
    // WEBPROXY_TEST_HOOK switches on the test builds' fault-injection hooks; it is
    // not a configuration key.
    Ok(figment.merge(
        Env::prefixed("WEBPROXY_")
            .ignore(&["TEST_HOOK"])
            .split("__"),
    ))
}

/// Loads and validates the configuration; errors name the key.
pub fn load(path: Option<&Path>) -> anyhow::Result<Settings> {
    let config: Config = figment(path)?
        .extract()
        .map_err(|e| anyhow::anyhow!(describe(e)))
        .context("invalid configuration")?;
    config.validate().context("invalid configuration")
}

/// figment's errors, one line each, with the key path spelled out.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let source = e
                .metadata
                .as_ref()
                .and_then(|m| m.source.as_ref())
                .map(|s| format!(" (from {s})"))
                .unwrap_or_default();
            if key.is_empty() {
                format!("{}{source}", e.kind)
            } else {
                format!("{key}: {}{source}", e.kind)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[derive(Serialize)]
struct EffectiveRule<'a> {
    name: &'a str,
    method: &'a str,
    url_pattern: &'a str,
    action: RuleAction,
    pool: &'a str,
    timeout: String,
    retry: &'a webproxy_dispatcher::RetryPolicy,
    follow_redirects: u32,
    /// The one origin the rule's requests may go to.
    #[serde(skip_serializing_if = "Option::is_none")]
    origin: Option<String>,
    /// Where each injected header comes from; never its value.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    inject_headers: std::collections::BTreeMap<&'a str, &'a webproxy_dispatcher::SecretSource>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    deny_request_headers: &'a [String],
}

#[derive(Serialize)]
struct Effective<'a> {
    nats: &'a crate::nats_auth::NatsConfig,
    streams: &'a webproxy_dispatcher::StreamsConfig,
    outbound: &'a webproxy_dispatcher::OutboundConfig,
    pools: &'a std::collections::BTreeMap<String, webproxy_dispatcher::PoolConfig>,
    request_rules: Vec<EffectiveRule<'a>>,
    warnings: &'a [String],
}

/// Prints the effective pools and rules, as `check-config` does, with `warnings` (from
/// [`Settings::warnings`]) on stderr and, with `json`, in the output too.
pub fn print_effective(settings: &Settings, warnings: &[String], json: bool) -> anyhow::Result<()> {
    for warning in warnings {
        eprintln!("warning: {warning}");
    }
    let rules = settings
        .dispatcher
        .cluster
        .rules
        .iter()
        .map(|r| EffectiveRule {
            name: &r.name,
            method: r.method.map_or("*", |m| m.as_str()),
            url_pattern: r.pattern.as_str(),
            action: r.action,
            pool: &r.pool,
            timeout: humantime::format_duration(r.timeout).to_string(),
            retry: &r.retry,
            follow_redirects: r.security.follow_redirects,
            origin: r.security.origin.as_ref().map(|o| o.ascii_serialization()),
            inject_headers: r
                .security
                .inject
                .iter()
                .map(|(name, source)| (name.as_str(), source))
                .collect(),
            deny_request_headers: &r.security.deny_request_headers,
        })
        .collect();
    let effective = Effective {
        nats: &settings.config.nats,
        streams: &settings.config.streams,
        outbound: &settings.config.outbound,
        pools: &settings.dispatcher.cluster.pools,
        request_rules: rules,
        warnings,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&effective)?);
        return Ok(());
    }
    if warnings.is_empty() {
        println!("configuration is valid");
    } else {
        println!("configuration is valid, with {} warnings", warnings.len());
    }
    println!("prefix: {}", settings.dispatcher.subjects.prefix());
    let guard = &settings.dispatcher.cluster.outbound.guard;
    let nets = |nets: &[ipnet::IpNet]| {
        nets.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "address guard: private networks {}; allow [{}]; deny [{}]",
        if guard.allow_private_networks {
            "allowed"
        } else {
            "denied"
        },
        nets(&guard.allow),
        nets(&guard.deny)
    );
    println!("pools:");
    for (name, pool) in &settings.dispatcher.cluster.pools {
        let waiting = pool
            .max_waiting
            .map_or("unlimited".to_string(), |m| m.to_string());
        println!(
            "  {name}: max_in_flight={} max_waiting={waiting} subject={}",
            pool.max_in_flight,
            settings.dispatcher.subjects.request(name)
        );
    }
    if effective.request_rules.is_empty() {
        println!("request rules: none (every request is denied)");
    } else {
        println!("request rules (the first whose method and pattern match decides):");
        for rule in &effective.request_rules {
            let action = match rule.action {
                RuleAction::Accept => "accept",
                RuleAction::Deny => "deny",
            };
            println!(
                "  {}: {} {} -> {action} pool={} timeout={} max_retries={} retry_delay={} backoff_factor={} max_retry_delay={} jitter={}",
                rule.name,
                rule.method,
                rule.url_pattern,
                rule.pool,
                rule.timeout,
                rule.retry.max_retries,
                humantime::format_duration(rule.retry.retry_delay),
                rule.retry.backoff_factor,
                humantime::format_duration(rule.retry.max_retry_delay),
                rule.retry.jitter
            );
            if let Some(origin) = &rule.origin {
                println!("    sends only to the origin {origin}");
            }
            if rule.follow_redirects > 0 {
                println!("    follows up to {} redirects", rule.follow_redirects);
            }
            for (name, source) in &rule.inject_headers {
                let prefix = if source.prefix.is_empty() {
                    String::new()
                } else {
                    format!(" after the prefix {:?}", source.prefix)
                };
                println!("    injects {name} from the {source}{prefix} (value not shown)");
            }
            if !rule.deny_request_headers.is_empty() {
                println!("    drops headers {}", rule.deny_request_headers.join(", "));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
// figment::Jail's closures must return figment's own (large) error type.
#[allow(clippy::result_large_err)]
mod tests {
    use std::io::Write as _;

    use super::*;

    /// Runs `f` holding figment's jail lock: other tests set `WEBPROXY_*` variables in
    /// the process environment inside a jail, and a load outside one could read them.
    fn jailed<T>(f: impl FnOnce() -> T) -> T {
        let mut out = None;
        figment::Jail::expect_with(|_| {
            out = Some(f());
            Ok(())
        });
        out.expect("the jailed closure ran")
    }

    fn load_text(text: &str) -> anyhow::Result<Settings> {
        let mut file = tempfile::NamedTempFile::new()?;
        file.write_all(text.as_bytes())?;
        jailed(|| load(Some(file.path())))
    }

    fn error_of(text: &str) -> String {
        match load_text(text) {
            Ok(_) => panic!("expected an error for {text}"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn defaults_alone_are_valid() {
        let settings = jailed(|| load(None)).expect("defaults load");
        assert_eq!(settings.dispatcher.subjects.prefix(), "webproxy");
        assert_eq!(
            settings.dispatcher.cluster.pools["default"].max_in_flight,
            256
        );
        assert_eq!(settings.dispatcher.cluster.rules.iter().count(), 0);
    }

    #[test]
    fn example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/webproxy.toml");
        let settings = jailed(|| load(Some(&path))).expect("example loads");
        assert!(settings.dispatcher.cluster.pools.contains_key("default"));
        assert!(settings.dispatcher.cluster.rules.iter().count() > 0);
        assert!(settings.warnings().is_empty(), "{:?}", settings.warnings());
    }

    #[test]
    fn bad_pattern_names_the_rule_and_key() {
        let e = error_of("[[request_rules]]\nname = \"broken\"\nurl_pattern = \"(\"\n");
        assert!(e.contains("request_rules[0] (broken).url_pattern"), "{e}");
        assert!(e.contains("regex"), "{e}");
    }

    #[test]
    fn unknown_pool_names_the_rule_and_pool() {
        let e = error_of("[[request_rules]]\nname = \"r\"\nurl_pattern = \".\"\npool = \"nope\"\n");
        assert!(e.contains("request_rules[0] (r).pool"), "{e}");
        assert!(e.contains("nope"), "{e}");
    }

    #[test]
    fn bad_duration_names_the_key() {
        let e = error_of("[service]\nack_wait = \"soon\"\n");
        assert!(e.contains("service.ack_wait"), "{e}");
        let e = error_of(
            "[[request_rules]]\nname = \"r\"\nurl_pattern = \".\"\ntimeout = \"5 parsecs\"\n",
        );
        assert!(e.contains("request_rules.0.timeout"), "{e}");
    }

    #[test]
    fn unknown_key_is_named() {
        let e = error_of("[nats]\nurl = \"nats://127.0.0.1:4222\"\nsurl = 1\n");
        assert!(e.contains("surl"), "{e}");
    }

    #[test]
    fn environment_overrides_file_and_defaults() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("webproxy.toml", "[nats]\nurl = \"nats://file:4222\"\n")?;
            jail.set_env("WEBPROXY_NATS__URL", "nats://env:4222");
            jail.set_env("WEBPROXY_POOLS__P1__MAX_IN_FLIGHT", "3");
            let settings = load(Some(Path::new("webproxy.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(settings.config.nats.url, "nats://env:4222");
            assert_eq!(settings.dispatcher.cluster.pools["p1"].max_in_flight, 3);
            Ok(())
        });
    }

    #[test]
    fn unknown_environment_key_is_rejected() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("WEBPROXY_SERVICE_HOST", "10.0.0.1");
            let e = format!("{:#}", load(None).err().ok_or("accepted")?);
            assert!(e.contains("service_host"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn an_injecting_rule_without_origin_or_with_plain_http_is_refused() {
        let rule = "[[request_rules]]\nname = \"partner\"\nurl_pattern = '^https://api\\.partner\\.com/'\n";
        let inject = "[request_rules.inject_headers]\nAuthorization = { env = \"T\" }\n";
        let e = error_of(&format!("{rule}{inject}"));
        assert!(e.contains("request_rules[0] (partner).origin"), "{e}");
        assert!(
            e.contains("add origin = \"https://api.partner.com\""),
            "{e}"
        );
        let e = error_of(&format!(
            "{rule}origin = \"http://api.partner.com\"\n{inject}"
        ));
        assert!(e.contains("request_rules[0] (partner).origin"), "{e}");
        assert!(e.contains("allow_http = true"), "{e}");
        let settings = load_text(&format!(
            "{rule}origin = \"https://api.partner.com\"\n{inject}"
        ))
        .expect("valid");
        assert!(settings.warnings().is_empty(), "{:?}", settings.warnings());
    }

    #[test]
    fn warnings_name_the_rule_or_key() {
        let settings = load_text(
            "[nats]\nuser = \"webproxy\"\npassword = \"pw\"\n\n\
             [[request_rules]]\nname = \"no-admin\"\nurl_pattern = '^https://a\\.test/admin/'\naction = \"deny\"\n\
             [[request_rules]]\nname = \"health\"\nurl_pattern = '^https://a\\.test/admin/health'\n\
             [[request_rules]]\nname = \"loose\"\nurl_pattern = 'https://b.test/'\n",
        )
        .expect("valid");
        let warnings = settings.warnings();
        let has = |key: &str, what: &str| {
            warnings
                .iter()
                .any(|w| w.starts_with(key) && w.contains(what))
        };
        assert!(
            has("request_rules[1] (health)", "never matches"),
            "{warnings:?}"
        );
        assert!(
            has("request_rules[2] (loose).url_pattern", "not anchored"),
            "{warnings:?}"
        );
        assert!(
            has("request_rules[2] (loose).url_pattern", "unescaped '.'"),
            "{warnings:?}"
        );
        assert!(has("streams.reply_to_allow", "credentials"), "{warnings:?}");
        assert_eq!(warnings.len(), 4, "{warnings:?}");
        let allowed = load_text(
            "[nats]\nuser = \"webproxy\"\npassword = \"pw\"\n[streams]\nreply_to_allow = [\"callers.*.replies.>\"]\n",
        )
        .expect("valid");
        assert!(allowed.warnings().is_empty(), "{:?}", allowed.warnings());
        assert!(
            jailed(|| load(None))
                .expect("defaults")
                .warnings()
                .is_empty()
        );
    }

    #[test]
    fn default_pool_exists_beside_others() {
        let settings = load_text("[pools.p1]\nmax_in_flight = 1\n").expect("loads");
        assert!(settings.dispatcher.cluster.pools.contains_key("default"));
        assert_eq!(settings.dispatcher.cluster.pools["p1"].max_in_flight, 1);
    }
}
