//! The client's private error type and its one conversion into the contract's [`Error`].

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use session_runtime::{Error, Generation, SessionId, WorkerFailure};

use crate::protocol::{ErrorCode, FrameError};
use crate::transport::Refusal;

const RUNTIME: &str = "worker-relay";

/// What went wrong between the client and a relay.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RelayError {
    /// The transport could not be opened.
    #[error("connecting to the relay failed: {0}")]
    Connect(#[source] io::Error),
    /// The transport broke.
    #[error("the relay connection broke: {0}")]
    Transport(#[source] io::Error),
    /// The relay sent bytes that are not a valid frame.
    #[error("the relay sent a bad frame: {0}")]
    Frame(#[from] FrameError),
    /// The relay sent a valid frame that makes no sense here.
    #[error("protocol violation by the relay: {0}")]
    Protocol(String),
    /// Something took too long.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// The relay refused the connection or closed it with an error frame.
    #[error("the relay refused: {code}: {message}")]
    Rejected {
        /// Its code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// The channel handshake failed for a reason reconnecting will not change: the peer does not
    /// hold this session generation's secret (an impostor, a worker of another session or
    /// generation), refused this client's key, or speaks no channel.
    #[error("the relay channel was not authenticated: {0}")]
    Unauthenticated(#[source] crate::channel::HandshakeError),
    /// The relay accepted input this client never sent: another broker wrote to the agent.
    #[error("the relay accepted input this client never sent (another broker took over)")]
    Diverged,
    /// Whoever placed the worker says it is gone (its Pod deleted, its node lost).
    #[error("the worker is gone: {0}")]
    WorkerLost(WorkerFailure),
    /// Reconnecting failed for too long.
    #[error("gave up reconnecting after {after:?}: {last}")]
    GaveUp {
        /// How long it tried.
        after: Duration,
        /// The last failure.
        last: Box<RelayError>,
        /// Whether any connection was ever established.
        ever_connected: bool,
    },
}

impl RelayError {
    /// Whether retrying cannot help: the relay said no for a reason that will not change.
    pub(crate) fn is_fatal(&self) -> bool {
        match self {
            RelayError::Rejected { code, .. } => matches!(
                code,
                ErrorCode::Superseded
                    | ErrorCode::StaleEpoch
                    | ErrorCode::StaleGeneration
                    | ErrorCode::SessionMismatch
                    | ErrorCode::BadToken
                    | ErrorCode::UnsupportedVersion
                    | ErrorCode::ResumeGap
                    | ErrorCode::SpawnFailed
                    | ErrorCode::InputOverflow
            ),
            RelayError::Diverged
            | RelayError::GaveUp { .. }
            | RelayError::WorkerLost(_)
            | RelayError::Unauthenticated(_) => true,
            RelayError::Connect(error) => Refusal::from_io(error).is_some(),
            RelayError::Transport(_)
            | RelayError::Frame(_)
            | RelayError::Protocol(_)
            | RelayError::Timeout(_) => false,
        }
    }

    /// The one conversion into the contract's error:
    ///
    /// | relay failure | [`Error`] |
    /// |---|---|
    /// | `superseded`, `stale-epoch`, input diverged | [`Error::Fenced`] (by the same generation) |
    /// | `resume-gap` | [`Error::Disconnected`] |
    /// | `spawn-failed` | [`Error::WorkerFailed`] with [`WorkerFailure::Spawn`] |
    /// | `stale-generation`, `session-mismatch`, `bad-token`, `unsupported-version`, `input-overflow` | [`Error::Backend`], not retryable |
    /// | the channel handshake failed other than by the transport (the relay did not prove it holds the session generation's secret, or refused the broker's) | [`Error::Backend`], not retryable |
    /// | the connector's [`Refusal`] | [`Error::Backend`], retryable as the refusal says |
    /// | the worker lost, as its placer said ([`RelayClient::attach_until`](crate::RelayClient::attach_until)) | [`Error::WorkerFailed`] with that cause |
    /// | never connected within the reconnect budget | [`Error::Backend`], retryable |
    /// | connection lost for longer than the reconnect budget, anything else | [`Error::Disconnected`] |
    pub(crate) fn to_runtime(self: &Arc<Self>, id: SessionId, generation: Generation) -> Error {
        let backend = |retryable: bool, message: &str| Error::Backend {
            runtime: RUNTIME,
            retryable,
            message: message.to_owned(),
            source: Some(Box::new(Shared(Arc::clone(self)))),
        };
        match &**self {
            RelayError::Rejected { code, message } => match code {
                ErrorCode::Superseded | ErrorCode::StaleEpoch => Error::Fenced {
                    id,
                    generation,
                    current: generation,
                },
                ErrorCode::ResumeGap => Error::Disconnected { id },
                ErrorCode::SpawnFailed => Error::WorkerFailed {
                    id,
                    cause: WorkerFailure::Spawn(message.clone()),
                },
                ErrorCode::StaleGeneration
                | ErrorCode::SessionMismatch
                | ErrorCode::BadToken
                | ErrorCode::UnsupportedVersion => backend(false, "the worker relay refused the connection"),
                ErrorCode::InputOverflow => backend(
                    false,
                    "the worker relay refused more input than it buffers: the client's input window exceeds it",
                ),
                _ => Error::Disconnected { id },
            },
            RelayError::Unauthenticated(_) => backend(
                false,
                "the worker relay channel was not authenticated: the peer does not hold this session generation's secret, or refused the broker's",
            ),
            RelayError::Diverged => Error::Fenced {
                id,
                generation,
                current: generation,
            },
            RelayError::Connect(error) => match Refusal::from_io(error) {
                Some(refusal) => backend(refusal.retryable(), refusal.message()),
                None => Error::Disconnected { id },
            },
            RelayError::WorkerLost(cause) => Error::WorkerFailed {
                id,
                cause: cause.clone(),
            },
            // The last failure says why (a quota, throttling, a cold start that took too long):
            // the operator needs it, not only that the budget ran out.
            RelayError::GaveUp {
                ever_connected: false,
                last,
                ..
            } => backend(true, &format!("could not reach the worker relay: {last}")),
            _ => Error::Disconnected { id },
        }
    }
}

/// A shared [`RelayError`] as the `source` of an [`Error`].
struct Shared(Arc<RelayError>);

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for Shared {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> SessionId {
        session_runtime::SessionIdentity::new("i", "a", "p", "t")
            .expect("valid identity")
            .id()
    }

    fn convert(error: RelayError) -> Error {
        Arc::new(error).to_runtime(id(), 4)
    }

    fn rejected(code: ErrorCode) -> RelayError {
        RelayError::Rejected {
            code,
            message: "m".into(),
        }
    }

    #[test]
    fn conversion_follows_the_documented_table() {
        assert!(matches!(
            convert(rejected(ErrorCode::Superseded)),
            Error::Fenced {
                generation: 4,
                current: 4,
                ..
            }
        ));
        assert!(matches!(
            convert(rejected(ErrorCode::StaleEpoch)),
            Error::Fenced { .. }
        ));
        assert!(matches!(convert(RelayError::Diverged), Error::Fenced { .. }));
        assert!(matches!(
            convert(rejected(ErrorCode::ResumeGap)),
            Error::Disconnected { .. }
        ));
        assert!(matches!(
            convert(rejected(ErrorCode::SpawnFailed)),
            Error::WorkerFailed {
                cause: WorkerFailure::Spawn(_),
                ..
            }
        ));
        let refused = convert(rejected(ErrorCode::BadToken));
        assert!(
            matches!(refused, Error::Backend { retryable: false, .. }),
            "{refused}"
        );
        let unreachable = convert(RelayError::GaveUp {
            after: Duration::from_secs(1),
            last: Box::new(RelayError::Timeout("connect")),
            ever_connected: false,
        });
        assert!(unreachable.retryable());
        assert!(matches!(unreachable, Error::Backend { .. }));
        let lost = convert(RelayError::GaveUp {
            after: Duration::from_secs(1),
            last: Box::new(RelayError::Timeout("connect")),
            ever_connected: true,
        });
        assert!(matches!(lost, Error::Disconnected { .. }));
    }

    #[test]
    fn fatal_codes_are_the_ones_that_cannot_change() {
        assert!(rejected(ErrorCode::BadToken).is_fatal());
        assert!(!rejected(ErrorCode::ReplayedHello).is_fatal());
        assert!(!rejected(ErrorCode::IdleTimeout).is_fatal());
        assert!(!RelayError::Timeout("x").is_fatal());
        assert!(!rejected(ErrorCode::EpochAhead).is_fatal());
        let impostor = RelayError::Unauthenticated(crate::channel::HandshakeError::PeerUnauthenticated);
        assert!(impostor.is_fatal());
        assert!(matches!(
            convert(impostor),
            Error::Backend { retryable: false, .. }
        ));
        assert!(!RelayError::Transport(io::ErrorKind::UnexpectedEof.into()).is_fatal());
    }
}
