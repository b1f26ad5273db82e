//! The `/ws` stream between a client and a worker, frame by frame as AgentCore's front sees it:
//! each WebSocket frame is parsed (RFC 6455 §5.2) and passed on whole, and the front's quotas
//! are enforced per connection: the largest frame, the most frames per second (each direction),
//! and the longest a connection may stay open. A connection that breaks a quota is closed: the
//! client gets a close frame saying why, the worker sees its connection end.

use std::collections::VecDeque;
use std::io;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// The WebSocket quotas of AgentCore's front, per connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WebSocketLimits {
    /// The largest frame payload, in bytes (default 32 KB: 32,768).
    pub max_frame_bytes: usize,
    /// The most frames per second in one direction (default 250).
    pub max_frames_per_second: usize,
    /// How long a connection may stay open before the front ends it (default 60 minutes).
    pub max_duration: Duration,
}

impl WebSocketLimits {
    /// AgentCore's frame size quota.
    pub const DEFAULT_MAX_FRAME_BYTES: usize = 32 * 1024;
    /// AgentCore's frame rate quota.
    pub const DEFAULT_MAX_FRAMES_PER_SECOND: usize = 250;
    /// AgentCore's cap on a streaming connection.
    pub const DEFAULT_MAX_DURATION: Duration = Duration::from_secs(60 * 60);
}

impl Default for WebSocketLimits {
    fn default() -> Self {
        Self {
            max_frame_bytes: Self::DEFAULT_MAX_FRAME_BYTES,
            max_frames_per_second: Self::DEFAULT_MAX_FRAMES_PER_SECOND,
            max_duration: Self::DEFAULT_MAX_DURATION,
        }
    }
}

/// Why the front ended a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ended {
    /// A side closed or failed, or the connection was cut from outside.
    Normally,
    /// A quota was broken: the close code and reason sent to the client.
    Quota(u16, String),
}

/// One frame as received: its raw bytes (header and payload, passed on unchanged).
struct RawFrame {
    bytes: Vec<u8>,
}

/// Reads one frame from `from`, refusing a payload above `max_payload` before reading it.
/// `Ok(None)` at a clean end between frames.
async fn read_frame<R: AsyncRead + Unpin>(
    from: &mut R,
    max_payload: usize,
) -> Result<Option<RawFrame>, FrameError> {
    let mut head = [0u8; 2];
    match from.read_exact(&mut head).await {
        Ok(_) => {}
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(_) => return Err(FrameError::Io),
    }
    let masked = head[1] & 0x80 != 0;
    let mut bytes = head.to_vec();
    let length = match head[1] & 0x7f {
        126 => {
            let mut ext = [0u8; 2];
            from.read_exact(&mut ext).await.map_err(|_| FrameError::Io)?;
            bytes.extend_from_slice(&ext);
            u64::from(u16::from_be_bytes(ext))
        }
        127 => {
            let mut ext = [0u8; 8];
            from.read_exact(&mut ext).await.map_err(|_| FrameError::Io)?;
            bytes.extend_from_slice(&ext);
            u64::from_be_bytes(ext)
        }
        short => u64::from(short),
    };
    let length = usize::try_from(length)
        .ok()
        .filter(|&length| length <= max_payload)
        .ok_or(FrameError::TooLarge(length))?;
    let mask_len = if masked { 4 } else { 0 };
    let start = bytes.len();
    bytes.resize(start + mask_len + length, 0);
    from.read_exact(&mut bytes[start..])
        .await
        .map_err(|_| FrameError::Io)?;
    Ok(Some(RawFrame { bytes }))
}

enum FrameError {
    /// The connection failed or ended inside a frame.
    Io,
    TooLarge(u64),
}

/// Counts frames in the last second.
struct RateWindow {
    limit: usize,
    seen: VecDeque<Instant>,
}

impl RateWindow {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            seen: VecDeque::new(),
        }
    }

    /// Records a frame now; `false` if that makes more than the limit within one second.
    fn admit(&mut self) -> bool {
        let now = Instant::now();
        while self
            .seen
            .front()
            .is_some_and(|&at| now.duration_since(at) >= Duration::from_secs(1))
        {
            self.seen.pop_front();
        }
        self.seen.push_back(now);
        self.seen.len() <= self.limit
    }
}

/// Passes frames from `from` to `to` until `from` ends or a quota is broken; `on_frame` runs
/// for each frame passed. The end of `from` shuts `to` down.
async fn pump<R, W>(
    mut from: R,
    mut to: W,
    limits: WebSocketLimits,
    direction: &str,
    on_frame: &(dyn Fn() + Sync),
) -> Ended
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut rate = RateWindow::new(limits.max_frames_per_second);
    loop {
        match read_frame(&mut from, limits.max_frame_bytes).await {
            Ok(Some(frame)) => {
                if !rate.admit() {
                    return Ended::Quota(
                        1008,
                        format!(
                            "more than {} frames per second {direction}",
                            limits.max_frames_per_second
                        ),
                    );
                }
                on_frame();
                if to.write_all(&frame.bytes).await.is_err() {
                    return Ended::Normally;
                }
            }
            Ok(None) | Err(FrameError::Io) => {
                let _ = to.shutdown().await;
                return Ended::Normally;
            }
            Err(FrameError::TooLarge(length)) => {
                return Ended::Quota(
                    1009,
                    format!(
                        "a frame of {length} bytes {direction} is above the {} byte limit",
                        limits.max_frame_bytes
                    ),
                );
            }
        }
    }
}

/// An unmasked close frame (server to client) with `code` and `reason` (cut to fit a control
/// frame's 125 bytes).
fn close_frame(code: u16, reason: &str) -> Vec<u8> {
    let mut reason = reason.as_bytes().to_vec();
    reason.truncate(123);
    let mut frame = vec![0x88, u8::try_from(reason.len() + 2).unwrap_or(125)];
    frame.extend_from_slice(&code.to_be_bytes());
    frame.extend_from_slice(&reason);
    frame
}

/// Runs both directions of an upgraded connection until both end, `cut` fires, a quota is
/// broken or the connection reaches its maximum duration; then both sides are closed (on a
/// broken quota or the duration cap, the client first gets a close frame saying why).
pub(crate) async fn run<CR, CW, WR, WW>(
    client: (CR, CW),
    worker: (WR, WW),
    limits: WebSocketLimits,
    cut: &CancellationToken,
    on_frame: &(dyn Fn() + Sync),
) -> Ended
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    WR: AsyncRead + Unpin,
    WW: AsyncWrite + Unpin,
{
    let (from_client, mut to_client) = client;
    let (from_worker, to_worker) = worker;
    let ended = {
        let up = pump(from_client, to_worker, limits, "from the client", on_frame);
        // The worker's frames go to the client through a pipe the close frame can share.
        let (pipe_in, mut pipe_out) = tokio::io::duplex(64 * 1024);
        let down = pump(from_worker, pipe_in, limits, "from the container", on_frame);
        let forward = async {
            let _ = tokio::io::copy(&mut pipe_out, &mut to_client).await;
        };
        let both = async {
            tokio::pin!(up, down);
            let (mut up_done, mut down_done) = (None, None);
            loop {
                tokio::select! {
                    ended = &mut up, if up_done.is_none() => {
                        if let Ended::Quota(..) = ended { return ended; }
                        up_done = Some(ended);
                    }
                    ended = &mut down, if down_done.is_none() => {
                        if let Ended::Quota(..) = ended { return ended; }
                        down_done = Some(ended);
                    }
                }
                if up_done.is_some() && down_done.is_some() {
                    return Ended::Normally;
                }
            }
        };
        let ended = tokio::select! {
            _ = cut.cancelled() => Ended::Normally,
            _ = tokio::time::sleep(limits.max_duration) => {
                Ended::Quota(1001, "the connection reached its maximum duration".into())
            }
            ended = async { tokio::join!(both, forward).0 } => ended,
        };
        ended
    };
    if let Ended::Quota(code, reason) = &ended {
        tracing::debug!(code, %reason, "the front closes a WebSocket");
        let _ = to_client.write_all(&close_frame(*code, reason)).await;
    }
    let _ = to_client.shutdown().await;
    ended
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_of_every_length_form_are_read_whole() {
        for length in [0usize, 125, 126, 65535, 65536] {
            let mut wire = vec![0x82];
            match length {
                0..=125 => wire.push(0x80 | u8::try_from(length).expect("short")),
                126..=65535 => {
                    wire.push(0x80 | 126);
                    wire.extend_from_slice(&u16::try_from(length).expect("u16").to_be_bytes());
                }
                _ => {
                    wire.push(0x80 | 127);
                    wire.extend_from_slice(&(length as u64).to_be_bytes());
                }
            }
            wire.extend_from_slice(&[1, 2, 3, 4]);
            wire.extend(std::iter::repeat_n(7u8, length));
            wire.extend_from_slice(&[0x88, 0x80, 0, 0, 0, 0]);
            let mut reader = wire.as_slice();
            let frame = match read_frame(&mut reader, usize::MAX).await {
                Ok(Some(frame)) => frame,
                _ => panic!("a frame of {length} bytes"),
            };
            assert_eq!(frame.bytes.len(), wire.len() - 6, "{length}");
            assert!(matches!(read_frame(&mut reader, usize::MAX).await, Ok(Some(_))));
            assert!(matches!(read_frame(&mut reader, usize::MAX).await, Ok(None)));
        }
    }

    #[tokio::test]
    async fn a_frame_above_the_limit_is_refused_before_its_payload_is_read() {
        let wire = [0x82u8, 126, 0x80, 0x01];
        let mut reader = &wire[..];
        assert!(matches!(
            read_frame(&mut reader, 32 * 1024).await,
            Err(FrameError::TooLarge(32769))
        ));
    }

    #[test]
    fn the_rate_window_admits_the_limit_per_second() {
        let mut window = RateWindow::new(3);
        assert!(window.admit() && window.admit() && window.admit());
        assert!(!window.admit());
    }
}
