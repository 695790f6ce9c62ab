//! How webproxy (and `webproxy send`) authenticates to NATS and secures the
//! connection: one of a credentials file, an NKey seed file, a token, or a user and
//! password, and TLS with a CA and an optional client certificate. Files are checked
//! when the configuration is loaded, so an error names the key and the path.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use webproxy_protocol::SERVICE_INBOX;

use webproxy_config::ConfigError;
use webproxy_config::Redactor;

/// The `[nats]` settings. `Debug` and `Serialize` (what `check-config` prints) show the
/// URL without its credentials and the token and password as `[REDACTED]`.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NatsConfig {
    /// One server URL, or several separated by commas; a URL may carry credentials
    /// (`nats://user:password@host`, `nats://token@host`).
    #[serde(serialize_with = "serialize_redacted_urls")]
    pub(crate) url: String,
    /// Authentication and TLS; see `crate::config::nats_auth`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) credentials_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) nkey_seed_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) token: Option<crate::config::nats_auth::Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) password: Option<crate::config::nats_auth::Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tls_ca_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tls_cert_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tls_key_file: Option<std::path::PathBuf>,
    /// The connection's inbox prefix instead of webproxy's private one: for a caller
    /// whose permissions allow subscribing only under its own subjects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) inbox_prefix: Option<String>,
    /// The JetStream API prefix of an imported JetStream, instead of `$JS.API`; used by
    /// `send` and the operator commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) js_api_prefix: Option<String>,
}

fn serialize_redacted_urls<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&crate::config::nats_auth::redact_url_credentials(url))
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field(
                "url",
                &crate::config::nats_auth::redact_url_credentials(&self.url),
            )
            .field("credentials_file", &self.credentials_file)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("token", &self.token)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("js_api_prefix", &self.js_api_prefix)
            .finish()
    }
}

impl NatsConfig {
    /// The server URLs, trimmed.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
            .collect()
    }
}

/// A configured secret (a token or password): shown as [`Redactor::REDACTED`] when printed or
/// serialized, so `check-config` and debug output never carry it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(String);

impl Secret {
    pub(crate) fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(Redactor::REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(Redactor::REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

/// Checks the combination of keys and that every named file can be read.
pub(crate) fn check(nats: &NatsConfig) -> Result<(), ConfigError> {
    let methods = [
        ("nats.credentials_file", nats.credentials_file.is_some()),
        ("nats.nkey_seed_file", nats.nkey_seed_file.is_some()),
        ("nats.token", nats.token.is_some()),
        ("nats.user", nats.user.is_some() || nats.password.is_some()),
    ];
    let set: Vec<&str> = methods
        .iter()
        .filter(|(_, on)| *on)
        .map(|(k, _)| *k)
        .collect();
    if set.len() > 1 {
        return Err(ConfigError::new(
            set[1],
            format!(
                "set only one way to authenticate, not both {} and {}",
                set[0], set[1]
            ),
        ));
    }
    match (&nats.user, &nats.password) {
        (Some(_), None) => {
            return Err(ConfigError::new(
                "nats.password",
                "is required with nats.user",
            ));
        }
        (None, Some(_)) => {
            return Err(ConfigError::new(
                "nats.user",
                "is required with nats.password",
            ));
        }
        (Some(user), Some(_)) if user.is_empty() => {
            return Err(ConfigError::new("nats.user", "must not be empty"));
        }
        _ => {}
    }
    if nats.token.as_ref().is_some_and(|t| t.expose().is_empty()) {
        return Err(ConfigError::new("nats.token", "must not be empty"));
    }
    match (&nats.tls_cert_file, &nats.tls_key_file) {
        (Some(_), None) => {
            return Err(ConfigError::new(
                "nats.tls_key_file",
                "is required with nats.tls_cert_file",
            ));
        }
        (None, Some(_)) => {
            return Err(ConfigError::new(
                "nats.tls_cert_file",
                "is required with nats.tls_key_file",
            ));
        }
        _ => {}
    }
    for (key, prefix) in [
        ("nats.inbox_prefix", &nats.inbox_prefix),
        ("nats.js_api_prefix", &nats.js_api_prefix),
    ] {
        if prefix.as_deref().is_some_and(|p| !literal_subject(p)) {
            return Err(ConfigError::new(
                key,
                "must be a subject without wildcards, empty tokens or whitespace",
            ));
        }
    }
    for (key, path) in [
        ("nats.credentials_file", &nats.credentials_file),
        ("nats.nkey_seed_file", &nats.nkey_seed_file),
        ("nats.tls_ca_file", &nats.tls_ca_file),
        ("nats.tls_cert_file", &nats.tls_cert_file),
        ("nats.tls_key_file", &nats.tls_key_file),
    ] {
        if let Some(path) = path {
            readable(key, path)?;
        }
    }
    Ok(())
}

/// A subject a prefix can be: tokens that are neither empty nor wildcards.
fn literal_subject(subject: &str) -> bool {
    !subject.contains(char::is_whitespace)
        && subject
            .split('.')
            .all(|token| !token.is_empty() && token != "*" && token != ">")
}

fn readable(key: &str, path: &Path) -> Result<(), ConfigError> {
    if !path.is_file() {
        return Err(ConfigError::new(
            key,
            format!("{} does not exist or is not a file", path.display()),
        ));
    }
    std::fs::File::open(path)
        .map(|_| ())
        .map_err(|e| ConfigError::new(key, format!("cannot read {}: {e}", path.display())))
}

/// The secret values of the NATS settings, for the redactor: the token, the
/// password, the NKey seed, the seed inside a `.creds` file, and the credentials in
/// the server URLs.
pub(crate) fn secret_values(nats: &NatsConfig) -> Vec<String> {
    let mut values: Vec<String> = [&nats.token, &nats.password]
        .into_iter()
        .flatten()
        .map(|s| s.expose().to_string())
        .collect();
    if let Some(seed) = nats.nkey_seed_file.as_deref().and_then(read_seed) {
        values.push(seed);
    }
    if let Some(seed) = nats
        .credentials_file
        .as_deref()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| creds_seed(&text))
    {
        values.push(seed);
    }
    values.extend(url_credentials(&nats.url));
    values
}

/// The NKey seed in the text of a `.creds` file: the line inside its
/// `-----BEGIN USER NKEY SEED-----` block (the JWT beside it is signed, not secret).
pub(crate) fn creds_seed(text: &str) -> Option<String> {
    let mut lines = text.lines().map(str::trim);
    lines
        .find(|line| line.starts_with("---") && line.contains("BEGIN") && line.contains("SEED"))?;
    lines
        .find(|line| !line.is_empty())
        .filter(|line| !line.starts_with("---"))
        .map(str::to_string)
}

/// The secrets in NATS server URLs (`nats://user:password@host`, or
/// `nats://token@host` where the user part is the token), raw and percent-decoded.
/// A user name beside a password is not secret and is kept.
pub(crate) fn url_credentials(urls: &str) -> Vec<String> {
    let mut values = Vec::new();
    for url in urls.split(',') {
        let Some((userinfo, _)) = authority(url.trim()).and_then(|a| a.rsplit_once('@')) else {
            continue;
        };
        let secret = match userinfo.split_once(':') {
            Some((_, password)) => password,
            None => userinfo,
        };
        if secret.is_empty() {
            continue;
        }
        values.push(secret.to_string());
        let decoded =
            url::form_urlencoded::parse(format!("x={}", secret.replace('+', "%2B")).as_bytes())
                .next()
                .map(|(_, v)| v.into_owned());
        if let Some(decoded) = decoded.filter(|d| d != secret && !d.is_empty()) {
            values.push(decoded);
        }
    }
    values
}

/// The URLs with their user information replaced by [`Redactor::REDACTED`], for display.
pub(crate) fn redact_url_credentials(urls: &str) -> String {
    urls.split(',')
        .map(str::trim)
        .map(
            |url| match authority(url).and_then(|a| a.rsplit_once('@')) {
                Some((userinfo, _)) => url.replacen(
                    &format!("{userinfo}@"),
                    &format!("{}@", Redactor::REDACTED),
                    1,
                ),
                None => url.to_string(),
            },
        )
        .collect::<Vec<_>>()
        .join(",")
}

/// The authority of a URL (`nats://user:pw@host:4222/` gives `user:pw@host:4222`), or
/// of a bare `host:port`.
fn authority(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    rest.split(['/', '?', '#']).next()
}

fn read_seed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// webproxy's own inbox prefix, `_WEBPROXY_INBOX.<random>`: JetStream API responses,
/// publish acks and pulled messages arrive under it. Every subject under
/// [`SERVICE_INBOX`] is refused as a caller's `reply_to`, so no caller can inject
/// messages there, and NATS permissions can give the service exactly this prefix
/// instead of the `_INBOX.>` every caller shares.
pub(crate) fn service_inbox_prefix() -> String {
    let token: String = std::iter::repeat_with(fastrand::alphanumeric)
        .take(16)
        .collect();
    format!("{SERVICE_INBOX}.{token}")
}

/// Connect options carrying the authentication and TLS settings, and the inbox prefix:
/// `nats.inbox_prefix` where set, else webproxy's private one (every connection made
/// with the service's own `[nats]` settings: `serve` and the operator commands).
pub(crate) async fn connect_options(
    nats: &NatsConfig,
) -> std::io::Result<async_nats::ConnectOptions> {
    let inbox = nats
        .inbox_prefix
        .clone()
        .unwrap_or_else(service_inbox_prefix);
    let mut options = async_nats::ConnectOptions::new().custom_inbox_prefix(inbox);
    if let Some(path) = &nats.credentials_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| named(path, e))?;
    }
    if let Some(path) = &nats.nkey_seed_file {
        let seed = std::fs::read_to_string(path).map_err(|e| named(path, e))?;
        options = options.nkey(seed.trim().to_string());
    }
    if let Some(token) = &nats.token {
        options = options.token(token.expose().to_string());
    }
    if let (Some(user), Some(password)) = (&nats.user, &nats.password) {
        options = options.user_and_password(user.clone(), password.expose().to_string());
    }
    if let Some(ca) = &nats.tls_ca_file {
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&nats.tls_cert_file, &nats.tls_key_file) {
        options = options
            .add_client_certificate(cert.clone(), key.clone())
            .require_tls(true);
    }
    Ok(options)
}

fn named(path: &Path, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::PathBuf;

    use super::*;

    /// `[nats]` with a URL and nothing else.
    pub(crate) fn nats() -> NatsConfig {
        NatsConfig {
            url: "nats://127.0.0.1:4222".into(),
            credentials_file: None,
            nkey_seed_file: None,
            token: None,
            user: None,
            password: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            inbox_prefix: None,
            js_api_prefix: None,
        }
    }

    #[test]
    fn nothing_set_is_valid() {
        assert!(check(&nats()).is_ok());
    }

    #[test]
    fn one_method_at_a_time() {
        let mut config = nats();
        config.token = Some(Secret::new("t"));
        config.user = Some("u".into());
        config.password = Some(Secret::new("p"));
        let e = check(&config).expect_err("two methods");
        assert_eq!(e.key, "nats.user");
        assert!(e.message.contains("nats.token"), "{e}");
    }

    #[test]
    fn user_and_password_go_together() {
        let mut config = nats();
        config.user = Some("u".into());
        assert_eq!(
            check(&config).expect_err("no password").key,
            "nats.password"
        );
        config.user = None;
        config.password = Some(Secret::new("p"));
        assert_eq!(check(&config).expect_err("no user").key, "nats.user");
    }

    #[test]
    fn cert_and_key_go_together_and_files_must_exist() {
        let file = tempfile_path();
        let mut config = nats();
        config.tls_cert_file = Some(file.clone());
        assert_eq!(check(&config).expect_err("no key").key, "nats.tls_key_file");
        config.tls_key_file = Some("/nonexistent/key.pem".into());
        let e = check(&config).expect_err("missing file");
        assert_eq!(e.key, "nats.tls_key_file");
        assert!(e.message.contains("/nonexistent/key.pem"), "{e}");
        config.tls_key_file = Some(file.clone());
        assert!(check(&config).is_ok());
        config.credentials_file = Some("/nonexistent/x.creds".into());
        assert_eq!(
            check(&config).expect_err("missing").key,
            "nats.credentials_file"
        );
        let _ = std::fs::remove_file(file);
    }

    fn tempfile_path() -> PathBuf {
        let path = std::env::temp_dir().join(format!("webproxy-nats-auth-{}", std::process::id()));
        std::fs::write(&path, "x").expect("write");
        path
    }

    #[test]
    fn the_service_inbox_is_private_and_reserved() {
        let prefix = service_inbox_prefix();
        let (first, random) = prefix.split_once('.').expect("two tokens");
        assert_eq!(first, "_WEBPROXY_INBOX");
        assert_eq!(random.len(), 16);
        assert!(
            random.bytes().all(|b| b.is_ascii_alphanumeric()),
            "{prefix}"
        );
        assert_ne!(prefix, service_inbox_prefix());
        // Refused even where every other subject is allowed.
        let subjects = webproxy_protocol::Subjects::new("webproxy")
            .expect("prefix")
            .with_reply_to_allow(&[">".into()])
            .expect("pattern");
        // What async-nats puts under the prefix: one more token per inbox.
        let inbox = format!("{prefix}.AbC123");
        assert!(subjects.check_reply_to(&inbox, "x", None).is_err());
    }

    #[test]
    fn nats_url_credentials_are_found_and_hidden() {
        let urls = "nats://alice:pa%2Fss@n1:4222, tls://s3cr3t-token@n2:4222,nats://n3:4222";
        assert_eq!(url_credentials(urls), ["pa%2Fss", "pa/ss", "s3cr3t-token"]);
        let shown = redact_url_credentials(urls);
        assert_eq!(
            shown,
            "nats://[REDACTED]@n1:4222,tls://[REDACTED]@n2:4222,nats://n3:4222"
        );
        let mut config = nats();
        config.url = urls.into();
        for text in [
            format!("{config:?}"),
            serde_json::to_string(&config).expect("json"),
        ] {
            assert!(
                !text.contains("pa%2Fss") && !text.contains("s3cr3t-token"),
                "{text}"
            );
            assert!(text.contains("n3:4222"), "{text}");
        }
        let values = secret_values(&config);
        assert!(values.contains(&"s3cr3t-token".to_string()), "{values:?}");
        assert!(url_credentials("nats://127.0.0.1:4222").is_empty());
    }

    #[test]
    fn the_seed_of_a_creds_file_is_found_and_redacted() {
        let creds = "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.sig\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\n\
             -----BEGIN USER NKEY SEED-----\nSUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4\n------END USER NKEY SEED------\n";
        let seed = "SUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4";
        assert_eq!(creds_seed(creds).as_deref(), Some(seed));
        assert_eq!(creds_seed("no seed here"), None);
        let dir = std::env::temp_dir().join(format!("webproxy-creds-{}", std::process::id()));
        std::fs::write(&dir, creds).expect("write");
        let mut config = nats();
        config.credentials_file = Some(dir.clone());
        let redactor = Redactor::default();
        redactor.add_fixed(secret_values(&config));
        let line = format!("connecting with {seed} failed");
        assert_eq!(redactor.redact(&line), "connecting with [REDACTED] failed");
        let _ = std::fs::remove_file(dir);
    }

    #[test]
    fn secrets_never_print() {
        let mut config = nats();
        config.password = Some(Secret::new("hunter2"));
        config.user = Some("u".into());
        let json = serde_json::to_string(&config).expect("json");
        assert!(!json.contains("hunter2"), "{json}");
        assert!(!format!("{config:?}").contains("hunter2"));
        assert_eq!(secret_values(&config), ["hunter2"]);
    }
}
