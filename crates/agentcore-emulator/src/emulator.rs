//! [`Emulator`] and its [`EmulatorBuilder`].

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::arn::{valid_runtime_id, RuntimeArn};
use crate::credentials::TestCredentials;
use crate::error::{EmulatorError, WorkerError};
use crate::faults::{Fault, FaultPlan, Operation, RequestLog, RequestRecord};
use crate::lifecycle::{self, Lifecycle};
use crate::local::{LocalLauncher, WorkerCommand};
use crate::server::{self, Quotas, Shared};
use crate::sessions::Sessions;
use crate::storage::StorageLimits;
use crate::websocket::WebSocketLimits;
use crate::worker::{SandboxReport, SessionKey, WorkerLauncher};

/// The runtime id the emulator serves unless told otherwise.
pub const DEFAULT_RUNTIME_ID: &str = "emulated-AbCdEf1234";
/// The account of the emulated runtimes unless told otherwise.
pub const DEFAULT_ACCOUNT: &str = "123456789012";
/// The region unless told otherwise.
pub const DEFAULT_REGION: &str = "us-east-1";

/// Where the workers come from, until [`EmulatorBuilder::start`] makes a launcher of it.
#[derive(Debug)]
enum Workers {
    Launcher(Arc<dyn WorkerLauncher>),
    Command(WorkerCommand),
}

/// Configures an [`Emulator`]. Every setting has AgentCore's default except the workers,
/// which must be given ([`worker_command`](Self::worker_command) or
/// [`launcher`](Self::launcher)).
#[derive(Debug)]
pub struct EmulatorBuilder {
    region: String,
    account: String,
    runtime_ids: Vec<String>,
    qualifiers: Vec<String>,
    credentials: TestCredentials,
    lifecycle: Lifecycle,
    workers: Option<Workers>,
    websocket: WebSocketLimits,
    stream_bytes_are_activity: bool,
    invocations_per_second: usize,
    max_active_sessions: usize,
    stop_latency: Duration,
    chunk_invocation_bodies: bool,
    storage: StorageLimits,
}

/// AgentCore's quota of `InvokeAgentRuntime` calls (WebSocket upgrades included) per second
/// per endpoint.
pub const DEFAULT_INVOCATIONS_PER_SECOND: usize = 25;
/// AgentCore's quota of active sessions (microVMs) per account in the largest regions.
pub const DEFAULT_MAX_ACTIVE_SESSIONS: usize = 1000;
/// How long AgentCore may take to terminate a stopped session's microVM.
pub const DEFAULT_STOP_LATENCY: Duration = Duration::from_secs(15);

impl EmulatorBuilder {
    /// The region the emulated runtimes live in (and signatures must be scoped to).
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = region.into();
        self
    }

    /// The 12-digit account of the emulated runtimes.
    pub fn account_id(mut self, account: impl Into<String>) -> Self {
        self.account = account.into();
        self
    }

    /// Serves a runtime with this id (`name-XXXXXXXXXX`); the first call replaces the default
    /// [`DEFAULT_RUNTIME_ID`], later ones add runtimes.
    pub fn runtime(mut self, runtime_id: impl Into<String>) -> Self {
        if self.runtime_ids == [DEFAULT_RUNTIME_ID] {
            self.runtime_ids.clear();
        }
        self.runtime_ids.push(runtime_id.into());
        self
    }

    /// Accepts this endpoint name as `qualifier` besides `DEFAULT`.
    pub fn qualifier(mut self, name: impl Into<String>) -> Self {
        self.qualifiers.push(name.into());
        self
    }

    /// The credentials signatures are verified against (default [`TestCredentials::default`]).
    pub fn credentials(mut self, credentials: TestCredentials) -> Self {
        self.credentials = credentials;
        self
    }

    /// The idle timeout (default 900 s).
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.lifecycle.idle_timeout = timeout;
        self
    }

    /// The maximum lifetime of a worker (default 8 h).
    pub fn max_lifetime(mut self, lifetime: Duration) -> Self {
        self.lifecycle.max_lifetime = lifetime;
        self
    }

    /// How long unused session storage is kept (default 14 days).
    pub fn storage_expiry(mut self, expiry: Duration) -> Self {
        self.lifecycle.storage_expiry = expiry;
        self
    }

    /// The WebSocket quotas per connection (default [`WebSocketLimits::default`]: 32 KB frames,
    /// 250 frames per second each way, 60 minutes). A connection breaking one is closed.
    pub fn websocket_limits(mut self, limits: WebSocketLimits) -> Self {
        self.websocket = limits;
        self
    }

    /// Whether WebSocket frames count as session activity for the idle timeout (default
    /// `false`: AgentCore documents only invocations and `/ping` as what keeps a session; this
    /// flag models the other reading, for comparison).
    pub fn stream_bytes_are_activity(mut self, counted: bool) -> Self {
        self.stream_bytes_are_activity = counted;
        self
    }

    /// The most `InvokeAgentRuntime` calls and WebSocket upgrades per second per endpoint
    /// (default [`DEFAULT_INVOCATIONS_PER_SECOND`]); more are `429 ThrottlingException`.
    pub fn invocations_per_second(mut self, quota: usize) -> Self {
        self.invocations_per_second = quota;
        self
    }

    /// The most sessions with a running microVM at once (default
    /// [`DEFAULT_MAX_ACTIVE_SESSIONS`]); a call that would start one more is
    /// `402 ServiceQuotaExceededException`.
    pub fn max_active_sessions(mut self, quota: usize) -> Self {
        self.max_active_sessions = quota;
        self
    }

    /// How long a stopped session's microVM takes to terminate (default
    /// [`DEFAULT_STOP_LATENCY`]): its streams are cut at once, and invocations of the session
    /// meanwhile are `409 RetryableConflictException`.
    pub fn stop_latency(mut self, latency: Duration) -> Self {
        self.stop_latency = latency;
        self
    }

    /// Forwards every `InvokeAgentRuntime` body to the container chunked
    /// (`Transfer-Encoding: chunked`, several chunks), not only those the client sent chunked
    /// (default `false`). AgentCore's front is a streaming proxy whose framing towards the
    /// container is not documented; this makes a container prove it reads both.
    pub fn chunk_invocation_bodies(mut self, chunked: bool) -> Self {
        self.chunk_invocation_bodies = chunked;
        self
    }

    /// Session storage limits of the default [`LocalLauncher`] (default
    /// [`StorageLimits::default`]: AgentCore's reported 1 GB cap, no hard links, FIFOs, UNIX
    /// sockets, xattrs or `fallocate`, absent while a worker starts). A launcher given with
    /// [`launcher`](Self::launcher) keeps its own
    /// ([`LocalLauncherBuilder::storage_limits`](crate::LocalLauncherBuilder::storage_limits)).
    pub fn storage_limits(mut self, limits: StorageLimits) -> Self {
        self.storage = limits;
        self
    }

    /// Runs workers with the default [`LocalLauncher`] (sandbox `auto`, falling back to plain
    /// processes; storage under a fresh temporary root) running `command`.
    pub fn worker_command(mut self, command: WorkerCommand) -> Self {
        self.workers = Some(Workers::Command(command));
        self
    }

    /// Runs workers with `launcher` (e.g. a [`LocalLauncher`] built with its own root and
    /// sandbox mode, or a test's own).
    pub fn launcher(mut self, launcher: impl WorkerLauncher) -> Self {
        self.workers = Some(Workers::Launcher(Arc::new(launcher)));
        self
    }

    fn check(&self) -> Result<(), EmulatorError> {
        let invalid = |key: &'static str, reason: String| Err(EmulatorError::InvalidConfig { key, reason });
        let region_ok = !self.region.is_empty()
            && self
                .region
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if !region_ok {
            return invalid("region", format!("{:?} is not a region name", self.region));
        }
        if self.account.len() != 12 || !self.account.chars().all(|c| c.is_ascii_digit()) {
            return invalid("account_id", format!("{:?} is not 12 digits", self.account));
        }
        if let Some(bad) = self.runtime_ids.iter().find(|id| !valid_runtime_id(id)) {
            return invalid(
                "runtime",
                format!("{bad:?} is not a runtime id like name-AbCdEf1234"),
            );
        }
        if let Some(bad) = self.qualifiers.iter().find(|q| !server::valid_qualifier(q)) {
            return invalid("qualifier", format!("{bad:?} is not an endpoint name"));
        }
        for (key, value) in [
            ("websocket_limits.max_frame_bytes", self.websocket.max_frame_bytes),
            (
                "websocket_limits.max_frames_per_second",
                self.websocket.max_frames_per_second,
            ),
            ("invocations_per_second", self.invocations_per_second),
            ("max_active_sessions", self.max_active_sessions),
        ] {
            if value == 0 {
                return invalid(key, "must be at least 1".into());
            }
        }
        for (key, value) in [
            ("websocket_limits.max_duration", self.websocket.max_duration),
            ("idle_timeout", self.lifecycle.idle_timeout),
            ("max_lifetime", self.lifecycle.max_lifetime),
            ("storage_expiry", self.lifecycle.storage_expiry),
        ] {
            if value.is_zero() {
                return invalid(key, "must be longer than zero".into());
            }
        }
        Ok(())
    }

    /// Binds 127.0.0.1 on a free port and starts serving.
    ///
    /// # Errors
    /// [`EmulatorError::InvalidConfig`] for a bad setting or no workers configured (naming the
    /// builder method), [`EmulatorError::Bind`] if the port cannot be bound.
    pub async fn start(self) -> Result<Emulator, EmulatorError> {
        self.check()?;
        let launcher: Arc<dyn WorkerLauncher> = match self.workers {
            Some(Workers::Launcher(launcher)) => launcher,
            Some(Workers::Command(command)) => Arc::new(
                LocalLauncher::builder(command)
                    .storage_limits(self.storage)
                    .build()?,
            ),
            None => {
                return Err(EmulatorError::InvalidConfig {
                    key: "worker_command",
                    reason: "no workers: give a worker command or a launcher".into(),
                })
            }
        };
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(EmulatorError::Bind)?;
        let addr = listener.local_addr().map_err(EmulatorError::Bind)?;
        let runtimes = self
            .runtime_ids
            .iter()
            .map(|id| RuntimeArn::new(&self.region, &self.account, id))
            .collect();
        let mut qualifiers = vec!["DEFAULT".to_owned()];
        qualifiers.extend(self.qualifiers);
        let shared = Arc::new(Shared {
            region: self.region,
            runtimes,
            qualifiers,
            credentials: self.credentials,
            token_expired: AtomicBool::new(false),
            sessions: Sessions::new(launcher, self.stop_latency, self.max_active_sessions),
            faults: FaultPlan::default(),
            log: RequestLog::default(),
            shutdown: CancellationToken::new(),
            quotas: Quotas {
                websocket: self.websocket,
                stream_bytes_are_activity: self.stream_bytes_are_activity,
                invocations_per_second: self.invocations_per_second,
                chunk_invocation_bodies: self.chunk_invocation_bodies,
            },
            calls: Mutex::new(HashMap::new()),
        });
        let tasks = vec![
            tokio::spawn(server::serve(Arc::clone(&shared), listener)),
            tokio::spawn(lifecycle::run(Arc::clone(&shared), self.lifecycle)),
        ];
        tracing::info!(%addr, sandbox = %shared.sessions.launcher().sandbox(), "agentcore emulator listening");
        Ok(Emulator {
            shared,
            addr,
            lifecycle: self.lifecycle,
            tasks,
        })
    }
}

/// A running emulator of AgentCore Runtime's data plane on 127.0.0.1. See the crate docs.
///
/// Dropping it stops serving; call [`shutdown`](Self::shutdown) to also stop every worker and
/// wait for it.
#[derive(Debug)]
pub struct Emulator {
    shared: Arc<Shared>,
    addr: SocketAddr,
    lifecycle: Lifecycle,
    tasks: Vec<JoinHandle<()>>,
}

impl Emulator {
    /// A builder with AgentCore's defaults.
    pub fn builder() -> EmulatorBuilder {
        EmulatorBuilder {
            region: DEFAULT_REGION.into(),
            account: DEFAULT_ACCOUNT.into(),
            runtime_ids: vec![DEFAULT_RUNTIME_ID.into()],
            qualifiers: Vec::new(),
            credentials: TestCredentials::default(),
            lifecycle: Lifecycle::default(),
            workers: None,
            websocket: WebSocketLimits::default(),
            stream_bytes_are_activity: false,
            invocations_per_second: DEFAULT_INVOCATIONS_PER_SECOND,
            max_active_sessions: DEFAULT_MAX_ACTIVE_SESSIONS,
            stop_latency: DEFAULT_STOP_LATENCY,
            chunk_invocation_bodies: false,
            storage: StorageLimits::default(),
        }
    }

    /// `http://127.0.0.1:PORT`: the SDK's `endpoint_url`.
    pub fn endpoint_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The region.
    pub fn region(&self) -> &str {
        &self.shared.region
    }

    /// The first (by default the only) runtime's ARN.
    pub fn runtime_arn(&self) -> &RuntimeArn {
        // The builder refuses an empty list: `runtime` only ever adds.
        &self.shared.runtimes[0]
    }

    /// Every runtime's ARN.
    pub fn runtime_arns(&self) -> &[RuntimeArn] {
        &self.shared.runtimes
    }

    /// The credentials it accepts.
    pub fn credentials(&self) -> &TestCredentials {
        &self.shared.credentials
    }

    /// Its lifecycle settings.
    pub fn lifecycle(&self) -> Lifecycle {
        self.lifecycle
    }

    /// The sandbox workers run in.
    pub fn sandbox(&self) -> SandboxReport {
        self.shared.sessions.launcher().sandbox()
    }

    fn key(&self, session_id: &str) -> SessionKey {
        SessionKey::new(self.runtime_arn().clone(), session_id)
    }

    /// The host directory of `session_id`'s storage (first runtime), once it has one.
    pub async fn session_storage(&self, session_id: &str) -> Option<PathBuf> {
        self.shared
            .sessions
            .launcher()
            .storage_path(&self.key(session_id))
            .await
    }

    /// Whether `session_id` (first runtime) has a running worker.
    pub fn is_running(&self, session_id: &str) -> bool {
        self.shared
            .sessions
            .get(&self.key(session_id))
            .is_some_and(|session| session.ticket().is_some())
    }

    /// Stops `session_id`'s worker as the platform would (its streams are cut, storage kept);
    /// whether one was running.
    ///
    /// # Errors
    /// [`WorkerError`] if the launcher could not stop it.
    pub async fn stop_session(&self, session_id: &str) -> Result<bool, WorkerError> {
        match self.shared.sessions.get(&self.key(session_id)) {
            Some(session) => {
                self.shared
                    .sessions
                    .stop(&session, "stopped by the test", None)
                    .await
            }
            None => Ok(false),
        }
    }

    /// A new runtime version: every session's worker is stopped and its storage reset, as
    /// updating a runtime resets session storage.
    ///
    /// # Errors
    /// The first [`WorkerError`] met (the other sessions are still reset).
    pub async fn bump_runtime_version(&self) -> Result<(), WorkerError> {
        let mut first_error = None;
        for session in self.shared.sessions.all() {
            if let Err(error) = self
                .shared
                .sessions
                .reset(&session, "runtime version changed")
                .await
            {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Makes the next `count` calls of `operation` answer `fault`.
    pub fn fail_next(&self, operation: Operation, count: usize, fault: Fault) {
        self.shared.faults.arm(operation, count, fault);
    }

    /// Delays every chunk of an invocation's answer forwarded from a worker to a client by
    /// `delay`; `None` ends it.
    pub fn slow_stream(&self, delay: Option<Duration>) {
        self.shared.faults.set_chunk_delay(delay);
    }

    /// Cuts every open WebSocket of `session_id` (first runtime) now, both directions; the
    /// worker keeps running. Whether the session was known.
    pub fn drop_websockets(&self, session_id: &str) -> bool {
        match self.shared.sessions.get(&self.key(session_id)) {
            Some(session) => {
                session.drop_websockets();
                true
            }
            None => false,
        }
    }

    /// Marks the session token as expired (requests then get `ExpiredTokenException`), or not.
    pub fn expire_session_token(&self, expired: bool) {
        self.shared.token_expired.store(expired, Ordering::Relaxed);
    }

    /// Disarms every fault and the slow stream.
    pub fn clear_faults(&self) {
        self.shared.faults.clear();
    }

    /// Every request answered so far, in order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.log.snapshot()
    }

    /// Forgets the request log.
    pub fn clear_requests(&self) {
        self.shared.log.clear();
    }

    /// Stops serving, cuts every stream and stops every worker (storage stays).
    ///
    /// # Errors
    /// The first [`WorkerError`] met stopping a worker.
    pub async fn shutdown(mut self) -> Result<(), WorkerError> {
        self.shared.shutdown.cancel();
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
        let mut first_error = None;
        for session in self.shared.sessions.all() {
            if let Err(error) = self
                .shared
                .sessions
                .stop(&session, "emulator shutdown", None)
                .await
            {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
        self.shared.sessions.launcher().release();
    }
}
