//! `webproxy gateway` as a subprocess: its own config, log, HTTP port and health port.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use crate::{NatsServer, Service, ServiceOptions};

/// Generous: a cold 2-core machine may also be starting services.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `webproxy gateway`, killed when dropped. It derefs to its process
/// ([`Service`]: health listener, metrics, logs, signals).
pub struct Gateway {
    process: Service,
    port: u16,
}

impl Gateway {
    /// Starts the gateway against `nats` and waits until its `/readyz` is 200.
    /// The fixture writes `[nats]` and the start of `[gateway]` (`listen`,
    /// `health_listen`); `config` continues `[gateway]` with more keys, then
    /// `[[gateway.routes]]` and any other table.
    pub async fn start(nats: &NatsServer, config: &str) -> Gateway {
        Self::start_with(nats, config, ServiceOptions::default()).await
    }

    /// Like [`Gateway::start`] with explicit options (environment variables).
    pub async fn start_with(nats: &NatsServer, config: &str, options: ServiceOptions) -> Gateway {
        Self::start_with_url(&nats.url(), config, options).await
    }

    /// Like [`Gateway::start_with`] with an explicit NATS URL (e.g. a cluster seed
    /// list).
    pub async fn start_with_url(nats_url: &str, config: &str, options: ServiceOptions) -> Gateway {
        let gateway = Self::spawn(nats_url, config, options);
        gateway.process.wait_ready(READY_TIMEOUT).await;
        gateway
    }

    /// Like [`Gateway::start_with`] without waiting for it to be ready.
    pub fn spawn(nats_url: &str, config: &str, options: ServiceOptions) -> Gateway {
        let port = crate::free_port();
        Gateway {
            process: Service::spawn_command(nats_url, config, options, Some(port)),
            port,
        }
    }

    /// `http://127.0.0.1:PORT{path}`: the gateway's own listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// `https://localhost:PORT{path}`, for a gateway with TLS.
    pub fn tls_url(&self, path: &str) -> String {
        format!("https://localhost:{}{path}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `GET path` written by hand on a fresh connection (`Connection: close`), and the
    /// whole answer as text: every HTTP client resolves dot segments and some rewrite
    /// escapes, which the path tests must send as they are.
    pub async fn raw_get(&self, path: &str) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .expect("connect to the gateway");
        tcp.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("write the request");
        let mut answer = String::new();
        tcp.read_to_string(&mut answer)
            .await
            .expect("read the answer");
        answer
    }
}

impl Deref for Gateway {
    type Target = Service;

    fn deref(&self) -> &Service {
        &self.process
    }
}

/// For [`Service::wait_exit`] and [`Service::kill`].
impl DerefMut for Gateway {
    fn deref_mut(&mut self) -> &mut Service {
        &mut self.process
    }
}
