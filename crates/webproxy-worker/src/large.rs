//! Large response bodies: a body above the inline limit, for a request that opted in,
//! goes to a [`BodySink`] chunk by chunk as it arrives, so no attempt ever holds more
//! than the inline limit of it. Where the sink keeps it is the dispatcher's business.

use std::future::Future;
use std::pin::Pin;

use bytes::{Bytes, BytesMut};

/// What a sink's step comes to; the error is the caller's message.
pub type SinkFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, SinkError>> + Send + 'a>>;

/// Why a sink could not keep a body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SinkError {
    pub message: String,
    /// The store is full: another try would be refused the same way. Any other
    /// failure (the store unreachable or not yet answering) may pass.
    pub full: bool,
}

/// Where a large body goes. A sink belongs to one attempt; what it has kept of a body
/// that did not end in a response is removed by its owner, not by the worker.
pub trait BodySink: Send {
    /// Appends the next bytes of the body, in order.
    fn write(&mut self, bytes: Bytes) -> SinkFuture<'_, ()>;
    /// The body is complete: makes it readable. The sink knows where it put it.
    fn finish(&mut self) -> SinkFuture<'_, ()>;
}

/// A request's opt-in to a stored body: the largest it may be, and where it goes.
pub struct LargeBody<'a> {
    /// `[outbound] max_large_body`.
    pub max: u64,
    pub sink: &'a mut dyn BodySink,
}

/// How much of a stored body the response keeps in memory, for response rules' body
/// patterns and error excerpts: its first 64 KiB.
pub const STORED_BODY_PREFIX: usize = 64 * 1024;

/// A body read so far: inline while it fits the inline limit, then streamed.
pub(crate) struct BodyReader<'s, 'a> {
    inline_limit: usize,
    large: Option<&'s mut LargeBody<'a>>,
    inline: BytesMut,
    /// The bytes sent to the sink so far, once streaming.
    streamed: Option<u64>,
    prefix: Bytes,
}

/// Why a body could not be read whole.
pub(crate) enum BodyError {
    /// Above the limit that applies (`inline_limit`, or the opt-in's `max`).
    TooLarge {
        limit: u64,
    },
    Store(SinkError),
}

impl<'s, 'a> BodyReader<'s, 'a> {
    /// A reader for a response of `status`: only a final answer streams, since a 3xx
    /// the chain may follow is read inline.
    pub(crate) fn new(
        inline_limit: usize,
        large: Option<&'s mut LargeBody<'a>>,
        status: u16,
    ) -> Self {
        let large = large.filter(|_| !(300..400).contains(&status));
        BodyReader {
            inline_limit,
            large,
            inline: BytesMut::new(),
            streamed: None,
            prefix: Bytes::new(),
        }
    }

    /// The most a body may be, given a declared length: an early refusal.
    pub(crate) fn limit(&self) -> u64 {
        self.large
            .as_ref()
            .map_or(self.inline_limit as u64, |large| {
                large.max.max(self.inline_limit as u64)
            })
    }

    pub(crate) async fn push(&mut self, chunk: Bytes) -> Result<(), BodyError> {
        if let Some(streamed) = self.streamed {
            let total = streamed + chunk.len() as u64;
            if total > self.limit() {
                return Err(BodyError::TooLarge {
                    limit: self.limit(),
                });
            }
            self.streamed = Some(total);
            return self.write(chunk).await;
        }
        if self.inline.len() + chunk.len() <= self.inline_limit {
            self.inline.extend_from_slice(&chunk);
            return Ok(());
        }
        if self.large.is_none() {
            return Err(BodyError::TooLarge {
                limit: self.inline_limit as u64,
            });
        }
        // Past the inline limit with an opt-in: from here on the body is streamed,
        // what was read inline first.
        let head = std::mem::take(&mut self.inline).freeze();
        let total = (head.len() + chunk.len()) as u64;
        if total > self.limit() {
            return Err(BodyError::TooLarge {
                limit: self.limit(),
            });
        }
        // A copy: a slice would keep the whole inline buffer (up to the inline limit)
        // alive for as long as the body streams.
        self.prefix = Bytes::copy_from_slice(&head[..head.len().min(STORED_BODY_PREFIX)]);
        self.streamed = Some(total);
        self.write(head).await?;
        self.write(chunk).await
    }

    async fn write(&mut self, bytes: Bytes) -> Result<(), BodyError> {
        match self.large.as_mut() {
            Some(large) => large.sink.write(bytes).await.map_err(BodyError::Store),
            None => Ok(()),
        }
    }

    /// The body in memory: whole when it fit inline, else the stored body's prefix
    /// once the sink has made the whole readable.
    pub(crate) async fn finish(self) -> Result<Bytes, BodyError> {
        match (self.streamed, self.large) {
            (Some(_), Some(large)) => {
                large.sink.finish().await.map_err(BodyError::Store)?;
                Ok(self.prefix)
            }
            _ => Ok(self.inline.freeze()),
        }
    }
}

/// A request body read from storage as it is sent: its length, and its bytes in order
/// from a channel its reader fills (an `Err` ends the send as a failure). Sent on the
/// first leg only: a redirect that would send it again is the answer itself.
pub struct StreamedBody {
    pub len: u64,
    pub chunks: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
}

impl hyper::body::Body for StreamedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        self.chunks
            .poll_recv(cx)
            .map(|chunk| chunk.map(|chunk| chunk.map(hyper::body::Frame::data)))
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keeps what it is given, and refuses past `room` bytes, as a full store does.
    #[derive(Default)]
    struct Kept {
        bytes: Vec<u8>,
        finished: bool,
        room: Option<usize>,
    }

    impl BodySink for Kept {
        fn write(&mut self, bytes: Bytes) -> SinkFuture<'_, ()> {
            Box::pin(async move {
                if self
                    .room
                    .is_some_and(|room| self.bytes.len() + bytes.len() > room)
                {
                    return Err(SinkError {
                        message: "body store full".into(),
                        full: true,
                    });
                }
                self.bytes.extend_from_slice(&bytes);
                Ok(())
            })
        }

        fn finish(&mut self) -> SinkFuture<'_, ()> {
            Box::pin(async move {
                self.finished = true;
                Ok(())
            })
        }
    }

    async fn read(
        inline: usize,
        large: Option<&mut LargeBody<'_>>,
        status: u16,
        pieces: &[&[u8]],
    ) -> Result<Bytes, BodyError> {
        let mut reader = BodyReader::new(inline, large, status);
        for piece in pieces {
            reader.push(Bytes::copy_from_slice(piece)).await?;
        }
        reader.finish().await
    }

    #[tokio::test]
    async fn a_body_that_fits_inline_never_reaches_the_sink() {
        let mut kept = Kept::default();
        let mut large = LargeBody {
            max: 100,
            sink: &mut kept,
        };
        let body = read(4, Some(&mut large), 200, &[b"ab", b"cd"]).await;
        assert_eq!(body.ok().as_deref(), Some(&b"abcd"[..]));
        assert!(kept.bytes.is_empty() && !kept.finished);
    }

    #[tokio::test]
    async fn past_the_inline_limit_the_whole_body_streams_in_order() {
        let mut kept = Kept::default();
        let mut large = LargeBody {
            max: 100,
            sink: &mut kept,
        };
        let body = read(4, Some(&mut large), 200, &[b"abc", b"def", b"gh"]).await;
        assert_eq!(
            body.ok().as_deref(),
            Some(&b"abc"[..]),
            "the prefix read inline"
        );
        assert_eq!(kept.bytes, b"abcdefgh");
        assert!(kept.finished);
    }

    #[tokio::test]
    async fn limits_hold_with_and_without_the_opt_in() {
        let without = read(4, None, 200, &[b"abc", b"de"]).await;
        assert!(matches!(without, Err(BodyError::TooLarge { limit: 4 })));

        let mut kept = Kept::default();
        let mut large = LargeBody {
            max: 6,
            sink: &mut kept,
        };
        let over = read(4, Some(&mut large), 200, &[b"abc", b"de", b"fg"]).await;
        assert!(matches!(over, Err(BodyError::TooLarge { limit: 6 })));
        assert!(!kept.finished);

        // A 3xx the chain may follow is read inline whatever the opt-in.
        let mut kept = Kept::default();
        let mut large = LargeBody {
            max: 100,
            sink: &mut kept,
        };
        let redirect = read(4, Some(&mut large), 302, &[b"abc", b"de"]).await;
        assert!(matches!(redirect, Err(BodyError::TooLarge { limit: 4 })));
        assert!(kept.bytes.is_empty());
    }

    #[tokio::test]
    async fn a_sink_that_refuses_ends_the_read_with_its_error() {
        let mut kept = Kept {
            room: Some(5),
            ..Kept::default()
        };
        let mut large = LargeBody {
            max: 100,
            sink: &mut kept,
        };
        let full = read(4, Some(&mut large), 200, &[b"abc", b"de", b"fg"]).await;
        match full {
            Err(BodyError::Store(error)) => assert_eq!(error.message, "body store full"),
            _ => panic!("expected the store's error"),
        }
    }
}
