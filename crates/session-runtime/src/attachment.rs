//! [`Attachment`]: the broker's full-duplex stream to one session's worker, plus its control handle.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{oneshot, watch};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::{Error, Generation, Result, SessionId, WorkerExit};

/// The control side of a worker: liveness, termination and how it ended. Usable without the stream.
#[async_trait]
pub trait WorkerControl: fmt::Debug + Send + Sync {
    /// Backend-specific identity of the worker (pid and start time, Pod name and UID, ...).
    fn worker_id(&self) -> &str;

    /// The generation this worker was started for.
    fn generation(&self) -> Generation;

    /// Whether the worker is still running, as far as the runtime knows without blocking.
    fn is_alive(&self) -> bool;

    /// Asks the agent to stop (SIGTERM or the platform's equivalent), waits up to `grace`, then
    /// kills it. Returns how it ended.
    ///
    /// # Idempotency
    /// On a worker that already ended, returns its exit.
    async fn terminate(&self, grace: Duration) -> Result<WorkerExit>;

    /// Kills the worker and its whole process tree without grace. Returns how it ended.
    ///
    /// # Idempotency
    /// On a worker that already ended, returns its exit.
    async fn kill(&self) -> Result<WorkerExit>;

    /// Waits until the worker ends and returns how.
    ///
    /// # Cancellation
    /// Safe to drop; the worker is unaffected.
    async fn wait(&self) -> Result<WorkerExit>;

    /// The last lines the agent wrote to its standard error (at most 20 lines, 4 KiB), once it
    /// has ended: in an agent's own words, why it could not start or why it stopped.
    ///
    /// `None` while the agent runs, when it wrote nothing, or when the backend does not keep
    /// them: the relay-based backends (Kubernetes, AgentCore) do; the local runtime logs the
    /// agent's stderr as it comes instead (`agent_stderr`).
    fn stderr_tail(&self) -> Option<String> {
        None
    }
}

/// A once-set record of how a worker ended, which any number of tasks can wait for.
///
/// Backends use it to implement [`WorkerControl::wait`] and [`WorkerControl::is_alive`].
#[derive(Debug, Clone)]
pub struct ExitCell {
    sender: Arc<watch::Sender<Option<WorkerExit>>>,
}

impl Default for ExitCell {
    fn default() -> Self {
        Self::new()
    }
}

impl ExitCell {
    /// An empty cell: the worker is running.
    pub fn new() -> Self {
        Self {
            sender: Arc::new(watch::channel(None).0),
        }
    }

    /// Records the exit; only the first call has an effect.
    pub fn set(&self, exit: WorkerExit) {
        self.sender.send_if_modified(|slot| {
            if slot.is_none() {
                *slot = Some(exit);
                true
            } else {
                false
            }
        });
    }

    /// The exit, if the worker ended.
    pub fn get(&self) -> Option<WorkerExit> {
        *self.sender.borrow()
    }

    /// Waits for the exit.
    pub async fn wait(&self) -> WorkerExit {
        let mut receiver = self.sender.subscribe();
        loop {
            if let Some(exit) = *receiver.borrow_and_update() {
                return exit;
            }
            if receiver.changed().await.is_err() {
                // The sender lives in `self`, so this cannot happen while we are borrowed.
                return WorkerExit::Unknown;
            }
        }
    }
}

/// The runtime's side of an attachment's fence: fencing it ends the attachment's streams with
/// [`Error::Fenced`].
#[derive(Debug, Clone)]
pub struct FenceTrigger {
    token: CancellationToken,
    fenced_by: Arc<AtomicU64>,
}

/// The attachment's side of a fence.
#[derive(Debug, Clone)]
pub struct Fence {
    id: SessionId,
    generation: Generation,
    token: CancellationToken,
    fenced_by: Arc<AtomicU64>,
}

impl Fence {
    /// A new fence for an attachment of `generation`, and the trigger the runtime keeps.
    pub fn new(id: SessionId, generation: Generation) -> (Self, FenceTrigger) {
        let token = CancellationToken::new();
        let fenced_by = Arc::new(AtomicU64::new(0));
        let trigger = FenceTrigger {
            token: token.clone(),
            fenced_by: Arc::clone(&fenced_by),
        };
        (
            Self {
                id,
                generation,
                token,
                fenced_by,
            },
            trigger,
        )
    }

    /// The error of this fence, if it was triggered.
    pub fn check(&self) -> Result<()> {
        if self.token.is_cancelled() {
            Err(self.error())
        } else {
            Ok(())
        }
    }

    /// Whether the fence was triggered.
    pub fn is_fenced(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves when the fence is triggered.
    pub async fn fenced(&self) {
        self.token.cancelled().await
    }

    fn error(&self) -> Error {
        Error::Fenced {
            id: self.id,
            generation: self.generation,
            current: self.fenced_by.load(Ordering::Acquire),
        }
    }
}

impl FenceTrigger {
    /// Fences the attachment on behalf of generation `current`. Idempotent.
    pub fn fence(&self, current: Generation) {
        self.fenced_by.fetch_max(current, Ordering::AcqRel);
        self.token.cancel();
    }

    /// Whether the fence was triggered.
    pub fn is_fenced(&self) -> bool {
        self.token.is_cancelled()
    }
}

/// The raw pieces a backend builds an [`Attachment`] from.
#[non_exhaustive]
pub struct AttachmentParts {
    /// The session.
    pub id: SessionId,
    /// The worker's generation.
    pub generation: Generation,
    /// The agent's working directory inside the worker, as the agent sees it.
    pub working_dir: String,
    /// Exactly the agent's stdout.
    pub output: Box<dyn AsyncRead + Send + Sync + Unpin>,
    /// Exactly the agent's stdin.
    pub input: Box<dyn AsyncWrite + Send + Sync + Unpin>,
    /// The worker's control handle.
    pub control: Arc<dyn WorkerControl>,
    /// The fence the runtime triggers when a newer attachment takes over.
    pub fence: Fence,
}

impl fmt::Debug for AttachmentParts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttachmentParts")
            .field("id", &self.id)
            .field("generation", &self.generation)
            .field("working_dir", &self.working_dir)
            .finish_non_exhaustive()
    }
}

impl AttachmentParts {
    /// Collects the parts of an attachment.
    pub fn new(
        fence: Fence,
        working_dir: impl Into<String>,
        output: impl AsyncRead + Send + Sync + Unpin + 'static,
        input: impl AsyncWrite + Send + Sync + Unpin + 'static,
        control: Arc<dyn WorkerControl>,
    ) -> Self {
        Self {
            id: fence.id,
            generation: fence.generation,
            working_dir: working_dir.into(),
            output: Box::new(output),
            input: Box::new(input),
            control,
            fence,
        }
    }
}

/// The broker's stream to one worker of one session.
///
/// - [`output`](Self::output) is exactly the agent's stdout; stderr never appears in it.
/// - [`input`](Self::input) is a shareable line writer for exactly the agent's stdin. Reading and
///   writing are independent: an undrained output never blocks a write.
/// - [`control`](Self::control) stops the worker or tells how it ended.
/// - [`working_dir`](Self::working_dir) is the directory to send as `cwd` in `session/new` and
///   `session/load`.
///
/// Dropping an attachment detaches from the worker; it does not stop it. After a newer attach,
/// reads and writes fail with [`Error::Fenced`] (inside an `std::io::Error` for reads; see
/// [`Error::from_io`]).
pub struct Attachment {
    id: SessionId,
    generation: Generation,
    working_dir: String,
    output: AgentOutput,
    input: AgentInput,
    control: Arc<dyn WorkerControl>,
}

impl fmt::Debug for Attachment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attachment")
            .field("id", &self.id)
            .field("generation", &self.generation)
            .field("working_dir", &self.working_dir)
            .field("control", &self.control)
            .finish_non_exhaustive()
    }
}

impl Attachment {
    /// Builds an attachment. Must be called within a Tokio runtime: a write that cannot finish
    /// at once continues in a task, so that whole lines are written even if a caller's future is
    /// dropped, and a task lets go of the agent's stdin when the attachment is fenced.
    pub fn new(parts: AttachmentParts) -> Self {
        let AttachmentParts {
            id,
            generation,
            working_dir,
            output,
            input,
            control,
            fence,
        } = parts;
        Self {
            id,
            generation,
            working_dir,
            output: AgentOutput::new(output, fence.clone()),
            input: AgentInput::spawn(input, fence),
            control,
        }
    }

    /// The session.
    pub fn session_id(&self) -> SessionId {
        self.id
    }

    /// The generation of the worker behind this attachment.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The agent's working directory inside the worker: send it as `cwd` in `session/new` and
    /// `session/load`. A path of the broker's own means nothing inside an isolated worker.
    pub fn working_dir(&self) -> &str {
        &self.working_dir
    }

    /// The agent's stdout.
    pub fn output(&mut self) -> &mut AgentOutput {
        &mut self.output
    }

    /// A handle to the agent's stdin; clones share one ordered line stream.
    pub fn input(&self) -> AgentInput {
        self.input.clone()
    }

    /// The worker's control handle.
    pub fn control(&self) -> Arc<dyn WorkerControl> {
        Arc::clone(&self.control)
    }

    /// Splits the attachment for a reader loop that owns the output.
    pub fn into_split(self) -> (AgentOutput, AgentInput, Arc<dyn WorkerControl>) {
        (self.output, self.input, self.control)
    }
}

/// The agent's stdout. Ends with [`Error::Fenced`] (inside an `std::io::Error`) once fenced.
pub struct AgentOutput {
    inner: Box<dyn AsyncRead + Send + Sync + Unpin>,
    fence: Fence,
    fenced: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl fmt::Debug for AgentOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentOutput")
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

impl AgentOutput {
    fn new(inner: Box<dyn AsyncRead + Send + Sync + Unpin>, fence: Fence) -> Self {
        let fenced = Box::pin(fence.token.clone().cancelled_owned());
        Self { inner, fence, fenced }
    }
}

impl AsyncRead for AgentOutput {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.fenced.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(self.fence.error().into_io()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

/// The agent's stdin, shared by every clone of an [`AgentInput`].
struct InputSink {
    /// `None` once closed, broken or fenced.
    sink: Option<Box<dyn AsyncWrite + Send + Sync + Unpin>>,
    /// The fence a transport reported when it broke (generation, current): a relay taken over
    /// by a newer broker. Writes after that fail as fenced, not as disconnected.
    fenced_by_transport: Option<(Generation, Generation)>,
    /// Dropped with the last handle: ends the task that lets go of the sink at a fence.
    _last_handle: oneshot::Sender<()>,
}

/// A shareable writer of whole lines to the agent's stdin.
///
/// Lines written concurrently from several tasks never interleave: each write holds the sink
/// until its line is written and flushed. A line is either written whole or not at all even if
/// the caller's future is dropped: a write that cannot finish at once continues in a task of its
/// own. Writing never involves the reader, so it never waits on it.
#[derive(Clone)]
pub struct AgentInput {
    id: SessionId,
    fence: Fence,
    sink: Arc<tokio::sync::Mutex<InputSink>>,
}

impl fmt::Debug for AgentInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentInput")
            .field("id", &self.id)
            .field("fence", &self.fence)
            .finish()
    }
}

impl AgentInput {
    fn spawn(sink: Box<dyn AsyncWrite + Send + Sync + Unpin>, fence: Fence) -> Self {
        let (last_handle, all_dropped) = oneshot::channel();
        let shared = Arc::new(tokio::sync::Mutex::new(InputSink {
            sink: Some(sink),
            fenced_by_transport: None,
            _last_handle: last_handle,
        }));
        // A fenced attachment lets go of the agent's stdin at once, whoever still holds a handle
        // (a relay client's link ends with it).
        let weak = Arc::downgrade(&shared);
        let watched = fence.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = watched.fenced() => {
                    if let Some(shared) = weak.upgrade() {
                        shared.lock().await.sink = None;
                    }
                }
                _ = all_dropped => {}
            }
        });
        Self {
            id: fence.id,
            fence,
            sink: shared,
        }
    }

    /// Writes one line (a trailing `\n` is added when missing) and flushes it.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] if `line` contains `\n` anywhere but at its end.
    /// - [`Error::Fenced`] after a newer attachment took over.
    /// - [`Error::Disconnected`] if the agent's stdin is closed (the worker ended, or
    ///   [`close`](Self::close) was called).
    /// - The transport's own error when its write failed with one that says why (for example
    ///   [`Error::WorkerFailed`] for a worker its runtime saw go); later writes are
    ///   [`Error::Disconnected`].
    ///
    /// # Cancellation
    /// Once this write holds the sink, the line is written whole even if this future is dropped.
    pub async fn write_line(&self, line: impl AsRef<[u8]>) -> Result<()> {
        let line = line.as_ref();
        let body = line.strip_suffix(b"\n").unwrap_or(line);
        if body.contains(&b'\n') {
            return Err(Error::InvalidArgument {
                reason: "a line written to the agent must not contain a newline".into(),
            });
        }
        let mut framed = Vec::with_capacity(body.len() + 1);
        framed.extend_from_slice(body);
        framed.push(b'\n');
        let guard = self.hold_sink().await?;
        let mut write = Box::pin(write_held(guard, framed, self.fence.clone()));
        // A sink with room takes the line in this first poll, without a task hand-off; otherwise
        // the write moves to a task, which finishes it even if this future is dropped.
        match std::future::poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx))).await {
            Poll::Ready(written) => written,
            Poll::Pending => tokio::spawn(write)
                .await
                .unwrap_or_else(|_| Err(Error::Disconnected { id: self.id })),
        }
    }

    /// Closes the agent's stdin (half-close): the agent reads EOF; its output stays readable.
    ///
    /// # Idempotency
    /// Closing a closed input returns `Ok(())`.
    pub async fn close(&self) -> Result<()> {
        let mut guard = self.hold_sink().await?;
        if let Some(mut sink) = guard.sink.take() {
            let _ = sink.shutdown().await;
        }
        Ok(())
    }

    /// Waits for the sink, unless the attachment is fenced first.
    async fn hold_sink(&self) -> Result<tokio::sync::OwnedMutexGuard<InputSink>> {
        self.fence.check()?;
        tokio::select! {
            guard = Arc::clone(&self.sink).lock_owned() => Ok(guard),
            () = self.fence.fenced() => Err(self.fence.error()),
        }
    }
}

/// Writes and flushes `line` into the held sink; a failure lets go of the sink for good.
async fn write_held(
    mut held: tokio::sync::OwnedMutexGuard<InputSink>,
    line: Vec<u8>,
    fence: Fence,
) -> Result<()> {
    let state = &mut *held;
    let written = match state.sink.as_mut() {
        None => Err(None),
        Some(sink) => tokio::select! {
            biased;
            () = fence.fenced() => Err(None),
            written = async {
                sink.write_all(&line).await?;
                sink.flush().await
            } => written.map_err(Some),
        },
    };
    let Err(failure) = written else {
        return Ok(());
    };
    state.sink = None;
    if let Some(Error::Fenced {
        generation, current, ..
    }) = failure.as_ref().and_then(Error::from_io)
    {
        state.fenced_by_transport = Some((*generation, *current));
    }
    // The transport's reason, when it gave one, is the caller's to see (once: the sink is gone).
    let cause = failure
        .and_then(std::io::Error::into_inner)
        .and_then(|inner| inner.downcast::<Error>().ok())
        .map(|error| *error);
    Err(match (fence.check(), state.fenced_by_transport, cause) {
        (Err(fenced), _, _) => fenced,
        (Ok(()), Some((generation, current)), _) => Error::Fenced {
            id: fence.id,
            generation,
            current,
        },
        (Ok(()), None, Some(cause)) => cause,
        (Ok(()), None, None) => Error::Disconnected { id: fence.id },
    })
}
