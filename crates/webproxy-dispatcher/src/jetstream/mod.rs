//! What lives in JetStream beside the pools' work: every state bucket declared once and
//! reached through one handle ([`state`]), the streams, fences and layouts
//! ([`provision`]), the configuration bucket ([`config_store`]) and the instances'
//! heartbeats and lease ([`instances`]).

pub(crate) mod config_store;
pub(crate) mod instances;
pub(crate) mod provision;
pub(crate) mod state;
