//! [`PoolPath`]: each way openab-core's `SessionPool` ends a connection, as an explicit runtime call.

use std::fmt;

use session_runtime::{CloseReason, Result, SessionId, SessionRuntime, SuspendReason};

/// The pool's termination paths. Today they all end in "drop the last `Arc`" and are
/// indistinguishable to the agent; here each says what should happen to compute and storage.
///
/// Replacing a dead connection is not a termination path: open the session again
/// ([`ThreadSessions::open`](crate::compat::ThreadSessions::open)); its `attach` starts a new
/// generation and fences whatever was left of the old one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PoolPath {
    /// `reset_session`: the user asked for a clean slate.
    ExplicitReset,
    /// `cleanup_idle`: no activity for the idle TTL.
    IdleEviction,
    /// `get_or_create` at `max_sessions`: the least recently active session makes room.
    CapacityEviction,
    /// `cleanup_idle` found a turn in flight for longer than the hung threshold.
    HungEviction,
    /// `shutdown` when the broker stops.
    BrokerShutdown,
    /// The thread was archived or an administrator closed it.
    ThreadArchived,
}

/// The runtime call a [`PoolPath`] makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RuntimeCall {
    /// `suspend(reason)`: compute released, storage kept, resumable with `session/load`.
    Suspend(SuspendReason),
    /// `close(reason)`: the session ends; storage per the retention policy.
    Close(CloseReason),
}

impl fmt::Display for RuntimeCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuntimeCall::Suspend(reason) => write!(f, "suspend({reason})"),
            RuntimeCall::Close(reason) => write!(f, "close({reason})"),
        }
    }
}

impl PoolPath {
    /// Every path, for tables and tests.
    pub const ALL: [PoolPath; 6] = [
        PoolPath::ExplicitReset,
        PoolPath::IdleEviction,
        PoolPath::CapacityEviction,
        PoolPath::HungEviction,
        PoolPath::BrokerShutdown,
        PoolPath::ThreadArchived,
    ];

    /// The runtime call this path makes.
    pub fn call(self) -> RuntimeCall {
        match self {
            PoolPath::ExplicitReset => RuntimeCall::Close(CloseReason::Reset),
            PoolPath::IdleEviction => RuntimeCall::Suspend(SuspendReason::Idle),
            PoolPath::CapacityEviction => RuntimeCall::Suspend(SuspendReason::Capacity),
            PoolPath::HungEviction => RuntimeCall::Suspend(SuspendReason::Hung),
            PoolPath::BrokerShutdown => RuntimeCall::Suspend(SuspendReason::Shutdown),
            PoolPath::ThreadArchived => RuntimeCall::Close(CloseReason::Ended),
        }
    }

    /// Whether the pool keeps the thread's ACP session id for `session/load` afterwards.
    ///
    /// Hung eviction keeps storage (the turn is not assumed durable, the workspace is) but, as
    /// upstream does, drops the ACP session id: the old process may have owned the turn.
    pub fn resumable(self) -> bool {
        matches!(
            self,
            PoolPath::IdleEviction | PoolPath::CapacityEviction | PoolPath::BrokerShutdown
        )
    }

    /// Makes the call.
    ///
    /// # Errors
    /// As [`SessionRuntime::suspend`] and [`SessionRuntime::close`]; both are idempotent, so a
    /// failed call can be repeated.
    pub async fn apply(self, runtime: &dyn SessionRuntime, id: &SessionId) -> Result<()> {
        match self.call() {
            RuntimeCall::Suspend(reason) => runtime.suspend(id, reason).await,
            RuntimeCall::Close(reason) => runtime.close(id, reason).await,
        }
    }
}
