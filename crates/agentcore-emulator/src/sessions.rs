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
    /// Until when the last stop is still terminating the microVM: requests meanwhile get
    /// `409 RetryableConflictException`.
    terminating_until: Mutex<Option<Instant>>,
    /// The `time_of_last_update` the worker's `/ping` last reported.
    reported_update: Mutex<Option<u64>>,
}

impl Session {
    fn new(key: SessionKey) -> Self {
        Self {
            key,
            worker: tokio::sync::Mutex::new(None),
            current: Mutex::new(None),
            last_activity: Mutex::new(Instant::now()),
            websockets: Mutex::new(CancellationToken::new()),
            terminating_until: Mutex::new(None),
            reported_update: Mutex::new(None),
        }
    }

    /// Notes the `time_of_last_update` a `/ping` reported; whether it changed since the last
    /// one (the first report of a worker counts as a change).
    pub(crate) fn note_reported_update(&self, reported: Option<u64>) -> bool {
        let mut last = self.reported_update.lock();
        let changed = reported.is_some() && *last != reported;
        *last = reported;
        changed
    }

    /// Whether a stop of this session is still terminating its microVM.
    pub(crate) fn is_terminating(&self) -> bool {
        self.terminating_until
            .lock()
            .is_some_and(|until| Instant::now() < until)
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
    /// How long a stopped session's microVM takes to terminate.
    stop_latency: Duration,
    /// The most sessions with a running worker at once (AgentCore's active session quota).
    max_active: usize,
}

/// Why no worker could be had for a session.
#[derive(Debug)]
pub(crate) enum NoWorker {
    /// As many sessions as the quota allows already run.
    AtCapacity(usize),
    /// The launcher failed.
    Failed(WorkerError),
}

impl Sessions {
    pub(crate) fn new(launcher: Arc<dyn WorkerLauncher>, stop_latency: Duration, max_active: usize) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            launcher,
            stop_latency,
            max_active,
        }
    }

    /// How many sessions have a running worker.
    fn active(&self) -> usize {
        self.all()
            .iter()
            .filter(|session| session.ticket().is_some())
            .count()
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
    ///
    /// A new worker beyond the active session quota is refused ([`NoWorker::AtCapacity`]).
    pub(crate) async fn ensure_worker(&self, session: &Session) -> Result<Ticket, NoWorker> {
        let mut worker = session.worker.lock().await;
        if let Some(live) = worker.as_ref() {
            return Ok(live.ticket.clone());
        }
        if self.active() >= self.max_active {
            return Err(NoWorker::AtCapacity(self.max_active));
        }
        let started = self
            .launcher
            .start(&session.key)
            .await
            .map_err(NoWorker::Failed)?;
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
        *session.terminating_until.lock() = Some(Instant::now() + self.stop_latency);
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
