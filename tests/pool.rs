//! openab-core's `SessionPool` behaviour (reproduced in `tests/pool_harness`) on top of the
//! compatibility layer, against three runtimes: `FakeRuntime`, the local runtime in plain mode and
//! the local runtime sandboxed with bubblewrap.
//!
//! Every scenario runs on each runtime (see `on_every_runtime!`) and checks, for its pool path:
//! - the runtime call and its reason, as recorded by `RecordingRuntime`;
//! - compute: the old worker's `SessionControl::is_alive`, and `status().worker`;
//! - storage: a marker file written through the test agent's exec probe (in the worker, in its
//!   working directory) survives suspend, hung eviction and a failed start, and is gone after a
//!   reset or an archived thread with the default retention policy (delete).
//!
//! Nothing here waits on the clock: idle and hung thresholds are zero or an hour, and long turns
//! are always cancelled or killed. Waits on the agent are bounded so a broken runtime fails a
//! test instead of hanging it.

mod pool_harness;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use openab_runtime::compat::{AcpCallError, PoolPath, ThreadSessions};
use openab_runtime::config::SandboxMode;
use openab_runtime::testing::{acp_test_agent_binary, FakeRuntime};
use openab_runtime::{
    AgentCommand, CloseReason, Error, IsolationLevel, LocalRuntime, SessionId, SessionRuntime, SessionState,
    SessionStatus, StorageState, SuspendReason,
};
use pool_harness::{
    Cleanup, ConnectionInfo, Op, Opened, PoolConfig, PoolError, RecordingRuntime, SessionPool, Turn,
};
use tempfile::TempDir;
use tokio::task::JoinHandle;

/// A Discord thread (a thread is its own channel).
const DISCORD: &str = "discord:1234567890";
/// Another Discord thread.
const DISCORD_2: &str = "discord:1234567891";
/// A Slack thread: channel and `thread_ts`, so the thread part has a `:` of its own.
const SLACK: &str = "slack:C0123ABC:1712345678.000100";
const INSTALLATION: &str = "pool-harness";
const AGENT: &str = "test-agent";
/// A turn that streams until it is cancelled or its worker is killed.
const LONG_TURN: &str = "/chunks=1000000 /delay_ms=20 keep going";
/// The file the storage checks write in the worker's working directory.
const MARKER: &str = ".pool-harness-marker";
/// The longest any single wait on an agent may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(30);
/// The test agent's JSON-RPC code for a session it does not know.
const UNKNOWN_SESSION: i64 = -32002;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Fake,
    LocalPlain,
    LocalSandboxed,
}

/// One test's runtime state: what outlives a broker process.
struct World {
    backend: Backend,
    /// The fake runtime lives in memory: a restarted broker gets the same instance.
    fake: Option<Arc<FakeRuntime>>,
    /// The local runtime's root: a restarted broker gets a new instance over it.
    root: TempDir,
    /// The pool's state directory (`thread_map.json`).
    state: TempDir,
}

impl World {
    fn new(backend: Backend) -> Self {
        let fake = (backend == Backend::Fake).then(|| {
            Arc::new(
                FakeRuntime::builder()
                    .installation(INSTALLATION)
                    .build()
                    .expect("fake runtime"),
            )
        });
        Self {
            backend,
            fake,
            root: tempfile::tempdir().expect("runtime root"),
            state: tempfile::tempdir().expect("pool state directory"),
        }
    }

    fn runtime(&self) -> Arc<dyn SessionRuntime> {
        let sandbox = match self.backend {
            Backend::Fake => return Arc::<FakeRuntime>::clone(self.fake.as_ref().expect("fake runtime")),
            Backend::LocalPlain => SandboxMode::None,
            Backend::LocalSandboxed => SandboxMode::Bubblewrap,
        };
        let agent = acp_test_agent_binary().expect("the acp-test-agent binary");
        let runtime = LocalRuntime::builder(AgentCommand::new(agent.display().to_string()))
            .root(self.root.path())
            .installation(INSTALLATION)
            .sandbox(sandbox)
            .build()
            .unwrap_or_else(|error| panic!("local runtime ({sandbox:?}; CI installs bubblewrap): {error}"));
        Arc::new(runtime)
    }

    /// A broker process: a pool over a new runtime instance (the same one for the fake runtime),
    /// recorded, resuming whatever the state directory holds.
    fn broker(&self, configure: impl FnOnce(&mut PoolConfig)) -> Broker {
        let recorder = Arc::new(RecordingRuntime::new(self.runtime()));
        let sessions = ThreadSessions::new(Arc::<RecordingRuntime>::clone(&recorder), INSTALLATION, AGENT);
        let mut config = PoolConfig::new(self.state.path());
        configure(&mut config);
        let pool = Arc::new(SessionPool::new(sessions, config).expect("pool"));
        Broker { pool, recorder }
    }
}

struct Broker {
    pool: Arc<SessionPool>,
    recorder: Arc<RecordingRuntime>,
}

impl Broker {
    fn id(&self, key: &str) -> SessionId {
        self.pool.sessions().session_id(key).expect("a valid key")
    }

    fn ops(&self, key: &str) -> Vec<Op> {
        self.recorder.ops(&self.id(key))
    }

    async fn status(&self, key: &str) -> SessionStatus {
        self.recorder.status(&self.id(key)).await.expect("status")
    }

    async fn storage(&self, key: &str) -> PathBuf {
        let status = self.status(key).await;
        PathBuf::from(status.storage_refs.first().expect("a storage reference"))
    }

    async fn write_marker(&self, key: &str, content: &str) {
        let output = self
            .pool
            .exec(key, &format!("printf %s '{content}' > {MARKER}"))
            .await
            .expect("exec");
        assert_eq!(output.exit_code, Some(0), "writing the marker: {}", output.stderr);
    }

    /// The marker in the worker's working directory, as the worker sees it.
    async fn marker(&self, key: &str) -> Option<String> {
        let output = self
            .pool
            .exec(key, &format!("cat {MARKER} 2>/dev/null"))
            .await
            .expect("exec");
        (output.exit_code == Some(0)).then_some(output.stdout)
    }

    /// Starts a turn that streams until it is stopped, and waits for its first chunk.
    async fn start_long_turn(&self, key: &str) -> JoinHandle<Result<Turn, PoolError>> {
        let (started, first_chunk) = tokio::sync::oneshot::channel();
        let mut started = Some(started);
        let pool = Arc::clone(&self.pool);
        let key = key.to_owned();
        let turn = tokio::spawn(async move {
            pool.prompt_with(&key, LONG_TURN, move |_| {
                if let Some(started) = started.take() {
                    let _ = started.send(());
                }
            })
            .await
        });
        bounded("the long turn's first chunk", first_chunk)
            .await
            .expect("the turn streams");
        turn
    }

    async fn shutdown(&self) {
        self.pool.shutdown().await.expect("shutdown");
    }
}

async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, future)
        .await
        .unwrap_or_else(|_| panic!("{what} took longer than {PATIENCE:?}"))
}

async fn turn_result(turn: JoinHandle<Result<Turn, PoolError>>) -> Result<Turn, PoolError> {
    bounded("the turn's end", turn).await.expect("the turn task")
}

fn assert_suspended(status: &SessionStatus, reason: SuspendReason) {
    assert_eq!(status.state, SessionState::Suspended, "{status:?}");
    assert_eq!(status.suspend_reason, Some(reason), "{status:?}");
    assert!(
        status.worker.is_none(),
        "no worker may be recorded after suspend: {status:?}"
    );
    assert_eq!(
        status.storage,
        StorageState::Present,
        "suspend keeps storage: {status:?}"
    );
}

/// The runtime records `connection`'s worker as the running one.
fn assert_running(status: &SessionStatus, connection: &ConnectionInfo) {
    assert_eq!(status.state, SessionState::Running, "{status:?}");
    assert_eq!(status.generation, connection.generation, "{status:?}");
    let worker = status.worker.as_ref().expect("a running session has a worker");
    assert_eq!(worker.generation, connection.generation, "{status:?}");
    assert_eq!(worker.worker_id, connection.worker_id, "{status:?}");
}

/// The status after a close for `reason` under the default retention policy: closed, storage
/// deleted, no worker; or not found (a runtime may forget a session whose storage it deleted).
fn assert_closed_and_deleted(status: openab_runtime::Result<SessionStatus>, reason: CloseReason) {
    match status {
        Ok(status) => {
            assert_eq!(status.state, SessionState::Closed, "{status:?}");
            assert_eq!(status.close_reason, Some(reason), "{status:?}");
            assert_eq!(status.storage, StorageState::Deleted, "{status:?}");
            assert!(status.worker.is_none(), "{status:?}");
        }
        Err(Error::NotFound { .. }) => {}
        Err(error) => panic!("status after close({reason}): {error}"),
    }
}

/// A turn ended because its worker went away, as a typed error.
fn assert_worker_gone(result: &Result<Turn, PoolError>) {
    match result {
        Err(error) => assert!(
            matches!(
                error.acp(),
                Some(
                    AcpCallError::ChannelClosed { .. }
                        | AcpCallError::Runtime(Error::Fenced { .. } | Error::Disconnected { .. })
                )
            ),
            "unexpected turn error: {error:?}"
        ),
        Ok(turn) => panic!("the turn cannot have finished normally: {turn:?}"),
    }
}

fn thread_map(world: &World) -> BTreeMap<String, String> {
    let text =
        std::fs::read_to_string(world.state.path().join(pool_harness::THREAD_MAP)).expect("thread map");
    serde_json::from_str(&text).expect("thread map JSON")
}

/// Per-key creation gate; a thread's first message is fresh; threads get separate sessions; a
/// turn streams.
async fn creation_gate_gives_one_session_per_thread(backend: Backend) {
    let world = World::new(backend);
    let broker = world.broker(|_| {});
    let pool = &broker.pool;

    let results = tokio::join!(
        pool.get_or_create(DISCORD),
        pool.get_or_create(DISCORD),
        pool.get_or_create(DISCORD),
        pool.get_or_create(DISCORD),
    );
    let results = [results.0, results.1, results.2, results.3].map(|result| result.expect("get_or_create"));
    assert_eq!(
        results.iter().filter(|fresh| **fresh).count(),
        1,
        "exactly one call creates: {results:?}"
    );
    assert_eq!(
        broker.ops(DISCORD),
        [Op::Create, Op::Attach],
        "one worker for the thread"
    );
    assert!(broker.recorder.calls().iter().all(|call| call.ok));

    let isolation = pool.sessions().capabilities().isolation;
    let expected = match backend {
        Backend::Fake | Backend::LocalPlain => IsolationLevel::None,
        Backend::LocalSandboxed => IsolationLevel::Namespaces,
    };
    assert_eq!(isolation, expected, "{backend:?}");

    let discord = pool.info(DISCORD).expect("a live connection");
    assert_eq!(discord.opened, Opened::New);
    assert!(discord.alive && discord.cwd.starts_with('/'), "{discord:?}");
    assert_running(&broker.status(DISCORD).await, &discord);

    assert!(
        pool.get_or_create(SLACK).await.expect("slack thread"),
        "another thread is fresh too"
    );
    let slack = pool.info(SLACK).expect("a live connection");
    assert_ne!(slack.session_id, discord.session_id);
    assert_ne!(slack.acp_session_id, discord.acp_session_id);
    let (discord_storage, slack_storage) = (broker.storage(DISCORD).await, broker.storage(SLACK).await);
    assert_ne!(discord_storage, slack_storage);
    for storage in [&discord_storage, &slack_storage] {
        let path = storage.display().to_string();
        assert!(
            !path.contains("1234567890") && !path.contains("C0123ABC"),
            "a raw thread id in {path}"
        );
    }

    broker.write_marker(DISCORD, "discord").await;
    assert_eq!(broker.marker(DISCORD).await.as_deref(), Some("discord"));
    assert_eq!(
        broker.marker(SLACK).await,
        None,
        "each thread has its own workspace"
    );

    let mut streamed = Vec::new();
    let turn = pool
        .prompt_with(SLACK, "hello", |chunk| streamed.push(chunk.to_owned()))
        .await
        .expect("a prompt turn");
    assert_eq!(turn.stop_reason, "end_turn");
    assert_eq!(
        turn.chunks,
        ["echo[0]: hello", "echo[1]: hello", "echo[2]: hello"]
    );
    assert_eq!(streamed, turn.chunks);
    assert!(!turn.reset_notice);
    assert!(pool.last_active(SLACK).expect("active") >= slack.last_active);

    broker.shutdown().await;
}

/// At `max_sessions`, the least recently active idle session is suspended for capacity; busy
/// sessions are never evicted.
async fn capacity_eviction_suspends_the_least_recently_active(backend: Backend) {
    let world = World::new(backend);
    let broker = world.broker(|config| config.max_sessions = 2);
    let pool = &broker.pool;

    pool.get_or_create(DISCORD).await.expect("first thread");
    pool.get_or_create(DISCORD_2).await.expect("second thread");
    broker.write_marker(DISCORD_2, "second").await;
    pool.prompt(DISCORD, "hello")
        .await
        .expect("the first thread is used again");
    let second = pool.info(DISCORD_2).expect("live");
    let second_control = pool.control(DISCORD_2).expect("live");

    assert!(pool.get_or_create(SLACK).await.expect("a third thread"));
    assert_eq!(pool.active_keys(), [DISCORD, SLACK]);
    assert_eq!(
        broker.ops(DISCORD_2),
        [Op::Create, Op::Attach, Op::of(PoolPath::CapacityEviction)]
    );
    assert_eq!(
        Op::of(PoolPath::CapacityEviction),
        Op::Suspend(SuspendReason::Capacity)
    );
    assert!(!second_control.is_alive(), "capacity eviction stops the worker");
    assert_suspended(&broker.status(DISCORD_2).await, SuspendReason::Capacity);
    assert!(broker.storage(DISCORD_2).await.exists());
    assert_eq!(
        pool.persisted(DISCORD_2),
        Some(second.acp_session_id.clone()),
        "resumable"
    );

    // Both live sessions busy: nothing can make room, and no worker is started for nothing.
    let first_turn = broker.start_long_turn(DISCORD).await;
    let slack_turn = broker.start_long_turn(SLACK).await;
    match pool.get_or_create(DISCORD_2).await {
        Err(error @ PoolError::Exhausted(2)) => assert!(error.is_transient()),
        other => panic!("expected an exhausted pool, got {other:?}"),
    }
    assert_eq!(broker.ops(DISCORD_2).len(), 3);

    // Cancelling (without the turn's lock) frees them; Slack's ends first, so it is the oldest.
    pool.cancel(SLACK).await.expect("cancel");
    assert_eq!(
        turn_result(slack_turn).await.expect("cancelled turn").stop_reason,
        "cancelled"
    );
    pool.cancel(DISCORD).await.expect("cancel");
    assert_eq!(
        turn_result(first_turn).await.expect("cancelled turn").stop_reason,
        "cancelled"
    );

    assert!(
        !pool.get_or_create(DISCORD_2).await.expect("resume"),
        "a suspended thread is not fresh"
    );
    assert_eq!(pool.active_keys(), [DISCORD, DISCORD_2]);
    assert_eq!(
        broker.ops(SLACK).last(),
        Some(&Op::Suspend(SuspendReason::Capacity))
    );
    let resumed = pool.info(DISCORD_2).expect("live");
    assert_eq!(resumed.opened, Opened::Loaded);
    assert_eq!(resumed.acp_session_id, second.acp_session_id);
    assert!(resumed.generation > second.generation);
    assert_eq!(
        broker.marker(DISCORD_2).await.as_deref(),
        Some("second"),
        "storage survived"
    );

    broker.shutdown().await;
}

/// `cleanup_idle` suspends idle sessions; the next message resumes them with `session/load`.
async fn idle_eviction_suspends_and_resumes(backend: Backend) {
    let world = World::new(backend);
    let broker = world.broker(|_| {});
    let pool = &broker.pool;

    pool.get_or_create(SLACK).await.expect("thread");
    broker.write_marker(SLACK, "idle").await;
    pool.prompt(SLACK, "hello").await.expect("turn");
    let before = pool.info(SLACK).expect("live");
    let control = pool.control(SLACK).expect("live");

    assert_eq!(
        pool.cleanup_idle(Duration::from_secs(3600))
            .await
            .expect("cleanup"),
        Cleanup::default()
    );
    assert_eq!(
        broker.ops(SLACK),
        [Op::Create, Op::Attach],
        "recently used: nothing to do"
    );

    let cleanup = pool.cleanup_idle(Duration::ZERO).await.expect("cleanup");
    assert_eq!(cleanup.idle, [SLACK]);
    assert!(cleanup.hung.is_empty());
    assert_eq!(
        broker.ops(SLACK),
        [Op::Create, Op::Attach, Op::of(PoolPath::IdleEviction)]
    );
    assert_eq!(Op::of(PoolPath::IdleEviction), Op::Suspend(SuspendReason::Idle));
    assert!(!control.is_alive(), "idle eviction stops the worker");
    assert!(pool.active_keys().is_empty());
    assert_suspended(&broker.status(SLACK).await, SuspendReason::Idle);
    assert!(broker.storage(SLACK).await.exists());
    assert_eq!(
        thread_map(&world).get(SLACK),
        Some(&before.acp_session_id),
        "persisted for resume"
    );

    assert!(!pool.get_or_create(SLACK).await.expect("resume"));
    assert_eq!(
        broker.ops(SLACK),
        [
            Op::Create,
            Op::Attach,
            Op::Suspend(SuspendReason::Idle),
            Op::Create,
            Op::Attach
        ]
    );
    let after = pool.info(SLACK).expect("live");
    assert_eq!(after.opened, Opened::Loaded);
    assert_eq!(after.acp_session_id, before.acp_session_id);
    assert!(after.generation > before.generation);
    assert_running(&broker.status(SLACK).await, &after);
    assert_eq!(
        broker.marker(SLACK).await.as_deref(),
        Some("idle"),
        "storage survived"
    );
    assert_eq!(
        pool.prompt(SLACK, "again").await.expect("turn").stop_reason,
        "end_turn"
    );

    broker.shutdown().await;
}

/// A turn in flight past the hung threshold: the worker is killed, the session suspended as hung,
/// the ACP session id dropped; storage stays.
async fn hung_eviction_kills_and_starts_over(backend: Backend) {
    let world = World::new(backend);
    let broker = world.broker(|config| config.hung_threshold = Duration::ZERO);
    let pool = &broker.pool;

    pool.get_or_create(DISCORD).await.expect("thread");
    broker.write_marker(DISCORD, "hung").await;
    let before = pool.info(DISCORD).expect("live");
    let control = pool.control(DISCORD).expect("live");
    let turn = broker.start_long_turn(DISCORD).await;
    assert!(pool.info(DISCORD).expect("live").busy);

    let cleanup = pool
        .cleanup_idle(Duration::from_secs(3600))
        .await
        .expect("cleanup");
    assert_eq!(cleanup.hung, [DISCORD]);
    assert!(cleanup.idle.is_empty());
    assert_eq!(
        broker.ops(DISCORD),
        [Op::Create, Op::Attach, Op::of(PoolPath::HungEviction)]
    );
    assert_eq!(Op::of(PoolPath::HungEviction), Op::Suspend(SuspendReason::Hung));
    assert!(!control.is_alive(), "hung eviction kills the worker");
    assert_worker_gone(&turn_result(turn).await);
    assert_suspended(&broker.status(DISCORD).await, SuspendReason::Hung);
    assert!(broker.storage(DISCORD).await.exists());
    assert_eq!(
        pool.persisted(DISCORD),
        None,
        "the old worker may have owned the turn: not resumed"
    );
    assert!(!thread_map(&world).contains_key(DISCORD));

    assert!(
        pool.get_or_create(DISCORD).await.expect("next message"),
        "fresh: nothing persisted"
    );
    let after = pool.info(DISCORD).expect("live");
    assert_eq!(after.opened, Opened::New);
    assert_ne!(after.acp_session_id, before.acp_session_id);
    assert!(after.generation > before.generation);
    assert_eq!(
        broker.marker(DISCORD).await.as_deref(),
        Some("hung"),
        "storage survived"
    );

    broker.shutdown().await;
}

/// `cancel` works while a turn holds the connection; `reset` cancels first, then closes with
/// reason `reset`: compute stops and storage is deleted; the next message starts clean.
async fn explicit_reset_closes_and_deletes_storage(backend: Backend) {
    let world = World::new(backend);
    let broker = world.broker(|_| {});
    let pool = &broker.pool;

    pool.get_or_create(DISCORD).await.expect("thread");
    broker.write_marker(DISCORD, "before reset").await;
    let before = pool.info(DISCORD).expect("live");
    let control = pool.control(DISCORD).expect("live");
    let storage = broker.storage(DISCORD).await;

    let turn = broker.start_long_turn(DISCORD).await;
    pool.cancel(DISCORD).await.expect("lock-free cancel");
    assert_eq!(
        turn_result(turn).await.expect("cancelled turn").stop_reason,
        "cancelled"
    );

    let turn = broker.start_long_turn(DISCORD).await;
    pool.reset(DISCORD).await.expect("reset");
    match turn_result(turn).await {
        Ok(turn) => assert_eq!(turn.stop_reason, "cancelled"),
        ended => assert_worker_gone(&ended),
    }
    assert_eq!(
        broker.ops(DISCORD),
        [Op::Create, Op::Attach, Op::of(PoolPath::ExplicitReset)]
    );
    assert_eq!(Op::of(PoolPath::ExplicitReset), Op::Close(CloseReason::Reset));
    assert!(!control.is_alive(), "reset stops the worker");
    assert_closed_and_deleted(
        broker.recorder.status(&before.session_id).await,
        CloseReason::Reset,
    );
    assert!(
        !storage.exists(),
        "the default retention deletes storage on reset"
    );
    assert_eq!(pool.persisted(DISCORD), None);
    assert!(!thread_map(&world).contains_key(DISCORD));

    assert!(
        pool.get_or_create(DISCORD).await.expect("next message"),
        "fresh after reset"
    );
    assert_eq!(&broker.ops(DISCORD)[3..], [Op::Create, Op::Attach]);
    let after = pool.info(DISCORD).expect("live");
    assert_eq!(after.opened, Opened::New);
    assert_ne!(after.acp_session_id, before.acp_session_id);
    assert_eq!(broker.marker(DISCORD).await, None, "a clean workspace");

    match pool.reset("discord:999").await {
        Err(PoolError::NoSession(key)) => assert_eq!(key, "discord:999"),
        other => panic!("resetting an unknown thread: {other:?}"),
    }

    broker.shutdown().await;
}

/// An archived thread (or an administrator's close) ends its session with reason `ended`:
/// compute stops, storage goes per the retention policy (default: deleted), the thread's ACP
/// session id is forgotten, and a later message starts a new session.
async fn thread_archived_closes_with_reason_ended(backend: Backend) {
    let world = World::new(backend);
    let broker = world.broker(|_| {});
    let pool = &broker.pool;

    pool.get_or_create(SLACK).await.expect("thread");
    broker.write_marker(SLACK, "before archive").await;
    let before = pool.info(SLACK).expect("live");
    let control = pool.control(SLACK).expect("live");
    let storage = broker.storage(SLACK).await;

    pool.archive(SLACK).await.expect("archive");
    assert_eq!(
        broker.ops(SLACK),
        [Op::Create, Op::Attach, Op::Close(CloseReason::Ended)]
    );
    assert_eq!(Op::of(PoolPath::ThreadArchived), Op::Close(CloseReason::Ended));
    assert!(!control.is_alive(), "archiving stops the worker");
    assert_closed_and_deleted(
        broker.recorder.status(&before.session_id).await,
        CloseReason::Ended,
    );
    assert!(
        !storage.exists(),
        "the default retention deletes storage when a thread ends"
    );
    assert_eq!(pool.persisted(SLACK), None);

    assert!(pool.get_or_create(SLACK).await.expect("a later message"), "fresh");
    assert_eq!(broker.marker(SLACK).await, None, "a clean workspace");

    broker.shutdown().await;
}

/// Shutdown suspends every session and persists key → ACP session id; a new broker (a new
/// runtime instance over the same state) resumes with `session/load`, and starts a new ACP
/// session, with a notice, where the agent no longer knows the persisted one.
async fn shutdown_and_restart_resume_with_session_load(backend: Backend) {
    let world = World::new(backend);
    let first = world.broker(|_| {});
    for key in [DISCORD, SLACK] {
        first.pool.get_or_create(key).await.expect("thread");
        first.write_marker(key, key).await;
    }
    let (discord, slack) = (
        first.pool.info(DISCORD).expect("live"),
        first.pool.info(SLACK).expect("live"),
    );
    let controls = [
        first.pool.control(DISCORD).expect("live"),
        first.pool.control(SLACK).expect("live"),
    ];

    assert_eq!(first.pool.shutdown().await.expect("shutdown"), [DISCORD, SLACK]);
    for key in [DISCORD, SLACK] {
        assert_eq!(
            first.ops(key),
            [Op::Create, Op::Attach, Op::of(PoolPath::BrokerShutdown)]
        );
        assert_suspended(&first.status(key).await, SuspendReason::Shutdown);
        assert!(first.storage(key).await.exists());
    }
    assert_eq!(
        Op::of(PoolPath::BrokerShutdown),
        Op::Suspend(SuspendReason::Shutdown)
    );
    assert!(
        controls.iter().all(|control| !control.is_alive()),
        "shutdown stops every worker"
    );
    let mut map = thread_map(&world);
    assert_eq!(
        map,
        BTreeMap::from([
            (DISCORD.to_owned(), discord.acp_session_id.clone()),
            (SLACK.to_owned(), slack.acp_session_id.clone()),
        ])
    );
    drop(first);

    // The agent lost Slack's conversation (as if its state had been wiped).
    map.insert(SLACK.to_owned(), "forgotten-session".to_owned());
    std::fs::write(
        world.state.path().join(pool_harness::THREAD_MAP),
        serde_json::to_string(&map).expect("JSON"),
    )
    .expect("rewrite the thread map");

    let second = world.broker(|_| {});
    assert!(!second.pool.get_or_create(DISCORD).await.expect("resume"));
    assert_eq!(second.ops(DISCORD), [Op::Create, Op::Attach]);
    let resumed = second.pool.info(DISCORD).expect("live");
    assert_eq!(resumed.opened, Opened::Loaded);
    assert_eq!(resumed.acp_session_id, discord.acp_session_id);
    assert!(resumed.generation > discord.generation);
    assert_eq!(second.marker(DISCORD).await.as_deref(), Some(DISCORD));
    assert!(
        !second
            .pool
            .prompt(DISCORD, "hello")
            .await
            .expect("turn")
            .reset_notice
    );

    assert!(
        !second.pool.get_or_create(SLACK).await.expect("start over"),
        "not fresh: it was persisted"
    );
    let restarted = second.pool.info(SLACK).expect("live");
    assert_eq!(
        restarted.opened,
        Opened::NewAfterFailedLoad {
            rpc_code: Some(UNKNOWN_SESSION)
        }
    );
    assert_ne!(restarted.acp_session_id, "forgotten-session");
    assert_eq!(
        second.marker(SLACK).await.as_deref(),
        Some(SLACK),
        "storage survived; only the chat is new"
    );
    assert!(
        second
            .pool
            .prompt(SLACK, "hello")
            .await
            .expect("turn")
            .reset_notice,
        "the user is told"
    );
    assert!(
        !second
            .pool
            .prompt(SLACK, "again")
            .await
            .expect("turn")
            .reset_notice,
        "once"
    );
    assert_eq!(thread_map(&world).get(SLACK), Some(&restarted.acp_session_id));

    second.shutdown().await;
}

/// A worker killed behind the pool's back is replaced on the next message: a new generation
/// resumed with `session/load`. A transient `session/load` failure keeps the persisted id.
async fn dead_connection_is_replaced(backend: Backend) {
    let world = World::new(backend);
    let broker = world.broker(|_| {});
    let pool = &broker.pool;

    pool.get_or_create(SLACK).await.expect("thread");
    broker.write_marker(SLACK, "dead").await;
    let before = pool.info(SLACK).expect("live");
    let control = pool.control(SLACK).expect("live");
    control.kill().await.expect("kill out of band");
    assert!(!control.is_alive());

    assert!(
        !pool.get_or_create(SLACK).await.expect("replace"),
        "a replacement is not fresh"
    );
    assert_eq!(
        broker.ops(SLACK),
        [Op::Create, Op::Attach, Op::Create, Op::Attach],
        "attach, no suspend or close"
    );
    let replaced = pool.info(SLACK).expect("live");
    assert_eq!(replaced.opened, Opened::Loaded);
    assert_eq!(replaced.acp_session_id, before.acp_session_id);
    assert!(replaced.generation > before.generation && replaced.alive);
    assert_running(&broker.status(SLACK).await, &replaced);
    assert_eq!(
        broker.marker(SLACK).await.as_deref(),
        Some("dead"),
        "storage survived"
    );

    // The replacement's worker dies before `session/load` answers: transient, id kept.
    pool.control(SLACK).expect("live").kill().await.expect("kill");
    pool.kill_worker_before_next_load();
    match pool.get_or_create(SLACK).await {
        Err(error @ PoolError::ResumeFailed(_)) => assert!(error.is_transient(), "{error:?}"),
        other => panic!("expected a transient resume failure, got {other:?}"),
    }
    // The failed start is released as the guide says: suspend(Hung), storage kept.
    assert_eq!(
        broker.ops(SLACK).last(),
        Some(&Op::Suspend(SuspendReason::Hung)),
        "{:?}",
        broker.ops(SLACK)
    );
    assert_suspended(&broker.status(SLACK).await, SuspendReason::Hung);
    assert_eq!(pool.persisted(SLACK), Some(before.acp_session_id.clone()));
    assert!(!pool.get_or_create(SLACK).await.expect("retry"));
    let retried = pool.info(SLACK).expect("live");
    assert_eq!(retried.opened, Opened::Loaded);
    assert_eq!(retried.acp_session_id, before.acp_session_id);
    assert!(
        retried.generation > replaced.generation + 1,
        "the failed attempt used a generation too"
    );
    assert_eq!(broker.marker(SLACK).await.as_deref(), Some("dead"));

    broker.shutdown().await;
}

/// Runs each scenario on every runtime, as `<runtime>::<scenario>`.
macro_rules! on_every_runtime {
    ($($scenario:ident),* $(,)?) => {
        on_every_runtime!(@runtime fake, Fake, $($scenario),*);
        on_every_runtime!(@runtime local_plain, LocalPlain, $($scenario),*);
        on_every_runtime!(@runtime local_sandboxed, LocalSandboxed, $($scenario),*);
    };
    (@runtime $module:ident, $backend:ident, $($scenario:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::Backend::$backend).await;
                }
            )*
        }
    };
}

on_every_runtime!(
    creation_gate_gives_one_session_per_thread,
    capacity_eviction_suspends_the_least_recently_active,
    idle_eviction_suspends_and_resumes,
    hung_eviction_kills_and_starts_over,
    explicit_reset_closes_and_deletes_storage,
    thread_archived_closes_with_reason_ended,
    shutdown_and_restart_resume_with_session_load,
    dead_connection_is_replaced,
);
