//! [`AcpCallError`]: typed failures of an ACP request, replacing substring matching.

use std::time::Duration;

use session_runtime::{Error, WorkerFailure};

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

impl AcpCallError {
    /// The category of message a user should see for this failure (see [`UserErrorKind`]).
    ///
    /// [`AcpCallError::Rpc`] is [`UserErrorKind::Other`]: upstream shows coded agent errors with
    /// `format_coded_error`, by their code, not with `format_user_error`.
    pub fn user_error_kind(&self) -> UserErrorKind {
        match self {
            AcpCallError::Timeout { .. } => UserErrorKind::RequestTimeout,
            AcpCallError::ChannelClosed { .. } => UserErrorKind::ConnectionLost,
            AcpCallError::Rpc { .. } => UserErrorKind::Other,
            AcpCallError::Runtime(error) => user_error_kind(error),
        }
    }
}

/// What a chat user is told went wrong: the categories of upstream openab-core's
/// `format_user_error` (`error_display.rs`), chosen from a runtime [`Error`]'s kind instead of
/// from substrings of its message.
///
/// Upstream sorts a failure by looking for phrases in its text ("timeout waiting for",
/// "connection closed" or "channel closed", "failed to spawn" or "no such file", "pool
/// exhausted", "invalid api key" or "unauthorized"). A runtime error's message contains none of
/// them, so without this mapping an agent that exits at once, for example, would be shown as a
/// generic error instead of a lost connection. Classify with [`user_error_kind`] first and fall
/// back to `format_user_error` only for errors that are not the runtime's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UserErrorKind {
    /// Upstream's "Request Timeout": the agent or its worker did not answer in time.
    RequestTimeout,
    /// Upstream's "Connection Lost": the agent went away (exited, was killed or evicted, or its
    /// stream was replaced or broke). Trying again starts or reaches a worker.
    ConnectionLost,
    /// Upstream's "Agent Not Found": the agent could not be started as configured.
    AgentNotFound,
    /// Upstream's "Service Busy": no capacity right now (storage still held, nowhere to schedule
    /// a worker, a backend failure that may pass).
    ServiceBusy,
    /// Upstream's "Unauthorized". No runtime error maps here (credential failures of a backend
    /// are [`Error::Backend`], which says what failed); it exists so the categories match
    /// upstream's one for one.
    Unauthorized,
    /// Upstream's plain "Error", with the error's own text.
    Other,
}

impl UserErrorKind {
    /// Every category, in upstream's order.
    pub const ALL: [UserErrorKind; 6] = [
        UserErrorKind::RequestTimeout,
        UserErrorKind::ConnectionLost,
        UserErrorKind::AgentNotFound,
        UserErrorKind::ServiceBusy,
        UserErrorKind::Unauthorized,
        UserErrorKind::Other,
    ];

    /// The category's heading as upstream shows it in bold: `"Request Timeout"`,
    /// `"Connection Lost"`, `"Agent Not Found"`, `"Service Busy"`, `"Unauthorized"` or `"Error"`.
    pub fn title(&self) -> &'static str {
        match self {
            UserErrorKind::RequestTimeout => "Request Timeout",
            UserErrorKind::ConnectionLost => "Connection Lost",
            UserErrorKind::AgentNotFound => "Agent Not Found",
            UserErrorKind::ServiceBusy => "Service Busy",
            UserErrorKind::Unauthorized => "Unauthorized",
            UserErrorKind::Other => "Error",
        }
    }

    /// What the user can do about it, in a sentence; `None` for [`UserErrorKind::Other`], whose
    /// text is the error's own.
    fn advice(&self) -> Option<&'static str> {
        match self {
            UserErrorKind::RequestTimeout => {
                Some("The agent did not answer in time. Send the message again.")
            }
            UserErrorKind::ConnectionLost => {
                Some("The agent stopped unexpectedly. Send the message again to restart it.")
            }
            UserErrorKind::AgentNotFound => {
                Some("The agent could not be started. An operator needs to check its configuration.")
            }
            UserErrorKind::ServiceBusy => Some("No agent can be started right now. Try again in a moment."),
            UserErrorKind::Unauthorized => {
                Some("The agent's credentials were refused. An operator needs to check them.")
            }
            UserErrorKind::Other => None,
        }
    }
}

impl std::fmt::Display for UserErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.title())
    }
}

/// The category of message a user should see for a runtime error.
///
/// | error | category |
/// |---|---|
/// | [`Error::WorkerFailed`] with [`WorkerFailure::StartTimeout`] | [`UserErrorKind::RequestTimeout`] |
/// | [`Error::WorkerFailed`] with [`WorkerFailure::Exited`], [`OutOfMemory`](WorkerFailure::OutOfMemory) or [`Evicted`](WorkerFailure::Evicted); [`Error::Disconnected`], [`Error::Fenced`], [`Error::NotFound`], [`Error::StorageLost`] | [`UserErrorKind::ConnectionLost`] |
/// | [`Error::WorkerFailed`] with [`WorkerFailure::Spawn`] or [`ImagePull`](WorkerFailure::ImagePull); [`Error::InvalidConfig`] | [`UserErrorKind::AgentNotFound`] |
/// | [`Error::WorkerFailed`] with [`WorkerFailure::Unschedulable`]; [`Error::StorageInUse`]; a [`retryable`](Error::retryable) [`Error::Backend`] | [`UserErrorKind::ServiceBusy`] |
/// | every other error | [`UserErrorKind::Other`] |
///
/// ```
/// use openab_runtime::compat::{user_error_kind, UserErrorKind};
/// use openab_runtime::{Error, SessionIdentity, WorkerExit, WorkerFailure};
///
/// let id = SessionIdentity::new("openab", "agent", "discord", "1")?.id();
/// // An agent that exits at once: upstream's substring match would show a generic error.
/// let exited = Error::WorkerFailed { id, cause: WorkerFailure::Exited(WorkerExit::Code(1)) };
/// assert_eq!(user_error_kind(&exited), UserErrorKind::ConnectionLost);
/// # Ok::<(), Error>(())
/// ```
pub fn user_error_kind(error: &Error) -> UserErrorKind {
    match error {
        Error::WorkerFailed { cause, .. } => match cause {
            WorkerFailure::StartTimeout(_) => UserErrorKind::RequestTimeout,
            WorkerFailure::Spawn(_) | WorkerFailure::ImagePull(_) => UserErrorKind::AgentNotFound,
            WorkerFailure::Unschedulable(_) => UserErrorKind::ServiceBusy,
            WorkerFailure::OutOfMemory | WorkerFailure::Evicted(_) | WorkerFailure::Exited(_) => {
                UserErrorKind::ConnectionLost
            }
            _ => UserErrorKind::Other,
        },
        Error::Disconnected { .. } | Error::Fenced { .. } | Error::NotFound { .. } => {
            UserErrorKind::ConnectionLost
        }
        Error::InvalidConfig { .. } => UserErrorKind::AgentNotFound,
        Error::StorageLost { .. } => UserErrorKind::ConnectionLost,
        Error::StorageInUse { .. } => UserErrorKind::ServiceBusy,
        Error::Backend { retryable: true, .. } => UserErrorKind::ServiceBusy,
        _ => UserErrorKind::Other,
    }
}

/// A runtime error as a chat message: the category's heading in bold, then what the user can do
/// (or, for [`UserErrorKind::Other`], the error's own text), in the shape of upstream's
/// `format_user_error` output.
///
/// ```
/// use openab_runtime::compat::UserError;
/// use openab_runtime::{Error, SessionIdentity};
///
/// let id = SessionIdentity::new("openab", "agent", "discord", "1")?.id();
/// let text = UserError::new(&Error::Disconnected { id }).to_string();
/// assert!(text.starts_with("**Connection Lost**\n"), "{text}");
/// # Ok::<(), Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct UserError<'a> {
    error: &'a Error,
}

impl<'a> UserError<'a> {
    /// The message for `error`.
    pub fn new(error: &'a Error) -> Self {
        Self { error }
    }

    /// Its category.
    pub fn kind(&self) -> UserErrorKind {
        user_error_kind(self.error)
    }
}

impl std::fmt::Display for UserError<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = self.kind();
        match kind.advice() {
            Some(advice) => write!(f, "**{}**\n{advice}", kind.title()),
            None => write!(f, "**{}**\n{}", kind.title(), self.error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use session_runtime::{SessionIdentity, SessionState, WorkerExit};

    fn id() -> session_runtime::SessionId {
        SessionIdentity::new("openab", "agent", "discord", "1")
            .unwrap()
            .id()
    }

    fn failed(cause: WorkerFailure) -> Error {
        Error::WorkerFailed { id: id(), cause }
    }

    fn backend(retryable: bool) -> Error {
        Error::Backend {
            runtime: "kubernetes",
            retryable,
            message: "listing pods".into(),
            source: None,
        }
    }

    #[test]
    fn a_start_timeout_is_a_request_timeout() {
        let error = failed(WorkerFailure::StartTimeout(Duration::from_secs(120)));
        assert_eq!(user_error_kind(&error), UserErrorKind::RequestTimeout);
    }

    #[test]
    fn an_agent_that_exits_is_a_lost_connection_however_it_ends() {
        for exit in [
            WorkerExit::Code(0),
            WorkerExit::Code(1),
            WorkerExit::Signal(9),
            WorkerExit::OutOfMemory,
            WorkerExit::Evicted,
            WorkerExit::Unknown,
        ] {
            assert_eq!(
                user_error_kind(&failed(WorkerFailure::Exited(exit))),
                UserErrorKind::ConnectionLost,
                "{exit}"
            );
        }
        assert_eq!(
            user_error_kind(&failed(WorkerFailure::OutOfMemory)),
            UserErrorKind::ConnectionLost
        );
        assert_eq!(
            user_error_kind(&failed(WorkerFailure::Evicted("node drained".into()))),
            UserErrorKind::ConnectionLost
        );
    }

    #[test]
    fn a_gone_or_replaced_stream_is_a_lost_connection() {
        assert_eq!(
            user_error_kind(&Error::Disconnected { id: id() }),
            UserErrorKind::ConnectionLost
        );
        let fenced = Error::Fenced {
            id: id(),
            generation: 1,
            current: 2,
        };
        assert_eq!(user_error_kind(&fenced), UserErrorKind::ConnectionLost);
        assert_eq!(
            user_error_kind(&Error::NotFound { id: id() }),
            UserErrorKind::ConnectionLost
        );
    }

    #[test]
    fn an_agent_that_cannot_start_is_not_found() {
        assert_eq!(
            user_error_kind(&failed(WorkerFailure::Spawn("no such file".into()))),
            UserErrorKind::AgentNotFound
        );
        assert_eq!(
            user_error_kind(&failed(WorkerFailure::ImagePull("manifest unknown".into()))),
            UserErrorKind::AgentNotFound
        );
        let config = Error::InvalidConfig {
            key: "session_runtime.local.sandbox".into(),
            reason: "bubblewrap does not work here".into(),
        };
        assert_eq!(user_error_kind(&config), UserErrorKind::AgentNotFound);
    }

    #[test]
    fn no_capacity_is_busy_and_a_lasting_backend_failure_is_not() {
        assert_eq!(
            user_error_kind(&failed(WorkerFailure::Unschedulable("no node fits".into()))),
            UserErrorKind::ServiceBusy
        );
        let in_use = Error::StorageInUse {
            id: id(),
            holder: "pid 7".into(),
        };
        assert_eq!(user_error_kind(&in_use), UserErrorKind::ServiceBusy);
        assert_eq!(user_error_kind(&backend(true)), UserErrorKind::ServiceBusy);
        assert_eq!(user_error_kind(&backend(false)), UserErrorKind::Other);
    }

    #[test]
    fn the_remaining_kinds_are_other_with_their_own_text() {
        let others = [
            Error::InvalidIdentity {
                part: "thread",
                problem: "is empty".into(),
            },
            Error::InvalidArgument {
                reason: "a newline inside a line".into(),
            },
            Error::InvalidState {
                id: id(),
                state: SessionState::Closed,
                operation: "attach",
            },
            Error::Unsupported {
                operation: "seed",
                runtime: "shared",
            },
        ];
        for error in &others {
            assert_eq!(user_error_kind(error), UserErrorKind::Other, "{error}");
            let text = UserError::new(error).to_string();
            assert_eq!(text, format!("**Error**\n{error}"));
        }
    }

    #[test]
    fn messages_start_with_the_bold_heading_upstream_uses() {
        for (error, title) in [
            (
                failed(WorkerFailure::StartTimeout(Duration::from_secs(1))),
                "Request Timeout",
            ),
            (Error::Disconnected { id: id() }, "Connection Lost"),
            (failed(WorkerFailure::Spawn("denied".into())), "Agent Not Found"),
            (backend(true), "Service Busy"),
        ] {
            let text = UserError::new(&error).to_string();
            assert!(text.starts_with(&format!("**{title}**\n")), "{text}");
            assert!(!text.contains(&error.to_string()), "no internal detail: {text}");
        }
        assert_eq!(UserErrorKind::Unauthorized.to_string(), "Unauthorized");
        assert_eq!(UserErrorKind::ALL.len(), 6);
    }

    #[test]
    fn acp_call_errors_map_to_the_same_categories() {
        let timeout = AcpCallError::Timeout {
            method: "session/new".into(),
            after: Duration::from_secs(120),
        };
        assert_eq!(timeout.user_error_kind(), UserErrorKind::RequestTimeout);
        let closed = AcpCallError::ChannelClosed {
            method: "initialize".into(),
        };
        assert_eq!(closed.user_error_kind(), UserErrorKind::ConnectionLost);
        let rpc = AcpCallError::Rpc {
            code: -32603,
            message: "internal".into(),
        };
        assert_eq!(rpc.user_error_kind(), UserErrorKind::Other);
        let runtime = AcpCallError::Runtime(failed(WorkerFailure::Exited(WorkerExit::Code(2))));
        assert_eq!(runtime.user_error_kind(), UserErrorKind::ConnectionLost);
    }
}
