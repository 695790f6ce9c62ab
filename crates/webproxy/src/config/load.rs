//! Loads the configuration in figment layers, lowest first: the compiled-in
//! `config/default.toml`, the `--config` file, then `WEBPROXY_` environment variables
//! with `__` between levels; then lays the NATS connection settings of the flags and
//! the nats CLI's variables (`crate::config::connection`) over `[nats]`.

use std::path::Path;

use crate::config::connection::Layer;
use crate::config::schema::{Config, Settings};
use anyhow::{Context as _, bail};
use figment::providers::{Env, Format as _, Serialized, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::Serialize;
use webproxy_config::{ResponseRulesSource, RuleAction, key_path};

/// Every key with its default, commented.
pub(crate) const DEFAULT_CONFIG: &str = include_str!("../../../../config/default.toml");

/// The prefix of the configuration's environment variables.
const PREFIX: &str = "WEBPROXY_";

/// Variables under the prefix that are not configuration: the test builds'
/// fault-injection hooks, and the tests' paths to the binary and to an old nats-server.
const NOT_CONFIGURATION: [&str; 6] = [
    "WEBPROXY_TEST_HOOK",
    "WEBPROXY_TEST_CLOCK_OFFSET",
    "WEBPROXY_TEST_PROGRESS_OUTAGE",
    "WEBPROXY_TEST_OWNER_WAIT",
    "WEBPROXY_BIN",
    "WEBPROXY_OLD_NATS_SERVER",
];

/// The variables that name a key: `WEBPROXY_<SECTION>__<KEY>`. Every key lives in a
/// section, so a variable without `__` is never one (see [`stray_variables`]).
fn key_variables() -> Env {
    Env::prefixed(PREFIX)
        .filter(|key| key.as_str().contains("__"))
        .split("__")
}

/// `[nats]` holds only strings (URLs, names, secrets and paths), which are taken as
/// written: figment reads a variable's value as TOML would, so a token `007` would
/// become the number 7 and a password `1.50` the number 1.5.
fn is_raw(key: &str) -> bool {
    key.to_ascii_lowercase().starts_with("nats.")
}

/// The `[nats]` variables, each value the string the environment holds.
struct RawVariables;

impl Provider for RawVariables {
    fn metadata(&self) -> Metadata {
        Metadata::named(format!("`{PREFIX}NATS__*` environment variable(s)"))
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        key_variables()
            .iter()
            .filter(|(key, _)| is_raw(key.as_str()))
            .fold(Figment::new(), |figment, (key, value)| {
                figment.merge(Serialized::default(key.as_str(), value))
            })
            .data()
    }
}

/// The layers, unvalidated.
pub(crate) fn figment(path: Option<&Path>) -> anyhow::Result<Figment> {
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
    Ok(figment
        .merge(key_variables().filter(|key| !is_raw(key.as_str())))
        .merge(RawVariables))
}

/// The names of the process's `WEBPROXY_` variables.
fn prefixed_variables() -> Vec<String> {
    std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| variable_key(name).is_some())
        .collect()
}

/// The key a variable would set (`WEBPROXY_NATS__URL` sets `nats.url`), matching the
/// prefix without regard to case, as figment does.
fn variable_key(name: &str) -> Option<String> {
    let prefix = name.get(..PREFIX.len())?;
    prefix
        .eq_ignore_ascii_case(PREFIX)
        .then(|| name[PREFIX.len()..].to_ascii_lowercase().replace("__", "."))
}

/// A warning for each variable under the prefix that cannot be a key and is not one
/// of [`NOT_CONFIGURATION`]; such variables are ignored. A Kubernetes Service named
/// webproxy injects `WEBPROXY_SERVICE_HOST` and `WEBPROXY_PORT`, for example.
fn stray_variables(names: &[String]) -> Vec<String> {
    let mut stray: Vec<&String> = names
        .iter()
        .filter(|name| !name[PREFIX.len()..].contains("__"))
        .filter(|name| {
            !NOT_CONFIGURATION
                .iter()
                .any(|n| n.eq_ignore_ascii_case(name))
        })
        .collect();
    stray.sort();
    stray
        .into_iter()
        .map(|name| {
            format!(
                "{name} is not a configuration variable (those are {PREFIX}<SECTION>__<KEY>); ignored"
            )
        })
        .collect()
}

/// Loads and validates the configuration, with `connection` laid over `[nats]`;
/// errors name the key, and the variable when one set it.
pub(crate) fn load(path: Option<&Path>, connection: &Layer) -> anyhow::Result<Settings> {
    let variables = prefixed_variables();
    let figment = figment(path)?;
    let mut config: Config = figment
        .extract()
        .map_err(|e| anyhow::anyhow!(describe(e, &variables, &figment)))
        .context("invalid configuration")?;
    connection.apply(&mut config.nats);
    let mut settings = config.validate().context("invalid configuration")?;
    settings.environment_warnings = stray_variables(&variables);
    let file: Value = match path {
        Some(path) => {
            let file = Figment::from(Toml::file_exact(path));
            file.extract()
                .map_err(|e| anyhow::anyhow!(describe(e, &variables, &file)))?
        }
        None => Value::from(Dict::new()),
    };
    settings.cluster_keys_set = cluster_keys_set(&file, &variables);
    Ok(settings)
}

/// The cluster sections (those of a cluster document) that `file` sets, then the
/// variables among `variables` that set a cluster key: what `[config] source = "kv"`
/// ignores once the bucket holds a document.
fn cluster_keys_set(file: &Value, variables: &[String]) -> Vec<String> {
    let is_cluster_key = |key: &str| {
        crate::config::schema::SECTIONS.iter().any(|(_, path)| {
            key.strip_prefix(path)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        })
    };
    let mut set: Vec<String> = crate::config::schema::SECTIONS
        .iter()
        .filter(|(_, path)| file.find_ref(path).is_some())
        .map(|(name, _)| name.to_string())
        .collect();
    let mut named: Vec<String> = variables
        .iter()
        .filter(|name| variable_key(name).is_some_and(|key| is_cluster_key(&key)))
        .cloned()
        .collect();
    named.sort();
    set.extend(named);
    set
}

/// figment's errors, one line each, with the key written as every message writes it
/// (`request_rules[0] (local-echo).timeout`, the rule's name read from `data`). An
/// unknown key that one of `variables` set names that variable: it is probably
/// misspelt.
pub(crate) fn describe(error: figment::Error, variables: &[String], data: &Figment) -> String {
    error
        .into_iter()
        .map(|e| {
            // For an unknown field, figment's path ends with the field.
            if let figment::error::Kind::UnknownField(..) = &e.kind {
                let key = e.path.join(".");
                if let Some(name) = variables
                    .iter()
                    .find(|name| variable_key(name).as_deref() == Some(key.as_str()))
                {
                    return format!("{name} is not a configuration key ({key})");
                }
            }
            let key = key_path(&e.path, |element| element_name(data, element));
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

/// The `name` of the array element at `path` (figment's segments, an index as digits)
/// in `data`, when it has one.
fn element_name(data: &Figment, path: &[&str]) -> Option<String> {
    let (first, rest) = path.split_first()?;
    let root = data.find_value(first).ok()?;
    let mut value = &root;
    for segment in rest {
        value = match value {
            Value::Dict(_, dict) => dict.get(*segment)?,
            Value::Array(_, array) => array.get(segment.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    value.find_ref("name")?.as_str().map(str::to_owned)
}

#[derive(Serialize)]
struct EffectiveRule<'a> {
    name: &'a str,
    method: &'a str,
    url_pattern: &'a str,
    action: RuleAction,
    pool: &'a str,
    timeout: String,
    retry: &'a webproxy_config::RetryPolicy,
    follow_redirects: u32,
    /// The one origin the rule's requests may go to.
    #[serde(skip_serializing_if = "Option::is_none")]
    origin: Option<String>,
    /// Where each injected header comes from; never its value.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    inject_headers: std::collections::BTreeMap<&'a str, &'a webproxy_config::SecretSource>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    deny_request_headers: &'a [String],
    /// Whether a `;` in the path may be sent.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    allow_path_parameters: bool,
    /// What the rule's responses mean, and whether that is its own list, the global
    /// one or the defaults.
    response_rules: webproxy_config::AppliedResponseRules,
}

#[derive(Serialize)]
struct Effective<'a> {
    nats: &'a crate::config::nats_auth::NatsConfig,
    streams: &'a webproxy_config::StreamsConfig,
    outbound: &'a webproxy_config::OutboundConfig,
    pools: &'a std::collections::BTreeMap<String, webproxy_config::PoolConfig>,
    request_rules: Vec<EffectiveRule<'a>>,
    /// `webproxy gateway`'s part; tokens and key by their source, never their values.
    gateway: &'a crate::config::gateway::GatewayConfig,
    warnings: &'a [String],
}

/// Prints the effective pools and rules, as `check-config` does, with `warnings` (from
/// [`Settings::warnings`]) on stderr and, with `json`, in the output too.
pub(crate) fn print_effective(
    settings: &Settings,
    warnings: &[String],
    json: bool,
) -> anyhow::Result<()> {
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
            allow_path_parameters: r.security.allow_path_parameters,
            response_rules: r.applied_response_rules(),
        })
        .collect();
    let effective = Effective {
        nats: &settings.config.nats,
        streams: &settings.config.streams,
        outbound: &settings.config.outbound,
        pools: &settings.dispatcher.cluster.pools,
        request_rules: rules,
        gateway: &settings.config.gateway,
        warnings,
    };
    if json {
        outln!("{}", serde_json::to_string_pretty(&effective)?)?;
        return Ok(());
    }
    if warnings.is_empty() {
        outln!("configuration is valid")?;
    } else {
        let plural = if warnings.len() == 1 { "" } else { "s" };
        outln!(
            "configuration is valid, with {} warning{plural}",
            warnings.len()
        )?;
    }
    outln!("prefix: {}", settings.dispatcher.subjects.prefix())?;
    let guard = &settings.dispatcher.cluster.outbound.guard;
    let nets = |nets: &[ipnet::IpNet]| {
        nets.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    outln!(
        "address guard: private networks {}; allow [{}]; deny [{}]",
        if guard.allow_private_networks {
            "allowed"
        } else {
            "denied"
        },
        nets(&guard.allow),
        nets(&guard.deny)
    )?;
    outln!("pools:")?;
    for (name, pool) in &settings.dispatcher.cluster.pools {
        let waiting = pool
            .max_waiting
            .map_or("unlimited".to_string(), |m| m.to_string());
        outln!(
            "  {name}: max_in_flight={} max_waiting={waiting} subject={}",
            pool.max_in_flight,
            settings.dispatcher.subjects.request(name)
        )?;
    }
    if effective.request_rules.is_empty() {
        outln!("request rules: none (every request is denied)")?;
    } else {
        outln!("request rules (the first whose method and pattern match decides):")?;
        for rule in &effective.request_rules {
            let action = match rule.action {
                RuleAction::Accept => "accept",
                RuleAction::Deny => "deny",
            };
            outln!(
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
            )?;
            if let Some(origin) = &rule.origin {
                outln!("    sends only to the origin {origin}")?;
            }
            if rule.follow_redirects > 0 {
                outln!("    follows up to {} redirects", rule.follow_redirects)?;
            }
            for (name, source) in &rule.inject_headers {
                let prefix = if source.prefix.is_empty() {
                    String::new()
                } else {
                    format!(" after the prefix {:?}", source.prefix)
                };
                outln!("    injects {name} from the {source}{prefix} (value not shown)")?;
            }
            if !rule.deny_request_headers.is_empty() {
                outln!("    drops headers {}", rule.deny_request_headers.join(", "))?;
            }
            if rule.allow_path_parameters {
                outln!("    sends a ';' in the path (allow_path_parameters)")?;
            }
            if rule.action == RuleAction::Accept {
                let source = match rule.response_rules.source {
                    ResponseRulesSource::Own => "its own",
                    ResponseRulesSource::Global => "global",
                    ResponseRulesSource::Default => "default",
                };
                outln!(
                    "    response rules ({source}): {}",
                    rule.response_rules.summary()
                )?;
            }
        }
    }
    print_gateway(&settings.config.gateway, &settings.gateway)
}

/// The gateway's routes, as `webproxy gateway` would serve them.
fn print_gateway(
    config: &crate::config::gateway::GatewayConfig,
    gateway: &crate::config::gateway::Gateway,
) -> anyhow::Result<()> {
    if gateway.routes.is_empty() {
        return outln!("gateway routes: none");
    }
    outln!(
        "gateway routes (`webproxy gateway` on {}, health on {}; the longest matching path decides):",
        config.listen,
        config.health_listen
    )?;
    for route in &gateway.routes {
        let who = match &route.token {
            Some(source) => format!("token from the {source} in {}", route.token_header),
            None if gateway.allow_sources.is_empty() => "open to anyone who can connect".into(),
            None => "no token; only allow_sources may connect".into(),
        };
        outln!(
            "  {} -> {} pool={} ({who})",
            route.path,
            route.upstream,
            route.pool
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod default_toml;

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
        jailed(|| load(Some(file.path()), &Layer::default()))
    }

    fn error_of(text: &str) -> String {
        match load_text(text) {
            Ok(_) => panic!("expected an error for {text}"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn defaults_alone_are_valid() {
        let settings = jailed(|| load(None, &Layer::default())).expect("defaults load");
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
        let settings = jailed(|| load(Some(&path), &Layer::default())).expect("example loads");
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
        assert!(e.contains("request_rules[0] (r).timeout: "), "{e}");
        // A response rule's key within its request rule, and an element with no name.
        let e = error_of(
            "[[request_rules]]\nname = \"r\"\nurl_pattern = \".\"\n[[request_rules]]\nname = \"api\"\nurl_pattern = \"^x\"\n[[request_rules.response_rules]]\nstatus = \"503\"\naction = \"retry\"\n[[request_rules.response_rules]]\nstatus = \"500\"\naction = \"nope\"\n",
        );
        assert!(
            e.contains("request_rules[1] (api).response_rules[1].action: "),
            "{e}"
        );
        let e = error_of("[[response_rules]]\nstatus = \"500\"\naction = \"nope\"\n");
        assert!(e.contains("response_rules[0].action: "), "{e}");
        assert!(!e.contains("response_rules.0"), "{e}");
    }

    #[test]
    fn the_cluster_sections_a_file_and_the_environment_set_are_named() {
        let file: figment::value::Value = Figment::from(Toml::string(
            "[nats]\nurl = \"nats://x:4222\"\n[service]\nmax_deliver = 3\nshutdown_grace = \"5s\"\n[pools.a]\n[[request_rules]]\nname = \"r\"\nurl_pattern = \"x\"\n",
        ))
        .extract()
        .expect("TOML");
        let variables = [
            "WEBPROXY_OUTBOUND__ALLOW_PRIVATE_NETWORKS".to_string(),
            "WEBPROXY_SERVICE__SHUTDOWN_GRACE".to_string(),
            "WEBPROXY_SERVICE__ACK_WAIT".to_string(),
            "WEBPROXY_NATS__URL".to_string(),
        ];
        assert_eq!(
            super::cluster_keys_set(&file, &variables),
            [
                "[service] max_deliver",
                "[pools.*]",
                "[[request_rules]]",
                "WEBPROXY_OUTBOUND__ALLOW_PRIVATE_NETWORKS",
                "WEBPROXY_SERVICE__ACK_WAIT",
            ]
        );
        assert!(super::cluster_keys_set(&Dict::new().into(), &[]).is_empty());
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
            let settings = load(Some(Path::new("webproxy.toml")), &Layer::default())
                .map_err(|e| e.to_string())?;
            assert_eq!(settings.config.nats.url, "nats://env:4222");
            assert_eq!(settings.dispatcher.cluster.pools["p1"].max_in_flight, 3);
            Ok(())
        });
    }

    #[test]
    fn a_variable_that_cannot_be_a_key_only_warns() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("WEBPROXY_SERVICE_HOST", "10.0.0.1");
            jail.set_env("WEBPROXY_X", "1");
            jail.set_env("WEBPROXY_TEST_HOOK", "none");
            let settings = load(None, &Layer::default()).map_err(|e| format!("{e:#}"))?;
            let warnings = settings.warnings();
            assert_eq!(warnings.len(), 2, "{warnings:?}");
            assert!(
                warnings[0].starts_with("WEBPROXY_SERVICE_HOST is not"),
                "{warnings:?}"
            );
            assert!(warnings[1].starts_with("WEBPROXY_X is not"), "{warnings:?}");
            Ok(())
        });
    }

    #[test]
    fn a_misspelt_key_variable_is_refused_by_name() {
        for (variable, expected) in [
            (
                "WEBPROXY_NATS__PASSWRD",
                "WEBPROXY_NATS__PASSWRD is not a configuration key (nats.passwrd)",
            ),
            (
                "WEBPROXY_SERVICE__SHUTDOWN_GRAC",
                "WEBPROXY_SERVICE__SHUTDOWN_GRAC is not a configuration key",
            ),
        ] {
            figment::Jail::expect_with(|jail| {
                jail.set_env(variable, "1s");
                let e = format!(
                    "{:#}",
                    load(None, &Layer::default()).err().ok_or("accepted")?
                );
                assert!(e.contains(expected), "{e}");
                Ok(())
            });
        }
    }

    #[test]
    fn nats_values_are_taken_as_written() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("WEBPROXY_NATS__TOKEN", "007");
            let settings = load(None, &Layer::default()).map_err(|e| format!("{e:#}"))?;
            let token = settings.config.nats.token.as_ref().ok_or("no token")?;
            assert_eq!(token.expose(), "007");
            Ok(())
        });
        figment::Jail::expect_with(|jail| {
            jail.set_env("WEBPROXY_NATS__USER", "1.50");
            jail.set_env("WEBPROXY_NATS__PASSWORD", "1.50");
            jail.set_env("WEBPROXY_POOLS__P1__MAX_IN_FLIGHT", "3");
            let settings = load(None, &Layer::default()).map_err(|e| format!("{e:#}"))?;
            let nats = &settings.config.nats;
            assert_eq!(nats.user.as_deref(), Some("1.50"));
            assert_eq!(nats.password.as_ref().map(|p| p.expose()), Some("1.50"));
            // Other sections' values are still read as TOML values.
            assert_eq!(settings.dispatcher.cluster.pools["p1"].max_in_flight, 3);
            Ok(())
        });
    }

    #[test]
    fn connection_settings_outrank_the_nats_variables() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("WEBPROXY_NATS__URL", "nats://env:4222");
            jail.set_env("WEBPROXY_NATS__TOKEN", "env-token");
            let layer = Layer {
                url: Some("nats://nats-url:4222".into()),
                ..Layer::default()
            };
            let settings = load(None, &layer).map_err(|e| format!("{e:#}"))?;
            assert_eq!(settings.config.nats.url, "nats://nats-url:4222");
            assert!(settings.config.nats.token.is_some());
            Ok(())
        });
    }

    #[test]
    fn unknown_file_keys_are_still_refused() {
        let e = error_of("[nats]\nurl = \"nats://127.0.0.1:4222\"\npasswrd = \"x\"\n");
        assert!(e.contains("passwrd"), "{e}");
        assert!(!e.contains("WEBPROXY_"), "{e}");
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
            "[nats]\nuser = \"webproxy\"\npassword = \"pw\"\n\
             inbox_prefix = \"callers.a._INBOX\"\njs_api_prefix = \"a.API\"\n\n\
             [streams]\nreply_to_allow = [\"callers.{caller}.replies.>\", \"callers.*.replies.>\"]\n\n\
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
        assert!(
            has(
                "streams.reply_to_allow[1] = \"callers.*.replies.>\"",
                "{caller}"
            ),
            "{warnings:?}"
        );
        assert!(has("nats.inbox_prefix", "_WEBPROXY_INBOX"), "{warnings:?}");
        assert!(has("nats.js_api_prefix", "serve"), "{warnings:?}");
        assert_eq!(warnings.len(), 6, "{warnings:?}");
        let allowed = load_text(
            "[nats]\nuser = \"webproxy\"\npassword = \"pw\"\n[streams]\nreply_to_allow = [\"callers.{caller}.replies.>\", \"_INBOX.>\"]\n",
        )
        .expect("valid");
        assert!(allowed.warnings().is_empty(), "{:?}", allowed.warnings());
        assert!(
            jailed(|| load(None, &Layer::default()))
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
