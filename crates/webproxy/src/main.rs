//! The webproxy binary: parse the command line, load the configuration, set up
//! logging, and run the chosen command until it ends or a signal stops it.

mod cfg;
mod cli;
mod health;
mod send;
mod serve;
mod telemetry;

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    // Shared with the logger, which redacts the secrets loaded later.
    let redactor = webproxy_dispatcher::secrets::Redactor::default();
    let _telemetry = telemetry::init(cli.default_log_level(), redactor.clone());
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli.run(redactor)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
