//! How each fault is done to a running cell.

use std::process::Command;
use std::time::Duration;

use serde_json::json;
use webproxy_tests::wait_until;

use crate::cell::{Cell, Nats};
use crate::fault::Fault;
use crate::feature::ACK_WAIT;

/// How long the JetStream API stays unavailable (two of three nodes stopped): the
/// issue's 10 s.
const API_DOWN: Duration = Duration::from_secs(10);

/// How long a stalled pod stays stopped: past two `ack_wait`s, so the server has
/// redelivered what it held.
const STALL: Duration = Duration::from_secs(7);

/// How long the stream leaders may take to move to one node: a stepdown elects in a
/// second or two, several streams one after another on a loaded machine.
const LEADERS_MOVED: Duration = Duration::from_secs(60);

impl Fault {
    pub async fn inject(self, cell: &mut Cell) {
        match self {
            Fault::Restart => {
                let Nats::One(server) = &mut cell.nats else {
                    unreachable!("a restart cell runs one server")
                };
                tokio::task::block_in_place(|| server.restart_gracefully());
            }
            Fault::Leader => {
                lead_everything_from(cell, "n0").await;
                let Nats::Cluster(cluster) = &mut cell.nats else {
                    unreachable!("a leader cell runs a cluster")
                };
                cluster.nodes[0].kill();
            }
            Fault::Deleted => {
                for bucket in cell.feature.buckets() {
                    let stream = format!("KV_WEBPROXY_{bucket}");
                    if let Err(e) = cell.js.delete_stream(&stream).await {
                        panic!("delete {stream}: {e}");
                    }
                }
            }
            Fault::ApiDown => {
                let Nats::Cluster(cluster) = &mut cell.nats else {
                    unreachable!("an api-down cell runs a cluster")
                };
                cluster.nodes[1].kill();
                cluster.nodes[2].kill();
                // The outage itself: a fixed length is the scenario.
                tokio::time::sleep(API_DOWN).await;
                tokio::task::block_in_place(|| {
                    cluster.nodes[1].start_again();
                    cluster.nodes[2].start_again();
                });
            }
            Fault::Stalled => {
                let pid = cell.services[0].pid().to_string();
                signal("-STOP", &pid);
                // The stall itself: a fixed length is the scenario.
                tokio::time::sleep(STALL).await;
                signal("-CONT", &pid);
            }
            Fault::Pushed => {
                let down = cell.feature.document(&cell.upstream, ACK_WAIT / 3 * 2, 1);
                cell.push(&down).await;
                let up = cell.feature.document(&cell.upstream, ACK_WAIT * 2, 0);
                cell.push(&up).await;
            }
            Fault::Clock => {}
        }
    }
}

fn signal(signal: &str, pid: &str) {
    let status = Command::new("kill")
        .args([signal, pid])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {signal} {pid}");
}

/// Moves the leader of every stream (the pool streams, the replies, the dead letters
/// and every bucket) to `node` by stepdown with a preferred placement, and waits until
/// each is led from there.
async fn lead_everything_from(cell: &Cell, node: &str) {
    use futures::TryStreamExt as _;
    let names: Vec<String> = cell
        .js
        .stream_names()
        .try_collect()
        .await
        .expect("the stream names");
    for name in names {
        wait_until(
            LEADERS_MOVED,
            &format!("{name} led from {node}"),
            || async {
                let Ok(mut stream) = cell.js.get_stream(&name).await else {
                    return false;
                };
                let Ok(info) = stream.info().await else {
                    return false;
                };
                // A stream of one replica (a fence) has no leader to move.
                if info.config.num_replicas < 2 {
                    return true;
                }
                let leader = info.cluster.clone().and_then(|cluster| cluster.leader);
                if leader.as_deref() == Some(node) {
                    return true;
                }
                let request = json!({"placement": {"preferred": node}}).to_string();
                let _ = cell
                    .js
                    .client()
                    .request(
                        format!("$JS.API.STREAM.LEADER.STEPDOWN.{name}"),
                        request.into(),
                    )
                    .await;
                // Give the election a moment before asking again.
                tokio::time::sleep(Duration::from_secs(1)).await;
                false
            },
        )
        .await;
    }
}
