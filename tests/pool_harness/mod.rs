//! A small, readable reproduction of openab-core's `SessionPool`, built on the compatibility layer
//! ([`openab_runtime::compat`]) where upstream calls `AcpConnection::spawn`.
//!
//! It is a test harness, not a port: it keeps the behaviour the pool's callers rely on and shows,
//! for each termination path, which runtime call the pool makes.
//!
//! | upstream `SessionPool` | here |
//! |---|---|
//! | `creating[key]`, the per-key creation gate (never removed) | [`SessionPool::get_or_create`] holds `creating[key]` for the whole call |
//! | `AcpConnection::spawn` + `initialize` | [`ThreadSessions::open`] + `initialize` over the [`AgentTransport`] |
//! | `session_load(saved_sid)`, transient errors by substring | `session/load`; [`AcpCallError::is_transient`] keeps the persisted id and fails the call |
//! | `session_new(working_dir)` | `session/new` with `cwd` = [`AgentTransport::cwd`] (the directory inside the worker) |
//! | `run_reader_loop(stdout, stdin, pending, notify_tx)` | one reader task per connection over [`AgentTransport::reader`] |
//! | `cancel_handles` (`Arc<Mutex<ChildStdin>>`) | [`SessionControl::cancel`], without the connection's turn lock |
//! | `pgids` + `kill(-pgid)` for hung sessions | [`SessionControl::kill`], then [`PoolPath::HungEviction`] |
//! | `last_active`, `SessionActivity` | [`Activity`]: last activity and the start of the turn in flight |
//! | LRU eviction at `max_sessions` | [`PoolPath::CapacityEviction`] of the least recently active idle session |
//! | `cleanup_idle(ttl)` | [`SessionPool::cleanup_idle`]: [`PoolPath::IdleEviction`] and [`PoolPath::HungEviction`] |
//! | `reset_session` | [`SessionPool::reset`]: `session/cancel` first, then [`PoolPath::ExplicitReset`] |
//! | (thread archived, admin close) | [`SessionPool::archive`]: `session/cancel` first, then [`PoolPath::ThreadArchived`] |
//! | `shutdown` + `thread_map.json` | [`SessionPool::shutdown`]: [`PoolPath::BrokerShutdown`], key → ACP session id saved |
//! | a new broker process loading `thread_map.json` | [`SessionPool::new`] over the same state directory |
//! | a dead `AcpConnection` replaced in `get_or_create` | open again: `attach` starts a new generation, then `session/load` |
//!
//! [`RecordingRuntime`] wraps any [`SessionRuntime`] and records every lifecycle call, so tests can
//! check the runtime call and its reason for each path.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use openab_runtime::compat::{
    AcpCallError, AgentTransport, LineWriter, PoolPath, RuntimeCall, SessionControl, ThreadSessions,
};
use openab_runtime::{
    AgentOutput, Attachment, Capabilities, CloseReason, CreateOptions, Generation, ReconcileReport,
    SessionHandle, SessionId, SessionIdentity, SessionRuntime, SessionStatus, SuspendReason,
};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, OwnedMutexGuard};
use tokio::task::JoinHandle;

/// The file the pool keeps its key → ACP session id map in (upstream: `~/.openab/thread_map.json`).
pub(crate) const THREAD_MAP: &str = "thread_map.json";

/// The test agent's extension request that runs a shell command in the agent's own environment.
pub(crate) const EXEC_METHOD: &str = "_openab/exec";

/// Locks a std mutex; the pool's locks guard plain maps, so a panic elsewhere leaves them usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------------
// Configuration and errors
// ---------------------------------------------------------------------------------------------

/// How the pool behaves (upstream: `[pool]` and `[agent]` configuration).
#[derive(Debug, Clone)]
pub(crate) struct PoolConfig {
    /// The most live connections at once (upstream `max_sessions`).
    pub(crate) max_sessions: usize,
    /// How long a turn may be in flight before `cleanup_idle` treats it as hung (upstream
    /// `prompt_hard_timeout_secs + hung_grace_secs`, 1920 s by default).
    pub(crate) hung_threshold: Duration,
    /// How long `initialize`, `session/load` and other requests may take (upstream: 30 s).
    pub(crate) request_timeout: Duration,
    /// How long `session/new` may take (upstream: 120 s).
    pub(crate) new_session_timeout: Duration,
    /// Where [`THREAD_MAP`] lives; a pool built over the same directory resumes its threads.
    pub(crate) state_dir: PathBuf,
}

impl PoolConfig {
    /// Upstream's defaults, keeping state in `state_dir`.
    pub(crate) fn new(state_dir: impl Into<PathBuf>) -> Self {
        Self {
            max_sessions: 10,
            hung_threshold: Duration::from_secs(1920),
            request_timeout: Duration::from_secs(30),
            new_session_timeout: Duration::from_secs(120),
            state_dir: state_dir.into(),
        }
    }
}

/// Why a pool operation failed. Every variant is typed: callers never look at messages.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PoolError {
    /// Opening the session or an ACP request failed.
    #[error(transparent)]
    Acp(#[from] AcpCallError),
    /// `session/load` failed transiently: the persisted ACP session id is kept, and the next
    /// message retries (upstream: "session load timeout/connection lost").
    #[error("could not restore the previous session: {0}")]
    ResumeFailed(#[source] AcpCallError),
    /// Every live connection is busy and the pool is full.
    #[error("pool exhausted ({0} sessions)")]
    Exhausted(usize),
    /// The key has no session in the pool.
    #[error("no session for thread {0}")]
    NoSession(String),
    /// The agent answered with something the protocol does not allow.
    #[error("malformed answer to {method}: {detail}")]
    Malformed {
        /// The request.
        method: String,
        /// What was wrong.
        detail: String,
    },
    /// Saving or loading the thread map failed.
    #[error("thread map: {0}")]
    ThreadMap(#[from] std::io::Error),
}

impl From<openab_runtime::Error> for PoolError {
    fn from(error: openab_runtime::Error) -> Self {
        PoolError::Acp(AcpCallError::Runtime(error))
    }
}

impl PoolError {
    /// Whether retrying the same call later may succeed.
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            PoolError::Acp(error) | PoolError::ResumeFailed(error) => error.is_transient(),
            PoolError::Exhausted(_) => true,
            PoolError::NoSession(_) | PoolError::Malformed { .. } | PoolError::ThreadMap(_) => false,
        }
    }

    /// The ACP-level error inside, if there is one.
    pub(crate) fn acp(&self) -> Option<&AcpCallError> {
        match self {
            PoolError::Acp(error) | PoolError::ResumeFailed(error) => Some(error),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One connection: the reader loop, pending requests, the notification subscriber
// ---------------------------------------------------------------------------------------------

/// How the reader loop ended.
#[derive(Debug)]
enum ReaderEnd {
    /// The agent's output ended (the worker exited).
    Eof,
    /// Reading failed; the runtime's error (fenced, disconnected) is inside.
    Failed(std::io::Error),
}

impl ReaderEnd {
    /// The error a request for `method` fails with once the reader is gone.
    fn error(&self, method: &str) -> AcpCallError {
        match self {
            ReaderEnd::Eof => AcpCallError::ChannelClosed {
                method: method.to_owned(),
            },
            ReaderEnd::Failed(error) => AcpCallError::from_io(method, error),
        }
    }
}

/// A request waiting for its response.
struct Waiter {
    method: String,
    done: oneshot::Sender<Result<Value, AcpCallError>>,
}

/// Requests in flight, and how the reader ended once it did (no request is added after that).
#[derive(Default)]
struct Pending {
    waiters: HashMap<u64, Waiter>,
    end: Option<ReaderEnd>,
}

/// The JSON-RPC side of a connection: request ids, pending requests, the one notification
/// subscriber (the turn in progress), and the writer.
struct Rpc {
    /// The shared writer; each write uses a clone of its own, so lines never interleave.
    writer: Mutex<LineWriter>,
    next_id: AtomicU64,
    pending: Mutex<Pending>,
    subscriber: Mutex<Option<mpsc::UnboundedSender<Value>>>,
}

impl fmt::Debug for Rpc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rpc")
            .field("writer", &*lock(&self.writer))
            .finish_non_exhaustive()
    }
}

impl Rpc {
    /// Starts the reader loop over the agent's output.
    fn start(writer: LineWriter, reader: AgentOutput) -> (Arc<Self>, JoinHandle<()>) {
        let rpc = Arc::new(Self {
            writer: Mutex::new(writer),
            next_id: AtomicU64::new(1),
            pending: Mutex::default(),
            subscriber: Mutex::default(),
        });
        let task = tokio::spawn(read_loop(Arc::clone(&rpc), reader));
        (rpc, task)
    }

    /// Whether the reader loop has ended.
    fn ended(&self) -> bool {
        lock(&self.pending).end.is_some()
    }

    /// Writes one whole line to the agent's stdin through a clone of the shared [`LineWriter`].
    async fn send_line(&self, method: &str, mut line: String) -> Result<(), AcpCallError> {
        line.push('\n');
        let mut writer = lock(&self.writer).clone();
        let written = async {
            writer.write_all(line.as_bytes()).await?;
            writer.flush().await
        };
        written
            .await
            .map_err(|error| AcpCallError::from_io(method, &error))
    }

    /// Sends a request and waits for its result, for at most `timeout` when one is given.
    async fn call(
        &self,
        method: &str,
        params: Value,
        timeout: Option<Duration>,
    ) -> Result<Value, AcpCallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (done, answer) = oneshot::channel();
        {
            let mut pending = lock(&self.pending);
            if let Some(end) = &pending.end {
                return Err(end.error(method));
            }
            pending.waiters.insert(
                id,
                Waiter {
                    method: method.to_owned(),
                    done,
                },
            );
        }
        let line = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string();
        if let Err(error) = self.send_line(method, line).await {
            lock(&self.pending).waiters.remove(&id);
            return Err(error);
        }
        let answer = match timeout {
            Some(after) => match tokio::time::timeout(after, answer).await {
                Ok(answer) => answer,
                Err(_) => {
                    lock(&self.pending).waiters.remove(&id);
                    return Err(AcpCallError::Timeout {
                        method: method.to_owned(),
                        after,
                    });
                }
            },
            None => answer.await,
        };
        answer.unwrap_or_else(|_| {
            Err(AcpCallError::ChannelClosed {
                method: method.to_owned(),
            })
        })
    }

    /// Handles one line of the agent's output.
    fn dispatch(self: &Arc<Self>, line: &str) {
        let Ok(message) = serde_json::from_str::<Value>(line) else {
            return; // upstream skips lines that are not JSON
        };
        let method = message.get("method").and_then(Value::as_str);
        let id = message.get("id").filter(|id| !id.is_null());
        match (method, id) {
            (None, Some(id)) => {
                let Some(waiter) = id.as_u64().and_then(|id| lock(&self.pending).waiters.remove(&id)) else {
                    return; // a response nobody waits for any more (timed out)
                };
                let result = match message.get("error") {
                    Some(error) => Err(AcpCallError::Rpc {
                        code: error.get("code").and_then(Value::as_i64).unwrap_or(0),
                        message: error
                            .get("message")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_owned(),
                    }),
                    None => Ok(message.get("result").cloned().unwrap_or(Value::Null)),
                };
                let _ = waiter.done.send(result);
            }
            (Some("session/request_permission"), Some(id)) => {
                let outcome = permission_outcome(message.pointer("/params/options"));
                let reply = json!({"jsonrpc": "2.0", "id": id, "result": {"outcome": outcome}});
                self.reply_in_background(reply);
            }
            (Some(_), Some(id)) => {
                // `fs/*`, `terminal/*` and anything else the agent asks of the client: never served
                // on the broker's host for an isolated session (it would reopen the hole).
                let reply = json!({"jsonrpc": "2.0", "id": id,
                    "error": {"code": -32601, "message": "method not found"}});
                self.reply_in_background(reply);
            }
            (Some(_), None) => {
                if let Some(subscriber) = lock(&self.subscriber).as_ref() {
                    let _ = subscriber.send(message);
                }
            }
            (None, None) => {}
        }
    }

    /// Answers an agent request without making the reader wait for the agent's stdin.
    fn reply_in_background(self: &Arc<Self>, reply: Value) {
        let rpc = Arc::clone(self);
        tokio::spawn(async move {
            let _ = rpc.send_line("reply", reply.to_string()).await;
        });
    }
}

/// Upstream's auto-answer to `session/request_permission`: the first `allow_always` option, else
/// the first `allow_once`, else the first option that is not a rejection; `cancelled` when every
/// option rejects.
fn permission_outcome(options: Option<&Value>) -> Value {
    let Some(options) = options.and_then(Value::as_array) else {
        return json!({"outcome": "selected", "optionId": "allow_always"});
    };
    let kind = |option: &Value| {
        option
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let chosen = ["allow_always", "allow_once"]
        .iter()
        .find_map(|wanted| options.iter().find(|option| kind(option) == *wanted))
        .or_else(|| options.iter().find(|option| !kind(option).starts_with("reject")));
    match chosen.and_then(|option| option.get("optionId")) {
        Some(id) => json!({"outcome": "selected", "optionId": id}),
        None => json!({"outcome": "cancelled"}),
    }
}

/// The reader loop: resolves responses, forwards notifications, answers agent requests; at the
/// end, fails every pending request with a typed error and closes the subscriber.
async fn read_loop(rpc: Arc<Rpc>, reader: AgentOutput) {
    let mut lines = BufReader::new(reader).lines();
    let end = loop {
        match lines.next_line().await {
            Ok(Some(line)) => rpc.dispatch(&line),
            Ok(None) => break ReaderEnd::Eof,
            Err(error) => break ReaderEnd::Failed(error),
        }
    };
    {
        let mut pending = lock(&rpc.pending);
        for (_, waiter) in pending.waiters.drain() {
            let _ = waiter.done.send(Err(end.error(&waiter.method)));
        }
        pending.end = Some(end);
    }
    lock(&rpc.subscriber).take();
}

/// A connection's activity, readable without its turn lock (upstream `SessionActivity`).
#[derive(Debug)]
pub(crate) struct Activity {
    last_active: Mutex<Instant>,
    turn_started: Mutex<Option<Instant>>,
}

impl Activity {
    fn new() -> Self {
        Self {
            last_active: Mutex::new(Instant::now()),
            turn_started: Mutex::new(None),
        }
    }

    fn touch(&self) {
        *lock(&self.last_active) = Instant::now();
    }

    fn start_turn(&self) {
        self.touch();
        *lock(&self.turn_started) = Some(Instant::now());
    }

    fn end_turn(&self) {
        *lock(&self.turn_started) = None;
        self.touch();
    }

    /// When the connection was last used.
    pub(crate) fn last_active(&self) -> Instant {
        *lock(&self.last_active)
    }

    /// How long the turn in flight has been running, if one is.
    pub(crate) fn turn_age(&self) -> Option<Duration> {
        lock(&self.turn_started).map(|started| started.elapsed())
    }
}

/// How a connection's ACP session came to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Opened {
    /// `session/new`: nothing was persisted for the thread (or the agent cannot load sessions).
    New,
    /// `session/load` of the persisted ACP session id.
    Loaded,
    /// `session/load` failed permanently, so `session/new` started over (upstream shows
    /// "Session expired, starting fresh").
    NewAfterFailedLoad {
        /// The agent's JSON-RPC error code, when the agent refused the load.
        rpc_code: Option<i64>,
    },
}

/// One live connection to a session's worker.
struct Connection {
    session_id: SessionId,
    generation: Generation,
    cwd: String,
    acp_session_id: String,
    opened: Opened,
    rpc: Arc<Rpc>,
    reader: JoinHandle<()>,
    control: SessionControl,
    /// Held for a whole turn (upstream: the per-connection mutex `with_connection` holds).
    turn: Arc<tokio::sync::Mutex<()>>,
    activity: Activity,
    /// Upstream `session_reset`: the next turn tells the user the session started fresh.
    reset_notice: AtomicBool,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Connection {
    /// Busy: a turn holds the connection (upstream: `try_lock` fails; busy counts as alive).
    fn is_busy(&self) -> bool {
        self.turn.try_lock().is_err()
    }

    /// The worker runs and the reader still reads (upstream `alive()`).
    fn is_alive(&self) -> bool {
        self.control.is_alive() && !self.rpc.ended()
    }
}

/// An attachment being turned into a connection.
struct Opening {
    transport_cwd: String,
    session_id: SessionId,
    generation: Generation,
    rpc: Arc<Rpc>,
    reader: JoinHandle<()>,
    control: SessionControl,
}

impl Opening {
    fn new(transport: AgentTransport) -> Self {
        let AgentTransport {
            session_id,
            generation,
            cwd,
            reader,
            writer,
            control,
            ..
        } = transport;
        let (rpc, reader) = Rpc::start(writer, reader);
        Self {
            transport_cwd: cwd,
            session_id,
            generation,
            rpc,
            reader,
            control,
        }
    }

    /// Gives up on the new worker: the guide's `release_failed_start` (docs/openab-core.md §5.2),
    /// `suspend(Hung)`, which kills it without grace and keeps storage; a kill if that fails.
    async fn discard(self, sessions: &ThreadSessions) {
        let id = self.control.session_id();
        if sessions
            .runtime()
            .suspend(&id, SuspendReason::Hung)
            .await
            .is_err()
        {
            let _ = self.control.kill().await;
        }
        self.reader.abort();
    }
}

/// What the pool knows about one thread's live connection, for tests and the demo.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionInfo {
    /// The runtime session.
    pub(crate) session_id: SessionId,
    /// The worker's generation.
    pub(crate) generation: Generation,
    /// The worker's id, as the runtime reports it.
    pub(crate) worker_id: String,
    /// The agent's working directory inside the worker.
    pub(crate) cwd: String,
    /// The ACP session id.
    pub(crate) acp_session_id: String,
    /// How the ACP session came to be.
    pub(crate) opened: Opened,
    /// Whether the worker runs and the reader reads.
    pub(crate) alive: bool,
    /// Whether a turn holds the connection.
    pub(crate) busy: bool,
    /// When the connection was last used.
    pub(crate) last_active: Instant,
}

/// The result of a prompt turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Turn {
    /// The agent's stop reason (`end_turn`, `cancelled`, ...).
    pub(crate) stop_reason: String,
    /// The text of every `agent_message_chunk` of the turn, in order.
    pub(crate) chunks: Vec<String>,
    /// Whether this turn is the first after the thread's ACP session was started over
    /// (upstream prepends "Session expired, starting fresh...").
    pub(crate) reset_notice: bool,
}

/// What the exec probe reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExecOutput {
    /// The exit code, if the command exited.
    pub(crate) exit_code: Option<i64>,
    /// Its standard output.
    pub(crate) stdout: String,
    /// Its standard error.
    pub(crate) stderr: String,
}

/// What one `cleanup_idle` pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Cleanup {
    /// Keys suspended for being idle (or dead), resumable with `session/load`.
    pub(crate) idle: Vec<String>,
    /// Keys whose turn was hung: worker killed, ACP session id dropped.
    pub(crate) hung: Vec<String>,
}

// ---------------------------------------------------------------------------------------------
// The pool
// ---------------------------------------------------------------------------------------------

/// The pool's maps, behind one lock that is never held across an `.await`.
#[derive(Default)]
struct PoolState {
    /// Live connections.
    active: HashMap<String, Arc<Connection>>,
    /// Key → ACP session id of live and suspended threads: what goes to [`THREAD_MAP`].
    persisted: HashMap<String, String>,
    /// The per-key creation gates. Never removed: concurrency control, not session state.
    creating: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
}

/// openab-core's `SessionPool`, over a [`SessionRuntime`] instead of child processes.
pub(crate) struct SessionPool {
    sessions: ThreadSessions,
    config: PoolConfig,
    state: Mutex<PoolState>,
    /// Serializes writes of the thread map.
    saving: Mutex<()>,
    kill_before_next_load: AtomicBool,
}

impl fmt::Debug for SessionPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionPool")
            .field("sessions", &self.sessions)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl SessionPool {
    /// A pool over `sessions`, resuming the threads persisted in `config.state_dir` (a broker
    /// start). A corrupt thread map is ignored, as upstream does.
    ///
    /// # Errors
    /// [`PoolError::ThreadMap`] if the state directory cannot be created or the map cannot be read.
    pub(crate) fn new(sessions: ThreadSessions, config: PoolConfig) -> Result<Self, PoolError> {
        std::fs::create_dir_all(&config.state_dir)?;
        let persisted = match std::fs::read(config.state_dir.join(THREAD_MAP)) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_default(),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => HashMap::new(),
            Err(error) => return Err(error.into()),
        };
        Ok(Self {
            sessions,
            config,
            state: Mutex::new(PoolState {
                persisted,
                ..PoolState::default()
            }),
            saving: Mutex::default(),
            kill_before_next_load: AtomicBool::new(false),
        })
    }

    /// The sessions the pool opens.
    pub(crate) fn sessions(&self) -> &ThreadSessions {
        &self.sessions
    }

    /// Where the thread map is saved.
    pub(crate) fn thread_map_path(&self) -> PathBuf {
        self.config.state_dir.join(THREAD_MAP)
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        lock(&self.state)
    }

    fn gate(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(self.state().creating.entry(key.to_owned()).or_default())
    }

    fn connection(&self, key: &str) -> Result<Arc<Connection>, PoolError> {
        self.state()
            .active
            .get(key)
            .cloned()
            .ok_or_else(|| PoolError::NoSession(key.to_owned()))
    }

    /// Saves the current key → ACP session id map, atomically (upstream: `*.json.tmp`, then
    /// `rename`). Saves are serialized and each writes the map as it is when it starts, so the
    /// file never goes back to an older map.
    fn save(&self) -> Result<(), PoolError> {
        let _saving = lock(&self.saving);
        let persisted: BTreeMap<String, String> = self.state().persisted.clone().into_iter().collect();
        let path = self.thread_map_path();
        let temporary = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(&persisted).map_err(std::io::Error::other)?;
        std::fs::write(&temporary, text)?;
        std::fs::rename(&temporary, &path)?;
        Ok(())
    }

    /// Test fault: the next `get_or_create` kills its new worker right before `session/load`,
    /// so the load fails the way a worker lost mid-resume does.
    pub(crate) fn kill_worker_before_next_load(&self) {
        self.kill_before_next_load.store(true, Ordering::SeqCst);
    }

    /// Makes sure `key` has a live connection; returns whether its session is *fresh* (nothing
    /// live and nothing persisted before), which is when upstream applies `[[...]]` directives.
    ///
    /// Same-key calls are serialized by the key's creation gate. An existing connection that is
    /// busy or alive is kept. A dead one is replaced: the session is opened again (a new
    /// generation) and resumed with `session/load`. At `max_sessions`, the least recently active
    /// idle connection is suspended ([`PoolPath::CapacityEviction`]).
    ///
    /// # Errors
    /// - [`PoolError::ResumeFailed`] if `session/load` failed transiently; the persisted ACP
    ///   session id is kept for the next call.
    /// - [`PoolError::Exhausted`] if the pool is full of busy connections.
    /// - [`PoolError::Acp`] if opening the session or an ACP request failed.
    pub(crate) async fn get_or_create(&self, key: &str) -> Result<bool, PoolError> {
        let gate = self.gate(key);
        let _creating = gate.lock().await;

        let (existing, saved) = {
            let state = self.state();
            (state.active.get(key).cloned(), state.persisted.get(key).cloned())
        };
        let had_existing = existing.is_some();
        if let Some(connection) = existing {
            if connection.is_busy() || connection.is_alive() {
                return Ok(false);
            }
            // Dead: forget it; its persisted ACP session id is loaded into the replacement.
            let mut state = self.state();
            if state
                .active
                .get(key)
                .is_some_and(|current| Arc::ptr_eq(current, &connection))
            {
                state.active.remove(key);
            }
        }
        if self.full_of_busy_connections(key) {
            return Err(PoolError::Exhausted(self.config.max_sessions));
        }

        let opening = Opening::new(self.sessions.open(key, &CreateOptions::new()).await?);
        let (acp_session_id, opened) = match self.start_acp_session(&opening, saved.as_deref()).await {
            Ok(started) => started,
            Err(error) => {
                opening.discard(&self.sessions).await;
                return Err(error);
            }
        };
        let reset_notice = opened != Opened::Loaded && (had_existing || saved.is_some());
        let Opening {
            transport_cwd,
            session_id,
            generation,
            rpc,
            reader,
            control,
        } = opening;
        let connection = Arc::new(Connection {
            session_id,
            generation,
            cwd: transport_cwd,
            acp_session_id: acp_session_id.clone(),
            opened,
            rpc,
            reader,
            control,
            turn: Arc::default(),
            activity: Activity::new(),
            reset_notice: AtomicBool::new(reset_notice),
        });

        let inserted = self.insert(key, connection, acp_session_id);
        let victim = match inserted {
            Inserted::Yes { victim } => victim,
            Inserted::Full(_connection) => {
                // Every other connection became busy while this one was opened: no room for it.
                self.sessions.end(key, PoolPath::CapacityEviction).await?;
                return Err(PoolError::Exhausted(self.config.max_sessions));
            }
        };
        let evicted = match victim {
            // The victim's ACP session id stays persisted: the next message resumes it.
            Some(victim) => self.sessions.end(&victim.key, PoolPath::CapacityEviction).await,
            None => Ok(()),
        };
        self.save()?;
        evicted?;
        Ok(!had_existing && saved.is_none())
    }

    /// Inserts `key`'s new connection, taking the least recently active idle connection out of
    /// the pool if it is full.
    fn insert(&self, key: &str, connection: Arc<Connection>, acp_session_id: String) -> Inserted {
        let mut state = self.state();
        let mut victim = None;
        if state.active.len() >= self.config.max_sessions {
            match evictable(&state, key) {
                Some(chosen) => {
                    state.active.remove(&chosen.key);
                    victim = Some(chosen);
                }
                None => return Inserted::Full(connection),
            }
        }
        state.active.insert(key.to_owned(), connection);
        state.persisted.insert(key.to_owned(), acp_session_id);
        Inserted::Yes { victim }
    }

    /// Whether the pool is full and nothing but `key` could make room (every other connection
    /// is busy or being created). Checked before a worker is started for nothing.
    fn full_of_busy_connections(&self, key: &str) -> bool {
        let state = self.state();
        state.active.len() >= self.config.max_sessions && evictable(&state, key).is_none()
    }

    /// `initialize`, then `session/load` of `saved` if the agent can, else `session/new`.
    async fn start_acp_session(
        &self,
        opening: &Opening,
        saved: Option<&str>,
    ) -> Result<(String, Opened), PoolError> {
        let timeout = Some(self.config.request_timeout);
        let init = json!({
            "protocolVersion": 1,
            "clientCapabilities": {},
            "clientInfo": {"name": "openab-pool-harness", "version": env!("CARGO_PKG_VERSION")},
        });
        let answer = opening.rpc.call("initialize", init, timeout).await?;
        let supports_load = answer
            .pointer("/agentCapabilities/loadSession")
            .and_then(Value::as_bool)
            .unwrap_or(false);

        let mut opened = Opened::New;
        if let (Some(saved), true) = (saved, supports_load) {
            if self.kill_before_next_load.swap(false, Ordering::SeqCst) {
                let _ = opening.control.kill().await;
            }
            let params = json!({"sessionId": saved, "cwd": opening.transport_cwd, "mcpServers": []});
            match opening.rpc.call("session/load", params, timeout).await {
                Ok(_) => return Ok((saved.to_owned(), Opened::Loaded)),
                Err(error) if error.is_transient() => return Err(PoolError::ResumeFailed(error)),
                Err(AcpCallError::Rpc { code, .. }) => {
                    opened = Opened::NewAfterFailedLoad { rpc_code: Some(code) }
                }
                Err(_) => opened = Opened::NewAfterFailedLoad { rpc_code: None },
            }
        }
        let params = json!({"cwd": opening.transport_cwd, "mcpServers": []});
        let answer = opening
            .rpc
            .call("session/new", params, Some(self.config.new_session_timeout))
            .await?;
        let acp_session_id =
            answer
                .get("sessionId")
                .and_then(Value::as_str)
                .ok_or_else(|| PoolError::Malformed {
                    method: "session/new".into(),
                    detail: "no sessionId".into(),
                })?;
        Ok((acp_session_id.to_owned(), opened))
    }

    /// Runs one prompt turn on `key`'s connection and collects its message chunks.
    ///
    /// # Errors
    /// [`PoolError::NoSession`] without a live connection; [`PoolError::Acp`] if the turn failed
    /// (e.g. [`AcpCallError::ChannelClosed`] when the worker died under it).
    pub(crate) async fn prompt(&self, key: &str, text: &str) -> Result<Turn, PoolError> {
        self.prompt_with(key, text, |_| {}).await
    }

    /// Like [`prompt`](Self::prompt), calling `on_chunk` with each chunk as it streams in.
    pub(crate) async fn prompt_with(
        &self,
        key: &str,
        text: &str,
        mut on_chunk: impl FnMut(&str) + Send,
    ) -> Result<Turn, PoolError> {
        let connection = self.connection(key)?;
        let _turn = Arc::clone(&connection.turn).lock_owned().await;
        let reset_notice = connection.reset_notice.swap(false, Ordering::AcqRel);
        let (subscriber, mut updates) = mpsc::unbounded_channel();
        *lock(&connection.rpc.subscriber) = Some(subscriber);
        connection.activity.start_turn();
        let _in_flight = InFlight(&connection);

        let params = json!({
            "sessionId": connection.acp_session_id,
            "prompt": [{"type": "text", "text": text}],
        });
        let answer = connection.rpc.call("session/prompt", params, None);
        tokio::pin!(answer);
        let mut chunks = Vec::new();
        let mut take = |update: Value| {
            if let Some(text) = chunk_text(&update, &connection.acp_session_id) {
                on_chunk(&text);
                chunks.push(text);
            }
        };
        let answer = loop {
            tokio::select! {
                Some(update) = updates.recv() => take(update),
                answer = &mut answer => break answer,
            }
        };
        // The agent sends a turn's chunks before its answer: whatever is queued belongs to it.
        while let Ok(update) = updates.try_recv() {
            take(update);
        }
        let answer = answer?;
        let stop_reason =
            answer
                .get("stopReason")
                .and_then(Value::as_str)
                .ok_or_else(|| PoolError::Malformed {
                    method: "session/prompt".into(),
                    detail: "no stopReason".into(),
                })?;
        Ok(Turn {
            stop_reason: stop_reason.to_owned(),
            chunks,
            reset_notice,
        })
    }

    /// Cancels `key`'s turn in flight, without waiting for the turn's lock (upstream
    /// `cancel_session`: `session/cancel` through the lock-free handle).
    ///
    /// # Errors
    /// [`PoolError::NoSession`] without a live connection; [`PoolError::Acp`] if the agent's stdin
    /// is gone or did not take the line in time.
    pub(crate) async fn cancel(&self, key: &str) -> Result<(), PoolError> {
        let (control, acp_session_id) = {
            let state = self.state();
            let connection = state
                .active
                .get(key)
                .ok_or_else(|| PoolError::NoSession(key.to_owned()))?;
            (connection.control.clone(), connection.acp_session_id.clone())
        };
        control.cancel(&acp_session_id).await?;
        Ok(())
    }

    /// Runs `command` with `/bin/sh -c` inside `key`'s worker, in its working directory (the
    /// test agent's exec probe; it stands in for the agent editing files).
    ///
    /// # Errors
    /// As [`prompt`](Self::prompt).
    pub(crate) async fn exec(&self, key: &str, command: &str) -> Result<ExecOutput, PoolError> {
        let connection = self.connection(key)?;
        let params = json!({"command": command, "cwd": connection.cwd});
        let answer = connection
            .rpc
            .call(EXEC_METHOD, params, Some(self.config.request_timeout))
            .await?;
        let text = |field: &str| {
            answer
                .get(field)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        Ok(ExecOutput {
            exit_code: answer.get("exitCode").and_then(Value::as_i64),
            stdout: text("stdout"),
            stderr: text("stderr"),
        })
    }

    /// Suspends idle (or dead) connections and evicts hung ones (upstream: every 60 s).
    ///
    /// - Not busy, and unused for `ttl` or dead: [`PoolPath::IdleEviction`]; the ACP session id
    ///   stays persisted, so the next message resumes with `session/load`.
    /// - Busy with a turn in flight for longer than the hung threshold: [`SessionControl::kill`]
    ///   without grace, then [`PoolPath::HungEviction`]; the ACP session id is dropped, because
    ///   the old worker may have owned the turn. (Upstream first sends a best-effort
    ///   `session/cancel` and kills 10 s later; an agent that is hung does not read it.)
    ///
    /// A key whose creation gate is held is left for the next pass.
    ///
    /// # Errors
    /// The first runtime or thread map error; the other keys are still handled.
    pub(crate) async fn cleanup_idle(&self, ttl: Duration) -> Result<Cleanup, PoolError> {
        let snapshot: Vec<(String, Arc<Connection>)> = self
            .state()
            .active
            .iter()
            .map(|(key, connection)| (key.clone(), Arc::clone(connection)))
            .collect();
        let mut done = Cleanup::default();
        let mut first_error = None;
        for (key, connection) in snapshot {
            let path = if connection.is_busy() {
                match connection.activity.turn_age() {
                    Some(age) if age >= self.config.hung_threshold => PoolPath::HungEviction,
                    _ => continue,
                }
            } else if !connection.is_alive() || connection.activity.last_active().elapsed() >= ttl {
                PoolPath::IdleEviction
            } else {
                continue;
            };
            let Ok(_gate) = self.gate(&key).try_lock_owned() else {
                continue;
            };
            // An idle connection is held while it is suspended: a turn that starts meanwhile
            // waits, then fails with a typed error instead of losing its worker mid-turn.
            let _idle_turn = match path {
                PoolPath::IdleEviction => match Arc::clone(&connection.turn).try_lock_owned() {
                    Ok(turn) => Some(turn),
                    Err(_) => continue,
                },
                _ => None,
            };
            {
                let mut state = self.state();
                if !state
                    .active
                    .get(&key)
                    .is_some_and(|current| Arc::ptr_eq(current, &connection))
                {
                    continue;
                }
                state.active.remove(&key);
                if path == PoolPath::HungEviction {
                    state.persisted.remove(&key);
                }
            }
            if path == PoolPath::HungEviction {
                // Lock-free, while the stuck turn still holds the connection.
                let _ = connection.control.kill().await;
            }
            let ended = self.sessions.end(&key, path).await;
            match path {
                PoolPath::HungEviction => done.hung.push(key),
                _ => done.idle.push(key),
            }
            if let Err(error) = ended {
                first_error.get_or_insert(PoolError::from(error));
            }
        }
        if let Err(error) = self.save() {
            first_error.get_or_insert(error);
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(done),
        }
    }

    /// Resets `key`: `session/cancel` for a turn in flight first, then [`PoolPath::ExplicitReset`]
    /// (the session's storage goes per the retention policy). The next message starts fresh.
    ///
    /// Unlike upstream, which errs when nothing is live, a suspended thread is reset too.
    ///
    /// # Errors
    /// [`PoolError::NoSession`] if the key had neither a live nor a persisted session (the
    /// runtime is still asked to close it); runtime errors of the close.
    pub(crate) async fn reset(&self, key: &str) -> Result<(), PoolError> {
        self.end_thread(key, PoolPath::ExplicitReset).await
    }

    /// The thread was archived (or an administrator closed it): as [`reset`](Self::reset), with
    /// [`PoolPath::ThreadArchived`] (`close(Ended)`).
    ///
    /// # Errors
    /// As for [`reset`](Self::reset).
    pub(crate) async fn archive(&self, key: &str) -> Result<(), PoolError> {
        self.end_thread(key, PoolPath::ThreadArchived).await
    }

    /// Ends `key`'s session by `path`: `session/cancel` for a turn in flight first, then the
    /// path's close; its ACP session id is forgotten.
    async fn end_thread(&self, key: &str, path: PoolPath) -> Result<(), PoolError> {
        let gate = self.gate(key);
        let _creating = gate.lock().await;
        let (connection, had_persisted) = {
            let mut state = self.state();
            (state.active.remove(key), state.persisted.remove(key).is_some())
        };
        self.save()?;
        if let Some(connection) = &connection {
            let _ = connection.control.cancel(&connection.acp_session_id).await;
        }
        self.sessions.end(key, path).await?;
        if connection.is_none() && !had_persisted {
            return Err(PoolError::NoSession(key.to_owned()));
        }
        Ok(())
    }

    /// Broker shutdown: persists every live thread's ACP session id and suspends its session
    /// ([`PoolPath::BrokerShutdown`]). Returns the keys it suspended.
    ///
    /// Unlike upstream, it does not wait for turns in flight (upstream awaits every connection
    /// mutex without a bound and can hang behind a stuck turn).
    ///
    /// # Errors
    /// The first runtime or thread map error; every key is still handled.
    pub(crate) async fn shutdown(&self) -> Result<Vec<String>, PoolError> {
        let connections: Vec<_> = {
            let mut state = self.state();
            let connections: Vec<_> = state.active.drain().collect();
            for (key, connection) in &connections {
                state
                    .persisted
                    .insert(key.clone(), connection.acp_session_id.clone());
            }
            connections
        };
        let mut first_error = self.save().err();
        let mut keys = Vec::new();
        for (key, _connection) in connections {
            if let Err(error) = self.sessions.end(&key, PoolPath::BrokerShutdown).await {
                first_error.get_or_insert(error.into());
            }
            keys.push(key);
        }
        keys.sort();
        match first_error {
            Some(error) => Err(error),
            None => Ok(keys),
        }
    }

    /// What the pool knows about `key`'s live connection.
    pub(crate) fn info(&self, key: &str) -> Option<ConnectionInfo> {
        let connection = self.state().active.get(key).cloned()?;
        let (worker_id, _) = connection.control.worker();
        Some(ConnectionInfo {
            session_id: connection.session_id,
            generation: connection.generation,
            worker_id: worker_id.to_owned(),
            cwd: connection.cwd.clone(),
            acp_session_id: connection.acp_session_id.clone(),
            opened: connection.opened.clone(),
            alive: connection.is_alive(),
            busy: connection.is_busy(),
            last_active: connection.activity.last_active(),
        })
    }

    /// The lock-free control handle of `key`'s live connection (to kill a worker out of band).
    pub(crate) fn control(&self, key: &str) -> Option<SessionControl> {
        self.state()
            .active
            .get(key)
            .map(|connection| connection.control.clone())
    }

    /// The ACP session id persisted for `key` (live or suspended).
    pub(crate) fn persisted(&self, key: &str) -> Option<String> {
        self.state().persisted.get(key).cloned()
    }

    /// When `key`'s connection was last used.
    pub(crate) fn last_active(&self, key: &str) -> Option<Instant> {
        self.state()
            .active
            .get(key)
            .map(|connection| connection.activity.last_active())
    }

    /// The keys with a live connection, sorted.
    pub(crate) fn active_keys(&self) -> Vec<String> {
        let mut keys: Vec<_> = self.state().active.keys().cloned().collect();
        keys.sort();
        keys
    }
}

/// A connection chosen to make room, held (its creation gate and its turn lock) while it is
/// suspended, so that neither a creation nor a turn can start on it meanwhile.
struct Victim {
    key: String,
    _gate: OwnedMutexGuard<()>,
    _turn: OwnedMutexGuard<()>,
}

/// The least recently active connection other than `key` that neither a turn nor a creation
/// holds.
fn evictable(state: &PoolState, key: &str) -> Option<Victim> {
    let mut candidates: Vec<_> = state
        .active
        .iter()
        .filter(|(other, _)| other.as_str() != key)
        .map(|(other, connection)| {
            (
                connection.activity.last_active(),
                other.clone(),
                Arc::clone(connection),
            )
        })
        .collect();
    candidates.sort_by_key(|(last_active, ..)| *last_active);
    candidates.into_iter().find_map(|(_, other, connection)| {
        let turn = Arc::clone(&connection.turn).try_lock_owned().ok()?;
        let gate = state.creating.get(&other).cloned()?.try_lock_owned().ok()?;
        Some(Victim {
            key: other,
            _gate: gate,
            _turn: turn,
        })
    })
}

/// What [`SessionPool::insert`] did.
enum Inserted {
    /// Inserted; the connection to suspend for room, if one had to go.
    Yes { victim: Option<Victim> },
    /// The pool is full of busy connections; the new one is handed back.
    Full(Arc<Connection>),
}

/// Marks the end of a turn however the turn's future ends (answered, failed or dropped).
struct InFlight<'a>(&'a Connection);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        lock(&self.0.rpc.subscriber).take();
        self.0.activity.end_turn();
    }
}

/// The text of an `agent_message_chunk` update of `acp_session_id`.
fn chunk_text(update: &Value, acp_session_id: &str) -> Option<String> {
    let params = update.get("params")?;
    if params.get("sessionId").and_then(Value::as_str) != Some(acp_session_id) {
        return None;
    }
    let update = params.get("update")?;
    if update.get("sessionUpdate").and_then(Value::as_str) != Some("agent_message_chunk") {
        return None;
    }
    update
        .pointer("/content/text")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

// ---------------------------------------------------------------------------------------------
// RecordingRuntime
// ---------------------------------------------------------------------------------------------

/// A lifecycle operation, with its reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// `create`.
    Create,
    /// `attach` (a new generation).
    Attach,
    /// `suspend(reason)`.
    Suspend(SuspendReason),
    /// `close(reason)`.
    Close(CloseReason),
}

impl Op {
    /// The operation a pool path makes ([`PoolPath::call`]).
    pub(crate) fn of(path: PoolPath) -> Op {
        match path.call() {
            RuntimeCall::Suspend(reason) => Op::Suspend(reason),
            RuntimeCall::Close(reason) => Op::Close(reason),
            // `RuntimeCall` is non-exhaustive: a new kind of call needs a new `Op`.
            other => panic!("the harness does not know the runtime call {other}"),
        }
    }
}

/// One recorded lifecycle call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LifecycleCall {
    /// What was called, with its reason.
    pub(crate) op: Op,
    /// On which session.
    pub(crate) session: SessionId,
    /// Whether it succeeded.
    pub(crate) ok: bool,
}

/// A [`SessionRuntime`] that forwards every method to `inner` and records each lifecycle call
/// (`create`, `attach`, `suspend`, `close`) with its session and reason.
#[derive(Debug)]
pub(crate) struct RecordingRuntime {
    inner: Arc<dyn SessionRuntime>,
    calls: Mutex<Vec<LifecycleCall>>,
}

impl RecordingRuntime {
    /// Records the calls made to `inner`.
    pub(crate) fn new(inner: Arc<dyn SessionRuntime>) -> Self {
        Self {
            inner,
            calls: Mutex::default(),
        }
    }

    /// Every call so far, in the order they finished.
    pub(crate) fn calls(&self) -> Vec<LifecycleCall> {
        lock(&self.calls).clone()
    }

    /// The operations made on `session`, in order.
    pub(crate) fn ops(&self, session: &SessionId) -> Vec<Op> {
        lock(&self.calls)
            .iter()
            .filter(|call| call.session == *session)
            .map(|call| call.op)
            .collect()
    }

    fn record<T>(&self, op: Op, session: SessionId, result: &openab_runtime::Result<T>) {
        lock(&self.calls).push(LifecycleCall {
            op,
            session,
            ok: result.is_ok(),
        });
    }
}

#[async_trait]
impl SessionRuntime for RecordingRuntime {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn create(
        &self,
        identity: &SessionIdentity,
        options: &CreateOptions,
    ) -> openab_runtime::Result<SessionHandle> {
        let result = self.inner.create(identity, options).await;
        self.record(Op::Create, identity.id(), &result);
        result
    }

    async fn attach(&self, id: &SessionId) -> openab_runtime::Result<Attachment> {
        let result = self.inner.attach(id).await;
        self.record(Op::Attach, *id, &result);
        result
    }

    async fn suspend(&self, id: &SessionId, reason: SuspendReason) -> openab_runtime::Result<()> {
        let result = self.inner.suspend(id, reason).await;
        self.record(Op::Suspend(reason), *id, &result);
        result
    }

    async fn close(&self, id: &SessionId, reason: CloseReason) -> openab_runtime::Result<()> {
        let result = self.inner.close(id, reason).await;
        self.record(Op::Close(reason), *id, &result);
        result
    }

    async fn status(&self, id: &SessionId) -> openab_runtime::Result<SessionStatus> {
        self.inner.status(id).await
    }

    async fn list(&self) -> openab_runtime::Result<Vec<SessionStatus>> {
        self.inner.list().await
    }

    async fn reconcile(&self) -> openab_runtime::Result<ReconcileReport> {
        self.inner.reconcile().await
    }
}
