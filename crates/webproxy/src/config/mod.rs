//! The process's configuration: the file's schema and how it is loaded in layers, the
//! cluster document of the configuration bucket, the `[gateway]` section, and the NATS
//! connection settings with their credentials. Checking the cluster part is
//! `webproxy-config`'s.

pub(crate) mod connection;
pub(crate) mod document;
pub(crate) mod gateway;
pub(crate) mod load;
pub(crate) mod nats_auth;
pub(crate) mod schema;
