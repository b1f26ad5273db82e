//! What the runtimes record, through the [`metrics`] facade: the embedding broker (or
//! `oab-runtime controller`) installs the recorder and exporter it wants, and nothing is
//! recorded, at almost no cost, when it installs none. Every name and label is defined here,
//! once, for every backend.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | [`ATTACH_SECONDS`] | histogram | `backend`, `start` ([`StartKind`]) |
//! | [`WORKER_READY_SECONDS`] | histogram | `backend`, `start` |
//! | [`START_FAILURES`] | counter | `backend`, `cause` ([`Error::cause_label`]) |
//! | [`SESSIONS`] | gauge | `backend`, `phase` ([`SessionState::as_str`], or `provisioning`) |
//! | [`RECONCILE_SECONDS`] | histogram | `backend` |
//! | [`RECONCILE_ACTIONS`] | counter | `backend`, `action` |
//! | [`API_REQUESTS`] | counter | `backend`, `verb` |
//! | [`RELAY_RECONNECTS`] | counter | (none: the relay's client serves every backend with workers) |
//! | [`EGRESS_REQUESTS`] | counter | `kind` (`connect`, `http`, `route`, `other`), `status` |

use std::time::Duration;

use crate::{Error, SessionState, WorkerFailure};

/// From `attach` to the attachment being ready for the agent's output, in seconds; successful
/// attaches only. With a worker (Kubernetes), that is the relay's first byte, its handshake
/// answer; locally, the agent's process running in its sandbox.
pub const ATTACH_SECONDS: &str = "openab_attach_first_byte_seconds";
/// From a worker's creation to its readiness (a Pod's Ready condition), in seconds.
pub const WORKER_READY_SECONDS: &str = "openab_worker_ready_seconds";
/// Attaches that failed to start a worker, by classified cause.
pub const START_FAILURES: &str = "openab_start_failures_total";
/// Sessions by phase, as the last reconcile pass counted them.
pub const SESSIONS: &str = "openab_sessions";
/// How long a reconcile pass took, in seconds.
pub const RECONCILE_SECONDS: &str = "openab_reconcile_pass_seconds";
/// What reconcile passes did, by action.
pub const RECONCILE_ACTIONS: &str = "openab_reconcile_actions_total";
/// Requests to the platform's API (the Kubernetes API server), by verb.
pub const API_REQUESTS: &str = "openab_api_requests_total";
/// Times an attachment's link to its worker was lost and connected again.
pub const RELAY_RECONNECTS: &str = "openab_relay_reconnects_total";

/// Requests to an egress proxy (the local runtime's or the gateway), by kind and answer.
pub const EGRESS_REQUESTS: &str = "openab_egress_requests_total";

/// How a worker came to serve an attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartKind {
    /// The session's first worker.
    New,
    /// A worker after a suspend.
    Resume,
    /// A worker in place of one that still ran (another broker's, or one replaced).
    Replacement,
    /// No new worker: a running one taken over from an older broker.
    TakeOver,
    /// No new worker: a warm one (started with no session, from a backend's pool) claimed.
    Warm,
}

impl StartKind {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            StartKind::New => "new",
            StartKind::Resume => "resume",
            StartKind::Replacement => "replacement",
            StartKind::TakeOver => "takeover",
            StartKind::Warm => "warm",
        }
    }

    /// How an attach of a session in `state` starts its worker.
    pub fn of(state: SessionState) -> StartKind {
        match state {
            SessionState::Created => StartKind::New,
            SessionState::Running => StartKind::Replacement,
            _ => StartKind::Resume,
        }
    }
}

/// Describes every metric (units and help text) to the installed recorder; call once after
/// installing one.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_histogram!(
        ATTACH_SECONDS,
        Unit::Seconds,
        "From attach to the worker's first byte"
    );
    describe_histogram!(
        WORKER_READY_SECONDS,
        Unit::Seconds,
        "From a worker's creation to its readiness"
    );
    describe_counter!(START_FAILURES, "Attaches that failed to start a worker, by cause");
    describe_gauge!(SESSIONS, "Sessions by phase at the last reconcile pass");
    describe_histogram!(RECONCILE_SECONDS, Unit::Seconds, "Reconcile pass duration");
    describe_counter!(RECONCILE_ACTIONS, "Reconcile actions, by kind");
    describe_counter!(API_REQUESTS, "Requests to the platform API, by verb");
    describe_counter!(RELAY_RECONNECTS, "Worker links lost and connected again");
    describe_counter!(EGRESS_REQUESTS, "Egress proxy requests, by kind and status");
}

/// Records a successful attach of `backend` that started as `start` and took `elapsed`.
pub fn attached(backend: &'static str, start: StartKind, elapsed: Duration) {
    metrics::histogram!(ATTACH_SECONDS, "backend" => backend, "start" => start.label()).record(elapsed);
}

/// Records a worker of `backend` that became ready `elapsed` after it was created.
pub fn worker_ready(backend: &'static str, start: StartKind, elapsed: Duration) {
    metrics::histogram!(WORKER_READY_SECONDS, "backend" => backend, "start" => start.label()).record(elapsed);
}

/// Records an attach of `backend` that failed with `error`.
pub fn start_failed(backend: &'static str, error: &Error) {
    metrics::counter!(START_FAILURES, "backend" => backend, "cause" => error.cause_label()).increment(1);
}

/// Sets the number of sessions of `backend` in `phase`.
pub fn sessions(backend: &'static str, phase: &'static str, count: usize) {
    metrics::gauge!(SESSIONS, "backend" => backend, "phase" => phase).set(count as f64);
}

/// Records a reconcile pass of `backend` that took `elapsed`.
pub fn reconciled(backend: &'static str, elapsed: Duration) {
    metrics::histogram!(RECONCILE_SECONDS, "backend" => backend).record(elapsed);
}

/// Counts `count` reconcile actions of kind `action`.
pub fn reconcile_actions(backend: &'static str, action: &'static str, count: usize) {
    if count > 0 {
        metrics::counter!(RECONCILE_ACTIONS, "backend" => backend, "action" => action)
            .increment(count as u64);
    }
}

/// Counts one request to the platform's API with `verb`.
pub fn api_request(backend: &'static str, verb: &'static str) {
    metrics::counter!(API_REQUESTS, "backend" => backend, "verb" => verb).increment(1);
}

/// Counts one request to an egress proxy of `kind`, answered `status`.
pub fn egress_request(kind: &'static str, status: u16) {
    metrics::counter!(EGRESS_REQUESTS, "kind" => kind, "status" => status.to_string()).increment(1);
}

/// Counts one reconnect of an attachment's link to its worker's relay.
pub fn relay_reconnected() {
    metrics::counter!(RELAY_RECONNECTS).increment(1);
}

impl WorkerFailure {
    /// A stable label for the cause (metrics, logs): `start_timeout`, `spawn`, `image_pull`,
    /// `unschedulable`, `out_of_memory`, `evicted` or `exited`.
    pub fn label(&self) -> &'static str {
        match self {
            WorkerFailure::StartTimeout(_) => "start_timeout",
            WorkerFailure::Spawn(_) => "spawn",
            WorkerFailure::ImagePull(_) => "image_pull",
            WorkerFailure::Unschedulable(_) => "unschedulable",
            WorkerFailure::OutOfMemory => "out_of_memory",
            WorkerFailure::Evicted(_) => "evicted",
            WorkerFailure::Exited(_) => "exited",
        }
    }
}

impl Error {
    /// A stable label for why an operation failed: the [`WorkerFailure`]'s for
    /// [`Error::WorkerFailed`], else the error's kind (`fenced`, `storage_in_use`, `backend`...).
    pub fn cause_label(&self) -> &'static str {
        match self {
            Error::WorkerFailed { cause, .. } => cause.label(),
            Error::InvalidIdentity { .. } => "invalid_identity",
            Error::InvalidConfig { .. } => "invalid_config",
            Error::InvalidArgument { .. } => "invalid_argument",
            Error::InvalidOverlay { .. } => "invalid_overlay",
            Error::NotFound { .. } => "not_found",
            Error::InvalidState { .. } => "invalid_state",
            Error::Fenced { .. } => "fenced",
            Error::Disconnected { .. } => "disconnected",
            Error::Unsupported { .. } => "unsupported",
            Error::StorageInUse { .. } => "storage_in_use",
            Error::StorageLost { .. } => "storage_lost",
            Error::Backend { .. } => "backend",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SessionIdentity;

    #[test]
    fn labels_are_stable_words() {
        let id = SessionIdentity::new("i", "a", "p", "t").expect("identity").id();
        let oom = Error::WorkerFailed {
            id,
            cause: WorkerFailure::OutOfMemory,
        };
        assert_eq!(oom.cause_label(), "out_of_memory");
        assert_eq!(
            Error::StorageInUse {
                id,
                holder: "x".into()
            }
            .cause_label(),
            "storage_in_use"
        );
        assert_eq!(StartKind::of(SessionState::Created), StartKind::New);
        assert_eq!(StartKind::of(SessionState::Suspended).label(), "resume");
        assert_eq!(StartKind::of(SessionState::Running).label(), "replacement");
    }
}
