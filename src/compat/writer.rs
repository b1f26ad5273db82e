//! [`LineWriter`]: the agent's stdin as an `AsyncWrite` that delivers whole lines.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use session_runtime::{AgentInput, Error};
use tokio::io::AsyncWrite;

type Pending = Pin<Box<dyn Future<Output = session_runtime::Result<()>> + Send>>;

/// The agent's stdin as an `AsyncWrite`, for code written against `ChildStdin` (upstream's
/// `run_reader_loop<R, W>` and `Arc<Mutex<ChildStdin>>`).
///
/// Bytes are collected until a `\n`; each complete line is handed to the attachment's
/// [`AgentInput`] in one piece, so lines from different clones never interleave and a write never
/// waits on the agent's output being read. `flush` completes once every complete line written so
/// far has reached the agent's stdin. Clones share the stdin but not a partial line: finish each
/// line on one clone (upstream always writes a whole message plus `\n` under its mutex).
///
/// Errors are `std::io::Error`s carrying the runtime's [`Error`] (see [`Error::from_io`]):
/// [`Error::Fenced`] once a newer attachment took over, [`Error::Disconnected`] once the worker
/// is gone.
pub struct LineWriter {
    input: AgentInput,
    partial: Vec<u8>,
    pending: Option<Pending>,
}

impl std::fmt::Debug for LineWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LineWriter")
            .field("input", &self.input)
            .field("partial_bytes", &self.partial.len())
            .field("writing", &self.pending.is_some())
            .finish()
    }
}

impl Clone for LineWriter {
    fn clone(&self) -> Self {
        Self::new(self.input.clone())
    }
}

impl LineWriter {
    /// Wraps an attachment's input.
    pub fn new(input: AgentInput) -> Self {
        Self {
            input,
            partial: Vec::new(),
            pending: None,
        }
    }

    /// The underlying line input (for `write_line` without the `AsyncWrite` dance).
    pub fn input(&self) -> &AgentInput {
        &self.input
    }

    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(pending) = self.pending.as_mut() {
            let result = std::task::ready!(pending.as_mut().poll(cx));
            self.pending = None;
            result.map_err(Error::into_io)?;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for LineWriter {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        // One line in flight at a time: that is the backpressure.
        std::task::ready!(self.poll_pending(cx))?;
        let Some(end) = buf.iter().position(|b| *b == b'\n') else {
            self.partial.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        };
        let mut line = std::mem::take(&mut self.partial);
        line.extend_from_slice(&buf[..end]);
        let input = self.input.clone();
        self.pending = Some(Box::pin(async move { input.write_line(line).await }));
        Poll::Ready(Ok(end + 1))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_pending(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        let input = self.input.clone();
        self.pending = Some(Box::pin(async move { input.close().await }));
        self.poll_pending(cx)
    }
}
