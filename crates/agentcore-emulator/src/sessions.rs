//! The session table: one entry per runtime session the emulator has seen, its running worker
//! (if any), its last activity, and the tokens that cut its streams.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::error::WorkerError;
use crate::worker::{RunningWorker, SessionKey, WorkerLauncher};

/// Counts worker starts.
static STARTS: AtomicU64 = AtomicU64::new(0);

/// What a request needs of a running worker, without holding the session's lock.
#[derive(Debug, Clone)]
pub(crate) struct Ticket {
    /// The worker's address.
    pub(crate) addr: SocketAddr,
    /// Cancelled when this worker stops: every stream to it is cut.
    pub(crate) stopped: CancellationToken,
    /// When it started (for the maximum lifetime).
    pub(crate) started: Instant,
    /// Which start this was (unique in the process): tells a worker from its successor.
    pub(crate) start_number: u64,
}

#[derive(Debug)]
struct Live {
    worker: Box<dyn RunningWorker>,
    ticket: Ticket,
}

/// One emulated runtime session.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) key: SessionKey,
    /// The running worker. An async lock: starting and stopping happen one at a time.
    worker: tokio::sync::Mutex<Option<Live>>,
    /// The running worker's ticket, readable without waiting for a start or stop.
    current: Mutex<Option<Ticket>>,
    /// The last request or stream traffic.
    last_activity: Mutex<Instant>,
    /// Cancelled (and replaced) to drop every open WebSocket of the session.
    websockets: Mutex<CancellationToken>,
}

impl Session {
    fn new(key: SessionKey) -> Self {
        Self {
            key,
            worker: tokio::sync::Mutex::new(None),
            current: Mutex::new(None),
            last_activity: Mutex::new(Instant::now()),
            websockets: Mutex::new(CancellationToken::new()),
        }
    }

    /// Records activity now (a request, or bytes on a stream).
    pub(crate) fn touch(&self) {
        *self.last_activity.lock() = Instant::now();
    }

    /// How long since the last activity.
    pub(crate) fn idle_for(&self) -> Duration {
        self.last_activity.lock().elapsed()
    }

    /// The running worker's ticket, if one runs.
    pub(crate) fn ticket(&self) -> Option<Ticket> {
        self.current.lock().clone()
    }

    /// The token a new WebSocket of this session watches.
    pub(crate) fn websocket_token(&self) -> CancellationToken {
        self.websockets.lock().clone()
    }

    /// Cuts every open WebSocket of the session (later ones are unaffected).
    pub(crate) fn drop_websockets(&self) {
        let old = std::mem::take(&mut *self.websockets.lock());
        old.cancel();
    }
}

/// Every session seen, and the launcher that runs their workers.
#[derive(Debug)]
pub(crate) struct Sessions {
    map: Mutex<HashMap<SessionKey, Arc<Session>>>,
    launcher: Arc<dyn WorkerLauncher>,
}

impl Sessions {
    pub(crate) fn new(launcher: Arc<dyn WorkerLauncher>) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            launcher,
        }
    }

    pub(crate) fn launcher(&self) -> &Arc<dyn WorkerLauncher> {
        &self.launcher
    }

    /// The session of `key`, made known if it was not.
    pub(crate) fn entry(&self, key: &SessionKey) -> Arc<Session> {
        Arc::clone(
            self.map
                .lock()
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Session::new(key.clone()))),
        )
    }

    /// The session of `key`, if known.
    pub(crate) fn get(&self, key: &SessionKey) -> Option<Arc<Session>> {
        self.map.lock().get(key).cloned()
    }

    /// Every known session.
    pub(crate) fn all(&self) -> Vec<Arc<Session>> {
        self.map.lock().values().cloned().collect()
    }

    /// The running worker of `session`, started now if none runs.
    pub(crate) async fn ensure_worker(&self, session: &Session) -> Result<Ticket, WorkerError> {
        let mut worker = session.worker.lock().await;
        if let Some(live) = worker.as_ref() {
            return Ok(live.ticket.clone());
        }
        let started = self.launcher.start(&session.key).await?;
        let ticket = Ticket {
            addr: started.address(),
            stopped: CancellationToken::new(),
            started: Instant::now(),
            start_number: STARTS.fetch_add(1, Ordering::Relaxed),
        };
        *session.current.lock() = Some(ticket.clone());
        *worker = Some(Live {
            worker: started,
            ticket: ticket.clone(),
        });
        session.touch();
        Ok(ticket)
    }

    /// Stops `session`'s worker, cutting its streams first; whether one was running.
    ///
    /// `only` limits the stop to that worker (a reaper decision about a worker that was already
    /// replaced must not stop its successor).
    pub(crate) async fn stop(
        &self,
        session: &Session,
        why: &str,
        only: Option<&Ticket>,
    ) -> Result<bool, WorkerError> {
        let mut worker = session.worker.lock().await;
        let Some(live) = worker.take() else {
            return Ok(false);
        };
        if only.is_some_and(|ticket| ticket.start_number != live.ticket.start_number) {
            *worker = Some(live);
            return Ok(false);
        }
        *session.current.lock() = None;
        live.ticket.stopped.cancel();
        tracing::debug!(
            session = session.key.session_id(),
            why,
            "stopping an emulated session's worker"
        );
        live.worker.stop().await?;
        Ok(true)
    }

    /// Stops `session`'s worker and deletes its storage; the session is forgotten.
    pub(crate) async fn reset(&self, session: &Session, why: &str) -> Result<(), WorkerError> {
        self.stop(session, why, None).await?;
        // Hold the worker lock across the reset so no request starts a worker on storage that is
        // being deleted.
        let worker = session.worker.lock().await;
        self.launcher.reset_storage(&session.key).await?;
        drop(worker);
        self.map.lock().remove(&session.key);
        Ok(())
    }
}
