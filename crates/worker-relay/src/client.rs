//! The broker side: turns a [`Connector`] to a relay into a contract [`Attachment`] that
//! reconnects and resumes transparently when the transport drops.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::{Buf, Bytes, BytesMut};
use parking_lot::Mutex;
use session_runtime::{
    Attachment, AttachmentParts, Error, ExitCell, Fence, Generation, SessionId, WorkerControl, WorkerExit,
    WorkerFailure,
};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter, ReadBuf};
use tokio::sync::{oneshot, watch, Notify};
use tokio_util::sync::CancellationToken;

use crate::channel::{self, ChannelKey, HandshakeError};
use crate::error::RelayError;
use crate::protocol::{
    Arrival, DelayedAck, Frame, FrameReader, Hello, LazyTimer, Peer, ReadError, RelaySignal, Seq, Sequencer,
    Welcome,
};
use crate::token::{BrokerKey, Token};
use crate::transport::{Connector, Transport};

mod bind;

pub use self::bind::{bind, BindError};

/// How long a detaching client may take to deliver its last input and acknowledgement.
const DETACH_PATIENCE: Duration = Duration::from_secs(2);

/// Largest input chunk put into one data frame.
const INPUT_CHUNK: usize = 64 * 1024;

/// How the client talks to one relay: whom it claims to be, its timers and its buffers.
#[derive(Clone)]
pub struct ClientConfig {
    session: SessionId,
    generation: Generation,
    epoch: u64,
    token: Token,
    channel_key: ChannelKey,
    heartbeat: Duration,
    idle_timeout: Duration,
    handshake_timeout: Duration,
    backoff_initial: Duration,
    backoff_max: Duration,
    give_up_after: Duration,
    output_buffer: usize,
    input_window: usize,
}

impl fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConfig")
            .field("session", &self.session)
            .field("generation", &self.generation)
            .field("epoch", &self.epoch)
            .field("heartbeat", &self.heartbeat)
            .field("give_up_after", &self.give_up_after)
            .finish_non_exhaustive()
    }
}

impl ClientConfig {
    /// A client of `generation` of `session` for a broker of `epoch`, presenting `token`.
    ///
    /// `epoch` must grow whenever a new broker (process or leader) takes over, e.g. the leader
    /// lease's transition count or the broker's start time in milliseconds: a relay refuses
    /// epochs older than one it accepted.
    ///
    /// Every connection first opens the [`channel`](crate::channel::initiate) with the key derived from
    /// `token`'s hash, so the relay proves it holds this session generation's secret before it
    /// receives the hello, the token or any input.
    pub fn new(session: SessionId, generation: Generation, epoch: u64, token: Token) -> Self {
        Self {
            session,
            generation,
            epoch,
            channel_key: ChannelKey::for_token(session.as_str(), &token),
            token,
            heartbeat: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(45),
            handshake_timeout: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            give_up_after: Duration::from_secs(30),
            output_buffer: 1 << 20,
            input_window: 1 << 20,
        }
    }

    /// As [`ClientConfig::new`], deriving the token from the broker's key.
    pub fn with_key(session: SessionId, generation: Generation, epoch: u64, key: &BrokerKey) -> Self {
        let token = key.token(session.as_str(), generation);
        Self::new(session, generation, epoch, token)
    }

    /// How often the client pings the relay (default 15 s); also sets the idle timeout, after
    /// which a silent connection is dropped and re-established, to three intervals.
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = interval;
        self.idle_timeout = interval.saturating_mul(3);
        self
    }

    /// How long a connection may stay silent before it is re-established.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// How long opening a transport plus the hello exchange may take (default 10 s).
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Reconnect backoff: the first delay, doubled up to `max` (defaults 50 ms and 2 s). The
    /// first reconnect after a working connection drops is immediate.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.backoff_initial = initial;
        self.backoff_max = max.max(initial);
        self
    }

    /// How long reconnecting may fail in a row before the attachment fails (default 30 s).
    pub fn give_up_after(mut self, budget: Duration) -> Self {
        self.give_up_after = budget;
        self
    }

    /// Agent output held for a slow reader before the client stops reading from the relay
    /// (default 1 MiB).
    pub fn output_buffer(mut self, bytes: usize) -> Self {
        self.output_buffer = bytes.max(1);
        self
    }

    /// Unacknowledged agent input kept for resending before writes wait (default 1 MiB). Keep it
    /// below the relay's input bound (`RelayConfig::input_bytes`, 4 MiB by default), which
    /// refuses a client with more unacknowledged input as `input-overflow`.
    pub fn input_window(mut self, bytes: usize) -> Self {
        self.input_window = bytes.max(1);
        self
    }

    /// The session.
    pub fn session(&self) -> SessionId {
        self.session
    }

    /// The generation.
    pub fn generation(&self) -> Generation {
        self.generation
    }
}

/// The broker's client of one relay.
#[derive(Debug, Clone)]
pub struct RelayClient {
    config: ClientConfig,
    connector: Arc<dyn Connector>,
}

impl RelayClient {
    /// A client that reaches the relay through `connector`.
    pub fn new(config: ClientConfig, connector: Arc<dyn Connector>) -> Self {
        Self { config, connector }
    }

    /// Connects, says hello, and returns the attachment: output is exactly the agent's stdout,
    /// input exactly its stdin, and the control handle signals the agent through the relay.
    /// `fence` must be of this client's session and generation.
    ///
    /// The attachment survives transport drops: the client reconnects (immediately, then with
    /// backoff), resumes the output after the last byte it received and resends input the relay
    /// did not acknowledge, so every byte arrives exactly once and in order. It ends:
    ///
    /// - normally when the agent exits: output reaches EOF, writes fail with
    ///   [`Error::Disconnected`], [`WorkerControl::wait`] gives the exit;
    /// - with [`Error::Fenced`] when a newer broker connection took over the relay (`superseded`,
    ///   `stale-epoch`) or wrote to the agent;
    /// - with [`Error::Disconnected`] on `resume-gap` (output this client needs was dropped) or
    ///   when reconnecting fails for longer than the reconnect budget.
    ///
    /// Reads report these errors inside an [`io::Error`] (see [`Error::from_io`]) after the
    /// output received before them.
    ///
    /// Every connection, the first and each reconnect, opens the [`channel`](crate::channel::initiate)
    /// first: nothing but its handshake leaves the broker until the peer proved it holds this
    /// session generation's secret, so a listener at a reused address receives no hello, no
    /// token and no input.
    ///
    /// # Errors
    /// - [`Error::Backend`] (retryable) if the relay could not be reached within the reconnect
    ///   budget; [`Error::Backend`] (not retryable) if it refused this client's session,
    ///   generation or token, or if the peer did not prove it holds the session generation's
    ///   secret (an impostor, a worker of another session or generation) or refused this
    ///   broker's channel key. On a reconnect the same ends the attachment with that error.
    /// - [`Error::WorkerFailed`] if the agent could not be started.
    /// - [`Error::Fenced`] if a newer broker holds the relay.
    ///
    /// # Cancellation
    /// Dropping the future abandons the connection; the relay keeps the agent.
    pub async fn attach(&self, fence: Fence) -> Result<Attachment, Error> {
        self.attach_watched(fence, None).await
    }

    /// [`attach`](Self::attach), told of the worker's loss by whoever placed it: when `lost`
    /// resolves (its Pod was deleted, its node is gone), the attachment ends at once with
    /// [`Error::WorkerFailed`] and that cause, instead of reconnecting to a relay that is no
    /// longer there for the whole reconnect budget. `lost` is dropped when the attachment ends
    /// any other way.
    ///
    /// # Errors
    /// As [`attach`](Self::attach), and [`Error::WorkerFailed`] if `lost` resolves first.
    ///
    /// # Cancellation
    /// As [`attach`](Self::attach).
    pub async fn attach_until(
        &self,
        fence: Fence,
        lost: impl std::future::Future<Output = WorkerFailure> + Send + 'static,
    ) -> Result<Attachment, Error> {
        self.attach_watched(fence, Some(Box::pin(lost))).await
    }

    async fn attach_watched(&self, fence: Fence, lost: Option<LossSignal>) -> Result<Attachment, Error> {
        let shared = Arc::new(Shared {
            config: self.config.clone(),
            state: Mutex::new(LinkState::new()),
            wake_writer: Notify::new(),
            out_space: Notify::new(),
            exit: ExitCell::new(),
            stderr_tail: std::sync::OnceLock::new(),
            failed: watch::channel(None).0,
            fence: fence.clone(),
            detached: CancellationToken::new(),
        });
        // Dropping this future before the attachment exists drops the guard, which stops the link.
        let guard = Arc::new(DetachGuard(shared.detached.clone()));
        let (first_tx, first_rx) = oneshot::channel();
        let link = tokio::spawn(run_link(
            Arc::clone(&shared),
            Arc::clone(&self.connector),
            first_tx,
        ));
        if let Some(lost) = lost {
            tokio::spawn(end_when_lost(Arc::clone(&shared), link.abort_handle(), lost));
        }
        let welcome = match first_rx.await {
            Ok(Ok(welcome)) => welcome,
            Ok(Err(error)) => return Err(error.to_runtime(self.config.session, self.config.generation)),
            Err(_) => {
                link.abort();
                let failed = shared.failed.borrow().clone();
                return Err(match failed {
                    Some(error) => shared.error(&error),
                    None => Error::Disconnected {
                        id: self.config.session,
                    },
                });
            }
        };
        let control = Arc::new(RelayControl {
            worker_id: format!(
                "oab-relay:{}:{}:{}",
                self.config.session, self.config.generation, welcome.pid
            ),
            shared: Arc::clone(&shared),
            _guard: Arc::clone(&guard),
        });
        let output = RelayOutput {
            shared: Arc::clone(&shared),
            _guard: Arc::clone(&guard),
        };
        let input = RelayInput {
            shared,
            _guard: guard,
        };
        Ok(Attachment::new(AttachmentParts::new(
            fence,
            welcome.working_dir,
            output,
            input,
            control as Arc<dyn WorkerControl>,
        )))
    }
}

/// State shared by the link task, the output reader, the input writer and the control handle.
struct Shared {
    config: ClientConfig,
    state: Mutex<LinkState>,
    /// Input queued, an acknowledgement or pong due, or a signal requested.
    wake_writer: Notify,
    /// Output was consumed (or stopped mattering).
    out_space: Notify,
    exit: ExitCell,
    /// The agent's last words on stderr, set (when it wrote any) before `exit`.
    stderr_tail: std::sync::OnceLock<String>,
    failed: watch::Sender<Option<Arc<RelayError>>>,
    fence: Fence,
    detached: CancellationToken,
}

struct LinkState {
    output: Sequencer,
    out_queue: VecDeque<Bytes>,
    out_bytes: usize,
    out_eof: bool,
    out_waker: Option<Waker>,
    /// Whether anyone still reads the output.
    out_open: bool,
    /// Whether the first welcome was applied.
    based: bool,
    in_next: Seq,
    in_acked: Seq,
    in_unacked: VecDeque<(Seq, Bytes)>,
    in_bytes: usize,
    in_closed: bool,
    in_waker: Option<Waker>,
    /// The last requested signal and a counter of requests.
    signal: Option<(RelaySignal, u32)>,
    signal_requests: u64,
    /// Kill or terminate requested: output is buffered without bound so the exit gets through.
    terminating: bool,
    pong: Option<u64>,
    exited: bool,
    fatal: Option<Arc<RelayError>>,
}

impl LinkState {
    fn new() -> Self {
        Self {
            output: Sequencer::default(),
            out_queue: VecDeque::new(),
            out_bytes: 0,
            out_eof: false,
            out_waker: None,
            out_open: true,
            based: false,
            in_next: 1,
            in_acked: 0,
            in_unacked: VecDeque::new(),
            in_bytes: 0,
            in_closed: false,
            in_waker: None,
            signal: None,
            signal_requests: 0,
            terminating: false,
            pong: None,
            exited: false,
            fatal: None,
        }
    }
}

impl Shared {
    fn error(&self, error: &Arc<RelayError>) -> Error {
        error.to_runtime(self.config.session, self.config.generation)
    }

    /// Records a fatal failure and wakes everyone waiting.
    fn fail(&self, error: RelayError) {
        tracing::warn!(session = %self.config.session, %error, "relay attachment failed");
        let error = Arc::new(error);
        let wakers = {
            let mut state = self.state.lock();
            if state.fatal.is_none() && !state.exited {
                state.fatal = Some(Arc::clone(&error));
            }
            [state.out_waker.take(), state.in_waker.take()]
        };
        wakers.into_iter().flatten().for_each(Waker::wake);
        self.failed.send_replace(Some(error));
    }

    async fn wait_exit(&self) -> Result<WorkerExit, Error> {
        let mut failed = self.failed.subscribe();
        tokio::select! {
            exit = self.exit.wait() => Ok(exit),
            error = failed.wait_for(Option::is_some) => match error.ok().and_then(|e| e.clone()) {
                Some(error) => match self.exit.get() {
                    Some(exit) => Ok(exit),
                    None => Err(self.error(&error)),
                },
                None => Err(Error::Disconnected { id: self.config.session }),
            },
        }
    }

    fn request_signal(&self, signal: RelaySignal, grace: Duration) {
        {
            let mut state = self.state.lock();
            state.signal = Some((signal, u32::try_from(grace.as_millis()).unwrap_or(u32::MAX)));
            state.signal_requests += 1;
            state.terminating = true;
        }
        self.out_space.notify_one();
        self.wake_writer.notify_one();
    }
}

/// What tells an attachment its worker is gone.
type LossSignal = Pin<Box<dyn std::future::Future<Output = WorkerFailure> + Send>>;

/// Ends the attachment with the worker's loss when `lost` resolves first; gives up watching
/// once the attachment ended otherwise (exit, failure, detach).
async fn end_when_lost(shared: Arc<Shared>, link: tokio::task::AbortHandle, lost: LossSignal) {
    let mut failed = shared.failed.subscribe();
    tokio::select! {
        cause = lost => {
            if shared.state.lock().exited {
                return;
            }
            // The link may be inside a connection attempt or its backoff: it stops here, and
            // its first-welcome sender with it.
            link.abort();
            shared.fail(RelayError::WorkerLost(cause));
        }
        _ = shared.exit.wait() => {}
        _ = failed.wait_for(Option::is_some) => {}
        () = shared.detached.cancelled() => {}
    }
}

/// Cancels the link when the attachment's last handle is dropped.
struct DetachGuard(CancellationToken);

impl Drop for DetachGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The agent's stdout, as received from the relay.
struct RelayOutput {
    shared: Arc<Shared>,
    _guard: Arc<DetachGuard>,
}

impl AsyncRead for RelayOutput {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let mut state = self.shared.state.lock();
        if !state.out_queue.is_empty() {
            while buf.remaining() > 0 {
                let Some(front) = state.out_queue.front_mut() else {
                    break;
                };
                let n = front.len().min(buf.remaining());
                buf.put_slice(&front[..n]);
                front.advance(n);
                if front.is_empty() {
                    state.out_queue.pop_front();
                }
                state.out_bytes -= n;
            }
            drop(state);
            self.shared.out_space.notify_one();
            return Poll::Ready(Ok(()));
        }
        if state.out_eof {
            return Poll::Ready(Ok(()));
        }
        if let Some(error) = &state.fatal {
            let error = Arc::clone(error);
            drop(state);
            return Poll::Ready(Err(self.shared.error(&error).into_io()));
        }
        state.out_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for RelayOutput {
    fn drop(&mut self) {
        let mut state = self.shared.state.lock();
        state.out_open = false;
        state.out_queue.clear();
        state.out_bytes = 0;
        drop(state);
        self.shared.out_space.notify_one();
    }
}

/// The agent's stdin, sent to the relay in sequenced frames and kept until acknowledged.
struct RelayInput {
    shared: Arc<Shared>,
    _guard: Arc<DetachGuard>,
}

impl AsyncWrite for RelayInput {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let shared = &self.shared;
        let mut state = shared.state.lock();
        if let Some(error) = &state.fatal {
            let error = Arc::clone(error);
            drop(state);
            return Poll::Ready(Err(shared.error(&error).into_io()));
        }
        if state.exited || state.in_closed {
            return Poll::Ready(Err(Error::Disconnected {
                id: shared.config.session,
            }
            .into_io()));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if state.in_bytes >= shared.config.input_window {
            state.in_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = buf.len().min(INPUT_CHUNK);
        let seq = state.in_next;
        state.in_next += 1;
        let frame = encode(&Frame::Data {
            seq,
            payload: Bytes::copy_from_slice(&buf[..n]),
        });
        state.in_bytes += frame.len();
        state.in_unacked.push_back((seq, frame));
        drop(state);
        shared.wake_writer.notify_one();
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Written bytes are in the resend queue already; the link delivers them.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let shared = &self.shared;
        {
            let mut state = shared.state.lock();
            if !state.in_closed && !state.exited && state.fatal.is_none() {
                state.in_closed = true;
                let seq = state.in_next;
                state.in_next += 1;
                let frame = encode(&Frame::Eof { seq });
                state.in_bytes += frame.len();
                state.in_unacked.push_back((seq, frame));
            }
        }
        shared.wake_writer.notify_one();
        Poll::Ready(Ok(()))
    }
}

/// The worker's control handle, backed by relay frames.
struct RelayControl {
    worker_id: String,
    shared: Arc<Shared>,
    _guard: Arc<DetachGuard>,
}

impl fmt::Debug for RelayControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayControl")
            .field("worker_id", &self.worker_id)
            .field("exit", &self.shared.exit.get())
            .finish()
    }
}

#[async_trait]
impl WorkerControl for RelayControl {
    fn worker_id(&self) -> &str {
        &self.worker_id
    }

    fn generation(&self) -> Generation {
        self.shared.config.generation
    }

    /// `false` once the relay reported the agent's exit, or the attachment failed for good (the
    /// worker may then still run under another broker; this handle cannot tell).
    fn is_alive(&self) -> bool {
        self.shared.exit.get().is_none() && self.shared.state.lock().fatal.is_none()
    }

    /// Sends `SIGTERM` to the agent's process group through the relay, which sends `SIGKILL`
    /// after `grace`; waits for the exit the relay reports. From then on, output the reader has
    /// not taken beyond the output buffer is discarded, so the exit report is never held up
    /// behind it. The request is sent again after a reconnect; the relay forwards it once.
    async fn terminate(&self, grace: Duration) -> session_runtime::Result<WorkerExit> {
        if let Some(exit) = self.shared.exit.get() {
            return Ok(exit);
        }
        let signal = if grace.is_zero() {
            RelaySignal::Kill
        } else {
            RelaySignal::Terminate
        };
        self.shared.request_signal(signal, grace);
        self.shared.wait_exit().await
    }

    async fn kill(&self) -> session_runtime::Result<WorkerExit> {
        if let Some(exit) = self.shared.exit.get() {
            return Ok(exit);
        }
        self.shared.request_signal(RelaySignal::Kill, Duration::ZERO);
        self.shared.wait_exit().await
    }

    async fn wait(&self) -> session_runtime::Result<WorkerExit> {
        self.shared.wait_exit().await
    }

    /// What the relay sent with the agent's exit.
    fn stderr_tail(&self) -> Option<String> {
        self.shared.stderr_tail.get().cloned()
    }
}

fn encode(frame: &Frame) -> Bytes {
    let mut out = BytesMut::new();
    // Frames built by the client are always within the protocol's limits.
    let _ = frame.encode(&mut out);
    out.freeze()
}

/// A nonce that grows across every hello this process sends: microseconds since the Unix epoch,
/// or one more than the last nonce if the clock did not move on.
fn next_nonce() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let next = now.max(last + 1);
        match LAST.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

/// How one connection ended.
enum ConnEnd {
    /// The agent's exit arrived, or the attachment was dropped: stop.
    Finished,
    /// Reconnect.
    Fault(RelayError),
    /// Stop with this error.
    Fatal(RelayError),
}

/// The link task: connects, runs connections, reconnects, and gives up after the budget.
async fn run_link(
    shared: Arc<Shared>,
    connector: Arc<dyn Connector>,
    first: oneshot::Sender<Result<Welcome, Arc<RelayError>>>,
) {
    let config = shared.config.clone();
    let mut first = Some(first);
    let mut backoff = config.backoff_initial;
    let mut failing_since: Option<Instant> = None;
    let mut ever_connected = false;
    loop {
        if shared.detached.is_cancelled() || shared.state.lock().exited {
            break;
        }
        let attempt = tokio::select! {
            attempt = connect(&shared, &*connector) => attempt,
            () = shared.detached.cancelled() => break,
        };
        let error = match attempt {
            Ok((reader, writer, welcome)) => {
                if ever_connected {
                    session_runtime::telemetry::relay_reconnected();
                }
                ever_connected = true;
                failing_since = None;
                backoff = config.backoff_initial;
                if let Some(first) = first.take() {
                    let _ = first.send(Ok(welcome));
                }
                match run_connection(&shared, reader, writer).await {
                    ConnEnd::Finished => break,
                    ConnEnd::Fatal(error) => {
                        shared.fail(error);
                        break;
                    }
                    ConnEnd::Fault(error) => {
                        tracing::debug!(session = %config.session, %error, "relay connection lost; reconnecting");
                        continue;
                    }
                }
            }
            Err(error) => error,
        };
        if error.is_fatal() {
            match first.take() {
                Some(first) => {
                    let _ = first.send(Err(Arc::new(error)));
                }
                None => shared.fail(error),
            }
            break;
        }
        let since = *failing_since.get_or_insert_with(Instant::now);
        if since.elapsed() >= config.give_up_after {
            let error = RelayError::GaveUp {
                after: since.elapsed(),
                last: Box::new(error),
                ever_connected,
            };
            match first.take() {
                Some(first) => {
                    let _ = first.send(Err(Arc::new(error)));
                }
                None => shared.fail(error),
            }
            break;
        }
        tracing::debug!(session = %config.session, %error, ?backoff, "connecting to the relay failed; retrying");
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = shared.detached.cancelled() => break,
        }
        backoff = (backoff * 2).min(config.backoff_max);
    }
}

type Reader = FrameReader<tokio::io::ReadHalf<Transport>>;
type Writer = BufWriter<tokio::io::WriteHalf<Transport>>;

/// Opens a transport and exchanges hello and welcome.
async fn connect(
    shared: &Shared,
    connector: &dyn Connector,
) -> Result<(Reader, Writer, Welcome), RelayError> {
    let config = &shared.config;
    let handshake = async {
        let transport = connector.connect().await.map_err(RelayError::Connect)?;
        // Nothing but the handshake goes out before the relay proved it holds the secret.
        let transport: Transport = Box::new(
            channel::initiate(transport, &config.channel_key)
                .await
                .map_err(channel_error)?,
        );
        let (read_half, write_half) = tokio::io::split(transport);
        let mut reader = FrameReader::new(read_half, Peer::Relay);
        let mut writer = BufWriter::with_capacity(64 * 1024, write_half);
        let resume = shared.state.lock().output.last();
        let hello = Frame::Hello(Hello {
            session: config.session.as_str().to_owned(),
            generation: config.generation,
            epoch: config.epoch,
            nonce: next_nonce(),
            resume,
            token: config.token,
        });
        writer
            .write_all(&encode(&hello))
            .await
            .map_err(RelayError::Transport)?;
        writer.flush().await.map_err(RelayError::Transport)?;
        let welcome = match reader.next().await {
            Ok(Some(Frame::Welcome(welcome))) => welcome,
            Ok(Some(Frame::Error { code, message })) => return Err(RelayError::Rejected { code, message }),
            Ok(Some(other)) => {
                return Err(RelayError::Protocol(format!(
                    "expected a welcome, got {}",
                    other.frame_type()
                )))
            }
            Ok(None) => {
                return Err(RelayError::Transport(io::ErrorKind::UnexpectedEof.into()));
            }
            Err(error) => return Err(read_error(error)),
        };
        Ok((reader, writer, welcome))
    };
    let (reader, writer, welcome) = tokio::time::timeout(config.handshake_timeout, handshake)
        .await
        .map_err(|_| RelayError::Timeout("the relay handshake"))??;
    apply_welcome(shared, &welcome)?;
    Ok((reader, writer, welcome))
}

fn channel_error(error: HandshakeError) -> RelayError {
    match error {
        HandshakeError::Io(error) => RelayError::Transport(error),
        other => RelayError::Unauthenticated(other),
    }
}

fn read_error(error: ReadError) -> RelayError {
    match error {
        ReadError::Frame(error) => RelayError::Frame(error),
        ReadError::Io(error) => RelayError::Transport(error),
        ReadError::Truncated { .. } => RelayError::Transport(io::ErrorKind::UnexpectedEof.into()),
    }
}

/// Reconciles the client's stream positions with what the relay says it has.
fn apply_welcome(shared: &Shared, welcome: &Welcome) -> Result<(), RelayError> {
    if welcome.generation != shared.config.generation {
        return Err(RelayError::Protocol(format!(
            "welcome for generation {}, not {}",
            welcome.generation, shared.config.generation
        )));
    }
    let mut state = shared.state.lock();
    if !state.based {
        // A fresh client takes the streams where the relay has them.
        state.based = true;
        state.output = Sequencer::new(welcome.output_first - 1);
        state.in_acked = welcome.input_acked;
        state.in_next = welcome.input_acked + 1;
        return Ok(());
    }
    if welcome.output_first != state.output.last() + 1 {
        return Err(RelayError::Protocol(format!(
            "output resumes at {}, expected {}",
            welcome.output_first,
            state.output.last() + 1
        )));
    }
    if welcome.input_acked < state.in_acked || welcome.input_acked >= state.in_next {
        return Err(RelayError::Diverged);
    }
    let waker = ack_input(&mut state, welcome.input_acked);
    drop(state);
    if let Some(waker) = waker {
        waker.wake();
    }
    Ok(())
}

/// Drops acknowledged input; the writer's waker, which the caller must wake.
#[must_use]
fn ack_input(state: &mut LinkState, seq: Seq) -> Option<Waker> {
    while let Some((first, frame)) = state.in_unacked.front() {
        if *first > seq {
            break;
        }
        state.in_bytes -= frame.len();
        state.in_unacked.pop_front();
    }
    state.in_acked = state.in_acked.max(seq);
    state.in_waker.take()
}

/// Runs one established connection until it ends.
async fn run_connection(shared: &Arc<Shared>, mut reader: Reader, mut writer: Writer) -> ConnEnd {
    let sent_through = shared.state.lock().in_acked;
    let detached = tokio::select! {
        end = read_loop(shared, &mut reader) => return end,
        end = write_loop(shared, &mut writer, sent_through) => return end,
        () = shared.detached.cancelled() => detach(shared, &mut reader, &mut writer),
    };
    let _ = tokio::time::timeout(DETACH_PATIENCE, detached).await;
    ConnEnd::Finished
}

/// Closes a connection because the attachment was dropped: sends the input written so far (a
/// write that returned `Ok` is delivered, as with a pipe) and an acknowledgement of the output
/// received (so the next broker does not get it again), then closes gracefully.
async fn detach(shared: &Shared, reader: &mut Reader, writer: &mut Writer) -> io::Result<()> {
    let frames = {
        let state = shared.state.lock();
        let mut frames: Vec<Bytes> = state.in_unacked.iter().map(|(_, frame)| frame.clone()).collect();
        let received = state.output.last();
        if received > 0 {
            frames.push(encode(&Frame::Ack { seq: received }));
        }
        frames
    };
    send(writer, &frames).await?;
    writer.shutdown().await?;
    // Drain until the relay closes its side, so no reset cuts off what was just written.
    while let Ok(Some(_)) = reader.next().await {}
    Ok(())
}

async fn read_loop(shared: &Arc<Shared>, reader: &mut Reader) -> ConnEnd {
    let idle = shared.config.idle_timeout;
    // One idle timer for the connection, checked against the time the current wait began when
    // it fires, instead of a timer registered and dropped per frame.
    let idle_timer = tokio::time::sleep(idle);
    tokio::pin!(idle_timer);
    loop {
        let waiting_since = tokio::time::Instant::now();
        let next = loop {
            tokio::select! {
                biased;
                next = reader.next() => break next,
                () = &mut idle_timer => {
                    if waiting_since.elapsed() >= idle {
                        return ConnEnd::Fault(RelayError::Timeout("waiting for the relay"));
                    }
                    idle_timer.as_mut().reset(waiting_since + idle);
                }
            }
        };
        let frame = match next {
            Ok(Some(frame)) => frame,
            Ok(None) if shared.state.lock().exited => return ConnEnd::Finished,
            Ok(None) => {
                return ConnEnd::Fault(RelayError::Transport(io::ErrorKind::UnexpectedEof.into()));
            }
            Err(error) => return ConnEnd::Fault(read_error(error)),
        };
        match frame {
            Frame::Data { seq, payload } => {
                match shared.state.lock().output.check(seq) {
                    Ok(Arrival::New) => {}
                    Ok(Arrival::Duplicate) => continue,
                    Err(error) => return ConnEnd::Fault(error.into()),
                }
                if !push_output(shared, seq, payload).await {
                    return ConnEnd::Finished;
                }
            }
            Frame::Eof { seq } | Frame::Exit { seq, .. } => {
                let exit = match frame {
                    Frame::Exit {
                        status, stderr_tail, ..
                    } => Some((status, stderr_tail)),
                    _ => None,
                };
                let wakers = {
                    let mut state = shared.state.lock();
                    match state.output.accept(seq) {
                        Ok(Arrival::New) => {}
                        Ok(Arrival::Duplicate) => continue,
                        Err(error) => return ConnEnd::Fault(error.into()),
                    }
                    // Stdout ends before the exit is reported, whatever the relay sent.
                    state.out_eof = true;
                    if exit.is_some() {
                        state.exited = true;
                    }
                    [state.out_waker.take(), state.in_waker.take()]
                };
                if let Some((status, stderr_tail)) = exit {
                    if !stderr_tail.is_empty() {
                        if !matches!(status, crate::protocol::ExitStatus::Code(0)) {
                            // Debug-formatted: the agent's control characters and line ends
                            // are escaped, so its words cannot pose as log lines of their own.
                            tracing::warn!(
                                session = %shared.config.session,
                                %status,
                                stderr = ?stderr_tail,
                                "the agent ended; its last lines on stderr are attached"
                            );
                        }
                        let _ = shared.stderr_tail.set(stderr_tail);
                    }
                    shared.exit.set(WorkerExit::from(status));
                }
                wakers.into_iter().flatten().for_each(Waker::wake);
                shared.wake_writer.notify_one();
            }
            Frame::Ack { seq } => {
                let waker = {
                    let mut state = shared.state.lock();
                    if seq >= state.in_next {
                        return ConnEnd::Fault(RelayError::Protocol(format!(
                            "ack of input {seq}, but only {} was sent",
                            state.in_next - 1
                        )));
                    }
                    ack_input(&mut state, seq)
                };
                if let Some(waker) = waker {
                    waker.wake();
                }
            }
            Frame::Ping { nonce } => {
                shared.state.lock().pong = Some(nonce);
                shared.wake_writer.notify_one();
            }
            Frame::Pong { .. } => {}
            Frame::Error { code, message } => {
                let error = RelayError::Rejected { code, message };
                return if error.is_fatal() {
                    ConnEnd::Fatal(error)
                } else {
                    ConnEnd::Fault(error)
                };
            }
            other => {
                return ConnEnd::Fault(RelayError::Protocol(format!(
                    "unexpected {} from the relay",
                    other.frame_type()
                )))
            }
        }
    }
}

/// Queues received output for the reader, waiting for room unless nobody needs it bounded.
/// `false` if the attachment was dropped meanwhile.
async fn push_output(shared: &Shared, seq: Seq, payload: Bytes) -> bool {
    let mut payload = Some(payload);
    // The common case, room in the queue, registers no waiter.
    if try_push_output(shared, seq, &mut payload) {
        return true;
    }
    loop {
        let notified = shared.out_space.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if try_push_output(shared, seq, &mut payload) {
            return true;
        }
        tokio::select! {
            () = notified => {}
            () = shared.fence.fenced() => {}
            () = shared.detached.cancelled() => return false,
        }
    }
}

/// Queues `payload` (taking it) if there is room or nobody needs it bounded; `false` to wait.
fn try_push_output(shared: &Shared, seq: Seq, payload: &mut Option<Bytes>) -> bool {
    let mut state = shared.state.lock();
    let full = state.out_bytes >= shared.config.output_buffer;
    if full && !state.terminating && state.out_open && !shared.fence.is_fenced() {
        return false;
    }
    // Output nobody reads, and output beyond the bound once the agent is being stopped: waiting
    // for room then would hold up the exit report behind it (and an agent that floods its stdout
    // while it stops must not grow the broker's memory).
    let discard = !state.out_open || shared.fence.is_fenced() || (full && state.terminating);
    let _ = state.output.accept(seq);
    let waker = match payload.take() {
        Some(payload) if !discard && !payload.is_empty() => {
            state.out_bytes += payload.len();
            state.out_queue.push_back(payload);
            state.out_waker.take()
        }
        _ => None,
    };
    drop(state);
    if let Some(waker) = waker {
        waker.wake();
    }
    shared.wake_writer.notify_one();
    true
}

/// What the writer has to send right now.
struct Outgoing {
    frames: Vec<Bytes>,
    sent_through: Seq,
}

async fn write_loop(shared: &Arc<Shared>, writer: &mut Writer, mut sent_through: Seq) -> ConnEnd {
    let heartbeat = shared.config.heartbeat;
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ack = DelayedAck::new(0);
    let mut ack_timer = LazyTimer::new();
    let mut signals_sent = 0u64;
    let mut nonce = 0u64;
    loop {
        let outgoing = {
            let mut state = shared.state.lock();
            let mut frames = Vec::new();
            let mut bytes = 0;
            for (seq, frame) in &state.in_unacked {
                if *seq <= sent_through {
                    continue;
                }
                if bytes > 256 * 1024 {
                    break;
                }
                bytes += frame.len();
                frames.push(frame.clone());
                sent_through = *seq;
            }
            if let Some(nonce) = state.pong.take() {
                frames.push(encode(&Frame::Pong { nonce }));
            }
            if state.signal_requests > signals_sent {
                signals_sent = state.signal_requests;
                if let Some((signal, grace_ms)) = state.signal {
                    frames.push(encode(&Frame::Signal { signal, grace_ms }));
                }
            }
            // The relay finishes once its exit report is acknowledged: do not make it wait.
            if let Some(seq) = ack.take(state.output.last(), !frames.is_empty(), state.exited) {
                frames.push(encode(&Frame::Ack { seq }));
            }
            Outgoing { frames, sent_through }
        };
        sent_through = outgoing.sent_through;
        if !outgoing.frames.is_empty() {
            if let Err(error) = send(writer, &outgoing.frames).await {
                return ConnEnd::Fault(RelayError::Transport(error));
            }
            // More may be pending (the batch was bounded): loop without waiting.
            continue;
        }
        ack_timer.arm(ack.deadline());
        tokio::select! {
            () = shared.wake_writer.notified() => {}
            () = ack_timer.fired() => {}
            _ = ping.tick() => {
                nonce += 1;
                if let Err(error) = send(writer, &[encode(&Frame::Ping { nonce })]).await {
                    return ConnEnd::Fault(RelayError::Transport(error));
                }
            }
        }
    }
}

async fn send(writer: &mut Writer, frames: &[Bytes]) -> io::Result<()> {
    for frame in frames {
        writer.write_all(frame).await?;
    }
    writer.flush().await
}
