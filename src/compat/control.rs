//! [`SessionControl`]: the lock-free handle the pool keeps beside each connection.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use session_runtime::{AgentInput, Error, Result, SessionId, WorkerControl, WorkerExit};

/// How long a `session/cancel` may take to reach the agent's stdin before it is given up.
pub const CANCEL_BOUND: Duration = Duration::from_secs(5);

/// What the pool's `cancel_handles` and `pgids` maps held, in one cloneable object usable while a
/// turn holds the connection mutex: cancel the turn, kill a hung worker, check liveness.
#[derive(Debug, Clone)]
pub struct SessionControl {
    id: SessionId,
    input: AgentInput,
    worker: Arc<dyn WorkerControl>,
}

impl SessionControl {
    /// A control handle over an attachment's input and worker.
    pub fn new(id: SessionId, input: AgentInput, worker: Arc<dyn WorkerControl>) -> Self {
        Self { id, input, worker }
    }

    /// The runtime session this controls.
    pub fn session_id(&self) -> SessionId {
        self.id
    }

    /// Sends `session/cancel` for the ACP session `acp_session_id`, bounded by [`CANCEL_BOUND`].
    ///
    /// # Errors
    /// [`Error::Fenced`] / [`Error::Disconnected`] if the stream is gone; [`Error::Backend`]
    /// (retryable) if the agent's stdin did not take the line within the bound.
    pub async fn cancel(&self, acp_session_id: &str) -> Result<()> {
        let line =
            json!({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": acp_session_id}});
        match tokio::time::timeout(CANCEL_BOUND, self.input.write_line(line.to_string())).await {
            Ok(result) => result,
            Err(_) => Err(Error::Backend {
                runtime: "compat",
                retryable: true,
                message: format!(
                    "session {} did not take session/cancel within {CANCEL_BOUND:?}",
                    self.id
                ),
                source: None,
            }),
        }
    }

    /// Kills the worker without grace (replaces `kill(-pgid)` for hung sessions). The runtime
    /// record is unchanged: follow with [`PoolPath::HungEviction`](crate::compat::PoolPath).
    pub async fn kill(&self) -> Result<WorkerExit> {
        self.worker.kill().await
    }

    /// Stops the worker: SIGTERM (or the platform's equivalent), then a kill after `grace`.
    pub async fn terminate(&self, grace: Duration) -> Result<WorkerExit> {
        self.worker.terminate(grace).await
    }

    /// Whether the worker still runs (replaces `alive()`). Never blocks.
    pub fn is_alive(&self) -> bool {
        self.worker.is_alive()
    }

    /// The worker's id and generation, for logs.
    pub fn worker(&self) -> (&str, u64) {
        (self.worker.worker_id(), self.worker.generation())
    }
}
