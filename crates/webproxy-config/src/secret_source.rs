//! Where an injected header's secret comes from, as the request rules configure it.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Where an injected header's value comes from:
/// `{ env = "PARTNER_TOKEN", prefix = "Bearer " }` or `{ file = "/run/secrets/token" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Put before the secret, e.g. `"Bearer "`; not itself secret.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefix: String,
}

impl SecretSource {
    /// Exactly one of `env` and `file`.
    pub fn validate(&self) -> Result<(), String> {
        match (&self.env, &self.file) {
            (Some(env), None) if !env.is_empty() => Ok(()),
            (None, Some(file)) if !file.as_os_str().is_empty() => Ok(()),
            (Some(_), Some(_)) => Err("set one of `env` and `file`, not both".into()),
            _ => Err("set `env = \"VARIABLE\"` or `file = \"/path\"`".into()),
        }
    }

    pub fn is_file(&self) -> bool {
        self.file.is_some()
    }

    /// Checks that exactly one of `env` and `file` is set, for a secret that is not an
    /// injected header (the gateway's tokens and key); `key` names it in the error.
    pub fn check(&self, key: &str) -> Result<(), crate::ConfigError> {
        self.validate()
            .map_err(|message| crate::ConfigError::new(key, message))
    }

    /// Reads the value from the process environment or the file, as injected secrets
    /// are read (a file's trailing newline dropped; empty, CR, LF and NUL refused).
    pub fn read(&self) -> Result<String, String> {
        read_secret(self, &|name| std::env::var(name).ok(), &|path| {
            std::fs::read(path)
        })
    }
}

impl fmt::Display for SecretSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.env, &self.file) {
            (Some(env), _) => write!(f, "environment variable {env}"),
            (_, Some(file)) => write!(f, "file {}", file.display()),
            _ => f.write_str("nothing"),
        }
    }
}

/// Reads one secret with `env` and `read_file` (injected so the rules are tested without
/// touching the process environment). A file's trailing newline is dropped.
pub fn read_secret(
    source: &SecretSource,
    env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&std::path::Path) -> std::io::Result<Vec<u8>>,
) -> Result<String, String> {
    let value = match (&source.env, &source.file) {
        (Some(var), _) => {
            env(var).ok_or_else(|| format!("environment variable {var} is not set"))?
        }
        (_, Some(path)) => {
            let bytes = read_file(path)
                .map_err(|e| format!("cannot read secret file {}: {e}", path.display()))?;
            let mut text = String::from_utf8(bytes)
                .map_err(|_| format!("secret file {} is not UTF-8", path.display()))?;
            if text.ends_with('\n') {
                text.pop();
                if text.ends_with('\r') {
                    text.pop();
                }
            }
            text
        }
        _ => return Err("names no environment variable or file".into()),
    };
    if value.is_empty() {
        return Err(format!("the {source} is empty"));
    }
    if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        return Err(format!(
            "the {source} contains CR, LF or NUL, which a header cannot carry"
        ));
    }
    Ok(value)
}
