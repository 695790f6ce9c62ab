//! The minimal pipeline (`webproxy-pipeline`, the bench crate's second binary) as a
//! process of its own beside the bench, so that its CPU, RSS and profile are its own
//! as `webproxy serve`'s are.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

/// The pools the pipeline serves, as the bench's webproxy configuration has them:
/// `default` (the levels) and `slot` (slot utilization).
const POOLS: [&str; 2] = ["default=512", "slot=1"];

/// A running pipeline, killed when dropped.
pub(crate) struct Pipeline {
    pid: u32,
    _child: Child,
}

impl Pipeline {
    /// Starts the pipeline against `nats_url` and waits until its consumers are made.
    pub(crate) async fn start(nats_url: &str) -> anyhow::Result<Pipeline> {
        let binary = binary()?;
        let mut command = Command::new(&binary);
        command.arg("--nats").arg(nats_url);
        for pool in POOLS {
            command.arg("--pool").arg(pool);
        }
        let mut child = command
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;
        let pid = child.id().context("the pipeline exited at once")?;
        let stdout = child.stdout.take().context("the pipeline's stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
        match ready {
            Ok(Ok(Some(line))) if line == "ready" => Ok(Pipeline { pid, _child: child }),
            other => anyhow::bail!("the pipeline did not say ready within 30 s: {other:?}"),
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }
}

/// `webproxy-pipeline` beside the running bench binary (cargo builds both into one
/// directory).
fn binary() -> anyhow::Result<PathBuf> {
    let bench = std::env::current_exe().context("cannot find the bench's own path")?;
    Ok(bench.with_file_name("webproxy-pipeline"))
}
