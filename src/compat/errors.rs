//! [`AcpCallError`]: typed failures of an ACP request, replacing substring matching.

use std::time::Duration;

use session_runtime::Error;

/// Why an ACP request over a session failed.
///
/// Replaces upstream's `TRANSIENT_LOAD_ERRORS = ["timeout waiting for", "channel closed"]`: the
/// pool asks [`is_transient`](Self::is_transient) instead of matching messages.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AcpCallError {
    /// No response within the request's timeout.
    #[error("timeout waiting for {method} response after {after:?}")]
    Timeout {
        /// The request's method.
        method: String,
        /// How long it waited.
        after: Duration,
    },
    /// The agent's output ended before the response (the worker died or was replaced).
    #[error("channel closed waiting for {method}")]
    ChannelClosed {
        /// The request's method.
        method: String,
    },
    /// The agent answered with a JSON-RPC error.
    #[error("JSON-RPC error {code}: {message}")]
    Rpc {
        /// The JSON-RPC error code.
        code: i64,
        /// Its message.
        message: String,
    },
    /// The session runtime failed.
    #[error(transparent)]
    Runtime(#[from] Error),
}

impl AcpCallError {
    /// Whether the pool should keep the persisted ACP session id and retry on the next message
    /// (a transient failure), rather than start a fresh ACP session.
    ///
    /// Transient: timeouts, a closed channel, and runtime errors that are
    /// [`retryable`](Error::retryable) (a disconnected stream, storage in use, start timeouts).
    /// Permanent: JSON-RPC errors (e.g. the agent does not know the session) and every other
    /// runtime error.
    pub fn is_transient(&self) -> bool {
        match self {
            AcpCallError::Timeout { .. } | AcpCallError::ChannelClosed { .. } => true,
            AcpCallError::Rpc { .. } => false,
            AcpCallError::Runtime(error) => error.retryable(),
        }
    }

    /// Classifies an I/O error from the attachment's reader or writer.
    pub fn from_io(method: &str, error: &std::io::Error) -> Self {
        match Error::from_io(error) {
            Some(Error::Fenced {
                id,
                generation,
                current,
            }) => AcpCallError::Runtime(Error::Fenced {
                id: *id,
                generation: *generation,
                current: *current,
            }),
            Some(Error::Disconnected { id }) => AcpCallError::Runtime(Error::Disconnected { id: *id }),
            _ => AcpCallError::ChannelClosed {
                method: method.to_owned(),
            },
        }
    }
}
