//! A TCP relay on 127.0.0.1 in front of another loopback server. Cutting it drops
//! every connection through it and refuses new ones until it is healed: one caller's
//! network going away while the server and everyone else stay up. Pausing it stalls
//! every connection in both directions, new ones included, without closing any, until
//! it is resumed: a partition that neither side is told about (no RST, no FIN).

use std::net::{Ipv4Addr, SocketAddr};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A running relay; it stops, dropping its connections, when dropped.
pub struct Relay {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    paused: watch::Sender<bool>,
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
        let (paused, paused_rx) = watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                // Refused while cut: the connection is closed as soon as it is made.
                if *cut_rx.borrow() {
                    continue;
                }
                tokio::spawn(relay(inbound, target, cut_rx.clone(), paused_rx.clone()));
            }
        });
        Relay {
            addr,
            cut,
            paused,
            accept,
        }
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

    /// Stalls every connection in both directions, and holds new ones unanswered: no
    /// byte goes through and nothing is closed until [`Relay::resume`]. Bytes read
    /// just before the pause are held too and delivered, in order, on resume.
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    /// Lets every connection flow again, held ones included.
    pub fn resume(&self) {
        self.paused.send_replace(false);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

async fn relay(
    inbound: TcpStream,
    target: SocketAddr,
    mut cut: watch::Receiver<bool>,
    paused: watch::Receiver<bool>,
) {
    // A connection made while paused is not even passed on until the relay resumes.
    if flowing(&mut paused.clone()).await.is_none() {
        return;
    }
    let Ok(outbound) = TcpStream::connect(target).await else {
        return;
    };
    let (from_caller, to_caller) = inbound.into_split();
    let (from_server, to_server) = outbound.into_split();
    // Either side closing ends the connection: enough for NATS, which never half-closes.
    tokio::select! {
        _ = pipe(from_caller, to_server, paused.clone()) => {}
        _ = pipe(from_server, to_caller, paused) => {}
        _ = cut.wait_for(|cut| *cut) => {}
    }
}

/// Copies `from` to `to` while the relay is not paused.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut paused: watch::Receiver<bool>) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        if flowing(&mut paused).await.is_none() {
            return;
        }
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        // Read just before a pause: held until the relay resumes.
        if flowing(&mut paused).await.is_none() {
            return;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}

/// Waits until the relay is not paused; `None` once the relay is gone.
async fn flowing(paused: &mut watch::Receiver<bool>) -> Option<()> {
    paused.wait_for(|paused| !*paused).await.ok().map(drop)
}
