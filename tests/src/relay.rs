//! A TCP relay on 127.0.0.1 in front of another loopback server. Cutting it drops
//! every connection through it and refuses new ones until it is healed: one caller's
//! network going away while the server and everyone else stay up.

use std::net::{Ipv4Addr, SocketAddr};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A running relay; it stops, dropping its connections, when dropped.
pub struct Relay {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl Relay {
    /// Relays connections on a fresh 127.0.0.1 port to `target`.
    pub async fn start(target: SocketAddr) -> Relay {
        assert!(target.ip().is_loopback(), "relays only to loopback");
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind relay on 127.0.0.1:0");
        let addr = listener.local_addr().expect("relay local address");
        let (cut, cut_rx) = watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                // Refused while cut: the connection is closed as soon as it is made.
                if *cut_rx.borrow() {
                    continue;
                }
                tokio::spawn(relay(inbound, target, cut_rx.clone()));
            }
        });
        Relay { addr, cut, accept }
    }

    /// `nats://127.0.0.1:PORT`, for a NATS client to connect through the relay.
    pub fn nats_url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// Drops every relayed connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Accepts and relays connections again.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

async fn relay(mut inbound: TcpStream, target: SocketAddr, mut cut: watch::Receiver<bool>) {
    let Ok(mut outbound) = TcpStream::connect(target).await else {
        return;
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
        _ = cut.wait_for(|cut| *cut) => {}
    }
}
