//! The commands, one module each (`cli.rs` dispatches to them): `serve` (with
//! `serve_follow`, its live configuration and heartbeat), `gateway`, `send`, `pools`,
//! `dead`, `cancel` and `config`; `operator` is what the commands that talk to a running
//! deployment share.

pub(crate) mod cancel;
pub(crate) mod config;
pub(crate) mod dead;
pub(crate) mod gateway;
pub(crate) mod operator;
pub(crate) mod pools;
pub(crate) mod send;
pub(crate) mod serve;
pub(crate) mod serve_follow;
