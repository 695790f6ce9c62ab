//! The attempt claim: a delivery made again while another one calls waits for it.

use super::*;

/// An upstream on loopback that answers each call `200 ok` after `delay`, counting the
/// calls it has and the most it had open at once.
struct SlowUpstream {
    port: u16,
    calls: Arc<std::sync::atomic::AtomicUsize>,
    open: Arc<std::sync::atomic::AtomicUsize>,
    most_open: Arc<std::sync::atomic::AtomicUsize>,
}

impl SlowUpstream {
    async fn start(delay: Duration) -> SlowUpstream {
        use std::sync::atomic::Ordering::SeqCst;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let upstream = SlowUpstream {
            port,
            calls: Arc::default(),
            open: Arc::default(),
            most_open: Arc::default(),
        };
        let (calls, open, most_open) = (
            upstream.calls.clone(),
            upstream.open.clone(),
            upstream.most_open.clone(),
        );
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                calls.fetch_add(1, SeqCst);
                let now_open = open.fetch_add(1, SeqCst) + 1;
                most_open.fetch_max(now_open, SeqCst);
                let open = open.clone();
                tokio::spawn(async move {
                    let mut request = [0u8; 4096];
                    let _ = socket.read(&mut request).await;
                    tokio::time::sleep(delay).await;
                    let _ = socket
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                        )
                        .await;
                    open.fetch_sub(1, SeqCst);
                });
            }
        });
        upstream
    }

    /// A GET of `/x` with `id`.
    fn envelope(&self, id: &str) -> String {
        format!(
            r#"{{"id":"{id}","method":"GET","url":"http://127.0.0.1:{}/x"}}"#,
            self.port
        )
    }

    fn open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// After a consumer's leadership changes, the server may hand a message out again while
/// another instance's delivery of it still calls the upstream; the later delivery waits
/// for the attempt claim, then finds the stored reply. Two calls at once would break a
/// pool limit of 1.
#[tokio::test]
async fn a_message_delivered_again_while_another_delivery_calls_waits_for_it() {
    use std::sync::atomic::Ordering::SeqCst;
    let f = Fixture::start().await;
    let upstream = SlowUpstream::start(Duration::from_millis(1500)).await;
    let payload = upstream.envelope("w");
    let (holder, later) = (caller(&payload, 61, 2), caller(&payload, 61, 3));
    let later_run = async {
        // Bounded: the holder's call is open within 10 s.
        let opened = tokio::time::timeout(Duration::from_secs(10), async {
            while upstream.open() == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            opened.is_ok(),
            "the holder's call never reached the upstream"
        );
        f.handle(&later).await
    };
    let (held, waited) = tokio::time::timeout(
        Duration::from_secs(30),
        futures::future::join(f.handle(&holder), later_run),
    )
    .await
    .expect("both deliveries end");
    assert_eq!((held, waited), (Settled::Done, Settled::Done));
    assert_eq!(upstream.most_open.load(SeqCst), 1, "two calls at once");
    assert_eq!(
        upstream.calls.load(SeqCst),
        1,
        "the later delivery called too"
    );
    assert_eq!(holder.final_acks(), ["Ack"]);
    assert_eq!(
        later.final_acks(),
        ["Ack"],
        "answered from the stored reply"
    );
}

/// A claim whose holder died (never renewed, never released) lapses after its TTL, and
/// the delivery waiting for it then makes the attempt.
#[tokio::test]
async fn a_claim_whose_holder_died_lapses_and_the_waiting_delivery_attempts() {
    use std::sync::atomic::Ordering::SeqCst;
    let f = Fixture::start().await;
    let upstream = SlowUpstream::start(Duration::from_millis(10)).await;
    let payload = upstream.envelope("l");
    let key = crate::conversation::progress::attempt_key(STREAM, 62);
    let taken = f
        .shared
        .outlet
        .progress
        .take_attempt(&key, 2, Duration::from_secs(1))
        .await
        .expect("taken");
    assert!(
        matches!(taken, crate::conversation::progress::Taken::Held { .. }),
        "{taken:?}"
    );
    let later = caller(&payload, 62, 3);
    // Bounded: a 1 s TTL, and the server's expiry sweep, lapse within 10 s.
    let settled = tokio::time::timeout(Duration::from_secs(10), f.handle(&later))
        .await
        .expect("the claim lapsed and the delivery went on");
    assert_eq!(settled, Settled::Done);
    assert_eq!(later.final_acks(), ["Ack"]);
    assert_eq!(
        upstream.calls.load(SeqCst),
        1,
        "the waiting delivery attempted"
    );
}

/// Two deliveries of one hop message (the server handed it out again, and both copies
/// raced to take its step): the one whose write lost carries on as that step rather
/// than ack, since the copy that won may be stale and leave the message. A hop of
/// another sequence that lost is stale and acks.
#[tokio::test]
async fn a_copy_of_the_hop_that_took_the_step_carries_on_and_another_hop_is_stale() {
    let f = Fixture::start().await;
    let progress = &f.shared.outlet.progress;
    let caller = HopState::first(Origin::new(STREAM, 71), SystemTime::UNIX_EPOCH, None);
    let untaken = Record {
        kind: crate::conversation::hop::HopKind::Park,
        subject: "webproxy.retry.partner.t".into(),
        msg_id: "park:t".into(),
        hop: caller.next(crate::conversation::hop::AttemptHistory::default(), None),
        taken_by: None,
    };
    let step = untaken.step();
    let before = progress.write(&untaken, None).await.expect("recorded");
    // The winning copy of hop message 80 took the step after both had read the record.
    let mut taken = untaken.clone();
    taken.taken_by = Some(80);
    let now = progress.write(&taken, Some(before)).await.expect("taken");

    let carried =
        crate::conversation::before::take_step(progress, (untaken.clone(), before), step, 80).await;
    assert!(
        matches!(carried, Ok(revision) if revision == now),
        "{carried:?}"
    );
    let other = crate::conversation::before::take_step(progress, (untaken, before), step, 81).await;
    assert!(
        matches!(other, Err(crate::conversation::ending::Ending::Stale)),
        "{other:?}"
    );
}
