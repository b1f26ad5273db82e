//! A small ACP client that drives an agent over an [`Attachment`], for tests and probes.
//!
//! Requests and notifications are built from the published ACP schema types
//! (`agent-client-protocol-schema`), so client and agent speak the protocol as published.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_client_protocol_schema::v1 as acp;
use agent_client_protocol_schema::ProtocolVersion;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;

use crate::{AgentInput, AgentOutput, Attachment, Error, WorkerControl};

/// The ACP test agent's extension method that runs a shell command in the agent's environment.
pub const EXEC_METHOD: &str = "_openab/exec";

/// How long a single request may take before the client reports it as hung.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// `session/update` notifications a slow collector may fall behind by before it is told it lagged.
const UPDATE_BACKLOG: usize = 16 * 1024;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The runtime failed (fenced, disconnected, ...).
    #[error(transparent)]
    Runtime(#[from] Error),
    /// The agent answered with a JSON-RPC error.
    #[error("agent error {code}: {message}")]
    Rpc {
        /// The JSON-RPC error code.
        code: i64,
        /// The error message.
        message: String,
    },
    /// The agent's output ended before the answer arrived.
    #[error("agent output ended: {0}")]
    Closed(String),
    /// The answer did not arrive in time.
    #[error("no answer to {0} within the timeout")]
    Timeout(String),
    /// The answer did not have the published shape.
    #[error("malformed answer to {method}: {detail}")]
    Malformed {
        /// The request.
        method: String,
        /// What was wrong.
        detail: String,
    },
}

/// How the client answers the agent's `session/request_permission`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PermissionAnswer {
    /// Select the option with this id.
    Select(String),
    /// Answer `cancelled`.
    Cancelled,
}

/// The result of a `session/prompt` turn.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PromptOutcome {
    /// The stop reason, as its wire name (`end_turn`, `cancelled`, ...).
    pub stop_reason: String,
    /// The text of every `agent_message_chunk` seen for the session during the turn, in order.
    pub chunks: Vec<String>,
}

/// What the exec probe reported.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExecOutput {
    /// The exit code, if the command exited.
    pub exit_code: Option<i32>,
    /// The signal, if it was killed.
    pub signal: Option<i32>,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

impl ExecOutput {
    /// Whether it exited with 0.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0)
    }
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, ClientError>>>>>;

/// An ACP client over one [`Attachment`].
///
/// A reader task owns the agent's output: it resolves responses, forwards `session/update`
/// notifications, and answers `session/request_permission` per [`PermissionAnswer`].
pub struct AcpClient {
    input: AgentInput,
    control: Arc<dyn WorkerControl>,
    working_dir: String,
    pending: Pending,
    updates: broadcast::Sender<Arc<acp::SessionNotification>>,
    permission: Arc<Mutex<PermissionAnswer>>,
    permission_requests: Arc<AtomicU64>,
    next_id: AtomicU64,
    reader: JoinHandle<()>,
    timeout: Duration,
}

impl fmt::Debug for AcpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcpClient")
            .field("input", &self.input)
            .finish_non_exhaustive()
    }
}

impl Drop for AcpClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl AcpClient {
    /// Takes over the attachment's output and starts the reader task.
    pub fn new(attachment: Attachment) -> Self {
        let working_dir = attachment.working_dir().to_owned();
        let (output, input, control) = attachment.into_split();
        let pending: Pending = Arc::default();
        let (updates, _) = broadcast::channel(UPDATE_BACKLOG);
        let permission = Arc::new(Mutex::new(PermissionAnswer::Select("allow".into())));
        let permission_requests = Arc::new(AtomicU64::new(0));
        let reader = tokio::spawn(read_loop(
            output,
            input.clone(),
            Arc::clone(&pending),
            updates.clone(),
            Arc::clone(&permission),
            Arc::clone(&permission_requests),
        ));
        Self {
            input,
            control,
            working_dir,
            pending,
            updates,
            permission,
            permission_requests,
            next_id: AtomicU64::new(1),
            reader,
            timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// The attachment's in-worker working directory.
    pub fn working_dir(&self) -> &str {
        &self.working_dir
    }

    /// The worker's control handle.
    pub fn control(&self) -> Arc<dyn WorkerControl> {
        Arc::clone(&self.control)
    }

    /// The writer shared with the reader task (e.g. for a raw `session/cancel`).
    pub fn input(&self) -> &AgentInput {
        &self.input
    }

    /// Sets how later permission requests are answered.
    pub fn answer_permissions_with(&self, answer: PermissionAnswer) {
        *self.permission.lock() = answer;
    }

    /// How many permission requests the agent has sent so far.
    pub fn permission_requests(&self) -> u64 {
        self.permission_requests.load(Ordering::Acquire)
    }

    /// Sends a request and waits for its result.
    pub async fn request(&self, method: &str, params: Value) -> Result<Value, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (done, answer) = oneshot::channel();
        self.pending.lock().insert(id, done);
        let line = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).to_string();
        if let Err(error) = self.input.write_line(line).await {
            self.pending.lock().remove(&id);
            return Err(error.into());
        }
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ClientError::Closed(format!("while waiting for {method}"))),
            Err(_) => {
                self.pending.lock().remove(&id);
                Err(ClientError::Timeout(method.to_owned()))
            }
        }
    }

    /// Sends a notification.
    pub async fn notify(&self, method: &str, params: Value) -> Result<(), ClientError> {
        let line = json!({"jsonrpc": "2.0", "method": method, "params": params}).to_string();
        Ok(self.input.write_line(line).await?)
    }

    /// `initialize` with the latest protocol version; returns the agent's answer.
    pub async fn initialize(&self) -> Result<acp::InitializeResponse, ClientError> {
        let request = acp::InitializeRequest::new(ProtocolVersion::LATEST);
        self.typed("initialize", &request).await
    }

    /// `session/new` in `cwd`; returns the ACP session id.
    pub async fn new_session(&self, cwd: &str) -> Result<String, ClientError> {
        let response: acp::NewSessionResponse = self
            .typed("session/new", &acp::NewSessionRequest::new(cwd))
            .await?;
        Ok(response.session_id.0.to_string())
    }

    /// `session/load` of an earlier ACP session in `cwd`.
    pub async fn load_session(&self, session: &str, cwd: &str) -> Result<(), ClientError> {
        let request = acp::LoadSessionRequest::new(session.to_owned(), cwd);
        self.request("session/load", to_value(&request)).await.map(drop)
    }

    /// Runs a whole prompt turn and collects its message chunks.
    pub async fn prompt(&self, session: &str, text: &str) -> Result<PromptOutcome, ClientError> {
        // Subscribe before sending, so no chunk of this turn can be missed. The reader forwards a
        // turn's chunks before its response, so they are all queued once the response is here.
        let mut updates = self.updates.subscribe();
        let request = acp::PromptRequest::new(
            session.to_owned(),
            vec![acp::ContentBlock::Text(acp::TextContent::new(text))],
        );
        let response: acp::PromptResponse = self.typed("session/prompt", &request).await?;
        let mut chunks = Vec::new();
        loop {
            match updates.try_recv() {
                Ok(notification) if notification.session_id.0.as_ref() == session => {
                    chunks.extend(chunk_text(&notification));
                }
                Ok(_) => {}
                Err(broadcast::error::TryRecvError::Lagged(missed)) => {
                    return Err(ClientError::Malformed {
                        method: "session/prompt".into(),
                        detail: format!(
                            "{missed} updates were dropped: the turn outgrew the client's backlog"
                        ),
                    })
                }
                Err(_) => break,
            }
        }
        Ok(PromptOutcome {
            stop_reason: wire_name(&response.stop_reason),
            chunks,
        })
    }

    /// Waits for the next `agent_message_chunk` of `session` sent after this call, and returns its text.
    pub async fn next_chunk(&self, session: &str) -> Result<String, ClientError> {
        let mut updates = self.updates.subscribe();
        let wait = async {
            loop {
                match updates.recv().await {
                    Ok(notification) if notification.session_id.0.as_ref() == session => {
                        if let Some(text) = chunk_text(&notification) {
                            return Ok(text);
                        }
                    }
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => {
                        return Err(ClientError::Closed("while waiting for session/update".into()))
                    }
                }
            }
        };
        tokio::time::timeout(self.timeout, wait)
            .await
            .unwrap_or_else(|_| Err(ClientError::Timeout("session/update".into())))
    }

    /// Sends `session/cancel` for `session`.
    pub async fn cancel(&self, session: &str) -> Result<(), ClientError> {
        let notification = acp::CancelNotification::new(session.to_owned());
        self.notify("session/cancel", to_value(&notification)).await
    }

    /// Runs `command` with `/bin/sh -c` in the agent's own environment (test agent only).
    pub async fn exec(&self, command: &str) -> Result<ExecOutput, ClientError> {
        let value = self.request(EXEC_METHOD, json!({ "command": command })).await?;
        let malformed = |detail: &str| ClientError::Malformed {
            method: EXEC_METHOD.into(),
            detail: detail.into(),
        };
        let int = |key: &str| {
            value
                .get(key)
                .and_then(Value::as_i64)
                .and_then(|v| i32::try_from(v).ok())
        };
        let text = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_owned);
        Ok(ExecOutput {
            exit_code: int("exitCode"),
            signal: int("signal"),
            stdout: text("stdout").ok_or_else(|| malformed("no stdout"))?,
            stderr: text("stderr").ok_or_else(|| malformed("no stderr"))?,
        })
    }

    async fn typed<Req: serde::Serialize + Sync, Resp: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        request: &Req,
    ) -> Result<Resp, ClientError> {
        let value = self.request(method, to_value(request)).await?;
        serde_json::from_value(value).map_err(|e| ClientError::Malformed {
            method: method.into(),
            detail: e.to_string(),
        })
    }
}

fn to_value<T: serde::Serialize>(value: &T) -> Value {
    // Schema types always serialize (no maps with non-string keys, no failing impls).
    serde_json::to_value(value).unwrap_or(Value::Null)
}

fn wire_name<T: serde::Serialize>(value: &T) -> String {
    match to_value(value) {
        Value::String(name) => name,
        other => other.to_string(),
    }
}

fn chunk_text(notification: &acp::SessionNotification) -> Option<String> {
    match &notification.update {
        acp::SessionUpdate::AgentMessageChunk(chunk) => match &chunk.content {
            acp::ContentBlock::Text(text) => Some(text.text.clone()),
            _ => None,
        },
        _ => None,
    }
}

async fn read_loop(
    output: AgentOutput,
    input: AgentInput,
    pending: Pending,
    updates: broadcast::Sender<Arc<acp::SessionNotification>>,
    permission: Arc<Mutex<PermissionAnswer>>,
    permission_requests: Arc<AtomicU64>,
) {
    let mut lines = BufReader::new(output).lines();
    let end = loop {
        let line = match lines.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => break "end of output".to_owned(),
            Err(error) => break error.to_string(),
        };
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let method = message.get("method").and_then(Value::as_str);
        let id = message.get("id").filter(|id| !id.is_null());
        match (method, id) {
            (None, Some(id)) => {
                let Some(done) = id.as_u64().and_then(|id| pending.lock().remove(&id)) else {
                    continue;
                };
                let result = match message.get("error") {
                    Some(error) => Err(ClientError::Rpc {
                        code: error.get("code").and_then(Value::as_i64).unwrap_or(0),
                        message: error
                            .get("message")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned(),
                    }),
                    None => Ok(message.get("result").cloned().unwrap_or(Value::Null)),
                };
                let _ = done.send(result);
            }
            (Some("session/update"), None) => {
                let params = message.get("params").cloned().unwrap_or(Value::Null);
                if let Ok(notification) = serde_json::from_value(params) {
                    let _ = updates.send(Arc::new(notification));
                }
            }
            (Some("session/request_permission"), Some(id)) => {
                permission_requests.fetch_add(1, Ordering::AcqRel);
                let outcome = match &*permission.lock() {
                    PermissionAnswer::Select(option) => acp::RequestPermissionOutcome::Selected(
                        acp::SelectedPermissionOutcome::new(option.clone()),
                    ),
                    PermissionAnswer::Cancelled => acp::RequestPermissionOutcome::Cancelled,
                };
                let result = to_value(&acp::RequestPermissionResponse::new(outcome));
                let reply = json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string();
                // The writer task owns ordering; the reader must not wait for it.
                let input = input.clone();
                tokio::spawn(async move { input.write_line(reply).await });
            }
            (Some(_), Some(id)) => {
                let reply = json!({"jsonrpc": "2.0", "id": id,
                    "error": {"code": -32601, "message": "method not found"}})
                .to_string();
                let input = input.clone();
                tokio::spawn(async move { input.write_line(reply).await });
            }
            _ => {}
        }
    };
    for (_, done) in pending.lock().drain() {
        let _ = done.send(Err(ClientError::Closed(end.clone())));
    }
}
