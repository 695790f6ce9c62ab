//! `[gateway]`, the HTTP gateway's configuration: its schema and its checks, compiled
//! into the routes `webproxy gateway` serves. A leaf, so the file's schema
//! (`config.rs`) and the gateway (`gateway/`) both use it without a circle.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use url::Url;
use webproxy_config::{ConfigError, SecretSource, element_key};

/// The path prefix the gateway answers itself (`/_webproxy/replies/<id>`); no route
/// may claim it.
pub(crate) const RESERVED_PATH: &str = "/_webproxy";

/// The header callers send a route's token in unless the route names another.
pub(crate) const PROXY_AUTHORIZATION: &str = "proxy-authorization";

/// `[gateway]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GatewayConfig {
    /// Where the gateway serves HTTP (loopback by default).
    pub(crate) listen: SocketAddr,
    /// `/healthz`, `/readyz` and `/metrics`.
    pub(crate) health_listen: SocketAddr,
    /// How long a request waits for its reply before the answer is 202.
    #[serde(with = "humantime_serde")]
    pub(crate) wait: Duration,
    /// Requests waiting in this gateway at once; more get 503.
    pub(crate) max_concurrent: usize,
    /// Connections open at once; more are answered 503 and closed.
    pub(crate) max_connections: usize,
    /// Connections open at once from one source address (an IPv6 /64); 0 is no cap.
    pub(crate) max_connections_per_source: usize,
    /// How long a request's head may take to arrive, counted from when the gateway
    /// starts waiting for it (hyper's `header_read_timeout`).
    #[serde(with = "humantime_serde")]
    pub(crate) header_read_timeout: Duration,
    /// How long a request's body may send nothing before it is answered 408.
    #[serde(with = "humantime_serde")]
    pub(crate) body_idle_timeout: Duration,
    /// How long a connection may stay open with no request on it; 0 turns keep-alive
    /// off.
    #[serde(with = "humantime_serde")]
    pub(crate) keep_alive_timeout: Duration,
    /// CIDRs (or addresses) that may connect at all; empty allows every address.
    #[serde(default)]
    pub(crate) allow_sources: Vec<String>,
    /// The HMAC key of minted ids; unset, the gateways share a random one in the
    /// bucket `<PREFIX>_GATEWAY_KEY`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) key: Option<SecretSource>,
    /// The header whose value is a client's idempotency key.
    pub(crate) idempotency_header: String,
    /// TLS for the listener, from PEM files: the certificate chain and its key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tls_cert_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tls_key_file: Option<PathBuf>,
    #[serde(default)]
    pub(crate) routes: Vec<RouteConfig>,
}

/// `[[gateway.routes]]`: `<path><rest>` goes to `<upstream><rest>` through `pool`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RouteConfig {
    pub(crate) path: String,
    pub(crate) upstream: String,
    #[serde(default = "default_pool")]
    pub(crate) pool: String,
    /// The token callers must send; `{ env = "NAME" }` or `{ file = "PATH" }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) token: Option<SecretSource>,
    /// The header the token comes in; `Proxy-Authorization` (as `Bearer <token>`)
    /// by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) token_header: Option<String>,
    /// Open to anyone who can connect, on purpose.
    #[serde(default)]
    pub(crate) anonymous: bool,
    /// Bodies of any size up to `[outbound] max_large_body`, both ways: request bodies
    /// over the inline limit are uploaded to the pool's upload store, and responses
    /// over it are stored and streamed back from the pool's body store.
    #[serde(default)]
    pub(crate) large_bodies: bool,
}

fn default_pool() -> String {
    "default".into()
}

/// A route, checked.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    /// The path prefix, as configured; also the route's label in metrics and ids.
    pub(crate) path: String,
    /// The upstream, canonical (the form the service matches rules against).
    pub(crate) upstream: Url,
    pub(crate) pool: String,
    pub(crate) token: Option<SecretSource>,
    /// The token's header, lower case.
    pub(crate) token_header: String,
    /// `large_bodies`: requests opt in to stored bodies both ways.
    pub(crate) large_bodies: bool,
}

impl Route {
    /// Whether the token comes in `Proxy-Authorization` (a missing or wrong one is
    /// 407) rather than a header of the route's own (401).
    pub(crate) fn proxy_credential(&self) -> bool {
        self.token_header == PROXY_AUTHORIZATION
    }
}

/// `[gateway]`, checked.
#[derive(Debug, Clone)]
pub(crate) struct Gateway {
    pub(crate) allow_sources: Vec<IpNet>,
    pub(crate) routes: Vec<Route>,
    /// The idempotency header's name, lower case.
    pub(crate) idempotency_header: String,
    /// Both TLS files, when TLS is on.
    pub(crate) tls: Option<(PathBuf, PathBuf)>,
}

impl GatewayConfig {
    /// Checks `[gateway]`; errors name the key. A gateway that listens beyond loopback
    /// with a route open to anyone (no token, no `allow_sources`) is refused unless
    /// that route says `anonymous = true`.
    pub(crate) fn check(&self) -> Result<Gateway, ConfigError> {
        if self.max_concurrent == 0 {
            return Err(ConfigError::new(
                "gateway.max_concurrent",
                "must be at least 1",
            ));
        }
        self.check_limits()?;
        if self.wait.is_zero() {
            return Err(ConfigError::new(
                "gateway.wait",
                "must be more than 0 (use `Prefer: respond-async` for an answer at once)",
            ));
        }
        let allow_sources =
            webproxy_config::parse_cidrs("gateway.allow_sources", &self.allow_sources)?;
        if let Some(key) = &self.key {
            key.check("gateway.key")?;
            no_prefix(key, "gateway.key")?;
        }
        let idempotency_header =
            header_name("gateway.idempotency_header", &self.idempotency_header)?;
        let tls = match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
            (None, None) => None,
            _ => {
                return Err(ConfigError::new(
                    "gateway.tls_cert_file",
                    "set both tls_cert_file and tls_key_file, or neither",
                ));
            }
        };
        let mut routes: Vec<Route> = Vec::with_capacity(self.routes.len());
        for (index, config) in self.routes.iter().enumerate() {
            let key = element_key("gateway.routes", index, None);
            let route = config.check(&key)?;
            if routes.iter().any(|r| r.path == route.path) {
                return Err(ConfigError::new(
                    format!("{key}.path"),
                    format!("{:?} is the path of an earlier route", route.path),
                ));
            }
            let open = route.token.is_none() && allow_sources.is_empty();
            if open && !self.listen.ip().is_loopback() && !config.anonymous {
                return Err(ConfigError::new(
                    key,
                    format!(
                        "route {:?} has no token and [gateway] allow_sources is empty, yet gateway.listen = {} is not loopback: anyone who can reach it may call {}. Set its token, set allow_sources, or set anonymous = true on the route if that is meant",
                        route.path, self.listen, route.upstream
                    ),
                ));
            }
            routes.push(route);
        }
        Ok(Gateway {
            allow_sources,
            routes,
            idempotency_header,
            tls,
        })
    }
}

impl GatewayConfig {
    /// The connection limits: caps at least 1 (the per-source one 0, for none, or at
    /// most `max_connections`), timeouts over 0, and an idle connection's
    /// `keep_alive_timeout` no longer than `header_read_timeout`, which hyper also runs
    /// while a kept-alive connection waits for its next request.
    fn check_limits(&self) -> Result<(), ConfigError> {
        if self.max_connections == 0 {
            return Err(ConfigError::new(
                "gateway.max_connections",
                "must be at least 1",
            ));
        }
        if self.max_connections_per_source > self.max_connections {
            return Err(ConfigError::new(
                "gateway.max_connections_per_source",
                format!(
                    "{} is over max_connections = {}; 0 turns the cap off",
                    self.max_connections_per_source, self.max_connections
                ),
            ));
        }
        for (key, timeout) in [
            ("gateway.header_read_timeout", self.header_read_timeout),
            ("gateway.body_idle_timeout", self.body_idle_timeout),
        ] {
            if timeout.is_zero() {
                return Err(ConfigError::new(key, "must be more than 0"));
            }
        }
        if self.keep_alive_timeout > self.header_read_timeout {
            return Err(ConfigError::new(
                "gateway.keep_alive_timeout",
                format!(
                    "{} is longer than header_read_timeout = {}, which also ends a kept-alive connection waiting for its next request; raise header_read_timeout too",
                    humantime::format_duration(self.keep_alive_timeout),
                    humantime::format_duration(self.header_read_timeout)
                ),
            ));
        }
        Ok(())
    }
}

impl RouteConfig {
    fn check(&self, key: &str) -> Result<Route, ConfigError> {
        let path = &self.path;
        if !path.starts_with('/') || path.contains(['?', '#']) || path.contains("..") {
            return Err(ConfigError::new(
                format!("{key}.path"),
                format!("{path:?} must start with / and hold no ?, # or .."),
            ));
        }
        if path.starts_with(RESERVED_PATH) {
            return Err(ConfigError::new(
                format!("{key}.path"),
                format!("{path:?} is under {RESERVED_PATH}, which the gateway answers itself"),
            ));
        }
        let upstream = Url::parse(&self.upstream)
            .map_err(|e| e.to_string())
            .and_then(webproxy_protocol::canonical_url)
            .and_then(|url| {
                if url.query().is_some() {
                    Err("has a query string; the caller's is appended".into())
                } else {
                    Ok(url)
                }
            })
            .map_err(|message| {
                ConfigError::new(
                    format!("{key}.upstream"),
                    format!("{:?}: {message}", self.upstream),
                )
            })?;
        webproxy_protocol::validate_pool_name(&self.pool)
            .map_err(|e| ConfigError::new(format!("{key}.pool"), e.to_string()))?;
        if let Some(token) = &self.token {
            token.check(&format!("{key}.token"))?;
            no_prefix(token, &format!("{key}.token"))?;
        }
        let token_header = match &self.token_header {
            Some(name) => {
                if self.token.is_none() {
                    return Err(ConfigError::new(
                        format!("{key}.token_header"),
                        "names a header, but the route has no token",
                    ));
                }
                header_name(&format!("{key}.token_header"), name)?
            }
            None => PROXY_AUTHORIZATION.into(),
        };
        if self.anonymous && self.token.is_some() {
            return Err(ConfigError::new(
                format!("{key}.anonymous"),
                "the route has a token, so it is not anonymous",
            ));
        }
        Ok(Route {
            path: path.clone(),
            upstream,
            pool: self.pool.clone(),
            token: self.token.clone(),
            token_header,
            large_bodies: self.large_bodies,
        })
    }
}

/// A token or key is compared whole; a `prefix` (for injected headers) has no place.
fn no_prefix(source: &SecretSource, key: &str) -> Result<(), ConfigError> {
    if source.prefix.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::new(
            format!("{key}.prefix"),
            "is for injected headers; a token or key is read whole",
        ))
    }
}

/// A valid HTTP header name, lower case.
fn header_name(key: &str, name: &str) -> Result<String, ConfigError> {
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if !valid {
        return Err(ConfigError::new(
            key,
            format!("{name:?} is not an HTTP header name"),
        ));
    }
    let lower = name.to_ascii_lowercase();
    if webproxy_protocol::is_hop_by_hop(&lower) && lower != PROXY_AUTHORIZATION {
        return Err(ConfigError::new(
            key,
            format!("{name:?} is a hop-by-hop header"),
        ));
    }
    Ok(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(listen: &str, allow: &[&str], routes: &str) -> Result<Gateway, ConfigError> {
        let text = format!(
            "listen = \"{listen}\"\nhealth_listen = \"127.0.0.1:9091\"\nwait = \"30s\"\nmax_concurrent = 1024\nmax_connections = 2048\nmax_connections_per_source = 0\nheader_read_timeout = \"10s\"\nbody_idle_timeout = \"10s\"\nkeep_alive_timeout = \"5s\"\nidempotency_header = \"Idempotency-Key\"\nallow_sources = {allow:?}\n{routes}"
        );
        let config: GatewayConfig = toml::from_str(&text).expect("schema");
        config.check()
    }

    const OPEN: &str = "[[routes]]\npath = \"/api\"\nupstream = \"https://api.example.com/v1\"\n";

    #[test]
    fn an_open_route_beyond_loopback_is_refused_unless_anonymous() {
        assert!(config("127.0.0.1:8080", &[], OPEN).is_ok());
        let error = config("0.0.0.0:8080", &[], OPEN).expect_err("open beyond loopback");
        assert!(error.to_string().contains("gateway.routes[0]"), "{error}");
        assert!(config("0.0.0.0:8080", &["10.0.0.0/8"], OPEN).is_ok());
        assert!(config("0.0.0.0:8080", &[], &format!("{OPEN}anonymous = true\n")).is_ok());
        let token = format!("{OPEN}token = {{ env = \"T\" }}\n");
        assert!(config("0.0.0.0:8080", &[], &token).is_ok());
    }

    #[test]
    fn routes_are_checked_and_name_their_key() {
        let cases = [
            (
                "[[routes]]\npath = \"api\"\nupstream = \"https://h/\"\n",
                "routes[0].path",
            ),
            (
                "[[routes]]\npath = \"/_webproxy/x\"\nupstream = \"https://h/\"\n",
                "routes[0].path",
            ),
            (
                "[[routes]]\npath = \"/a\"\nupstream = \"ftp://h/\"\n",
                "routes[0].upstream",
            ),
            (
                "[[routes]]\npath = \"/a\"\nupstream = \"https://h/?q=1\"\n",
                "routes[0].upstream",
            ),
            (
                "[[routes]]\npath = \"/a\"\nupstream = \"https://h/\"\npool = \"a b\"\n",
                "routes[0].pool",
            ),
            (
                "[[routes]]\npath = \"/a\"\nupstream = \"https://h/\"\ntoken_header = \"X-T\"\n",
                "routes[0].token_header",
            ),
            (
                "[[routes]]\npath = \"/a\"\nupstream = \"https://h/\"\ntoken = { env = \"T\", prefix = \"Bearer \" }\n",
                "routes[0].token.prefix",
            ),
            (
                "[[routes]]\npath = \"/a\"\nupstream = \"https://h/\"\n[[routes]]\npath = \"/a\"\nupstream = \"https://h/\"\n",
                "routes[1].path",
            ),
        ];
        for (routes, key) in cases {
            let error = config("127.0.0.1:8080", &[], routes).expect_err(routes);
            assert!(error.to_string().contains(key), "{routes}: {error}");
        }
    }

    #[test]
    fn connection_limits_are_checked_and_name_their_key() {
        let with = |limits: &str| {
            let text = format!(
                "listen = \"127.0.0.1:8080\"\nhealth_listen = \"127.0.0.1:9091\"\nwait = \"30s\"\nmax_concurrent = 8\nidempotency_header = \"Idempotency-Key\"\n{limits}"
            );
            let config: GatewayConfig = toml::from_str(&text).expect("schema");
            config.check().map(|_| ())
        };
        let limits = |connections, per_source, header, body, idle| {
            format!(
                "max_connections = {connections}\nmax_connections_per_source = {per_source}\nheader_read_timeout = \"{header}\"\nbody_idle_timeout = \"{body}\"\nkeep_alive_timeout = \"{idle}\"\n"
            )
        };
        assert!(with(&limits(10, 10, "10s", "10s", "10s")).is_ok());
        assert!(
            with(&limits(10, 0, "10s", "10s", "0s")).is_ok(),
            "keep-alive off"
        );
        for (bad, key) in [
            (limits(0, 0, "10s", "10s", "5s"), "gateway.max_connections"),
            (
                limits(10, 11, "10s", "10s", "5s"),
                "gateway.max_connections_per_source",
            ),
            (
                limits(10, 0, "0s", "10s", "0s"),
                "gateway.header_read_timeout",
            ),
            (
                limits(10, 0, "10s", "0s", "5s"),
                "gateway.body_idle_timeout",
            ),
            (
                limits(10, 0, "10s", "10s", "11s"),
                "gateway.keep_alive_timeout",
            ),
        ] {
            let error = with(&bad).expect_err(&bad);
            assert!(error.to_string().contains(key), "{bad}: {error}");
        }
    }

    #[test]
    fn a_token_header_is_lower_case_and_proxy_authorization_by_default() {
        let gateway = config(
            "127.0.0.1:8080",
            &[],
            "[[routes]]\npath = \"/a\"\nupstream = \"https://h/\"\ntoken = { env = \"T\" }\n[[routes]]\npath = \"/b\"\nupstream = \"https://h/\"\ntoken = { env = \"T\" }\ntoken_header = \"X-Gateway-Token\"\n",
        )
        .expect("valid");
        assert!(gateway.routes[0].proxy_credential());
        assert_eq!(gateway.routes[1].token_header, "x-gateway-token");
        assert!(!gateway.routes[1].proxy_credential());
    }
}
