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
/// directory), or beside the directory of a test executable (`deps/`).
fn binary() -> anyhow::Result<PathBuf> {
    let bench = std::env::current_exe().context("cannot find the bench's own path")?;
    let mut dir = bench
        .parent()
        .context("the bench's path has no directory")?
        .to_path_buf();
    if dir.file_name().is_some_and(|name| name == "deps") {
        dir.pop();
    }
    Ok(dir.join("webproxy-pipeline"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt as _;
    use webproxy_client::{Client, Request};
    use webproxy_protocol::{HeaderValue, Outcome, header};
    use webproxy_testkit::{NatsServer, Upstream};

    use super::Pipeline;

    /// The pipeline keeps the contract webproxy is measured against: the live copy with
    /// its headers, and the stored reply a client reads by its origin, in the protocol's
    /// encoding (a repeated header as an array, a binary body in base64). Needs
    /// `target/<profile>/webproxy-pipeline` (`just test` builds the binaries first).
    #[tokio::test]
    async fn the_pipeline_answers_live_and_stores_the_reply_as_the_protocol_says() {
        let nats = NatsServer::start();
        let upstream = Upstream::start().await;
        let _pipeline = Pipeline::start(&nats.url())
            .await
            .expect("the pipeline starts");
        let connection = nats.client().await;
        let client = Client::new(connection.clone(), "webproxy").expect("a client");
        for (id, path) in [("multi-1", "/multi"), ("binary-1", "/binary")] {
            let mut live = connection
                .subscribe(format!("webproxy.reply.{id}"))
                .await
                .expect("subscribed");
            let request = Request::new("GET", upstream.url(path))
                .id(id)
                .pool("default");
            let submitted = client.submit(&request).await.expect("submitted");
            let copy = tokio::time::timeout(Duration::from_secs(10), live.next())
                .await
                .expect("a live copy within 10 s")
                .expect("the subscription is open");
            let headers = copy.headers.expect("the live copy's headers");
            assert_eq!(
                headers.get(header::OUTCOME).map(|v| v.as_str()),
                Some("response")
            );
            let origin = submitted.origin.to_string();
            assert_eq!(
                headers.get(header::ORIGIN).map(|v| v.as_str()),
                Some(origin.as_str())
            );
            let stored = client
                .reply(id, &submitted.origin)
                .await
                .expect("the replies stream answers")
                .expect("the reply is stored before its live copy");
            assert_eq!(
                (stored.outcome, stored.status),
                (Outcome::Response, Some(200))
            );
            let body = stored
                .body
                .decode()
                .expect("a body in the protocol's encoding");
            match path {
                "/multi" => {
                    assert_eq!(body, b"multi");
                    let multi = stored.headers.as_ref().and_then(|h| h.get("x-multi"));
                    let both = HeaderValue::Many(vec!["a".into(), "b".into()]);
                    assert_eq!(multi, Some(&both));
                }
                _ => assert_eq!(body, [0u8, 1, 2, 255, 254]),
            }
        }
    }
}
