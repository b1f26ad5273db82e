//! One broker connection: the handshake, then a reader (broker frames) and a writer (agent
//! output, acknowledgements, heartbeats) running independently, so neither direction ever waits
//! on the other.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{refuse, Inner, Refusal};
use crate::channel::{self, ChannelKey};
use crate::protocol::{DelayedAck, ErrorCode, Frame, FrameReader, LazyTimer, Peer, ReadError, Seq, Welcome};

/// Output bytes gathered per write batch.
const BATCH_BYTES: usize = 256 * 1024;

/// How long a closing writer may take to send its last frame.
const CLOSE_PATIENCE: Duration = Duration::from_secs(5);

/// How long a refused connection is read (and discarded) after the error frame went out, so
/// that closing it sends a FIN: closing a socket with unread input sends a reset instead, and a
/// reset can destroy the error frame in the peer's receive queue before the peer reads it.
const LINGER: Duration = Duration::from_secs(2);

enum Command {
    Pong(u64),
    Close(Refusal),
}

/// Opens the channel on `stream` (the broker proves it holds the session generation's key, the
/// relay proves it holds the secret), then serves the connection inside it. A peer that does not
/// authenticate within the handshake timeout gets the channel's refusal and nothing else.
pub(super) async fn serve<S>(inner: Arc<Inner>, stream: S)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let key = ChannelKey::derive(&inner.config.session, &inner.config.token_hash);
    let opened = tokio::select! {
        opened = tokio::time::timeout(inner.config.handshake_timeout, channel::respond(stream, &key)) => opened,
        () = inner.done.cancelled() => return,
    };
    match opened {
        Ok(Ok(secure)) => serve_authenticated(inner, secure).await,
        Ok(Err(error)) => tracing::info!(%error, "a connection failed the channel handshake"),
        Err(_) => tracing::info!("a connection did not complete the channel handshake in time"),
    }
}

/// Serves a connection whose channel is open: the hello, then both directions.
pub(super) async fn serve_authenticated<S>(inner: Arc<Inner>, stream: S)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (read_half, mut write_half) = tokio::io::split(stream);
    let mut reader = FrameReader::new(read_half, Peer::Broker);
    let first = tokio::select! {
        first = tokio::time::timeout(inner.config.handshake_timeout, reader.next()) => first,
        () = inner.done.cancelled() => return,
    };
    let hello = match first {
        Err(_) => {
            let message = format!("no hello within {:?}", inner.config.handshake_timeout);
            return refuse(&mut write_half, ErrorCode::HandshakeTimeout, message).await;
        }
        Ok(Err(ReadError::Frame(error))) => {
            return refuse(&mut write_half, error.code(), error.to_string()).await;
        }
        Ok(Err(_) | Ok(None)) => return,
        Ok(Ok(Some(Frame::Hello(hello)))) => hello,
        Ok(Ok(Some(other))) => {
            let message = format!("expected a hello, got {}", other.frame_type());
            return refuse(&mut write_half, ErrorCode::UnexpectedFrame, message).await;
        }
    };
    let accepted = match inner.accept_hello(&hello) {
        Ok(accepted) => accepted,
        Err((code, message)) => {
            refuse(&mut write_half, code, message).await;
            if code == ErrorCode::SpawnFailed {
                inner.finish_spawn_failed();
            }
            return;
        }
    };
    let id = accepted.id;
    let superseded = accepted.superseded.clone();
    tracing::info!(
        id,
        epoch = hello.epoch,
        resume = hello.resume,
        output_first = accepted.welcome.output_first,
        "connection accepted"
    );
    // A child of the relay's own: the relay finishing ends the connection through this one
    // token, so the loops below wait on two cancellations instead of three.
    let done = inner.done.child_token();
    let (commands, command_rx) = mpsc::channel(16);
    let mut writer = tokio::spawn(write_loop(
        Arc::clone(&inner),
        write_half,
        id,
        accepted.welcome,
        superseded.clone(),
        done.clone(),
        command_rx,
    ));
    let refusal = read_loop(&inner, &mut reader, id, &superseded, &done, &commands).await;
    let refused = refusal.is_some();
    match refusal {
        Some(refusal) => {
            tracing::info!(id, code = %refusal.0, message = %refusal.1, "closing a connection");
            let _ = commands.send(Command::Close(refusal)).await;
        }
        // The writer sends `superseded` itself.
        None if superseded.is_cancelled() => {}
        None => done.cancel(),
    }
    if tokio::time::timeout(CLOSE_PATIENCE, &mut writer).await.is_err() {
        writer.abort();
    }
    done.cancel();
    inner.disconnected(id);
    if refused {
        linger(reader.into_inner()).await;
    }
}

/// Reads and discards what the peer still sends, until it closes or [`LINGER`] passes.
pub(super) async fn linger<R: AsyncRead + Unpin>(mut read_half: R) {
    use tokio::io::AsyncReadExt;
    let mut sink = vec![0u8; 16 * 1024];
    let _ = tokio::time::timeout(LINGER, async {
        while matches!(read_half.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

async fn read_loop<R: AsyncRead + Unpin>(
    inner: &Arc<Inner>,
    reader: &mut FrameReader<R>,
    id: u64,
    superseded: &CancellationToken,
    done: &CancellationToken,
    commands: &mpsc::Sender<Command>,
) -> Option<Refusal> {
    let idle = inner.config.idle_timeout;
    // One idle timer for the connection, checked against the time the current wait began when
    // it fires, instead of a timer registered and dropped per frame.
    let idle_timer = tokio::time::sleep(idle);
    tokio::pin!(idle_timer);
    // Created once: a cancellation future registers a waiter when first polled, and one made
    // per frame would register and unregister it every time.
    // `done` is a child of the relay's own token, so the relay finishing cancels it too.
    let stopped = async {
        tokio::select! {
            () = done.cancelled() => {}
            () = superseded.cancelled() => {}
        }
    };
    tokio::pin!(stopped);
    loop {
        let waiting_since = tokio::time::Instant::now();
        let next = loop {
            tokio::select! {
                biased;
                // A frame already received is taken without looking at the cancellations (a
                // dozen polls of them per round trip before); they are looked at whenever the
                // reader has to wait. A frame of a connection that is no longer current changes
                // nothing: every handler below checks that it is.
                next = reader.next() => break next,
                () = &mut stopped => return None,
                () = &mut idle_timer => {
                    if waiting_since.elapsed() >= idle {
                        return Some((ErrorCode::IdleTimeout, format!("nothing received for {idle:?}")));
                    }
                    idle_timer.as_mut().reset(waiting_since + idle);
                }
            }
        };
        let frame = match next {
            Err(ReadError::Frame(error)) => return Some((error.code(), error.to_string())),
            Err(error) => {
                tracing::debug!(id, %error, "connection lost");
                return None;
            }
            Ok(None) => return None,
            Ok(Some(frame)) => frame,
        };
        let handled = match frame {
            Frame::Data { seq, payload } => inner.input(id, seq, Some(payload)),
            Frame::Eof { seq } => inner.input(id, seq, None),
            Frame::Ack { seq } => inner.output_ack(id, seq),
            Frame::Ping { nonce } => {
                let _ = commands.try_send(Command::Pong(nonce));
                Ok(())
            }
            Frame::Pong { .. } => Ok(()),
            Frame::Signal { signal, grace_ms } => {
                if inner.is_current(id) {
                    inner.signal(signal, grace_ms);
                }
                Ok(())
            }
            Frame::Error { code, message } => {
                tracing::info!(id, %code, %message, "the broker closed the connection with an error");
                return None;
            }
            Frame::Hello(_) => Err((
                ErrorCode::UnexpectedFrame,
                "a second hello on one connection".to_owned(),
            )),
            Frame::Bind(_) => Err((
                ErrorCode::UnexpectedFrame,
                "a bind on a connection that said hello".to_owned(),
            )),
            other @ (Frame::Welcome(_) | Frame::Exit { .. } | Frame::Bound { .. }) => Err((
                ErrorCode::UnexpectedFrame,
                format!("a broker does not send {}", other.frame_type()),
            )),
        };
        if let Err(refusal) = handled {
            return Some(refusal);
        }
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    inner: Arc<Inner>,
    writer: W,
    id: u64,
    welcome: Welcome,
    superseded: CancellationToken,
    done: CancellationToken,
    mut commands: mpsc::Receiver<Command>,
) {
    let mut writer = BufWriter::with_capacity(64 * 1024, writer);
    let mut next: Seq = welcome.output_first;
    let mut ack = DelayedAck::new(welcome.input_acked);
    if send(&mut writer, &[encode(&Frame::Welcome(welcome))], &done)
        .await
        .is_err()
    {
        return;
    }
    let heartbeat = inner.config.heartbeat;
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut nonce = 0u64;
    let mut changed = inner.subscribe();
    let mut batch = Vec::new();
    let mut ack_timer = LazyTimer::new();
    // Created once, not per wake-up (see `read_loop`).
    let is_done = done.cancelled();
    tokio::pin!(is_done);
    let is_superseded = superseded.cancelled();
    tokio::pin!(is_superseded);
    loop {
        changed.borrow_and_update();
        loop {
            batch.clear();
            let Some((after, accepted)) = inner.outgoing(id, next, BATCH_BYTES, &mut batch) else {
                break;
            };
            if let Some(seq) = ack.take(accepted, !batch.is_empty(), false) {
                batch.push(encode(&Frame::Ack { seq }));
            }
            if batch.is_empty() {
                break;
            }
            if send(&mut writer, &batch, &done).await.is_err() {
                done.cancel();
                return;
            }
            next = after;
        }
        ack_timer.arm(ack.deadline());
        let frame = tokio::select! {
            biased;
            () = &mut is_done => return,
            () = &mut is_superseded => {
                let frame = Frame::error(ErrorCode::Superseded, "a newer connection took over");
                let _ = send(&mut writer, &[encode(&frame)], &done).await;
                let _ = writer.shutdown().await;
                return;
            }
            command = commands.recv() => match command {
                Some(Command::Pong(nonce)) => Frame::Pong { nonce },
                Some(Command::Close((code, message))) => {
                    let _ = send(&mut writer, &[encode(&Frame::error(code, message))], &done).await;
                    let _ = writer.shutdown().await;
                    return;
                }
                None => return,
            },
            changed = changed.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
            _ = ping.tick() => {
                nonce += 1;
                Frame::Ping { nonce }
            }
            () = ack_timer.fired() => continue,
        };
        if send(&mut writer, &[encode(&frame)], &done).await.is_err() {
            done.cancel();
            return;
        }
    }
}

fn encode(frame: &Frame) -> Bytes {
    let mut out = BytesMut::new();
    // Frames built here are always within the protocol's limits.
    let _ = frame.encode(&mut out);
    out.freeze()
}

/// Writes and flushes `frames`, giving up when the connection is done.
async fn send<W: AsyncWrite + Unpin>(
    writer: &mut BufWriter<W>,
    frames: &[Bytes],
    done: &CancellationToken,
) -> std::io::Result<()> {
    let write = async {
        for frame in frames {
            writer.write_all(frame).await?;
        }
        writer.flush().await
    };
    // Biased: a write that completes at once never registers the cancellation waiter.
    tokio::select! {
        biased;
        written = write => written,
        () = done.cancelled() => Err(std::io::ErrorKind::ConnectionAborted.into()),
    }
}
