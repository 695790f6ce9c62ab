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
    pub(crate) env: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) file: Option<PathBuf>,
    /// Put before the secret, e.g. `"Bearer "`; not itself secret.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub prefix: String,
}

impl SecretSource {
    /// Exactly one of `env` and `file`.
    pub(crate) fn validate(&self) -> Result<(), String> {
        match (&self.env, &self.file) {
            (Some(env), None) if !env.is_empty() => Ok(()),
            (None, Some(file)) if !file.as_os_str().is_empty() => Ok(()),
            (Some(_), Some(_)) => Err("set one of `env` and `file`, not both".into()),
            _ => Err("set `env = \"VARIABLE\"` or `file = \"/path\"`".into()),
        }
    }

    pub(crate) fn is_file(&self) -> bool {
        self.file.is_some()
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
