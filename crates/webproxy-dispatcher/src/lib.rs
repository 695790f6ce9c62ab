//! Consumes webproxy's work streams: provisions streams and consumers, matches request
//! rules, decides what happens to each message, performs attempts through the worker,
//! publishes replies and dead letters, and acks.
//!
//! Decisions (`rules`, `decision`, `outbox`) are pure; effects live in `runtime` and
//! `provision`.

pub mod config;
pub mod decision;
pub mod egress;
pub mod health;
pub mod nats_auth;
pub mod outbox;
pub mod provision;
pub mod redirect;
pub mod rules;
pub mod runtime;
pub mod secrets;
pub mod security;

pub use config::{Config, ConfigError, Settings};
pub use health::Health;
pub use ipnet;
pub use runtime::{Dispatcher, connect};
