//! A scriptable ACP (Agent Client Protocol) agent for tests.
//!
//! The agent speaks newline-delimited JSON-RPC 2.0: every message is one line
//! of JSON terminated by `\n`. It can be run as the `acp-test-agent` binary
//! (serving stdin/stdout) or in-process through [`serve`] over any pair of
//! async streams, e.g. [`tokio::io::duplex`].
//!
//! # Methods
//!
//! - `initialize`: answers protocol version 1, `loadSession: true` and
//!   `agentInfo {name, version}`.
//! - `session/new` `{cwd, mcpServers}`: `cwd` must be absolute (else
//!   `-32602`). Returns a fresh `sessionId`. With
//!   [`AgentOptions::state_dir`] set, a file named by the session id and
//!   holding the cwd is written there (best effort), so a later process can
//!   load the session.
//! - `session/load` `{sessionId, cwd, mcpServers}`: for a known session (in
//!   memory or in the state directory) sends one `agent_message_chunk`
//!   `"loaded <id>"` and answers `null`; unknown sessions get `-32002`.
//! - `session/prompt` `{sessionId, prompt}`: streams
//!   `session/update` `agent_message_chunk` notifications, then answers
//!   `{"stopReason": "end_turn"}` (or `"cancelled"`). The text of the prompt's
//!   text blocks is concatenated; it may start with directives, whitespace
//!   separated, each optional, followed by the message:
//!   - `/chunks=N`: number of chunks (default [`AgentOptions::chunks`]);
//!   - `/delay_ms=N`: pause between chunks (default
//!     [`AgentOptions::chunk_delay`]);
//!   - `/size=N`: append `N` bytes of `x` filler to every chunk;
//!   - `/permission`: first ask the client with `session/request_permission`
//!     (options `allow` / allow_once and `reject` / reject_once).
//!
//!   Directive parsing stops at the first token that is not a directive; a
//!   directive with a malformed value is `-32602`. Chunk `i` (from 0) has the
//!   text `"echo[i]: <message>"` followed directly by the filler. After an
//!   `allow` the first chunk is prefixed with `"permission: allow; "`; after
//!   any other selected option `o`, or a `cancelled` outcome, exactly one chunk
//!   `"permission: o"` / `"permission: cancelled"` is sent and the turn ends
//!   with `end_turn`.
//! - `session/cancel` `{sessionId}` (notification): the turns in progress for
//!   the session stop at the next chunk boundary (a pending delay or
//!   permission wait is interrupted at once) and answer
//!   `{"stopReason": "cancelled"}`.
//! - [`EXEC_METHOD`] `{"command", "cwd"?, "timeout_ms"?}`: runs
//!   `/bin/sh -c <command>` in the agent's own environment and answers
//!   `{"exitCode", "signal", "stdout", "stderr", "timedOut"}`.
//!
//! Malformed input never stops the agent: unparsable JSON is answered with
//! `-32700` (id `null`), invalid envelopes with `-32600`, unknown methods
//! with `-32601` (unknown notifications are ignored), bad parameters with
//! `-32602`. Responses with unknown ids and blank lines are ignored. Lines
//! longer than 64 MiB are skipped and answered with `-32600`.

mod directives;
mod exec;
mod rpc;
#[cfg(target_os = "linux")]
mod sockets;

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agent_client_protocol_schema::v1::{
    AgentCapabilities, CancelNotification, ContentBlock, ContentChunk, Error as RpcError, Implementation,
    InitializeRequest, InitializeResponse, LoadSessionRequest, NewSessionRequest, NewSessionResponse,
    PermissionOption, PermissionOptionKind, PromptRequest, PromptResponse, RequestPermissionOutcome,
    RequestPermissionRequest, RequestPermissionResponse, SessionId, SessionNotification, SessionUpdate,
    StopReason, ToolCallStatus, ToolCallUpdate, ToolCallUpdateFields, ToolKind, AGENT_METHOD_NAMES,
    CLIENT_METHOD_NAMES,
};
use agent_client_protocol_schema::ProtocolVersion;
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;

use crate::rpc::Incoming;

/// Method name of the test-only exec extension request.
///
/// Request params: `{"command": "<shell string>", "cwd": "<absolute path>"?,
/// "timeout_ms": <u64>?}` (`timeoutMs` is accepted too). The command runs as
/// `/bin/sh -c <command>` with stdin from `/dev/null`, in `cwd`, else
/// [`AgentOptions::exec_dir`], else the agent's working directory, with the
/// agent's own environment, uid and namespaces. When `timeout_ms` elapses the
/// command is killed (`SIGKILL`).
///
/// Result: `{"exitCode": i32 | null, "signal": i32 | null, "stdout": string,
/// "stderr": string, "timedOut": bool}`; output is decoded as lossy UTF-8.
/// A relative `cwd` or a missing `command` is `-32602`; failing to start the
/// shell (e.g. `cwd` does not exist) is `-32603`.
pub const EXEC_METHOD: &str = "_openab/exec";

/// Method name of the test-only listen extension request (Linux only).
///
/// Request params: `{"kind": "tcp" | "abstract", "address": "<IP:PORT> | <name>", "reply":
/// "<text>"}`. The agent listens on the TCP address (port 0: a free port) or on the abstract
/// UNIX socket of that name (without the leading NUL), from its own environment, uid and
/// namespaces, and answers every connection with `reply`, then closes it, until it exits.
///
/// Result: `{"address": "<bound address>"}` (a TCP address with the port it got). Bad params are
/// `-32602`; failing to listen is `-32603`.
pub const LISTEN_METHOD: &str = "_openab/listen";

/// Method name of the test-only connect extension request (Linux only).
///
/// Request params: `{"kind": "tcp" | "abstract", "address": "<IP:PORT> | <name>",
/// "timeout_ms": <u64>?}` (default 5 s, at most 20 s). The agent connects from its own
/// environment and reads until the other end closes.
///
/// Result: `{"connected": bool, "received": string, "error": string | null, "errno": i32 |
/// null}`: a refused connection (`errno` 111 for `ECONNREFUSED`, 1 for `EPERM`) is a result. A
/// malformed address is `-32603`.
pub const CONNECT_METHOD: &str = "_openab/connect";

/// Longest accepted input line; longer lines are skipped and answered with
/// `-32600`.
pub const MAX_LINE_BYTES: usize = 64 * 1024 * 1024;

/// How the agent behaves; see the crate documentation for the protocol.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Keep running after stdin EOF, as real agents do. When `false` (the
    /// default), [`serve`] lets in-flight work finish, flushes its output and
    /// returns `Ok(())` on EOF. When `true`, the future stays pending until it
    /// is dropped (in-flight turns still complete).
    pub ignore_stdin_eof: bool,
    /// Default number of `session/update` chunks per prompt turn (default 3).
    pub chunks: usize,
    /// Default pause between two chunks (default zero).
    pub chunk_delay: Duration,
    /// Directory where session ids are persisted so `session/load` works
    /// after a restart; `None` keeps sessions in memory only.
    pub state_dir: Option<PathBuf>,
    /// Working directory for [`EXEC_METHOD`] probes without a `cwd`; `None`
    /// uses the process working directory.
    pub exec_dir: Option<PathBuf>,
    /// The `agentInfo.name` reported by `initialize` (default
    /// `"acp-test-agent"`).
    pub name: String,
}

impl Default for AgentOptions {
    fn default() -> Self {
        Self {
            ignore_stdin_eof: false,
            chunks: 3,
            chunk_delay: Duration::ZERO,
            state_dir: None,
            exec_dir: None,
            name: "acp-test-agent".to_owned(),
        }
    }
}

/// Serves the ACP test agent: reads newline-delimited JSON-RPC from `input`,
/// writes responses and notifications to `output` (one flushed line each).
///
/// Requests are handled concurrently: prompt turns and exec probes run as
/// their own tasks, so `session/cancel` and permission responses are
/// processed while a turn is streaming. Must be called within a tokio
/// runtime. Returns `Ok(())` on input EOF unless
/// [`AgentOptions::ignore_stdin_eof`] is set; returns an error when reading
/// the input or writing the output fails. Dropping the future stops the agent
/// and everything it started.
pub async fn serve<R, W>(input: R, output: W, options: AgentOptions) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    run(input, output, options, false).await
}

/// Like [`serve`], and also writes one short line per handled message to
/// stderr (never to `output`). Used by the `acp-test-agent` binary. Logging
/// never blocks the agent: lines go through a background thread and are
/// dropped when stderr is slow or unread.
pub async fn serve_with_stderr_log<R, W>(input: R, output: W, options: AgentOptions) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    run(input, output, options, true).await
}

async fn run<R, W>(input: R, output: W, options: AgentOptions, log: bool) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (sender, receiver) = mpsc::unbounded_channel();
    let log = if log { stderr_logger() } else { None };
    let agent = Arc::new(Agent::new(options, log, sender));
    let writer = write_loop(output, receiver);
    let reader = read_loop(agent, input);
    tokio::pin!(writer, reader);
    let mut reading = true;
    loop {
        tokio::select! {
            // The writer ends with Ok only once every sender is gone, i.e.
            // after the reader and all its tasks finished.
            done = &mut writer => return done,
            done = &mut reader, if reading => {
                reading = false;
                done?;
            }
        }
    }
}

/// Starts a thread writing log lines to stderr, so that a slow or unread
/// stderr can neither block nor crash the agent. The thread ends when the
/// sender is dropped.
fn stderr_logger() -> Option<std::sync::mpsc::SyncSender<String>> {
    let (sender, receiver) = std::sync::mpsc::sync_channel::<String>(1024);
    std::thread::Builder::new()
        .name("acp-test-agent-log".to_owned())
        .spawn(move || {
            use std::io::Write;
            let mut stderr = std::io::stderr();
            for line in receiver {
                if stderr.write_all(line.as_bytes()).is_err() {
                    break;
                }
            }
        })
        .ok()
        .map(|_| sender)
}

/// Writes queued lines to `output`, flushing after each burst, until every
/// sender is dropped.
async fn write_loop<W>(mut output: W, mut lines: mpsc::UnboundedReceiver<String>) -> io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    while let Some(line) = lines.recv().await {
        output.write_all(line.as_bytes()).await?;
        while let Ok(line) = lines.try_recv() {
            output.write_all(line.as_bytes()).await?;
        }
        output.flush().await?;
    }
    output.flush().await?;
    output.shutdown().await
}

/// Result of reading one input line.
enum LineRead {
    /// `buffer` holds one line (without its newline).
    Line,
    /// A line longer than [`MAX_LINE_BYTES`] was skipped.
    TooLong,
    /// End of input.
    Eof,
}

/// Reads one line into `buffer` (cleared first), skipping over lines longer
/// than [`MAX_LINE_BYTES`] without buffering them. A final line without a
/// newline still counts as a line.
async fn next_line<R>(reader: &mut R, buffer: &mut Vec<u8>) -> io::Result<LineRead>
where
    R: AsyncBufRead + Unpin,
{
    buffer.clear();
    let mut too_long = false;
    let mut seen_any = false;
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok(match (too_long, seen_any) {
                (true, _) => LineRead::TooLong,
                (false, true) => LineRead::Line,
                (false, false) => LineRead::Eof,
            });
        }
        seen_any = true;
        let newline = available.iter().position(|&byte| byte == b'\n');
        let piece = &available[..newline.unwrap_or(available.len())];
        if !too_long {
            if buffer.len() + piece.len() > MAX_LINE_BYTES {
                too_long = true;
                buffer.clear();
                buffer.shrink_to(64 * 1024);
            } else {
                buffer.extend_from_slice(piece);
            }
        }
        let used = piece.len() + usize::from(newline.is_some());
        reader.consume(used);
        if newline.is_some() {
            return Ok(if too_long {
                LineRead::TooLong
            } else {
                LineRead::Line
            });
        }
    }
}

/// Reads and dispatches input until EOF, then applies the EOF policy.
async fn read_loop<R>(agent: Arc<Agent>, input: R) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let mut reader = BufReader::with_capacity(64 * 1024, input);
    let mut tasks = JoinSet::new();
    let mut buffer = Vec::new();
    loop {
        match next_line(&mut reader, &mut buffer).await? {
            LineRead::Eof => break,
            LineRead::TooLong => {
                agent.log("line longer than 64 MiB skipped");
                agent.send(rpc::error_line(
                    &Value::Null,
                    &RpcError::new(rpc::INVALID_REQUEST, "Invalid request: line longer than 64 MiB"),
                ));
            }
            LineRead::Line => {
                let line = buffer.trim_ascii();
                if !line.is_empty() {
                    agent.handle(rpc::classify(line), &mut tasks);
                }
            }
        }
        while tasks.try_join_next().is_some() {}
    }
    agent.log("input closed");
    agent.close_input();
    if agent.options.ignore_stdin_eof {
        // Keep the tasks (and the output) alive until this future is dropped.
        std::future::pending::<()>().await;
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// A way a permission request ended.
enum Permission {
    /// The client selected this option.
    Selected(String),
    /// The client answered `cancelled`, answered with an error, or the input
    /// closed before an answer came.
    Cancelled,
    /// `session/cancel` arrived while waiting.
    Interrupted,
}

/// Agent-initiated requests waiting for the client's response.
#[derive(Default)]
struct Pending {
    /// Input is closed: no response can arrive any more.
    closed: bool,
    /// Waiters by request id.
    waiters: HashMap<String, oneshot::Sender<Result<Value, Value>>>,
}

/// State shared by the reader and the per-request tasks.
struct Agent {
    options: AgentOptions,
    /// Log lines for the stderr thread, when logging.
    log: Option<std::sync::mpsc::SyncSender<String>>,
    out: mpsc::UnboundedSender<String>,
    /// Known sessions and their cwd.
    sessions: Mutex<HashMap<String, PathBuf>>,
    /// Turns in progress: session id -> turn number -> cancel signal.
    turns: Mutex<HashMap<String, HashMap<u64, watch::Sender<bool>>>>,
    pending: Mutex<Pending>,
    next_turn: AtomicU64,
    next_request: AtomicU64,
}

/// Counter making session ids unique within the process.
static SESSION_COUNTER: AtomicU64 = AtomicU64::new(0);

fn new_session_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos())
        .unwrap_or_default();
    let count = SESSION_COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{nanos:x}-{:x}-{count:x}", std::process::id())
}

/// Whether `id` can safely name a file in the state directory.
fn storable_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 200
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_' || byte == b'.')
}

/// Parses request params into a schema type, mapping failure to `-32602`.
fn parse_params<T: DeserializeOwned>(params: Value) -> Result<T, RpcError> {
    serde_json::from_value(params)
        .map_err(|err| RpcError::new(rpc::INVALID_PARAMS, format!("Invalid params: {err}")))
}

fn unknown_session(id: &str) -> RpcError {
    RpcError::new(rpc::RESOURCE_NOT_FOUND, format!("unknown session {id}")).data(json!({ "sessionId": id }))
}

/// Resolves once `cancel` is set (never, if its sender is gone).
async fn cancelled(cancel: &mut watch::Receiver<bool>) {
    if cancel.wait_for(|set| *set).await.is_err() {
        std::future::pending::<()>().await;
    }
}

impl Agent {
    fn new(
        options: AgentOptions,
        log: Option<std::sync::mpsc::SyncSender<String>>,
        out: mpsc::UnboundedSender<String>,
    ) -> Self {
        Self {
            options,
            log,
            out,
            sessions: Mutex::default(),
            turns: Mutex::default(),
            pending: Mutex::default(),
            next_turn: AtomicU64::new(0),
            next_request: AtomicU64::new(0),
        }
    }

    fn log(&self, what: &str) {
        if let Some(log) = &self.log {
            // Never wait for stderr: drop the line when the thread lags.
            let _ = log.try_send(format!("acp-test-agent: {what}\n"));
        }
    }

    fn send(&self, line: String) {
        // The writer only goes away when the output failed; serve is then
        // returning the error already.
        let _ = self.out.send(line);
    }

    fn reply(&self, id: &Value, outcome: Result<Value, RpcError>) {
        self.send(match outcome {
            Ok(result) => rpc::result_line(id, result),
            Err(error) => rpc::error_line(id, &error),
        });
    }

    fn message_chunk(&self, session: &SessionId, text: String) {
        let update = SessionNotification::new(
            session.clone(),
            SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::from(text))),
        );
        self.send(rpc::notification_line(
            CLIENT_METHOD_NAMES.session_update,
            rpc::to_value(&update),
        ));
    }

    /// Input is gone: pending permission requests resolve as cancelled and
    /// new ones are not sent.
    fn close_input(&self) {
        let mut pending = self.pending.lock();
        pending.closed = true;
        pending.waiters.clear();
    }

    fn handle(self: &Arc<Self>, incoming: Incoming, tasks: &mut JoinSet<()>) {
        match incoming {
            Incoming::Invalid { id, error } => {
                self.log(&format!("invalid message: {}", error.message));
                self.send(rpc::error_line(&id, &error));
            }
            Incoming::Response { id, outcome } => {
                self.log(&format!("response id={id}"));
                let waiter = id.as_str().and_then(|id| self.pending.lock().waiters.remove(id));
                if let Some(waiter) = waiter {
                    let _ = waiter.send(outcome);
                }
            }
            Incoming::Notification { method, params } => {
                self.log(&format!("notification {method}"));
                if method == AGENT_METHOD_NAMES.session_cancel {
                    if let Ok(cancel) = serde_json::from_value::<CancelNotification>(params) {
                        self.cancel(&cancel.session_id);
                    }
                }
            }
            Incoming::Request { id, method, params } => {
                self.log(&format!("request {method} id={id}"));
                self.request(id, &method, params, tasks);
            }
        }
    }

    fn request(self: &Arc<Self>, id: Value, method: &str, params: Value, tasks: &mut JoinSet<()>) {
        let names = &AGENT_METHOD_NAMES;
        if method == names.initialize {
            let outcome = self.initialize(params);
            self.reply(&id, outcome);
        } else if method == names.session_new {
            let outcome = self.new_session(params);
            self.reply(&id, outcome);
        } else if method == names.session_load {
            let outcome = self.load_session(params);
            self.reply(&id, outcome);
        } else if method == names.session_prompt {
            if let Err(error) = self.prompt(&id, params, tasks) {
                self.reply(&id, Err(error));
            }
        } else if method == names.session_cancel {
            // A cancel sent as a request still cancels; answer it politely.
            let outcome = parse_params::<CancelNotification>(params).map(|cancel| {
                self.cancel(&cancel.session_id);
                Value::Null
            });
            self.reply(&id, outcome);
        } else if method == EXEC_METHOD {
            self.exec(id, params, tasks);
        } else if method == LISTEN_METHOD || method == CONNECT_METHOD {
            self.socket_probe(id, method == LISTEN_METHOD, params, tasks);
        } else {
            self.reply(
                &id,
                Err(RpcError::new(
                    rpc::METHOD_NOT_FOUND,
                    format!("Method not found: {method}"),
                )),
            );
        }
    }

    fn initialize(&self, request: Value) -> Result<Value, RpcError> {
        let _request: InitializeRequest = parse_params(request)?;
        let response = InitializeResponse::new(ProtocolVersion::V1)
            .agent_capabilities(AgentCapabilities::new().load_session(true))
            .agent_info(Implementation::new(
                self.options.name.clone(),
                env!("CARGO_PKG_VERSION"),
            ));
        Ok(rpc::to_value(&response))
    }

    fn new_session(&self, request: Value) -> Result<Value, RpcError> {
        let request: NewSessionRequest = parse_params(request)?;
        if !request.cwd.is_absolute() {
            return Err(RpcError::new(
                rpc::INVALID_PARAMS,
                format!("Invalid params: cwd must be absolute: {}", request.cwd.display()),
            ));
        }
        let id = new_session_id();
        self.persist(&id, &request.cwd);
        self.sessions.lock().insert(id.clone(), request.cwd);
        Ok(rpc::to_value(&NewSessionResponse::new(id)))
    }

    /// Best effort: an unwritable state directory leaves the session in
    /// memory only.
    fn persist(&self, id: &str, cwd: &Path) {
        let Some(dir) = &self.options.state_dir else {
            return;
        };
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(dir.join(id), cwd.to_string_lossy().as_bytes()));
        if let Err(err) = written {
            self.log(&format!("cannot persist session {id}: {err}"));
        }
    }

    /// Whether the session is known, looking into the state directory when
    /// it is not in memory.
    fn known_session(&self, id: &str) -> bool {
        if self.sessions.lock().contains_key(id) {
            return true;
        }
        let Some(dir) = &self.options.state_dir else {
            return false;
        };
        if !storable_id(id) {
            return false;
        }
        match std::fs::read_to_string(dir.join(id)) {
            Ok(cwd) => {
                self.sessions
                    .lock()
                    .entry(id.to_owned())
                    .or_insert_with(|| PathBuf::from(cwd));
                true
            }
            Err(_) => false,
        }
    }

    fn load_session(&self, request: Value) -> Result<Value, RpcError> {
        let request: LoadSessionRequest = parse_params(request)?;
        if !request.cwd.is_absolute() {
            return Err(RpcError::new(
                rpc::INVALID_PARAMS,
                format!("Invalid params: cwd must be absolute: {}", request.cwd.display()),
            ));
        }
        let id = request.session_id;
        if !self.known_session(&id.0) {
            return Err(unknown_session(&id.0));
        }
        self.message_chunk(&id, format!("loaded {id}"));
        Ok(Value::Null)
    }

    fn cancel(&self, session: &SessionId) {
        if let Some(turns) = self.turns.lock().get(&*session.0) {
            for signal in turns.values() {
                signal.send_replace(true);
            }
        }
    }

    fn prompt(self: &Arc<Self>, id: &Value, request: Value, tasks: &mut JoinSet<()>) -> Result<(), RpcError> {
        let request: PromptRequest = parse_params(request)?;
        let session = request.session_id;
        if !self.sessions.lock().contains_key(&*session.0) {
            return Err(unknown_session(&session.0));
        }
        let text: String = request
            .prompt
            .iter()
            .filter_map(|block| match block {
                ContentBlock::Text(text) => Some(text.text.as_str()),
                _ => None,
            })
            .collect();
        let plan = directives::parse(&text, self.options.chunks, self.options.chunk_delay)
            .map_err(|err| RpcError::new(rpc::INVALID_PARAMS, format!("Invalid params: {err}")))?;

        // Register before spawning so that a cancel right behind the prompt
        // finds the turn.
        let turn = self.next_turn.fetch_add(1, Ordering::Relaxed);
        let (signal, cancel) = watch::channel(false);
        self.turns
            .lock()
            .entry(session.0.to_string())
            .or_default()
            .insert(turn, signal);

        let agent = Arc::clone(self);
        let id = id.clone();
        tasks.spawn(async move {
            let stop = agent.turn(&session, plan, cancel).await;
            {
                let mut turns = agent.turns.lock();
                if let Some(session_turns) = turns.get_mut(&*session.0) {
                    session_turns.remove(&turn);
                    if session_turns.is_empty() {
                        turns.remove(&*session.0);
                    }
                }
            }
            agent.reply(&id, Ok(rpc::to_value(&PromptResponse::new(stop))));
        });
        Ok(())
    }

    async fn turn(
        &self,
        session: &SessionId,
        plan: directives::TurnPlan,
        mut cancel: watch::Receiver<bool>,
    ) -> StopReason {
        let mut prefix = "";
        if plan.permission {
            match self.ask_permission(session, &mut cancel).await {
                Permission::Interrupted => return StopReason::Cancelled,
                Permission::Selected(option) if option == "allow" => prefix = "permission: allow; ",
                Permission::Selected(option) => {
                    self.message_chunk(session, format!("permission: {option}"));
                    return StopReason::EndTurn;
                }
                Permission::Cancelled => {
                    self.message_chunk(session, "permission: cancelled".to_owned());
                    return StopReason::EndTurn;
                }
            }
        }
        for index in 0..plan.chunks {
            if index > 0 && !plan.delay.is_zero() {
                tokio::select! {
                    () = tokio::time::sleep(plan.delay) => {}
                    () = cancelled(&mut cancel) => return StopReason::Cancelled,
                }
            }
            if *cancel.borrow() {
                return StopReason::Cancelled;
            }
            let mut text = format!("{prefix}echo[{index}]: {}", plan.message);
            text.extend(std::iter::repeat_n('x', plan.size));
            prefix = "";
            self.message_chunk(session, text);
            // Let the reader run (it handles cancels) even without a delay.
            tokio::task::yield_now().await;
        }
        StopReason::EndTurn
    }

    async fn ask_permission(&self, session: &SessionId, cancel: &mut watch::Receiver<bool>) -> Permission {
        let number = self.next_request.fetch_add(1, Ordering::Relaxed) + 1;
        let request_id = format!("agent-{number}");
        let (waiter, answer) = oneshot::channel();
        {
            let mut pending = self.pending.lock();
            if pending.closed {
                return Permission::Cancelled;
            }
            pending.waiters.insert(request_id.clone(), waiter);
        }
        let tool_call = ToolCallUpdate::new(
            format!("permission-{number}"),
            ToolCallUpdateFields::new()
                .title("Stream the echo answer".to_owned())
                .kind(ToolKind::Other)
                .status(ToolCallStatus::Pending),
        );
        let options = vec![
            PermissionOption::new("allow", "Allow", PermissionOptionKind::AllowOnce),
            PermissionOption::new("reject", "Reject", PermissionOptionKind::RejectOnce),
        ];
        let request = RequestPermissionRequest::new(session.clone(), tool_call, options);
        self.send(rpc::request_line(
            &request_id,
            CLIENT_METHOD_NAMES.session_request_permission,
            rpc::to_value(&request),
        ));
        tokio::select! {
            answer = answer => match answer {
                Ok(Ok(result)) => {
                    match serde_json::from_value::<RequestPermissionResponse>(result) {
                        Ok(response) => match response.outcome {
                            RequestPermissionOutcome::Selected(selected) => {
                                Permission::Selected(selected.option_id.0.to_string())
                            }
                            _ => Permission::Cancelled,
                        },
                        Err(_) => Permission::Cancelled,
                    }
                }
                Ok(Err(_)) | Err(_) => Permission::Cancelled,
            },
            () = cancelled(cancel) => {
                self.pending.lock().waiters.remove(&request_id);
                Permission::Interrupted
            }
        }
    }

    /// [`LISTEN_METHOD`] (`listen`) or [`CONNECT_METHOD`], on a blocking thread: both use
    /// `std`'s sockets, which name abstract UNIX sockets.
    #[cfg(target_os = "linux")]
    fn socket_probe(self: &Arc<Self>, id: Value, listen: bool, params: Value, tasks: &mut JoinSet<()>) {
        let work: Box<dyn FnOnce() -> Result<Value, RpcError> + Send> = if listen {
            match parse_params::<sockets::ListenParams>(params) {
                Ok(params) => Box::new(move || sockets::listen(params).map_err(internal)),
                Err(error) => return self.reply(&id, Err(error)),
            }
        } else {
            match parse_params::<sockets::ConnectParams>(params) {
                Ok(params) => Box::new(move || sockets::connect(params).map_err(internal)),
                Err(error) => return self.reply(&id, Err(error)),
            }
        };
        let agent = Arc::clone(self);
        tasks.spawn(async move {
            let outcome = tokio::task::spawn_blocking(work)
                .await
                .unwrap_or_else(|join| Err(internal(format!("the probe failed: {join}"))));
            agent.reply(&id, outcome);
        });
    }

    /// Socket probes need Linux (abstract sockets); elsewhere the methods are unknown.
    #[cfg(not(target_os = "linux"))]
    fn socket_probe(self: &Arc<Self>, id: Value, _listen: bool, _params: Value, _tasks: &mut JoinSet<()>) {
        let error = RpcError::new(rpc::METHOD_NOT_FOUND, "socket probes need Linux".to_owned());
        self.reply(&id, Err(error));
    }

    fn exec(self: &Arc<Self>, id: Value, request: Value, tasks: &mut JoinSet<()>) {
        let request: exec::ExecParams = match parse_params(request) {
            Ok(request) => request,
            Err(error) => return self.reply(&id, Err(error)),
        };
        if let Some(cwd) = &request.cwd {
            if !cwd.is_absolute() {
                return self.reply(
                    &id,
                    Err(RpcError::new(
                        rpc::INVALID_PARAMS,
                        format!("Invalid params: cwd must be absolute: {}", cwd.display()),
                    )),
                );
            }
        }
        let agent = Arc::clone(self);
        tasks.spawn(async move {
            let outcome = exec::run(request, agent.options.exec_dir.as_deref())
                .await
                .map_err(|err| RpcError::new(rpc::INTERNAL_ERROR, err));
            agent.reply(&id, outcome);
        });
    }
}

/// An internal error (`-32603`) saying `why`.
#[cfg(target_os = "linux")]
fn internal(why: String) -> RpcError {
    RpcError::new(rpc::INTERNAL_ERROR, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_are_unique_and_storable() {
        let first = new_session_id();
        let second = new_session_id();
        assert_ne!(first, second);
        assert!(storable_id(&first));
        assert!(!storable_id("../etc/passwd"));
        assert!(!storable_id(""));
        assert!(!storable_id(".hidden"));
    }

    #[tokio::test]
    async fn next_line_skips_overlong_lines() {
        let mut data = vec![b'a'; MAX_LINE_BYTES + 10];
        data.extend_from_slice(b"\nshort\nlast");
        let mut reader = BufReader::new(&data[..]);
        let mut buffer = Vec::new();
        assert!(matches!(
            next_line(&mut reader, &mut buffer).await.unwrap(),
            LineRead::TooLong
        ));
        assert!(matches!(
            next_line(&mut reader, &mut buffer).await.unwrap(),
            LineRead::Line
        ));
        assert_eq!(buffer, b"short");
        assert!(matches!(
            next_line(&mut reader, &mut buffer).await.unwrap(),
            LineRead::Line
        ));
        assert_eq!(buffer, b"last");
        assert!(matches!(
            next_line(&mut reader, &mut buffer).await.unwrap(),
            LineRead::Eof
        ));
    }
}
