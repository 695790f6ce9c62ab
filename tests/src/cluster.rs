//! A JetStream cluster of real nats-servers on loopback: each node a [`NatsServer`]
//! with a cluster block, a route to every other node, and a monitoring port so tests
//! can ask which node a client is connected to.

use serde_json::Value;

use crate::{NatsServer, free_port, http_client};

/// A running cluster; nodes are killed when it is dropped.
pub struct NatsCluster {
    pub nodes: Vec<NatsServer>,
    monitor_ports: Vec<u16>,
}

impl NatsCluster {
    /// Starts `size` nodes that route to each other, with JetStream clustered. Nodes do
    /// not advertise each other to clients (`no_advertise`): a client reaches the nodes
    /// its test gives it, so one that a relay stalls cannot slip out to another node.
    pub fn start(size: usize) -> NatsCluster {
        let route_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let monitor_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let routes = route_ports
            .iter()
            .map(|p| format!("\"nats-route://127.0.0.1:{p}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let nodes = (0..size)
            .map(|i| {
                NatsServer::start_with(&format!(
                    "server_name: \"n{i}\"\n\
                     http: \"127.0.0.1:{monitor}\"\n\
                     cluster {{\n  name: \"webproxy-test\"\n  no_advertise: true\n  listen: \"127.0.0.1:{route}\"\n  routes: [{routes}]\n}}\n",
                    monitor = monitor_ports[i],
                    route = route_ports[i],
                ))
            })
            .collect();
        NatsCluster {
            nodes,
            monitor_ports,
        }
    }

    /// Waits until every node's `/healthz` answers 200: JetStream enabled and its meta
    /// group led and current. A cluster that just started elects for a few seconds,
    /// more on a loaded machine; a service started before that spends its own start
    /// timeout on the election.
    pub async fn wait_jetstream_ready(&self, timeout: std::time::Duration) {
        let http = http_client();
        crate::wait_until(timeout, "every node's /healthz to answer 200", || async {
            for port in &self.monitor_ports {
                let healthy = http
                    .get(format!("http://127.0.0.1:{port}/healthz"))
                    .send()
                    .await
                    .is_ok_and(|response| response.status().is_success());
                if !healthy {
                    return false;
                }
            }
            true
        })
        .await;
    }

    /// Every node's client URL, comma-separated, as `[nats] url` takes them.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The index of the node holding a client connection named `name`, if any, from
    /// each node's `/connz` monitoring endpoint.
    pub async fn node_with_client(&self, name: &str) -> Option<usize> {
        let http = http_client();
        for (index, port) in self.monitor_ports.iter().enumerate() {
            let Ok(response) = http
                .get(format!("http://127.0.0.1:{port}/connz"))
                .send()
                .await
            else {
                continue;
            };
            let Some(connz) = response
                .bytes()
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            else {
                continue;
            };
            let found = connz["connections"]
                .as_array()
                .is_some_and(|conns| conns.iter().any(|c| c["name"] == name));
            if found {
                return Some(index);
            }
        }
        None
    }
}
