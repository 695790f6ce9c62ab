//! What webproxy keeps in JetStream beside the pools' work, for every other crate to
//! reach one way: every state bucket declared once and reached through one handle
//! ([`state`]), the streams, fences and layouts ([`provision`]), the configuration
//! bucket ([`config_store`]) and the instances' heartbeats and lease ([`instances`]);
//! with the two things every loop that talks to the server shares, the retry schedule
//! ([`backoff`]) and the server's clock as this pod estimates it ([`clock`]).
//!
//! No decision about a request lives here: that is `webproxy-dispatcher`'s.

#![warn(unreachable_pub)]

pub mod backoff;
pub mod clock;
pub mod config_store;
pub mod follow;
pub mod instances;
pub mod provision;
pub mod state;
