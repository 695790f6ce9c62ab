//! The security settings compiled into the form the service runs on: the address
//! guard, request and header limits, dropped headers, a rule's redirect budget,
//! injections and origin. Whether a request is within the limits is the dispatcher's
//! plan; which headers a leg sends is the worker's.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ipnet::IpNet;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use url::{Origin, Url};

use crate::error::{ConfigError, element_key};
use crate::secret_source::SecretSource;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OutboundConfig {
    pub max_response_bytes: ByteLimit,
    /// The largest body a request that set `large_body` may get, stored; absent from
    /// documents older than large bodies.
    #[serde(default = "default_max_large_body")]
    pub max_large_body: u64,
    /// The address guard; see `crate::security`.
    pub allow_private_networks: bool,
    pub allow_cidrs: Vec<String>,
    pub deny_cidrs: Vec<String>,
    /// Request limits: larger requests get `invalid_request`.
    pub max_request_bytes: u64,
    /// Header count and size limits, for requests and responses alike.
    pub max_headers: usize,
    pub max_header_bytes: usize,
    /// Headers dropped from every request, whatever the caller sends.
    pub deny_request_headers: Vec<String>,
    /// The longest one host name lookup may take, a wait for a free slot included.
    #[serde(with = "humantime_serde")]
    pub dns_timeout: Duration,
    /// The most lookups under way at once on this instance.
    pub dns_max_concurrent: usize,
    /// DNS servers (`IP` or `IP:port`) asked instead of /etc/resolv.conf's.
    pub dns_servers: Vec<String>,
}

/// 64 MiB, as `config/default.toml` ships it.
fn default_max_large_body() -> u64 {
    64 << 20
}

impl OutboundConfig {
    /// `max_request_bytes`: the largest request body, which the gateway also refuses
    /// (413) before publishing.
    pub fn max_request_bytes(&self) -> u64 {
        self.max_request_bytes
    }
}

/// `"auto"` (derived from the server's `max_payload`) or a number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum ByteLimit {
    #[serde(serialize_with = "serialize_auto")]
    Auto,
    Bytes(u64),
}

fn serialize_auto<S: serde::Serializer>(s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str("auto")
}

impl<'de> Deserialize<'de> for ByteLimit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct LimitVisitor;
        impl Visitor<'_> for LimitVisitor {
            type Value = ByteLimit;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\" or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteLimit, E> {
                Ok(ByteLimit::Bytes(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteLimit, E> {
                u64::try_from(v)
                    .map(ByteLimit::Bytes)
                    .map_err(|_| E::custom("must not be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteLimit, E> {
                if v == "auto" {
                    Ok(ByteLimit::Auto)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }
        }
        d.deserialize_any(LimitVisitor)
    }
}

/// What may leave this instance.
#[derive(Debug, Clone)]
pub struct Outbound {
    /// Resolved against the server's `max_payload` at start.
    pub max_response_bytes: ByteLimit,
    /// The largest stored body of a request that set `large_body`.
    pub max_large_body: u64,
    pub guard: AddressGuard,
    pub max_request_bytes: u64,
    pub max_headers: usize,
    pub max_header_bytes: usize,
    /// Lower case.
    pub deny_request_headers: Vec<String>,
    /// Host name lookups: `dns_timeout`, `dns_max_concurrent`, `dns_servers`.
    pub dns: DnsBounds,
}

/// `[outbound]`'s address guard keys, checked: which addresses may be connected to.
/// The worker's `GuardPolicy` is made from it; its doc says what each field opens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressGuard {
    pub allow_private_networks: bool,
    pub allow: Vec<IpNet>,
    pub deny: Vec<IpNet>,
}

/// `[outbound]`'s DNS keys, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsBounds {
    pub timeout: Duration,
    pub max_concurrent: usize,
    /// Empty: /etc/resolv.conf's.
    pub servers: Vec<SocketAddr>,
}

impl Default for DnsBounds {
    /// As `config/default.toml` ships them.
    fn default() -> Self {
        DnsBounds {
            timeout: Duration::from_secs(5),
            max_concurrent: 256,
            servers: Vec::new(),
        }
    }
}

impl Outbound {
    pub fn compile(config: &OutboundConfig) -> Result<Outbound, ConfigError> {
        if config.max_headers == 0 {
            return Err(ConfigError::new(
                "outbound.max_headers",
                "must be at least 1",
            ));
        }
        if config.max_header_bytes == 0 {
            return Err(ConfigError::new(
                "outbound.max_header_bytes",
                "must be at least 1",
            ));
        }
        if config.dns_timeout.is_zero() {
            return Err(ConfigError::new(
                "outbound.dns_timeout",
                "must be more than 0",
            ));
        }
        if config.dns_max_concurrent == 0 {
            return Err(ConfigError::new(
                "outbound.dns_max_concurrent",
                "must be at least 1",
            ));
        }
        let servers = config
            .dns_servers
            .iter()
            .enumerate()
            .map(|(i, text)| {
                dns_server(text)
                    .map_err(|m| ConfigError::new(element_key("outbound.dns_servers", i, None), m))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Outbound {
            max_response_bytes: config.max_response_bytes,
            max_large_body: config.max_large_body,
            guard: AddressGuard {
                allow_private_networks: config.allow_private_networks,
                allow: parse_cidrs("outbound.allow_cidrs", &config.allow_cidrs)?,
                deny: parse_cidrs("outbound.deny_cidrs", &config.deny_cidrs)?,
            },
            max_request_bytes: config.max_request_bytes,
            max_headers: config.max_headers,
            max_header_bytes: config.max_header_bytes,
            deny_request_headers: header_names(&config.deny_request_headers).map_err(
                |(i, m)| ConfigError::new(element_key("outbound.deny_request_headers", i, None), m),
            )?,
            dns: DnsBounds {
                timeout: config.dns_timeout,
                max_concurrent: config.dns_max_concurrent,
                servers,
            },
        })
    }
}

/// A DNS server as `dns_servers` names it: an IP address (port 53) or `IP:port`
/// (`[v6]:port` for IPv6).
fn dns_server(text: &str) -> Result<SocketAddr, String> {
    text.parse::<SocketAddr>()
        .or_else(|_| text.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
        .map_err(|_| {
            format!("{text:?} is not an IP address or IP:port (\"10.0.0.2\", \"[fd00::53]:5353\")")
        })
}

/// A request rule's security settings.
#[derive(Debug, Clone, Default)]
pub struct RuleSecurity {
    /// The rule's position in the file, which keys its secrets.
    pub index: usize,
    /// The redirect budget of a whole chain that starts under this rule.
    pub follow_redirects: u32,
    /// Header name (as configured) and where its value comes from.
    pub inject: Vec<(String, SecretSource)>,
    /// Lower case; on top of `[outbound] deny_request_headers`.
    pub deny_request_headers: Vec<String>,
    /// The one origin a hop under this rule may go to; always set when the rule
    /// injects headers.
    pub origin: Option<Origin>,
    /// Whether a hop under this rule may have a `;` in its path (`allow_path_parameters`).
    pub allow_path_parameters: bool,
}

impl RuleSecurity {
    /// Whether a hop to `url` may be sent under this rule: with an origin, only to
    /// exactly that scheme, host and port. A request the rule's pattern matches but
    /// whose origin differs is refused, never sent without the injected headers.
    pub fn check_origin(&self, url: &Url) -> Result<(), String> {
        match &self.origin {
            Some(origin) if url.origin() != *origin => Err(format!(
                "is bound to origin {}, not {}",
                origin.ascii_serialization(),
                url.origin().ascii_serialization()
            )),
            _ => Ok(()),
        }
    }

    /// Whether `url`'s path may be sent under this rule: a `;` in it (raw or `%3B`)
    /// only with `allow_path_parameters`, since Tomcat, Jetty and Spring drop what
    /// follows it and would read another path than the rules matched. `.;` and `..;`
    /// segments never reach here: the canonical URL refuses them.
    pub fn check_path(&self, url: &Url) -> Result<(), String> {
        match webproxy_protocol::path_parameter(url) {
            Some(segment) if !self.allow_path_parameters => Err(format!(
                "does not allow a ';' in the path (raw or %3B, in segment {segment}), which \
                 Tomcat, Jetty and Spring drop with what follows it as a path parameter, so \
                 the upstream could read another path than the rules matched; \
                 allow_path_parameters = true on the rule sends it"
            )),
            _ => Ok(()),
        }
    }
}

/// A rule's `origin`: scheme, host and port and nothing else; https unless
/// `allow_http`. The error names the field.
pub fn parse_origin(text: &str, allow_http: bool) -> Result<Origin, (&'static str, String)> {
    let example = "like \"https://api.partner.com\" or \"https://api.partner.com:8443\"";
    let url = Url::parse(text).map_err(|e| {
        (
            "origin",
            format!("{text:?} is not a URL ({e}); write it {example}"),
        )
    })?;
    match url.scheme() {
        "https" => {}
        "http" if allow_http => {}
        "http" => {
            return Err((
                "origin",
                format!(
                    "{text:?} is http, so the injected credentials would travel in clear: use https, or set allow_http = true (for a loopback or test upstream)"
                ),
            ));
        }
        other => {
            return Err((
                "origin",
                format!("{text:?} has scheme {other:?}; write it {example}"),
            ));
        }
    }
    let bare = url.host().is_some()
        && url.username().is_empty()
        && url.password().is_none()
        && url.path() == "/"
        && url.query().is_none()
        && url.fragment().is_none();
    if !bare {
        return Err((
            "origin",
            format!("{text:?} must be only a scheme, host and port, {example}"),
        ));
    }
    if url.host_str().is_some_and(|h| h.ends_with('.')) {
        return Err((
            "origin",
            format!("{text:?}: name the host without the trailing dot"),
        ));
    }
    Ok(url.origin())
}

/// The origin a pattern such as `^https://api\.partner\.com/` names literally, for
/// the error that asks for one.
pub fn suggested_origin(pattern: &str) -> Option<String> {
    let rest = pattern.strip_prefix('^').unwrap_or(pattern);
    let (scheme, after) = rest.split_once("://")?;
    let authority = after.split('/').next()?.replace("\\.", ".");
    if authority.is_empty() || authority.contains(|c: char| "\\()[]*+?{}|^$".contains(c)) {
        return None;
    }
    let url = Url::parse(&format!("{scheme}://{authority}")).ok()?;
    Some(url.origin().ascii_serialization())
}

pub fn is_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Header names, lower-cased; an error gives the index.
pub fn header_names(names: &[String]) -> Result<Vec<String>, (usize, String)> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            if is_token(name) {
                Ok(name.to_ascii_lowercase())
            } else {
                Err((i, format!("{name:?} is not a header name")))
            }
        })
        .collect()
}

/// CIDRs, or single addresses taken as one-address networks.
/// CIDRs or bare addresses (a host's /32 or /128), truncated to their network;
/// the error names `key[index]`.
pub fn parse_cidrs(key: &str, items: &[String]) -> Result<Vec<IpNet>, ConfigError> {
    items
        .iter()
        .enumerate()
        .map(|(index, text)| {
            let text = text.trim();
            text.parse::<IpNet>()
                .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
                .map(|net| net.trunc())
                .map_err(|_| {
                    ConfigError::new(
                        element_key(key, index, None),
                        format!("{text:?} is not a CIDR (like \"10.0.0.0/8\") or an IP address"),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::ByteLimit;
    use super::*;
    use crate::rules::RequestRuleConfig;

    fn outbound(allow: &[&str], deny: &[&str]) -> OutboundConfig {
        OutboundConfig {
            max_response_bytes: ByteLimit::Auto,
            max_large_body: default_max_large_body(),
            allow_private_networks: false,
            allow_cidrs: allow.iter().map(|s| s.to_string()).collect(),
            deny_cidrs: deny.iter().map(|s| s.to_string()).collect(),
            max_request_bytes: 10,
            max_headers: 2,
            max_header_bytes: 20,
            deny_request_headers: vec!["Proxy-Authorization".into(), "X-Forwarded-Host".into()],
            dns_timeout: Duration::from_secs(5),
            dns_max_concurrent: 256,
            dns_servers: Vec::new(),
        }
    }

    #[test]
    fn dns_keys_are_checked_and_name_the_key() {
        let mut config = outbound(&[], &[]);
        config.dns_servers = vec![
            "10.0.0.2".into(),
            "127.0.0.1:5353".into(),
            "[::1]:53".into(),
        ];
        let compiled = Outbound::compile(&config).expect("valid");
        let servers: Vec<String> = compiled.dns.servers.iter().map(|s| s.to_string()).collect();
        assert_eq!(servers, ["10.0.0.2:53", "127.0.0.1:5353", "[::1]:53"]);
        assert_eq!(compiled.dns.max_concurrent, 256);
        config.dns_servers = vec!["10.0.0.2".into(), "dns.example".into()];
        let e = Outbound::compile(&config).expect_err("a name");
        assert!(e.to_string().contains("outbound.dns_servers[1]"), "{e}");
        config.dns_servers.clear();
        config.dns_max_concurrent = 0;
        let e = Outbound::compile(&config).expect_err("no lookups");
        assert!(e.to_string().contains("outbound.dns_max_concurrent"), "{e}");
        config.dns_max_concurrent = 1;
        config.dns_timeout = Duration::ZERO;
        let e = Outbound::compile(&config).expect_err("no time");
        assert!(e.to_string().contains("outbound.dns_timeout"), "{e}");
    }

    #[test]
    fn rule_security_is_checked() {
        let mut config: RequestRuleConfig = toml::from_str(
            "name = \"r\"\nurl_pattern = \".\"\nfollow_redirects = 2\n\
             deny_request_headers = [\"X-A\"]\norigin = \"https://a.test\"\n\
             [inject_headers]\nAuthorization = { env = \"T\", prefix = \"Bearer \" }\n",
        )
        .expect("toml");
        let security = RuleSecurity::compile(&config).expect("valid");
        assert_eq!(security.follow_redirects, 2);
        assert_eq!(security.deny_request_headers, ["x-a"]);
        assert_eq!(security.inject[0].0, "Authorization");
        config.deny_request_headers = vec!["bad name".into()];
        assert_eq!(
            RuleSecurity::compile(&config).map(|_| ()).unwrap_err().0,
            "deny_request_headers"
        );
        config.deny_request_headers.clear();
        config.inject_headers.insert(
            "X-B".into(),
            SecretSource {
                env: None,
                file: None,
                prefix: String::new(),
            },
        );
        assert_eq!(
            RuleSecurity::compile(&config).map(|_| ()).unwrap_err().0,
            "inject_headers"
        );
    }

    fn rule_toml(extra: &str) -> RequestRuleConfig {
        toml::from_str(&format!(
            "name = \"partner\"\nurl_pattern = '^https://api\\.partner\\.com/'\n{extra}"
        ))
        .expect("toml")
    }

    const INJECTS: &str = "[inject_headers]\nAuthorization = { env = \"T\" }\n";

    #[test]
    fn an_injecting_rule_must_name_an_https_origin() {
        let e = RuleSecurity::compile(&rule_toml(INJECTS))
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.0, "origin");
        assert!(
            e.1.contains("add origin = \"https://api.partner.com\""),
            "{}",
            e.1
        );
        let http = format!("origin = \"http://api.partner.com\"\n{INJECTS}");
        let e = RuleSecurity::compile(&rule_toml(&http))
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.0, "origin");
        assert!(e.1.contains("allow_http = true"), "{}", e.1);
        let allowed = format!("origin = \"http://127.0.0.1:8080\"\nallow_http = true\n{INJECTS}");
        let security = RuleSecurity::compile(&rule_toml(&allowed)).expect("valid");
        assert_eq!(
            security.origin.map(|o| o.ascii_serialization()).as_deref(),
            Some("http://127.0.0.1:8080")
        );
        let e = RuleSecurity::compile(&rule_toml("allow_http = true\n"))
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.0, "allow_http");
        for bad in [
            "https://api.partner.com/v1",
            "https://api.partner.com?x",
            "https://u:p@api.partner.com",
            "https://api.partner.com.",
            "ftp://api.partner.com",
            "api.partner.com",
        ] {
            let config = rule_toml(&format!("origin = {bad:?}\n{INJECTS}"));
            let e = RuleSecurity::compile(&config).map(|_| ()).unwrap_err();
            assert_eq!(e.0, "origin", "{bad}");
        }
        for good in ["https://api.partner.com", "https://API.partner.com:443/"] {
            let config = rule_toml(&format!("origin = {good:?}\n{INJECTS}"));
            let security = RuleSecurity::compile(&config).expect(good);
            assert_eq!(
                security.origin.map(|o| o.ascii_serialization()).as_deref(),
                Some("https://api.partner.com")
            );
        }
    }

    /// The forms that steered credentials elsewhere when only the pattern decided:
    /// each is refused by the origin, whatever the pattern matches.
    #[test]
    fn the_origin_refuses_every_other_scheme_host_and_port() {
        let security = RuleSecurity::compile(&rule_toml(&format!(
            "origin = \"https://api.partner.com\"\n{INJECTS}"
        )))
        .expect("valid");
        let check = |text: &str| {
            let url = webproxy_protocol::canonical_url(Url::parse(text).expect(text));
            url.map(|url| security.check_origin(&url))
        };
        assert_eq!(check("https://api.partner.com/x"), Ok(Ok(())));
        assert_eq!(check("https://api.partner.com:443/x"), Ok(Ok(())));
        for other in [
            "https://evil.example/?u=https://api.partner.com/",
            "https://evil.example/#https://api.partner.com/",
            "https://api.partner.com.evil.example/",
            "https://apixpartner.com/",
            "http://api.partner.com/",
            "https://api.partner.com:8443/",
        ] {
            let refusal = check(other).expect(other).expect_err(other);
            assert!(refusal.contains("https://api.partner.com"), "{refusal}");
        }
        // The `@` form never gets that far: user information is invalid_request.
        assert!(check("https://api.partner.com@evil.example/").is_err());
        assert!(check("https://evil.example@api.partner.com/").is_err());
    }

    #[test]
    fn cidrs_and_single_addresses_parse() {
        let compiled =
            Outbound::compile(&outbound(&["127.0.0.2/32", "10.1.2.3", "::1"], &[])).expect("valid");
        let nets: Vec<String> = compiled.guard.allow.iter().map(|n| n.to_string()).collect();
        assert_eq!(nets, ["127.0.0.2/32", "10.1.2.3/32", "::1/128"]);
    }

    #[test]
    fn host_bits_are_dropped() {
        let compiled = Outbound::compile(&outbound(&[], &["10.1.2.3/8"])).expect("valid");
        assert_eq!(compiled.guard.deny[0].to_string(), "10.0.0.0/8");
    }

    #[test]
    fn a_bad_cidr_names_the_key_and_index() {
        let e = Outbound::compile(&outbound(&["10.0.0.0/8", "ten"], &[])).expect_err("bad");
        assert_eq!(e.key, "outbound.allow_cidrs[1]");
        let e = Outbound::compile(&outbound(&[], &["10.0.0.0/33"])).expect_err("bad");
        assert_eq!(e.key, "outbound.deny_cidrs[0]");
    }
}
