//! The platform's clock: the idle timeout as AgentCore documents it, the maximum lifetime, and
//! session storage expiry.
//!
//! The idle clock of a running session restarts at every request for it (an invocation, a
//! WebSocket upgrade), whenever its `/ping` answers `HealthyBusy`, and whenever the
//! `time_of_last_update` its `/ping` reports changes; frames on an open WebSocket restart it only
//! with [`EmulatorBuilder::stream_bytes_are_activity`](crate::EmulatorBuilder::stream_bytes_are_activity).
//! A session whose clock reaches the idle timeout is stopped.

use std::sync::Arc;
use std::time::Duration;

use crate::proxy;
use crate::server::Shared;

/// AgentCore's lifecycle settings for the emulated runtimes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifecycle {
    /// A session whose idle clock (see the module docs) reaches this is stopped (default 900 s,
    /// AgentCore's `idleRuntimeSessionTimeout`).
    pub idle_timeout: Duration,
    /// A worker is stopped at this age, even mid-stream (default 8 h).
    pub max_lifetime: Duration,
    /// A session's storage is deleted after this long without use (default 14 days).
    pub storage_expiry: Duration,
}

impl Lifecycle {
    /// AgentCore's default idle timeout.
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(900);
    /// AgentCore's default maximum lifetime.
    pub const DEFAULT_MAX_LIFETIME: Duration = Duration::from_secs(8 * 3600);
    /// Session storage's idle expiry.
    pub const DEFAULT_STORAGE_EXPIRY: Duration = Duration::from_secs(14 * 24 * 3600);

    /// How often the clock looks: a small fraction of the shortest limit, within 50 ms to 1 s.
    fn tick(&self) -> Duration {
        let shortest = self.idle_timeout.min(self.max_lifetime).min(self.storage_expiry);
        (shortest / 10).clamp(Duration::from_millis(50), Duration::from_secs(1))
    }
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            idle_timeout: Self::DEFAULT_IDLE_TIMEOUT,
            max_lifetime: Self::DEFAULT_MAX_LIFETIME,
            storage_expiry: Self::DEFAULT_STORAGE_EXPIRY,
        }
    }
}

/// Runs until shutdown.
pub(crate) async fn run(shared: Arc<Shared>, lifecycle: Lifecycle) {
    let mut tick = tokio::time::interval(lifecycle.tick());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        for session in shared.sessions.all() {
            match session.ticket() {
                Some(ticket) if ticket.started.elapsed() >= lifecycle.max_lifetime => {
                    let _ = shared
                        .sessions
                        .stop(&session, "maximum lifetime", Some(&ticket))
                        .await;
                }
                Some(ticket) => {
                    // AgentCore asks `/ping` continually; a worker that does not answer is not
                    // busy and reports nothing new.
                    let status = proxy::ping(ticket.addr).await;
                    let update = status.and_then(|status| status.time_of_last_update);
                    let busy = status.is_some_and(|status| status.busy);
                    if session.note_reported_update(update) || busy {
                        session.touch();
                    } else if session.idle_for() >= lifecycle.idle_timeout {
                        let _ = shared
                            .sessions
                            .stop(&session, "idle timeout", Some(&ticket))
                            .await;
                    }
                }
                None if session.idle_for() >= lifecycle.storage_expiry => {
                    if let Err(error) = shared.sessions.reset(&session, "session storage expired").await {
                        tracing::warn!(%error, session = session.key.session_id(), "storage expiry failed");
                    }
                }
                None => {}
            }
        }
    }
}
