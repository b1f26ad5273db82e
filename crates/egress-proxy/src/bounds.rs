//! What one session may take of the process serving its egress, and how its refusals are logged.
//!
//! One process serves many sessions' egress (the broker for the local runtime): a session's
//! agent that floods its proxy must meet its own session's limits, never the process's. Per
//! session:
//!
//! - at most [`MAX_CONNECTIONS`] connections at once: a connection beyond them is answered `503`
//!   and closed at once, so no descriptor is held for it, and the session's accept loop then
//!   pauses [`REFUSAL_PAUSE`], so a connect loop costs no more than a few accepts a millisecond;
//! - a request head of at most [`MAX_HEAD`] bytes (hyper's read buffer; `431` beyond it),
//!   complete within [`HEAD_TIMEOUT`] of the connection or of the previous response (a
//!   whole-head deadline: a slow-loris sending a byte at a time gains nothing, and the
//!   connection is closed without an answer);
//!
//! so the memory a session's proxy holds is bounded: per connection, the read buffer of at most
//! [`MAX_HEAD`] and the two 8 KiB buffers of a tunnel, about 2 MiB per session in all.
//! Refusals are counted, and logged at most five at once and one a second after that,
//! each line saying how many were not logged since the last.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use session_runtime::SessionId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What a connection beyond its session's or the proxy's limit is answered, without reading it.
pub const OVER_LIMIT: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
/// Connections one session may have open through its proxy at once.
pub const MAX_CONNECTIONS: usize = 64;
/// The longest request head (request line and headers) the proxy reads: hyper's read buffer,
/// which may not be smaller than 8 KiB.
pub const MAX_HEAD: usize = 16 * 1024;
/// How long a client has, from its connection, to send its whole request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// How many refusals are logged at once before the rate of one a second applies.
const LOG_BURST: u32 = 5;
/// How often a refusal is logged once the burst is spent.
const LOG_INTERVAL: Duration = Duration::from_secs(1);
/// How long a session's accept loop pauses after refusing a connection over its limit: at most
/// about a thousand refusals a second per session, however fast its agent connects.
pub const REFUSAL_PAUSE: Duration = Duration::from_millis(1);
/// How long the accept loop waits when the process or system is out of descriptors or memory.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The limits and the refusal log of one session's proxy, shared by all its sockets.
#[derive(Debug)]
pub struct SessionBounds {
    /// The session, as its log lines name it (`-` for requests of no known session).
    session: String,
    connections: Arc<Semaphore>,
    log: Mutex<LogBucket>,
    refused: AtomicU64,
}

/// The token bucket of the refusal log.
#[derive(Debug)]
struct LogBucket {
    tokens: u32,
    refilled_at: Instant,
    unlogged: u64,
}

/// A connection's place among its session's [`MAX_CONNECTIONS`]: released when dropped.
#[derive(Debug)]
pub struct ConnectionSlot(#[allow(dead_code)] OwnedSemaphorePermit);

impl SessionBounds {
    /// The bounds of session `id`'s proxy, with nothing in use.
    pub fn new(id: SessionId) -> Arc<Self> {
        Self::named(id.to_string())
    }

    /// The bounds under which requests that no session is known for (no or a wrong credential
    /// at a gateway) are counted and logged, as session `-`.
    pub fn unattributed() -> Arc<Self> {
        Self::named("-".to_owned())
    }

    fn named(session: String) -> Arc<Self> {
        Arc::new(SessionBounds {
            session,
            connections: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            log: Mutex::new(LogBucket {
                tokens: LOG_BURST,
                refilled_at: Instant::now(),
                unlogged: 0,
            }),
            refused: AtomicU64::new(0),
        })
    }

    /// The session, as log lines name it.
    pub fn session(&self) -> &str {
        &self.session
    }

    /// A place for a new connection, or `None` when the session has [`MAX_CONNECTIONS`] open.
    pub fn connection(&self) -> Option<ConnectionSlot> {
        Arc::clone(&self.connections)
            .try_acquire_owned()
            .ok()
            .map(ConnectionSlot)
    }

    /// How many connections of the session the proxy holds now.
    pub fn open_connections(&self) -> usize {
        MAX_CONNECTIONS - self.connections.available_permits()
    }

    /// How many refusals the session's proxy has made (each counted, logged or not).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Counts a refusal of a request to `destination` (if it got that far) for `reason`, and
    /// logs it at WARN unless the session's refusals are being logged at their limit. Every
    /// agent-chosen value is escaped ([`LogSafe`]): `reason` and `destination` may hold them.
    pub fn refuse(&self, destination: Option<&str>, reason: &str) {
        let total = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let Some(unlogged) = self.may_log() else {
            return;
        };
        let id = &self.session;
        let reason = LogSafe(reason);
        match destination {
            Some(destination) => tracing::warn!(
                session = %id, destination = %LogSafe(destination), %reason, refused_total = total,
                unlogged_since_last = unlogged, "egress refused"
            ),
            None => tracing::warn!(
                session = %id, %reason, refused_total = total, unlogged_since_last = unlogged,
                "egress refused"
            ),
        }
    }

    /// Logs `what` at INFO within the same rate as refusals (connection failures a session's
    /// agent can cause at will), without counting a refusal.
    pub fn note(&self, destination: &str, what: &str) {
        if let Some(unlogged) = self.may_log() {
            tracing::info!(
                session = %self.session, destination = %LogSafe(destination),
                unlogged_since_last = unlogged, "egress {}", LogSafe(what)
            );
        }
    }

    /// Whether a line may be logged now; if so, how many were not logged since the last one.
    fn may_log(&self) -> Option<u64> {
        let mut bucket = self.log.lock();
        let now = Instant::now();
        let earned = now.duration_since(bucket.refilled_at).as_secs_f64() / LOG_INTERVAL.as_secs_f64();
        if earned >= 1.0 {
            // Whole tokens only; the fraction carries over as the time not yet counted.
            let whole = earned.floor();
            bucket.tokens = (f64::from(bucket.tokens) + whole).min(f64::from(LOG_BURST)) as u32;
            bucket.refilled_at += LOG_INTERVAL.mul_f64(whole);
        }
        if bucket.tokens == 0 {
            bucket.unlogged += 1;
            return None;
        }
        bucket.tokens -= 1;
        Some(std::mem::take(&mut bucket.unlogged))
    }
}

/// Whether an accept failed for want of descriptors or memory (the process's or the
/// system's), which only time can cure: the accept loop waits [`ACCEPT_BACKOFF`] instead of
/// retrying at once (spinning a core while the condition lasts).
pub fn accept_exhausted(error: &std::io::Error) -> bool {
    use rustix::io::Errno;
    matches!(
        Errno::from_io_error(error),
        Some(Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM)
    )
}

/// Shows an agent-chosen value in a log line with every control character (and the Unicode
/// line separators and bidirectional overrides a terminal would act on) escaped as `\u{..}`:
/// such a value can neither start a line of its own nor move the cursor, colour or hide text.
#[derive(Debug)]
pub struct LogSafe<'a>(pub &'a str);

impl fmt::Display for LogSafe<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write;
        for c in self.0.chars() {
            let acts_on_display = c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
            if acts_on_display {
                write!(f, "\\u{{{:x}}}", u32::from(c))?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_safe_escapes_what_would_start_a_line_or_drive_a_terminal() {
        let shown = LogSafe("a\nb\r\x1b[2K\u{202e}c\u{7f}d é").to_string();
        assert_eq!(shown, "a\\u{a}b\\u{d}\\u{1b}[2K\\u{202e}c\\u{7f}d é");
    }

    #[test]
    fn refusals_are_counted_and_logged_in_a_burst_then_once_a_second() {
        let id = session_runtime::SessionIdentity::new("i", "a", "p", "t")
            .expect("identity")
            .id();
        let bounds = SessionBounds::new(id);
        let logged = (0..100).filter(|_| bounds.may_log().is_some()).count();
        assert_eq!(logged, LOG_BURST as usize);
        assert_eq!(bounds.log.lock().unlogged, 100 - u64::from(LOG_BURST));
        // A second later, one more line, which carries the count of those not logged.
        bounds.log.lock().refilled_at -= LOG_INTERVAL;
        assert_eq!(bounds.may_log(), Some(100 - u64::from(LOG_BURST)));
        assert_eq!(bounds.may_log(), None);
        for _ in 0..3 {
            bounds.refuse(None, "test");
        }
        assert_eq!(bounds.refused(), 3);
    }

    #[test]
    fn connections_are_bounded_per_session() {
        let id = session_runtime::SessionIdentity::new("i", "a", "p", "t")
            .expect("identity")
            .id();
        let bounds = SessionBounds::new(id);
        let slots: Vec<_> = (0..MAX_CONNECTIONS).map_while(|_| bounds.connection()).collect();
        assert_eq!(slots.len(), MAX_CONNECTIONS);
        assert!(bounds.connection().is_none());
        drop(slots);
        assert!(bounds.connection().is_some());
    }
}
