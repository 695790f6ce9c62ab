//! The error of a name (a subject, an id, a pool, an origin) that breaks its rules:
//! its own module, since every kind of name uses it.

use thiserror::Error;

/// A name that breaks its character rules; the message says which rule.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct InvalidName(pub String);
