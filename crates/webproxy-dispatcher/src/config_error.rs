//! The error a configuration that cannot run gives: the key it concerns and why.

use thiserror::Error;

/// A configuration that cannot run; the message names the key.
#[derive(Debug, Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

/// A [`ConfigError`] for `key`.
pub fn config_error(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        message: message.into(),
    }
}
