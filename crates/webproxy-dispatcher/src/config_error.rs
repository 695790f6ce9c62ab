//! The error a configuration that cannot run gives: the key it concerns and why.

use thiserror::Error;

/// A configuration that cannot run; the message names the key.
#[derive(Debug, Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    /// The error for `key`, saying what is wrong with it.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}
