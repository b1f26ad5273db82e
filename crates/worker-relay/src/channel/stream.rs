//! [`SecureStream`]: a byte stream carried in encrypted, authenticated records.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The longest Noise message: a received record's length prefix never exceeds it.
const MAX_RECORD: usize = 65_535;

/// The authentication tag every record carries.
const TAG_LEN: usize = 16;

/// The most plaintext one record this side seals carries (16 KiB, as TLS's records); longer
/// writes are split across records. Noise would allow 65,519 bytes, but a record is only usable
/// once it arrived whole: on a link that drops every few tens of kilobytes, records near that
/// size might never get through, where 16 KiB ones make progress (the protocol resumes from the
/// last whole item). The per-record cost (18 bytes, one tag) stays far below 1 %.
pub const MAX_RECORD_PLAINTEXT: usize = 16 * 1024;

/// The most plaintext a received record may carry: any Noise message.
const MAX_RECEIVED_PLAINTEXT: usize = MAX_RECORD - TAG_LEN;

/// A record's header: its ciphertext length, `u16` big-endian.
const HEADER_LEN: usize = 2;

/// Room for received ciphertext: two whole records, so one can be read while another waits.
const RECEIVE_ROOM: usize = 2 * (HEADER_LEN + MAX_RECORD);

/// Sealed records held for the transport before a write waits for it to take them.
const SEALED_LIMIT: usize = 128 * 1024;

/// A byte stream over `T` in which every byte travels in a ChaCha20-Poly1305 record of the
/// channel opened by [`initiate`](super::initiate) or [`respond`](super::respond).
///
/// Writes are sealed into records of at most [`MAX_RECORD_PLAINTEXT`] bytes and handed to `T`
/// once 128 KiB are sealed or on a flush; a write returns once its records are sealed, so callers
/// flush (as every writer of the protocol does) for them to leave. Reads return plaintext as each record
/// arrives whole and authenticates.
///
/// # Errors
/// A record that does not authenticate, or a transport that ends inside a record, is an
/// [`io::Error`] of kind [`InvalidData`](io::ErrorKind::InvalidData) or
/// [`UnexpectedEof`](io::ErrorKind::UnexpectedEof); the stream is unusable afterwards.
pub struct SecureStream<T> {
    inner: T,
    noise: snow::TransportState,
    /// Ciphertext read from `inner`: `received[received_start..received_end]`.
    received: Box<[u8]>,
    received_start: usize,
    received_end: usize,
    /// Whether `inner` reached its end.
    inner_ended: bool,
    /// A record that failed: every later read fails the same way.
    broken: Option<io::ErrorKind>,
    /// Decrypted plaintext not yet read: `plain[plain_start..plain_end]`.
    plain: Box<[u8]>,
    plain_start: usize,
    plain_end: usize,
    /// Sealed records not yet taken by `inner`: `sealed[sealed_start..]`.
    sealed: Vec<u8>,
    sealed_start: usize,
}

impl<T> fmt::Debug for SecureStream<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecureStream")
            .field("buffered_plaintext", &(self.plain_end - self.plain_start))
            .field("buffered_ciphertext", &(self.received_end - self.received_start))
            .field("unsent", &(self.sealed.len() - self.sealed_start))
            .finish_non_exhaustive()
    }
}

impl<T> SecureStream<T> {
    pub(super) fn new(inner: T, noise: snow::TransportState) -> Self {
        Self {
            inner,
            noise,
            received: vec![0; RECEIVE_ROOM].into_boxed_slice(),
            received_start: 0,
            received_end: 0,
            inner_ended: false,
            broken: None,
            plain: vec![0; MAX_RECEIVED_PLAINTEXT].into_boxed_slice(),
            plain_start: 0,
            plain_end: 0,
            sealed: Vec::with_capacity(SEALED_LIMIT),
            sealed_start: 0,
        }
    }

    /// The transport the channel runs over.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Decrypts the next record if it arrived whole; `Ok(false)` if more bytes are needed.
    fn open_record(&mut self) -> io::Result<bool> {
        let available = &self.received[self.received_start..self.received_end];
        let Some(header) = available.get(..HEADER_LEN) else {
            return Ok(false);
        };
        let len = usize::from(u16::from_be_bytes([header[0], header[1]]));
        if len < TAG_LEN {
            return Err(self.break_with(io::ErrorKind::InvalidData));
        }
        let Some(ciphertext) = available.get(HEADER_LEN..HEADER_LEN + len) else {
            return Ok(false);
        };
        match self.noise.read_message(ciphertext, &mut self.plain) {
            Ok(n) => {
                self.plain_start = 0;
                self.plain_end = n;
                self.received_start += HEADER_LEN + len;
                if self.received_start == self.received_end {
                    self.received_start = 0;
                    self.received_end = 0;
                }
                Ok(true)
            }
            Err(_) => Err(self.break_with(io::ErrorKind::InvalidData)),
        }
    }

    fn break_with(&mut self, kind: io::ErrorKind) -> io::Error {
        self.broken = Some(kind);
        broken_error(kind)
    }

    /// Seals `plaintext` (at most [`MAX_RECORD_PLAINTEXT`] bytes) into one record.
    fn seal(&mut self, plaintext: &[u8]) -> io::Result<()> {
        let start = self.sealed.len();
        let len = plaintext.len() + TAG_LEN;
        let header = u16::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        self.sealed.extend_from_slice(&header.to_be_bytes());
        self.sealed.resize(start + HEADER_LEN + len, 0);
        match self
            .noise
            .write_message(plaintext, &mut self.sealed[start + HEADER_LEN..])
        {
            Ok(_) => Ok(()),
            Err(error) => {
                self.sealed.truncate(start);
                Err(io::Error::other(format!("sealing a record: {error}")))
            }
        }
    }
}

fn broken_error(kind: io::ErrorKind) -> io::Error {
    let message = match kind {
        io::ErrorKind::UnexpectedEof => "the channel's transport ended inside a record",
        _ => "a channel record did not authenticate (corrupted, forged or replayed bytes)",
    };
    io::Error::new(kind, message)
}

impl<T: AsyncWrite + Unpin> SecureStream<T> {
    /// Sealed bytes not yet taken by the transport.
    fn unsent(&self) -> usize {
        self.sealed.len() - self.sealed_start
    }

    /// Hands sealed records to the transport until none is left.
    fn poll_push(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sealed_start < self.sealed.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.sealed[self.sealed_start..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sealed_start += n;
        }
        self.sealed.clear();
        self.sealed_start = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SecureStream<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.plain_start < this.plain_end {
                let n = (this.plain_end - this.plain_start).min(buf.remaining());
                buf.put_slice(&this.plain[this.plain_start..this.plain_start + n]);
                this.plain_start += n;
                return Poll::Ready(Ok(()));
            }
            if let Some(kind) = this.broken {
                return Poll::Ready(Err(broken_error(kind)));
            }
            if this.open_record()? {
                continue;
            }
            if this.inner_ended {
                return Poll::Ready(if this.received_start == this.received_end {
                    Ok(())
                } else {
                    Err(this.break_with(io::ErrorKind::UnexpectedEof))
                });
            }
            if this.received_end == this.received.len() {
                // A partial record at the end of the room: move it to the front.
                this.received
                    .copy_within(this.received_start..this.received_end, 0);
                this.received_end -= this.received_start;
                this.received_start = 0;
            }
            let mut room = ReadBuf::new(&mut this.received[this.received_end..]);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut room))?;
            let n = room.filled().len();
            if n == 0 {
                this.inner_ended = true;
            }
            this.received_end += n;
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SecureStream<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.unsent() >= SEALED_LIMIT {
            ready!(this.poll_push(cx))?;
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // Seal record after record while there is room, so that a large write costs one system
        // call per SEALED_LIMIT rather than one per record; the flush every writer of the
        // protocol ends with sends the rest.
        let mut taken = 0;
        while taken < buf.len() && (taken == 0 || this.unsent() < SEALED_LIMIT) {
            let n = (buf.len() - taken).min(MAX_RECORD_PLAINTEXT);
            this.seal(&buf[taken..taken + n])?;
            taken += n;
        }
        if this.unsent() >= SEALED_LIMIT {
            if let Poll::Ready(Err(error)) = this.poll_push(cx) {
                return Poll::Ready(Err(error));
            }
        }
        Poll::Ready(Ok(taken))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_push(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_push(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::super::{initiate, respond, ChannelKey};
    use super::*;
    use crate::token::TokenHash;

    async fn pair() -> (
        SecureStream<tokio::io::DuplexStream>,
        SecureStream<tokio::io::DuplexStream>,
    ) {
        let key = ChannelKey::derive("s", &TokenHash::from_bytes([3; 32]));
        // A small pipe, so that records cross it in pieces and writes wait for the reader.
        let (near, far) = tokio::io::duplex(4096);
        let relay_key = key.clone();
        let relay = tokio::spawn(async move { respond(far, &relay_key).await });
        let broker = initiate(near, &key).await.expect("broker");
        (broker, relay.await.expect("task").expect("relay"))
    }

    #[tokio::test]
    async fn frames_larger_than_a_record_arrive_whole_and_in_order() {
        let (mut broker, mut relay) = pair().await;
        // A frame of the protocol's largest size, and a few odd sizes around a record's.
        let sizes = [1 << 20, MAX_RECORD_PLAINTEXT, MAX_RECORD_PLAINTEXT + 1, 1, 70_000];
        let total: usize = sizes.iter().sum();
        let writer = tokio::spawn(async move {
            for (i, size) in sizes.into_iter().enumerate() {
                let chunk: Vec<u8> = (0..size).map(|j| (i * 31 + j) as u8).collect();
                broker.write_all(&chunk).await.expect("write");
            }
            broker.shutdown().await.expect("shutdown");
        });
        let mut received = Vec::new();
        relay.read_to_end(&mut received).await.expect("read");
        writer.await.expect("writer");
        assert_eq!(received.len(), total);
        let mut offset = 0;
        for (i, size) in sizes.into_iter().enumerate() {
            let expected: Vec<u8> = (0..size).map(|j| (i * 31 + j) as u8).collect();
            assert!(received[offset..offset + size] == expected[..], "chunk {i}");
            offset += size;
        }
    }

    /// Passes the two handshake messages between the broker's end (`far`) and the relay's
    /// (`tap_near`) untouched; returns `far`'s halves for what follows.
    async fn forward_handshake(
        far: tokio::io::DuplexStream,
        tap_near: &mut tokio::io::DuplexStream,
    ) -> (
        tokio::io::ReadHalf<tokio::io::DuplexStream>,
        tokio::io::WriteHalf<tokio::io::DuplexStream>,
    ) {
        let (mut far_read, mut far_write) = tokio::io::split(far);
        let mut first = [0u8; 50];
        far_read.read_exact(&mut first).await.expect("message 1");
        tap_near.write_all(&first).await.expect("forward 1");
        let mut second = [0u8; 50];
        tap_near.read_exact(&mut second).await.expect("message 2");
        far_write.write_all(&second).await.expect("forward 2");
        (far_read, far_write)
    }

    #[tokio::test]
    async fn a_flipped_bit_breaks_the_stream() {
        let key = ChannelKey::derive("s", &TokenHash::from_bytes([3; 32]));
        let (near, far) = tokio::io::duplex(1 << 16);
        let (mut tap_near, tap_far) = tokio::io::duplex(1 << 16);
        let relay_key = key.clone();
        let relay = tokio::spawn(async move { respond(tap_far, &relay_key).await });
        // Forward the handshake untouched, then flip one bit of the first record.
        let forward = tokio::spawn(async move {
            let (mut far_read, _far_write) = forward_handshake(far, &mut tap_near).await;
            let mut record = [0u8; 2 + 5 + TAG_LEN];
            far_read.read_exact(&mut record).await.expect("record");
            record[4] ^= 1;
            tap_near.write_all(&record).await.expect("forward record");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        });
        let mut broker = initiate(near, &key).await.expect("broker");
        broker.write_all(b"hello").await.expect("write");
        broker.flush().await.expect("flush");
        let mut relay = relay.await.expect("task").expect("relay");
        let mut byte = [0u8; 1];
        let error = relay.read_exact(&mut byte).await.expect_err("must not decrypt");
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert_eq!(
            relay
                .read_exact(&mut byte)
                .await
                .expect_err("stays broken")
                .kind(),
            io::ErrorKind::InvalidData
        );
        forward.await.expect("forward");
    }

    #[tokio::test]
    async fn an_end_inside_a_record_is_unexpected_eof() {
        let key = ChannelKey::derive("s", &TokenHash::from_bytes([3; 32]));
        let (near, far) = tokio::io::duplex(1 << 16);
        let (mut tap_near, tap_far) = tokio::io::duplex(1 << 16);
        let relay_key = key.clone();
        let relay = tokio::spawn(async move { respond(tap_far, &relay_key).await });
        let forward = tokio::spawn(async move {
            let (mut far_read, _far_write) = forward_handshake(far, &mut tap_near).await;
            let mut record = [0u8; 2 + 5 + TAG_LEN];
            far_read.read_exact(&mut record).await.expect("record");
            tap_near.write_all(&record[..10]).await.expect("half a record");
            drop(tap_near);
        });
        let mut broker = initiate(near, &key).await.expect("broker");
        broker.write_all(b"hello").await.expect("write");
        broker.flush().await.expect("flush");
        let mut relay = relay.await.expect("task").expect("relay");
        forward.await.expect("forward");
        let mut rest = Vec::new();
        let error = relay.read_to_end(&mut rest).await.expect_err("truncated");
        assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof);
    }
}

#[cfg(test)]
mod duplex_tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::super::{initiate, respond, ChannelKey};
    use crate::token::TokenHash;

    /// Both directions at once through split halves, in small pieces, as the client and the
    /// relay use the channel.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_directions_flow_at_once_through_split_halves() {
        let key = ChannelKey::derive("s", &TokenHash::from_bytes([4; 32]));
        let (near, far) = tokio::io::duplex(1000);
        let relay_key = key.clone();
        let relay = tokio::spawn(async move { respond(far, &relay_key).await });
        let broker = initiate(near, &key).await.expect("broker");
        let relay = relay.await.expect("task").expect("relay");
        let (broker_read, broker_write) = tokio::io::split(broker);
        let (relay_read, relay_write) = tokio::io::split(relay);
        const TOTAL: usize = 2_000_000;
        let send = |mut writer: tokio::io::WriteHalf<_>| async move {
            let mut sent = 0;
            let mut i = 0usize;
            while sent < TOTAL {
                let n = (i * 7919 % 5000 + 1).min(TOTAL - sent);
                let chunk: Vec<u8> = (sent..sent + n).map(|j| j as u8).collect();
                writer.write_all(&chunk).await.expect("write");
                if i.is_multiple_of(3) {
                    writer.flush().await.expect("flush");
                }
                sent += n;
                i += 1;
            }
            writer.flush().await.expect("flush");
            writer
        };
        let receive = |mut reader: tokio::io::ReadHalf<_>| async move {
            let mut got = 0usize;
            let mut buf = vec![0u8; 3000];
            while got < TOTAL {
                let n = reader.read(&mut buf).await.expect("read");
                assert!(n > 0, "ended after {got}");
                for (k, byte) in buf[..n].iter().enumerate() {
                    assert_eq!(*byte, (got + k) as u8, "byte {}", got + k);
                }
                got += n;
            }
        };
        let a = tokio::spawn(send(broker_write));
        let b = tokio::spawn(send(relay_write));
        let c = tokio::spawn(receive(relay_read));
        let d = tokio::spawn(receive(broker_read));
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            c.await.expect("relay reads");
            d.await.expect("broker reads");
        })
        .await
        .expect("no deadlock");
        drop((a.await, b.await));
    }
}
