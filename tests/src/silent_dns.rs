//! A DNS server on loopback that reads every query and never answers, as a slow or
//! unreachable authoritative server looks to a resolver: the service's lookups must
//! end at `[outbound] dns_timeout` without holding a thread. It counts the queries it
//! dropped, so a test can tell that lookups are under way.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

/// The server; it stops when dropped.
pub struct SilentDns {
    addr: SocketAddr,
    queries: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl SilentDns {
    /// Listens on 127.0.0.1, on a free UDP port.
    pub async fn start() -> SilentDns {
        let socket = UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind the silent DNS server");
        let addr = socket.local_addr().expect("its address");
        let queries = Arc::new(AtomicUsize::new(0));
        let counted = queries.clone();
        let task = tokio::spawn(async move {
            let mut buffer = [0u8; 4096];
            while socket.recv_from(&mut buffer).await.is_ok() {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        });
        SilentDns {
            addr,
            queries,
            task,
        }
    }

    /// `127.0.0.1:PORT`, as `[outbound] dns_servers` takes it.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The queries read (and dropped) so far.
    pub fn queries(&self) -> usize {
        self.queries.load(Ordering::SeqCst)
    }
}

impl Drop for SilentDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}
