//! The one public error type of every session runtime.

use std::fmt;
use std::time::Duration;

use crate::{SessionId, SessionState};

/// A boxed error from a backend or the operating system, kept as the `source` of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Shorthand for results whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a session runtime can fail with, as kinds the broker can act on.
///
/// Match on the variant, never on the message. Messages are lower-case, name the
/// [`SessionId`] (never the raw thread id) and end without a period. Backends keep their own error
/// types private and convert them here at one boundary.
///
/// [`Error::retryable`] says whether the same call may succeed if simply repeated later.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A part of a [`SessionIdentity`](crate::SessionIdentity) is empty, too long, contains a
    /// control character, or names another installation.
    #[error("invalid session identity: {part} {problem}")]
    InvalidIdentity {
        /// Which part is wrong: `installation`, `agent`, `platform` or `thread`.
        part: &'static str,
        /// What is wrong with it.
        problem: String,
    },

    /// The configuration is invalid: an unknown key, a bad value, or a backend that was not compiled in.
    #[error("invalid configuration: `{key}`: {reason}")]
    InvalidConfig {
        /// The dotted key path, e.g. `session_runtime.idle_ttl`.
        key: String,
        /// What is wrong and, where possible, how to fix it.
        reason: String,
    },

    /// A caller passed an argument the operation cannot accept (e.g. a line with an embedded newline).
    #[error("invalid argument: {reason}")]
    InvalidArgument {
        /// What is wrong.
        reason: String,
    },

    /// A [`SessionOverlay`](crate::SessionOverlay) field cannot be applied: a malformed
    /// environment variable name, a value too long, a working directory outside what the runtime
    /// allows (a host path where the session has storage of its own, `..`, a symbolic link
    /// leading out, a directory the operator's configuration does not allow). The message names
    /// variables, never their values.
    #[error("invalid session overlay: `{field}` {problem}")]
    InvalidOverlay {
        /// The field: [`WORKING_DIR_FIELD`](crate::overlay::WORKING_DIR_FIELD) or
        /// [`ENV_FIELD`](crate::overlay::ENV_FIELD).
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },

    /// No session with this id exists (it was never created, or its record is gone).
    #[error("session {id} not found")]
    NotFound {
        /// The session.
        id: SessionId,
    },

    /// The session exists but its state does not allow the operation.
    #[error("session {id} is {state}; cannot {operation}")]
    InvalidState {
        /// The session.
        id: SessionId,
        /// The state it is in.
        state: SessionState,
        /// The refused operation, e.g. `attach`.
        operation: &'static str,
    },

    /// A newer attachment (higher generation) took over this session; this stream or call lost.
    ///
    /// Not retryable with this attachment. Whoever still needs the session attaches again, which
    /// in turn fences the current holder, so only one party should do so.
    #[error("session {id} attachment of generation {generation} was fenced by generation {current}")]
    Fenced {
        /// The session.
        id: SessionId,
        /// The generation of the fenced attachment.
        generation: u64,
        /// The generation that replaced it.
        current: u64,
    },

    /// The stream to the worker is gone (the worker ended, or the transport broke without a way
    /// to resume). Attaching again starts or reaches a worker.
    #[error("session {id} stream is disconnected")]
    Disconnected {
        /// The session.
        id: SessionId,
    },

    /// This runtime cannot perform the operation at all.
    #[error("{operation} is not supported by the {runtime} runtime")]
    Unsupported {
        /// The operation, e.g. `suspend`.
        operation: &'static str,
        /// The runtime, e.g. `local`.
        runtime: &'static str,
    },

    /// The worker could not be started or ended abnormally.
    #[error("session {id} worker failed: {cause}")]
    WorkerFailed {
        /// The session.
        id: SessionId,
        /// Why, classified.
        cause: WorkerFailure,
    },

    /// The session's storage is held by something else (another broker process or a worker that
    /// has not stopped yet).
    #[error("session {id} storage is in use: {holder}")]
    StorageInUse {
        /// The session.
        id: SessionId,
        /// Who holds it, as far as is known.
        holder: String,
    },

    /// The session's storage is gone: deleted or replaced by someone other than its runtime
    /// while the session still needed it. Its data cannot be had back by retrying; the session
    /// can only be closed (a new session under the same identity gets new storage).
    #[error("session {id} storage is lost: {storage}")]
    StorageLost {
        /// The session.
        id: SessionId,
        /// Which storage, and what became of it (e.g. `persistentvolumeclaim/x was deleted`).
        storage: String,
    },

    /// A failure inside the backend (API server, cloud service, filesystem).
    #[error("{runtime} runtime error: {message}")]
    Backend {
        /// The runtime, e.g. `kubernetes`.
        runtime: &'static str,
        /// Whether repeating the call later may succeed.
        retryable: bool,
        /// A short lower-case description of what was being done.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<BoxError>,
    },
}

impl Error {
    /// Whether repeating the same call later may succeed without anyone changing anything.
    ///
    /// `true` for [`Error::Disconnected`], [`Error::StorageInUse`], start timeouts and evictions in
    /// [`Error::WorkerFailed`], and backend errors marked retryable.
    pub fn retryable(&self) -> bool {
        match self {
            Error::Disconnected { .. } | Error::StorageInUse { .. } => true,
            Error::WorkerFailed { cause, .. } => cause.retryable(),
            Error::Backend { retryable, .. } => *retryable,
            Error::InvalidIdentity { .. }
            | Error::InvalidConfig { .. }
            | Error::InvalidArgument { .. }
            | Error::InvalidOverlay { .. }
            | Error::NotFound { .. }
            | Error::InvalidState { .. }
            | Error::Fenced { .. }
            | Error::StorageLost { .. }
            | Error::Unsupported { .. } => false,
        }
    }

    /// A backend error with a source.
    pub fn backend(
        runtime: &'static str,
        retryable: bool,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Backend {
            runtime,
            retryable,
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// Wraps this error in an [`std::io::Error`], for streams whose interface is `std::io`.
    ///
    /// [`Error::from_io`] recovers it.
    pub fn into_io(self) -> std::io::Error {
        let kind = match &self {
            Error::Fenced { .. } => std::io::ErrorKind::ConnectionAborted,
            Error::Disconnected { .. } => std::io::ErrorKind::BrokenPipe,
            Error::InvalidArgument { .. } | Error::InvalidOverlay { .. } => std::io::ErrorKind::InvalidInput,
            _ => std::io::ErrorKind::Other,
        };
        std::io::Error::new(kind, self)
    }

    /// The runtime error inside an [`std::io::Error`] produced by an [`Attachment`](crate::Attachment)
    /// stream, if there is one.
    pub fn from_io(error: &std::io::Error) -> Option<&Error> {
        error.get_ref().and_then(|inner| inner.downcast_ref::<Error>())
    }
}

/// Why a worker failed, classified so the broker can tell the user something true.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkerFailure {
    /// The worker did not become ready within the start timeout.
    StartTimeout(Duration),
    /// The agent program could not be started (missing binary, bad permissions, sandbox refused).
    Spawn(String),
    /// The worker image could not be pulled.
    ImagePull(String),
    /// No node can run the worker.
    Unschedulable(String),
    /// The worker ran out of memory.
    OutOfMemory,
    /// The worker was evicted or preempted by its platform.
    Evicted(String),
    /// The agent exited (code, or signal on unix) before it was asked to.
    Exited(WorkerExit),
}

impl WorkerFailure {
    /// Whether a retry may succeed without a configuration change.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            WorkerFailure::StartTimeout(_) | WorkerFailure::Evicted(_) | WorkerFailure::Unschedulable(_)
        )
    }
}

impl fmt::Display for WorkerFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerFailure::StartTimeout(t) => {
                write!(f, "not ready within {}", humantime::format_duration(*t))
            }
            WorkerFailure::Spawn(why) => write!(f, "could not start the agent: {why}"),
            WorkerFailure::ImagePull(why) => write!(f, "image pull failed: {why}"),
            WorkerFailure::Unschedulable(why) => write!(f, "unschedulable: {why}"),
            WorkerFailure::OutOfMemory => f.write_str("out of memory"),
            WorkerFailure::Evicted(why) => write!(f, "evicted: {why}"),
            WorkerFailure::Exited(exit) => write!(f, "{exit}"),
        }
    }
}

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WorkerExit {
    /// The agent exited with this code.
    Code(i32),
    /// The agent was killed by this signal number (unix).
    Signal(i32),
    /// The worker was killed for exceeding its memory limit.
    OutOfMemory,
    /// The platform removed the worker (eviction, node loss, session stopped from outside).
    Evicted,
    /// The worker is gone and how it ended cannot be known (e.g. it belonged to a previous broker
    /// process).
    Unknown,
}

impl WorkerExit {
    /// Whether the agent exited on its own with code 0.
    pub fn success(&self) -> bool {
        matches!(self, WorkerExit::Code(0))
    }
}

impl fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerExit::Code(code) => write!(f, "exited with code {code}"),
            WorkerExit::Signal(signal) => write!(f, "killed by signal {signal}"),
            WorkerExit::OutOfMemory => f.write_str("killed for exceeding its memory limit"),
            WorkerExit::Evicted => f.write_str("evicted by its platform"),
            WorkerExit::Unknown => f.write_str("ended in an unknown way"),
        }
    }
}
