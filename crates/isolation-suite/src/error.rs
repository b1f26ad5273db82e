//! [`SuiteError`]: why the suite could not produce a report.

use std::time::Duration;

use session_runtime::testing::ClientError;

use crate::Side;

/// Why the suite could not run to a report.
///
/// Only the set-up can fail this way: bad options, or a runtime that cannot create, attach or
/// report on a session, or an agent that does not answer `initialize`. Everything after that
/// (a probe that cannot run, a sentinel that cannot be written) is recorded in the report as an
/// inconclusive probe instead, so the operator sees what was and was not checked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SuiteError {
    /// The options are unusable (an invalid identity label, a relative path, ...).
    #[error("invalid suite options: {0}")]
    InvalidOptions(String),
    /// A runtime call failed.
    #[error("session {side}: {operation} failed: {source}")]
    Runtime {
        /// The session.
        side: Side,
        /// The runtime call (`create`, `attach`, `status`).
        operation: &'static str,
        /// The runtime's error.
        #[source]
        source: session_runtime::Error,
    },
    /// The agent in the session's worker did not answer as the ACP test agent does.
    #[error("session {side}: the agent failed {operation}: {source}")]
    Agent {
        /// The session.
        side: Side,
        /// The ACP request (`initialize`).
        operation: &'static str,
        /// The client's error.
        #[source]
        source: ClientError,
    },
    /// A runtime call or ACP request did not finish in time.
    #[error("session {side}: {operation} did not finish within {limit:?}")]
    Timeout {
        /// The session.
        side: Side,
        /// The call.
        operation: &'static str,
        /// The limit ([`SuiteOptions::lifecycle_timeout`](crate::SuiteOptions::lifecycle_timeout)).
        limit: Duration,
    },
}
