//! The relay server: runs inside the worker, owns the agent process, and serves the framed
//! protocol to the broker over TCP, a stdio bridge or a WebSocket.

mod agent;
mod agentcore;
mod bind;
mod conn;
mod http;
pub mod listen;

mod log;
mod stderr;

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use self::log::OutputLog;
use crate::protocol::{
    Arrival, ErrorCode, ExitStatus, Frame, Hello, RelaySignal, Seq, Sequencer, Welcome, MAX_SESSION_LEN,
    MAX_TEXT_LEN,
};
use crate::token::TokenHash;

pub use self::agentcore::{AgentCoreServer, RelayTemplate};
pub use self::bind::UnboundRelay;

/// Default TCP port of `oab-relay serve` (and of `oab-relay connect`).
pub const DEFAULT_PORT: u16 = 7780;

/// Default bound of the replay buffer: 16 MiB of unacknowledged agent output.
pub const DEFAULT_REPLAY_BYTES: usize = 16 << 20;

/// The default bound of broker input received but not yet written to the agent's stdin: 4 MiB,
/// four times the client's default input window.
pub const DEFAULT_INPUT_BYTES: usize = 4 << 20;

/// Default heartbeat interval.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(30);

/// What the relay does when unacknowledged agent output reaches the replay bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    /// Stop reading the agent's stdout until a broker acknowledges output (the agent blocks on
    /// its writes). Nothing is ever lost.
    #[default]
    Block,
    /// While a broker is connected, as [`Overflow::Block`]; while none is, drop the oldest output
    /// so the agent keeps running. A broker that later asks for dropped output gets `resume-gap`.
    Discard,
}

/// Why a [`RelayConfig`] cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// No agent program was given.
    #[error("no agent command given (oab-relay serve -- <agent argv>)")]
    NoAgent,
    /// The session id is not one a hello can carry.
    #[error("invalid session id: must be 1 to {MAX_SESSION_LEN} ASCII letters, digits, '-' or '_'")]
    InvalidSession,
}

/// How the relay runs: which session and generation it serves, the token hash it accepts, the
/// agent it starts and its limits.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    session: String,
    generation: u64,
    token_hash: TokenHash,
    program: OsString,
    args: Vec<OsString>,
    working_dir: PathBuf,
    env: Vec<(OsString, OsString)>,
    replay_bytes: usize,
    input_bytes: usize,
    overflow: Overflow,
    heartbeat: Duration,
    idle_timeout: Duration,
    handshake_timeout: Duration,
    linger: Duration,
    drain_grace: Duration,
    reap_orphans: bool,
}

impl RelayConfig {
    /// A relay for `generation` of `session`, accepting tokens that hash to `token_hash`, that
    /// starts `argv` (program first) on the first valid hello, in the current directory.
    pub fn new(
        session: impl Into<String>,
        generation: u64,
        token_hash: TokenHash,
        argv: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        let mut argv = argv.into_iter().map(Into::into);
        Self {
            session: session.into(),
            generation,
            token_hash,
            program: argv.next().unwrap_or_default(),
            args: argv.collect(),
            working_dir: std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
            env: Vec::new(),
            replay_bytes: DEFAULT_REPLAY_BYTES,
            input_bytes: DEFAULT_INPUT_BYTES,
            overflow: Overflow::Block,
            heartbeat: DEFAULT_HEARTBEAT,
            idle_timeout: DEFAULT_HEARTBEAT * 3,
            handshake_timeout: Duration::from_secs(10),
            linger: Duration::from_secs(60),
            drain_grace: Duration::from_secs(2),
            reap_orphans: false,
        }
    }

    /// The agent's working directory (default: the relay's), reported to the broker.
    pub fn working_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.working_dir = dir.into();
        self
    }

    /// Environment entries for the agent, set after the relay's own environment (without its
    /// `OAB_RELAY_` variables), so they win over the worker's for the same name; entries whose
    /// name starts with `OAB_RELAY_` are never passed on. A binding's environment arrives here.
    pub fn agent_env<K, V>(mut self, env: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<OsString>,
        V: Into<OsString>,
    {
        self.env
            .extend(env.into_iter().map(|(name, value)| (name.into(), value.into())));
        self
    }

    /// The bound of unacknowledged agent output kept for replay (default
    /// [`DEFAULT_REPLAY_BYTES`]). The buffer holds at most this plus one 256 KiB read.
    pub fn replay_bytes(mut self, bytes: usize) -> Self {
        self.replay_bytes = bytes;
        self
    }

    /// The bound of broker input received but not yet written to the agent's stdin (default
    /// [`DEFAULT_INPUT_BYTES`]). Input is read off the connection at once and written to the
    /// agent by a task of its own, so an agent that does not read its stdin never holds up the
    /// acknowledgements, heartbeats and signals behind its input; it is acknowledged once
    /// written, which bounds what a client sends. A broker with more than this unacknowledged is
    /// refused with `input-overflow`: keep clients' input windows below it.
    pub fn input_bytes(mut self, bytes: usize) -> Self {
        self.input_bytes = bytes.max(1);
        self
    }

    /// What happens when the replay buffer is full (default [`Overflow::Block`]).
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// How often the relay pings the broker (default 30 s); also sets the idle timeout, after
    /// which a silent connection is dropped, to three intervals.
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = interval;
        self.idle_timeout = interval.saturating_mul(3);
        self
    }

    /// How long a connection may stay silent before it is dropped (default three heartbeats).
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// How long a new connection has to send its hello (default 10 s).
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// How long the relay waits, after the agent exited, for a broker to acknowledge the exit
    /// before it ends anyway (default 60 s).
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// How long, after the agent exited, its stdout may stay open with nothing to read (a
    /// descendant holding it) before the relay ends the stream (default 2 s).
    pub fn drain_grace(mut self, grace: Duration) -> Self {
        self.drain_grace = grace;
        self
    }

    /// Reap every child that becomes a zombie, not only the agent (default `false`). Set it when
    /// the relay is the worker's init process or a child subreaper; never in a process that has
    /// children of its own.
    pub fn reap_orphans(mut self, reap: bool) -> Self {
        self.reap_orphans = reap;
        self
    }

    /// The session this relay serves.
    pub fn session(&self) -> &str {
        &self.session
    }

    /// The generation this relay serves.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

/// Where the agent is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AgentState {
    /// No valid hello has arrived yet.
    NotStarted,
    /// The agent runs with this pid.
    Running {
        /// Its process id (and process group id).
        pid: u32,
    },
    /// The agent ended.
    Exited {
        /// How.
        status: ExitStatus,
    },
    /// The agent could not be started.
    SpawnFailed {
        /// Why.
        reason: String,
    },
}

/// A snapshot of the relay, for health checks and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStatus {
    /// The agent.
    pub agent: AgentState,
    /// Whether a broker connection is current.
    pub connected: bool,
    /// Encoded bytes of unacknowledged agent output held for replay.
    pub buffered_bytes: usize,
    /// The last agent output item produced.
    pub output_last: Seq,
    /// The last output item a broker acknowledged.
    pub output_acked: Seq,
    /// The last broker input item accepted.
    pub input_accepted: Seq,
    /// When the agent last produced output or received input (Unix seconds).
    pub last_activity: u64,
}

/// The relay: one per worker, serving one session generation.
///
/// Cheap to clone; clones share the relay. Use it within a Tokio runtime with I/O, time and
/// signal handling enabled (`enable_all`): the agent is spawned, pumped and reaped from it. The
/// `oab-relay` binary runs it on a current-thread runtime.
#[derive(Debug, Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

impl Relay {
    /// A relay for `config`. The agent starts on the first valid hello.
    ///
    /// # Errors
    /// [`ConfigError`] if the configuration cannot be served.
    pub fn new(config: RelayConfig) -> Result<Self, ConfigError> {
        if config.program.is_empty() {
            return Err(ConfigError::NoAgent);
        }
        let session = config.session.as_bytes();
        if session.is_empty()
            || session.len() > MAX_SESSION_LEN
            || !session
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
        {
            return Err(ConfigError::InvalidSession);
        }
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                state: Mutex::new(State {
                    hello: None,
                    current: None,
                    next_conn: 1,
                    log: OutputLog::new(),
                    agent: AgentState::NotStarted,
                    agent_pid: None,
                    input_accepted: 0,
                    stdout_closed: false,
                    stderr_tail: stderr::StderrTail::default(),
                    stderr_closed: false,
                    terminating: false,
                    retiring: false,
                    exit_seq: None,
                    finished: None,
                    last_activity: unix_now(),
                    last_attached: unix_now(),
                }),
                changed: watch::channel(0).0,
                input: Mutex::new(InputQueue {
                    sequencer: Sequencer::default(),
                    eof: false,
                    items: VecDeque::new(),
                    bytes: 0,
                }),
                input_ready: Notify::new(),
                done: CancellationToken::new(),
                agent_gone: CancellationToken::new(),
            }),
        })
    }

    /// Serves one connection (TCP stream, stdio bridge, WebSocket bridge) to its end: first the
    /// [`channel`](crate::channel::initiate) handshake with the key derived from this relay's token hash
    /// (a peer that does not authenticate is refused before it learns anything, the session's
    /// generation included), then the framed protocol inside the channel.
    ///
    /// # Cancellation
    /// Dropping the future closes the connection; the agent and its buffered output are kept.
    pub async fn serve_connection<S>(&self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        conn::serve(Arc::clone(&self.inner), stream).await;
    }

    /// Serves a connection whose channel an AgentCore front already opened (and whose hello it
    /// read, to route it).
    pub(crate) async fn serve_authenticated<S>(&self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        conn::serve_authenticated(Arc::clone(&self.inner), stream).await;
    }

    /// Accepts framed-protocol connections on `listener` until the relay finishes.
    ///
    /// # Errors
    /// Never returns an error for a single failed accept; the signature leaves room for a fatal
    /// listener failure.
    pub async fn serve_tcp(&self, listener: TcpListener) -> std::io::Result<()> {
        accept_until(&listener, &self.inner.done, |stream| {
            let relay = self.clone();
            tokio::spawn(async move { relay.serve_connection(stream).await });
        })
        .await
    }

    /// Serves AgentCore's container contract on `listener` until the relay finishes: `GET /ping`
    /// (health), `GET /ws` (a WebSocket carrying the framed protocol in binary messages) and
    /// `POST /invocations` (a small status document).
    ///
    /// # Errors
    /// As [`serve_tcp`](Self::serve_tcp).
    pub async fn serve_http(&self, listener: TcpListener) -> std::io::Result<()> {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = self.inner.done.cancelled() => return Ok(()),
            };
            match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let patience = self.inner.config.handshake_timeout;
                    let target = http::Target::Relay(self.clone());
                    tokio::spawn(http::serve(target, stream, patience));
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// Asks the agent to stop, as when the relay itself receives `SIGTERM`: `SIGTERM` to its
    /// process group, then `SIGKILL` after `grace`. If no agent was started, the relay finishes.
    pub fn terminate(&self, grace: Duration) {
        let pid = {
            let state = self.inner.state.lock();
            match &state.agent {
                AgentState::Running { pid } => Some(*pid),
                _ => None,
            }
        };
        match pid {
            Some(_) => self.inner.signal(
                RelaySignal::Terminate,
                u32::try_from(grace.as_millis()).unwrap_or(u32::MAX),
            ),
            None => self.inner.finish_unless_running(),
        }
    }

    /// Ends this relay for good so that another may take over the worker's storage: the current
    /// connection is superseded, the agent's process group is killed, and the relay finishes once
    /// the agent is gone. Used when a newer generation arrives at a worker that outlives
    /// generations (AgentCore's microVM): the old agent must be gone before the new one starts.
    pub async fn retire(&self) {
        let running = {
            let mut state = self.inner.state.lock();
            // The broker of the old generation hears `superseded` (it is fenced), not an exit.
            if let Some(current) = state.current.take() {
                current.superseded.cancel();
            }
            state.retiring = true;
            matches!(state.agent, AgentState::Running { .. })
        };
        self.inner.bump();
        if running {
            self.inner.signal(RelaySignal::Kill, 0);
            self.inner.agent_gone.cancelled().await;
        }
        {
            let mut state = self.inner.state.lock();
            let code = match &state.agent {
                AgentState::Exited { status } => status.as_exit_code(),
                AgentState::SpawnFailed { .. } => 127,
                AgentState::NotStarted | AgentState::Running { .. } => 0,
            };
            Inner::finish_locked(&mut state, &self.inner.done, code);
        }
        self.inner.bump();
    }

    /// Waits until the relay is done: the agent exited and a broker acknowledged the exit (or
    /// the linger time passed), or the agent could not be started, or [`terminate`](Self::terminate)
    /// was called before any agent started. Returns the exit code for the relay process: the
    /// agent's code, 128 + its signal, 127 if it could not be started, 0 if none was.
    pub async fn finished(&self) -> i32 {
        self.inner.done.cancelled().await;
        self.inner.state.lock().finished.unwrap_or(0)
    }

    /// Whether the relay is done.
    pub fn is_finished(&self) -> bool {
        self.inner.done.is_cancelled()
    }

    /// A snapshot of the relay.
    pub fn status(&self) -> RelayStatus {
        let state = self.inner.state.lock();
        RelayStatus {
            agent: state.agent.clone(),
            connected: state.current.is_some(),
            buffered_bytes: state.log.bytes(),
            output_last: state.log.last(),
            output_acked: state.log.acked(),
            input_accepted: state.input_accepted,
            last_activity: state.last_activity,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.inner.config
    }
}

/// How far ahead of the relay's clock a hello's epoch may lie (clock skew between the broker's
/// host and the worker's).
///
/// A broker's epoch is its start time in Unix milliseconds (or a lease's transition count, far
/// below any clock), so an honest epoch is never in the future by more than the skew between two
/// clocks. The relay refuses anything further ahead with `epoch-ahead`: see the crate's "Epochs"
/// for why this, and not more, is what bounds a token holder.
pub const EPOCH_LEEWAY: Duration = Duration::from_secs(60);

/// Refuses an epoch further ahead of this host's clock than [`EPOCH_LEEWAY`].
pub(crate) fn check_epoch_not_ahead(epoch: u64) -> Result<(), Refusal> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let ceiling = now.saturating_add(u64::try_from(EPOCH_LEEWAY.as_millis()).unwrap_or(u64::MAX));
    if epoch > ceiling {
        return Err((
            ErrorCode::EpochAhead,
            format!(
                "epoch {epoch} lies ahead of this relay's clock ({now} ms) by more than {EPOCH_LEEWAY:?}"
            ),
        ));
    }
    Ok(())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The shared core of a relay.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) config: RelayConfig,
    state: Mutex<State>,
    /// Bumped on every change writers or the stdout pump may wait for.
    changed: watch::Sender<u64>,
    /// Broker input received and not yet written to the agent's stdin.
    input: Mutex<InputQueue>,
    /// Wakes the stdin pump when input arrives.
    input_ready: Notify,
    /// Cancelled when the relay is done.
    pub(crate) done: CancellationToken,
    /// Cancelled when the agent exited (a signal of its own, so that the stdout pump does not
    /// wake on every change).
    agent_gone: CancellationToken,
}

#[derive(Debug)]
struct State {
    /// The (epoch, nonce) of the last accepted hello.
    hello: Option<(u64, u64)>,
    current: Option<CurrentConn>,
    next_conn: u64,
    log: OutputLog,
    agent: AgentState,
    /// The agent's pid (and process group id), once started.
    agent_pid: Option<u32>,
    /// The last input item written to the agent's stdin (and so acknowledged).
    input_accepted: Seq,
    stdout_closed: bool,
    /// The last lines of the agent's standard error, and whether it closed.
    stderr_tail: stderr::StderrTail,
    stderr_closed: bool,
    /// Whether a SIGTERM was forwarded to the agent.
    terminating: bool,
    /// Whether [`Relay::retire`] began: no connection is accepted any more.
    retiring: bool,
    exit_seq: Option<Seq>,
    finished: Option<i32>,
    last_activity: u64,
    /// When a broker connection last began or ended (Unix seconds): `/ping`'s
    /// `time_of_last_update`.
    last_attached: u64,
}

impl State {
    fn is_current(&self, id: u64) -> bool {
        self.current.as_ref().is_some_and(|c| c.id == id)
    }
}

#[derive(Debug)]
struct CurrentConn {
    id: u64,
    superseded: CancellationToken,
}

/// Broker input between the connection and the agent's stdin.
#[derive(Debug)]
struct InputQueue {
    /// The items received (queued or written).
    sequencer: Sequencer,
    /// Whether the stdin EOF was received.
    eof: bool,
    /// Received, not yet written: (seq, bytes), `None` for the EOF.
    items: VecDeque<(Seq, Option<Bytes>)>,
    /// The payload bytes in `items`.
    bytes: usize,
}

/// A connection whose hello was accepted.
#[derive(Debug)]
pub(crate) struct Accepted {
    pub(crate) id: u64,
    pub(crate) superseded: CancellationToken,
    pub(crate) welcome: Welcome,
}

/// A refusal: the error frame to send, then close.
pub(crate) type Refusal = (ErrorCode, String);

impl Inner {
    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Validates a hello and, if it is acceptable, makes its connection the current one (the
    /// previous one is superseded), starting the agent if this is the first.
    pub(crate) fn accept_hello(self: &Arc<Self>, hello: &Hello) -> Result<Accepted, Refusal> {
        let config = &self.config;
        // The token first: a hello without it learns nothing about this relay, not even its
        // generation.
        if !config.token_hash.verify(&hello.token) {
            return Err((ErrorCode::BadToken, "the token does not match".into()));
        }
        if hello.session != config.session {
            return Err((
                ErrorCode::SessionMismatch,
                format!("this relay serves another session than {}", hello.session),
            ));
        }
        if hello.generation != config.generation {
            return Err((
                ErrorCode::StaleGeneration,
                format!(
                    "this relay serves generation {}, not {}",
                    config.generation, hello.generation
                ),
            ));
        }
        check_epoch_not_ahead(hello.epoch)?;
        let mut state = self.state.lock();
        if let Some((epoch, nonce)) = state.hello {
            if hello.epoch < epoch {
                return Err((
                    ErrorCode::StaleEpoch,
                    format!("epoch {} is older than epoch {epoch}", hello.epoch),
                ));
            }
            if hello.epoch == epoch && hello.nonce <= nonce {
                return Err((
                    ErrorCode::ReplayedHello,
                    format!("nonce {} does not exceed {nonce} in epoch {epoch}", hello.nonce),
                ));
            }
        }
        if state.finished.is_some() || state.retiring {
            return Err((ErrorCode::Internal, "the relay is shutting down".into()));
        }
        // Where the output this connection receives starts.
        let log = &state.log;
        if hello.resume > log.last() {
            return Err((
                ErrorCode::ResumeGap,
                format!(
                    "resume point {} is ahead of the output ({})",
                    hello.resume,
                    log.last()
                ),
            ));
        }
        let from = if hello.resume == 0 {
            log.acked() + 1
        } else {
            hello.resume + 1
        };
        if from < log.first_held() || log.discarded_beyond(from - 1) {
            return Err((
                ErrorCode::ResumeGap,
                format!(
                    "output from {from} on was requested but only {} on is buffered",
                    log.first_held()
                ),
            ));
        }
        let mut started = false;
        let pid = match &state.agent {
            AgentState::NotStarted => match agent::spawn(self) {
                Ok(spawned) => {
                    tracing::info!(pid = spawned.pid, "agent started");
                    state.agent = AgentState::Running { pid: spawned.pid };
                    state.agent_pid = Some(spawned.pid);
                    started = true;
                    spawned.pid
                }
                Err(error) => {
                    let reason = format!("{}: {error}", config.program.to_string_lossy());
                    tracing::error!(%reason, "the agent could not be started");
                    state.agent = AgentState::SpawnFailed {
                        reason: reason.clone(),
                    };
                    return Err((ErrorCode::SpawnFailed, reason));
                }
            },
            AgentState::Running { pid } => *pid,
            AgentState::Exited { .. } => state.agent_pid.unwrap_or(0),
            AgentState::SpawnFailed { reason } => return Err((ErrorCode::SpawnFailed, reason.clone())),
        };
        // Accepted: commit.
        if hello.resume > state.log.acked() {
            state.log.ack(hello.resume);
        }
        state.hello = Some((hello.epoch, hello.nonce));
        state.last_attached = unix_now();
        let id = state.next_conn;
        state.next_conn += 1;
        let superseded = CancellationToken::new();
        if let Some(previous) = state.current.replace(CurrentConn {
            id,
            superseded: superseded.clone(),
        }) {
            tracing::info!(previous = previous.id, current = id, "connection superseded");
            previous.superseded.cancel();
        }
        let welcome = Welcome {
            generation: config.generation,
            input_acked: state.input_accepted,
            output_first: from,
            pid,
            started,
            exited: matches!(state.agent, AgentState::Exited { .. }),
            working_dir: truncate_path(&config.working_dir),
        };
        drop(state);
        self.bump();
        Ok(Accepted {
            id,
            superseded,
            welcome,
        })
    }

    /// Forgets connection `id` if it is still the current one.
    pub(crate) fn disconnected(&self, id: u64) {
        let mut state = self.state.lock();
        if state.current.as_ref().is_some_and(|c| c.id == id) {
            state.current = None;
            state.last_attached = unix_now();
            drop(state);
            self.bump();
        }
    }

    pub(crate) fn is_current(&self, id: u64) -> bool {
        self.state.lock().is_current(id)
    }

    /// Encoded output items from `from` on (up to about `max_bytes`), the next item to send,
    /// and the input acknowledgement to send. `None` if the connection is no longer current.
    pub(crate) fn outgoing(
        &self,
        id: u64,
        from: Seq,
        max_bytes: usize,
        out: &mut Vec<Bytes>,
    ) -> Option<(Seq, Seq)> {
        let state = self.state.lock();
        if !state.is_current(id) {
            return None;
        }
        let next = state.log.collect(from, max_bytes, out);
        Some((next, state.input_accepted))
    }

    /// Takes a broker input item (`payload` `None` is the stdin EOF) for the agent's stdin:
    /// queued for the stdin pump, never waiting for the agent to read.
    pub(crate) fn input(&self, id: u64, seq: Seq, payload: Option<Bytes>) -> Result<(), Refusal> {
        let mut input = self.input.lock();
        if !self.is_current(id) {
            return Ok(());
        }
        match input.sequencer.check(seq) {
            Err(error) => return Err((ErrorCode::OutOfOrder, error.to_string())),
            Ok(Arrival::Duplicate) => return Ok(()),
            Ok(Arrival::New) => {}
        }
        if input.eof {
            return Err((
                ErrorCode::UnexpectedFrame,
                "input after the end of the agent's stdin".into(),
            ));
        }
        let len = payload.as_ref().map_or(0, Bytes::len);
        if input.bytes.saturating_add(len) > self.config.input_bytes {
            return Err((
                ErrorCode::InputOverflow,
                format!(
                    "more than {} bytes of input not yet written to the agent",
                    self.config.input_bytes
                ),
            ));
        }
        let _ = input.sequencer.accept(seq);
        input.eof = payload.is_none();
        input.bytes += len;
        input.items.push_back((seq, payload));
        drop(input);
        self.state.lock().last_activity = unix_now();
        self.input_ready.notify_one();
        Ok(())
    }

    /// The next input item for the agent's stdin, waiting for one; `None` once the relay is done.
    pub(crate) async fn next_input(&self) -> Option<(Seq, Option<Bytes>)> {
        loop {
            let ready = self.input_ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            if let Some(item) = self.input.lock().items.pop_front() {
                return Some(item);
            }
            tokio::select! {
                () = ready => {}
                () = self.done.cancelled() => return None,
            }
        }
    }

    /// Records that input item `seq` of `len` bytes was written to the agent (or dropped, the
    /// agent's stdin being closed): it is acknowledged to the broker.
    pub(crate) fn input_written(&self, seq: Seq, len: usize) {
        {
            let mut input = self.input.lock();
            input.bytes = input.bytes.saturating_sub(len);
        }
        self.state.lock().input_accepted = seq;
        self.bump();
    }

    /// Handles a broker acknowledgement of output.
    pub(crate) fn output_ack(&self, id: u64, seq: Seq) -> Result<(), Refusal> {
        let mut state = self.state.lock();
        if !state.is_current(id) {
            return Ok(());
        }
        if seq > state.log.last() {
            return Err((
                ErrorCode::OutOfOrder,
                format!("ack of output {seq}, but only {} was produced", state.log.last()),
            ));
        }
        if seq <= state.log.acked() {
            return Ok(());
        }
        state.log.ack(seq);
        let exit_acked = state.exit_seq.is_some_and(|exit| seq >= exit);
        if exit_acked {
            let code = match &state.agent {
                AgentState::Exited { status } => status.as_exit_code(),
                _ => 0,
            };
            Self::finish_locked(&mut state, &self.done, code);
        }
        drop(state);
        self.bump();
        Ok(())
    }

    /// Signals the agent's process group on the broker's (or the relay's own) behalf.
    pub(crate) fn signal(self: &Arc<Self>, signal: RelaySignal, grace_ms: u32) {
        let (running, pid, terminating) = {
            let mut state = self.state.lock();
            let terminating = signal == RelaySignal::Terminate && state.terminating;
            if signal == RelaySignal::Terminate {
                state.terminating = true;
            }
            (
                matches!(state.agent, AgentState::Running { .. }),
                state.agent_pid,
                terminating,
            )
        };
        let Some(pid) = pid else {
            return;
        };
        if !running {
            // After the agent's exit, a kill still clears what is left of its process group.
            if signal == RelaySignal::Kill {
                agent::signal_group(pid, RelaySignal::Kill);
            }
            return;
        }
        if terminating {
            // A client sends its signal again after a reconnect (the first may not have
            // arrived); a second SIGTERM would read as "force quit" to many programs, and the
            // first one's SIGKILL is already scheduled.
            tracing::debug!(pid, "the agent is already terminating");
            return;
        }
        tracing::info!(pid, signal = signal.number(), grace_ms, "signalling the agent");
        agent::signal_group(pid, signal);
        if signal == RelaySignal::Terminate && grace_ms > 0 {
            let inner = Arc::clone(self);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(u64::from(grace_ms))).await;
                let running = matches!(inner.state.lock().agent, AgentState::Running { .. });
                if running {
                    tracing::info!(pid, "the agent outlived its grace period; killing it");
                    agent::signal_group(pid, RelaySignal::Kill);
                }
            });
        }
    }

    /// Waits until the output log has room for another read (or, with [`Overflow::Discard`] and
    /// no broker connected, makes room). `false` once the relay is done.
    async fn wait_for_output_room(&self) -> bool {
        let mut changed = self.subscribe();
        loop {
            changed.borrow_and_update();
            {
                let mut state = self.state.lock();
                if state.log.bytes() < self.config.replay_bytes {
                    return true;
                }
                if self.config.overflow == Overflow::Discard && state.current.is_none() {
                    let limit = self.config.replay_bytes.saturating_sub(agent::READ_CHUNK + 64);
                    state.log.discard_to(limit);
                    return true;
                }
            }
            tokio::select! {
                changed = changed.changed() => if changed.is_err() { return false },
                () = self.done.cancelled() => return false,
            }
        }
    }

    /// Resolves `drain_grace` after the agent exited.
    async fn drain_deadline(&self) {
        self.agent_gone.cancelled().await;
        tokio::time::sleep(self.config.drain_grace).await;
    }

    /// The allocation of acknowledged output with room for `capacity` bytes, if one is kept.
    fn reuse_output_buffer(&self, capacity: usize) -> Option<bytes::BytesMut> {
        self.state.lock().log.reuse(capacity)
    }

    fn push_output_frame(&self, frame: bytes::BytesMut) {
        {
            let mut state = self.state.lock();
            state.log.push_data_frame(frame);
            state.last_activity = unix_now();
        }
        self.bump();
    }

    fn stdout_closed(self: &Arc<Self>) {
        {
            let mut state = self.state.lock();
            state.stdout_closed = true;
            state.log.push_eof();
            self.push_exit_locked(&mut state);
        }
        self.bump();
    }

    fn stderr_written(&self, chunk: &[u8]) {
        self.state.lock().stderr_tail.push(chunk);
    }

    fn stderr_closed(self: &Arc<Self>) {
        {
            let mut state = self.state.lock();
            state.stderr_closed = true;
            self.push_exit_locked(&mut state);
        }
        self.bump();
    }

    fn agent_exited(self: &Arc<Self>, status: ExitStatus) {
        tracing::info!(%status, "agent ended");
        {
            let mut state = self.state.lock();
            state.agent = AgentState::Exited { status };
            self.push_exit_locked(&mut state);
        }
        self.agent_gone.cancel();
        self.bump();
    }

    /// Appends the exit item once the agent's exit and the end of its stdout and stderr are
    /// known (so the item carries all of the stderr tail).
    fn push_exit_locked(self: &Arc<Self>, state: &mut State) {
        let AgentState::Exited { status } = state.agent else {
            return;
        };
        if !state.stdout_closed || !state.stderr_closed || state.exit_seq.is_some() {
            return;
        }
        let stderr_tail = state.stderr_tail.text();
        state.exit_seq = Some(state.log.push_exit(status, stderr_tail));
        let inner = Arc::clone(self);
        let linger = self.config.linger;
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(linger) => {
                    tracing::info!("no broker acknowledged the agent's exit; finishing");
                    let mut state = inner.state.lock();
                    Inner::finish_locked(&mut state, &inner.done, status.as_exit_code());
                }
                () = inner.done.cancelled() => {}
            }
        });
    }

    fn finish_locked(state: &mut State, done: &CancellationToken, code: i32) {
        if state.finished.is_none() {
            state.finished = Some(code);
            if let (Some(pid), AgentState::Exited { .. }) = (state.agent_pid, &state.agent) {
                // Whatever the agent left running in its process group goes with the relay.
                agent::signal_group(pid, RelaySignal::Kill);
            }
            done.cancel();
        }
    }

    /// Finishes the relay after a spawn failure was reported.
    pub(crate) fn finish_spawn_failed(&self) {
        let mut state = self.state.lock();
        Self::finish_locked(&mut state, &self.done, 127);
    }

    fn finish_unless_running(&self) {
        let mut state = self.state.lock();
        let code = match &state.agent {
            AgentState::Running { .. } => return,
            AgentState::Exited { status } => status.as_exit_code(),
            AgentState::SpawnFailed { .. } => 127,
            AgentState::NotStarted => 0,
        };
        Self::finish_locked(&mut state, &self.done, code);
    }

    /// What AgentCore's `/ping` reports: busy while a broker connection is current, and when one
    /// last began or ended.
    ///
    /// AgentCore ends a session whose `/ping` says `Healthy` for its idle timeout (a changed
    /// `time_of_last_update` restarts that clock) and keeps one that says `HealthyBusy`; bytes
    /// on the WebSocket are not documented to count. So an attached chat, however quiet, is
    /// busy: the connection is current only while the broker is heard from (it is dropped after
    /// the relay's idle timeout, three heartbeats by default). Once the broker is gone the relay
    /// says `Healthy` with the time it left, so the microVM ends one idle timeout later even if
    /// output is still unacknowledged or the agent is still writing: a broker that never comes
    /// back does not pin a microVM until its maximum lifetime.
    pub(crate) fn status_for_ping(&self) -> (bool, u64) {
        let state = self.state.lock();
        (state.current.is_some(), state.last_attached)
    }
}

fn truncate_path(path: &std::path::Path) -> String {
    let mut text = path.to_string_lossy().into_owned();
    if text.len() > MAX_TEXT_LEN {
        let mut cut = MAX_TEXT_LEN;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// Writes `frame` (an error) and closes the write side; failures are ignored: the peer is gone.
pub(crate) async fn refuse<W: AsyncWrite + Unpin>(writer: &mut W, code: ErrorCode, message: String) {
    tracing::info!(%code, %message, "refusing a connection");
    let frame = Frame::error(code, message);
    let _ = crate::protocol::write_frame(writer, &frame).await;
    let _ = writer.flush().await;
    let _ = writer.shutdown().await;
}
/// Accepts connections on `listener` until `done` is cancelled, handing each (with Nagle off) to
/// `serve`; a failed accept (descriptors exhausted, say) is logged and retried after 50 ms.
pub(crate) async fn accept_until(
    listener: &TcpListener,
    done: &CancellationToken,
    serve: impl Fn(tokio::net::TcpStream),
) -> std::io::Result<()> {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = done.cancelled() => return Ok(()),
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                tracing::debug!(%peer, "connection");
                serve(stream);
            }
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
