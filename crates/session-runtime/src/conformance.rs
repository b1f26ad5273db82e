//! The conformance suite: every behaviour of the [`SessionRuntime`] contract, as one public
//! async function each, runnable against any backend.
//!
//! Each function starts from a clean state (fresh identities of its own), panics with a message
//! naming the broken rule when the runtime misbehaves, and closes what it created. Behaviours a
//! runtime cannot show (per its [`Capabilities`](crate::Capabilities), or without a
//! [`FaultInjector`]) return [`Verdict::Skipped`] with the reason, never a silent pass.
//!
//! The runtime under test must run the ACP test agent (`acp-test-agent`) as its agent: the suite
//! uses its prompt directives and its exec probe.
//!
//! ```no_run
//! # async fn demo() {
//! use std::sync::Arc;
//! use session_runtime::conformance::{run_all, Target};
//! use session_runtime::testing::FakeRuntime;
//!
//! let runtime = Arc::new(FakeRuntime::builder().build().unwrap());
//! let report = run_all(&Target::new(Arc::<FakeRuntime>::clone(&runtime), "test").with_faults(runtime)).await;
//! assert!(report.skipped.is_empty(), "{report:?}");
//! # }
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use crate::overlay::{ENV_FIELD, WORKING_DIR_FIELD};
use crate::testing::{AcpClient, PermissionAnswer};
use crate::{
    CloseReason, CreateOptions, Error, Result, Retention, RetentionPolicy, SessionId, SessionIdentity,
    SessionOverlay, SessionRuntime, SessionState, StorageState, SuspendReason,
};

/// How long the suite waits for anything before it calls the runtime hung.
const PATIENCE: Duration = Duration::from_secs(30);

/// Test-only hooks that put a session's durable record into the state a crash would leave,
/// without the side effects that should have followed. Backends implement it for their
/// `tests/conformance.rs`; the suite uses it to check `reconcile`.
#[async_trait]
pub trait FaultInjector: Send + Sync {
    /// Records the session as suspended but leaves its worker running, as a broker killed between
    /// recording a suspend and stopping the worker would.
    async fn record_suspended_keep_worker(&self, id: &SessionId) -> Result<()>;

    /// Records the intent to close with `reason` and nothing else, as a broker killed right after
    /// recording a close would.
    async fn record_closing(&self, id: &SessionId, reason: CloseReason) -> Result<()>;
}

/// The runtime under test and what the suite may expect of it.
#[derive(Clone)]
pub struct Target {
    runtime: Arc<dyn SessionRuntime>,
    installation: String,
    retention: RetentionPolicy,
    faults: Option<Arc<dyn FaultInjector>>,
    overlay_host_dir: Option<PathBuf>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("runtime", &self.runtime)
            .field("installation", &self.installation)
            .field("retention", &self.retention)
            .field("faults", &self.faults.is_some())
            .field("overlay_host_dir", &self.overlay_host_dir)
            .finish()
    }
}

impl Target {
    /// A runtime serving `installation`, configured with the default retention policy.
    pub fn new(runtime: Arc<dyn SessionRuntime>, installation: impl Into<String>) -> Self {
        Self {
            runtime,
            installation: installation.into(),
            retention: RetentionPolicy::default(),
            faults: None,
            overlay_host_dir: None,
        }
    }

    /// For a runtime whose sessions share the host's storage (the local runtime's
    /// `storage = "shared"`): a host directory it allows as an overlay's working directory, with
    /// a writable directory beneath it (the suite makes `conformance-overlay` there). Without
    /// it, the suite gives overlays a directory relative to the session's workspace.
    pub fn with_overlay_host_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.overlay_host_dir = Some(dir.into());
        self
    }

    /// The retention policy the runtime was configured with.
    pub fn with_retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }

    /// Enables the behaviours that need fault injection.
    pub fn with_faults(mut self, faults: Arc<dyn FaultInjector>) -> Self {
        self.faults = Some(faults);
        self
    }

    fn identity(&self, behaviour: &str) -> SessionIdentity {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let thread = format!(
            "conformance/{behaviour}/{}-{nanos}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        SessionIdentity::new(self.installation.as_str(), "conformance", "test", thread).unwrap_or_else(|e| {
            panic!(
                "the suite's own identity is invalid (installation {}): {e}",
                self.installation
            )
        })
    }

    async fn create(&self, behaviour: &str) -> SessionId {
        let identity = self.identity(behaviour);
        let handle = within("create", self.runtime.create(&identity, &CreateOptions::new()))
            .await
            .unwrap_or_else(|e| panic!("{behaviour}: create failed: {e}"));
        assert!(
            handle.created,
            "{behaviour}: a fresh identity must be reported as created"
        );
        handle.id
    }

    async fn client(&self, id: &SessionId) -> AcpClient {
        let attachment = within("attach", self.runtime.attach(id))
            .await
            .unwrap_or_else(|e| panic!("attach {id} failed: {e}"));
        AcpClient::new(attachment)
    }

    async fn cleanup(&self, id: &SessionId) {
        if let Err(e) = within("close", self.runtime.close(id, CloseReason::Ended)).await {
            panic!("closing {id} at the end of a behaviour failed: {e}");
        }
    }
}

/// The outcome of one behaviour that did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The behaviour ran and held.
    Passed,
    /// The behaviour could not be checked against this runtime, and why.
    Skipped(String),
}

/// What [`run_all`] ran.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Behaviours that ran and held.
    pub passed: Vec<&'static str>,
    /// Behaviours that were skipped, with the reason.
    pub skipped: Vec<(&'static str, String)>,
}

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(PATIENCE, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what} did not finish within {PATIENCE:?}"),
    }
}

macro_rules! behaviours {
    ($($name:ident),* $(,)?) => {
        /// Runs every behaviour in turn; panics at the first that fails.
        pub async fn run_all(target: &Target) -> Report {
            let mut report = Report::default();
            $(
                match $name(target).await {
                    Verdict::Passed => report.passed.push(stringify!($name)),
                    Verdict::Skipped(why) => report.skipped.push((stringify!($name), why)),
                }
            )*
            report
        }

        /// The names of every behaviour, in the order [`run_all`] runs them.
        pub const BEHAVIOURS: &[&str] = &[$(stringify!($name)),*];
    };
}

behaviours!(
    create_is_idempotent,
    invalid_identities_are_rejected,
    attach_streams_acp_exchange,
    concurrent_attaches_fence_losers,
    write_completes_while_output_undrained,
    suspend_keeps_storage_and_resume_bumps_generation,
    close_applies_retention_by_reason,
    close_and_suspend_are_idempotent,
    unknown_and_closed_sessions_give_right_errors,
    reconcile_reclaims_stray_worker,
    reconcile_finishes_interrupted_close,
    overlay_is_applied_at_every_attach,
    invalid_overlays_are_rejected,
);

/// `create` provisions a session once; repeating it returns the same session unchanged.
pub async fn create_is_idempotent(target: &Target) -> Verdict {
    let identity = target.identity("create_is_idempotent");
    let runtime = &target.runtime;
    let first = within("create", runtime.create(&identity, &CreateOptions::new()))
        .await
        .expect("first create");
    assert!(first.created, "first create must provision the session");
    assert_eq!(
        first.id,
        identity.id(),
        "create must return the identity's session id"
    );
    assert_eq!(first.state, SessionState::Created);
    let second = within("create", runtime.create(&identity, &CreateOptions::new()))
        .await
        .expect("second create");
    assert!(!second.created, "a repeated create must not provision again");
    assert_eq!(
        (second.id, second.state, second.generation),
        (first.id, first.state, first.generation)
    );
    let status = runtime
        .status(&first.id)
        .await
        .expect("status of a created session");
    assert_eq!(status.state, SessionState::Created);
    assert_eq!(
        status.storage,
        StorageState::Present,
        "create must provision storage before any worker"
    );
    assert!(status.worker.is_none(), "create must not start a worker");
    let listed = runtime.list().await.expect("list");
    assert_eq!(
        listed.iter().filter(|s| s.id == first.id).count(),
        1,
        "list must show the session exactly once"
    );
    target.cleanup(&first.id).await;
    Verdict::Passed
}

/// Identities that are malformed or belong to another installation are refused with
/// [`Error::InvalidIdentity`].
pub async fn invalid_identities_are_rejected(target: &Target) -> Verdict {
    for (parts, part) in [
        (["", "agent", "discord", "1"], "installation"),
        ([target.installation.as_str(), "Agent!", "discord", "1"], "agent"),
        ([target.installation.as_str(), "agent", "", "1"], "platform"),
        (
            [target.installation.as_str(), "agent", "discord", "a\0b"],
            "thread",
        ),
        ([target.installation.as_str(), "agent", "discord", ""], "thread"),
    ] {
        match SessionIdentity::new(parts[0], parts[1], parts[2], parts[3]) {
            Err(Error::InvalidIdentity { part: got, .. }) => {
                assert_eq!(got, part, "wrong part blamed for {parts:?}")
            }
            other => panic!("identity {parts:?} must be rejected, got {other:?}"),
        }
    }
    let other = if target.installation == "elsewhere" {
        "elsewhere-2"
    } else {
        "elsewhere"
    };
    let foreign = SessionIdentity::new(other, "agent", "discord", "1").expect("valid foreign identity");
    match target.runtime.create(&foreign, &CreateOptions::new()).await {
        Err(Error::InvalidIdentity {
            part: "installation", ..
        }) => {}
        other => panic!("create for another installation must give InvalidIdentity, got {other:?}"),
    }
    Verdict::Passed
}

/// An attachment carries a full ACP exchange: initialize, `session/new` in the reported working
/// directory, a streamed prompt, a cancel mid-turn and a permission request answered by the client.
pub async fn attach_streams_acp_exchange(target: &Target) -> Verdict {
    let id = target.create("attach_streams_acp_exchange").await;
    let client = Arc::new(target.client(&id).await);
    let cwd = client.working_dir().to_owned();
    assert!(
        cwd.starts_with('/'),
        "the attachment's working directory must be absolute, got {cwd:?}"
    );

    let init = within("initialize", client.initialize())
        .await
        .expect("initialize");
    assert!(
        init.agent_capabilities.load_session,
        "the test agent announces session/load"
    );
    let session = within("session/new", client.new_session(&cwd))
        .await
        .expect("session/new in the reported cwd");

    let turn = within("prompt", client.prompt(&session, "/chunks=3 hello runtime"))
        .await
        .expect("prompt");
    assert_eq!(turn.stop_reason, "end_turn");
    assert_eq!(
        turn.chunks.len(),
        3,
        "every streamed chunk must arrive: {:?}",
        turn.chunks
    );
    assert!(
        turn.chunks.iter().all(|c| c.contains("hello runtime")),
        "chunks must echo the prompt: {:?}",
        turn.chunks
    );

    // Cancel mid-turn: the turn ends early with `cancelled`.
    let long_turn = {
        let client = Arc::clone(&client);
        let session = session.clone();
        tokio::spawn(async move {
            client
                .prompt(&session, "/chunks=2000 /delay_ms=5 long turn")
                .await
        })
    };
    let first = within("first chunk", client.next_chunk(&session))
        .await
        .expect("first chunk of a long turn");
    assert!(first.contains("long turn"), "unexpected chunk {first:?}");
    within("cancel", client.cancel(&session))
        .await
        .expect("session/cancel");
    let cancelled = within("cancelled turn", long_turn)
        .await
        .expect("prompt task")
        .expect("cancelled prompt");
    assert_eq!(
        cancelled.stop_reason, "cancelled",
        "a cancelled turn must stop with `cancelled`"
    );
    assert!(cancelled.chunks.len() < 2000, "cancel must stop the stream early");

    // The agent asks for permission; the client's answer decides the turn.
    client.answer_permissions_with(PermissionAnswer::Select("allow".into()));
    let allowed = within(
        "permission",
        client.prompt(&session, "/permission /chunks=1 edit"),
    )
    .await
    .expect("prompt");
    assert_eq!(
        client.permission_requests(),
        1,
        "the agent must have asked for permission once"
    );
    assert!(
        allowed
            .chunks
            .first()
            .is_some_and(|c| c.contains("permission: allow")),
        "{allowed:?}"
    );
    client.answer_permissions_with(PermissionAnswer::Select("reject".into()));
    let rejected = within("permission", client.prompt(&session, "/permission edit"))
        .await
        .expect("prompt");
    assert!(
        rejected.chunks.iter().any(|c| c.contains("permission: reject")),
        "{rejected:?}"
    );
    drop(client);
    target.cleanup(&id).await;
    Verdict::Passed
}

/// Concurrent attaches leave exactly one live worker; every other attachment is fenced.
pub async fn concurrent_attaches_fence_losers(target: &Target) -> Verdict {
    const ATTACHES: usize = 8;
    let id = target.create("concurrent_attaches_fence_losers").await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..ATTACHES {
        let runtime = Arc::clone(&target.runtime);
        tasks.spawn(async move { runtime.attach(&id).await });
    }
    let mut attachments = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("attach task") {
            Ok(attachment) => attachments.push(attachment),
            Err(Error::Fenced { .. }) => {}
            Err(e) => panic!("a concurrent attach may only win or be fenced, got {e}"),
        }
    }
    assert!(!attachments.is_empty(), "at least one concurrent attach must win");
    let status = target.runtime.status(&id).await.expect("status");
    let mut winners = 0;
    for attachment in &attachments {
        let probe = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}"#;
        match within("write", attachment.input().write_line(probe)).await {
            Ok(()) => {
                winners += 1;
                assert_eq!(
                    attachment.generation(),
                    status.generation,
                    "the winner must hold the current generation"
                );
            }
            Err(Error::Fenced {
                generation, current, ..
            }) => {
                assert!(generation < current, "a fence must come from a newer generation")
            }
            Err(e) => panic!("a losing attachment must be fenced, got {e}"),
        }
    }
    assert_eq!(winners, 1, "exactly one attachment may stay writable");
    let alive = attachments.iter().filter(|a| a.control().is_alive()).count();
    assert_eq!(
        alive, 1,
        "exactly one worker may be alive after concurrent attaches"
    );
    drop(attachments);
    target.cleanup(&id).await;
    Verdict::Passed
}

/// A write completes while the agent's output is not being read (the cancel path).
pub async fn write_completes_while_output_undrained(target: &Target) -> Verdict {
    use tokio::io::AsyncBufReadExt;

    let id = target.create("write_completes_while_output_undrained").await;
    let mut attachment = within("attach", target.runtime.attach(&id))
        .await
        .expect("attach");
    let cwd = attachment.working_dir().to_owned();
    let input = attachment.input();
    let mut lines = tokio::io::BufReader::new(attachment.output()).lines();
    macro_rules! next {
        () => {
            within("output line", lines.next_line())
                .await
                .expect("read output")
                .expect("output ended early")
        };
    }
    input
        .write_line(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}"#)
        .await
        .expect("write");
    next!();
    let new = serde_json_line(2, "session/new", &format!(r#"{{"cwd":{cwd:?},"mcpServers":[]}}"#));
    input.write_line(new).await.expect("write");
    let answer = next!();
    let session = answer
        .split("\"sessionId\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no sessionId in {answer}"))
        .to_owned();
    // About 64 MiB of output, far beyond any pipe or buffer, while nobody reads.
    let prompt = serde_json_line(
        3,
        "session/prompt",
        &format!(
            r#"{{"sessionId":"{session}","prompt":[{{"type":"text","text":"/chunks=1024 /size=65536 /delay_ms=1 flood"}}]}}"#
        ),
    );
    input.write_line(prompt).await.expect("write prompt");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cancel =
        format!(r#"{{"jsonrpc":"2.0","method":"session/cancel","params":{{"sessionId":"{session}"}}}}"#);
    within("a write while the output is undrained", input.write_line(cancel))
        .await
        .expect("write cancel");
    // Now drain: the turn must end, cancelled.
    let stop_reason = loop {
        let line = next!();
        if line.contains(r#""id":3"#) && line.contains("stopReason") {
            break line;
        }
    };
    assert!(
        stop_reason.contains("cancelled"),
        "the flood must end cancelled, got {stop_reason}"
    );
    drop(lines);
    drop(attachment);
    target.cleanup(&id).await;
    Verdict::Passed
}

/// Runs `command` in the worker; on failure, says how the worker ended.
async fn exec(client: &AcpClient, command: &str) -> crate::testing::ExecOutput {
    match within("exec", client.exec(command)).await {
        Ok(output) => output,
        Err(error) => {
            let control = client.control();
            let exit = tokio::time::timeout(Duration::from_secs(5), control.wait()).await;
            panic!(
                "exec {command:?} failed: {error}; worker {} ended: {exit:?}",
                control.worker_id()
            )
        }
    }
}

fn serde_json_line(id: u64, method: &str, params: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{params}}}"#)
}

/// Suspend releases the worker and keeps storage; the next attach resumes with a higher generation.
pub async fn suspend_keeps_storage_and_resume_bumps_generation(target: &Target) -> Verdict {
    if !target.runtime.capabilities().persistent_storage {
        return Verdict::Skipped("the runtime declares no persistent storage".into());
    }
    let id = target
        .create("suspend_keeps_storage_and_resume_bumps_generation")
        .await;
    let client = target.client(&id).await;
    let first_generation = client.control().generation();
    let write = within("exec", client.exec("echo kept-across-suspend > suspend-marker"))
        .await
        .expect("exec");
    assert!(write.success(), "writing to the workspace failed: {write:?}");
    let old_input = client.input().clone();
    let old_control = client.control();

    within("suspend", target.runtime.suspend(&id, SuspendReason::Idle))
        .await
        .expect("suspend");
    let status = target.runtime.status(&id).await.expect("status");
    assert_eq!(status.state, SessionState::Suspended);
    assert_eq!(status.suspend_reason, Some(SuspendReason::Idle));
    assert!(status.worker.is_none(), "a suspended session has no worker");
    assert_eq!(status.storage, StorageState::Present, "suspend must keep storage");
    within("worker exit after suspend", old_control.wait())
        .await
        .expect("wait");
    assert!(!old_control.is_alive(), "suspend must stop the worker");
    match old_input.write_line("{}").await {
        Err(Error::Fenced { .. } | Error::Disconnected { .. }) => {}
        other => panic!("writing to a suspended worker must fail as fenced or disconnected, got {other:?}"),
    }
    drop(client);

    let resumed = target.client(&id).await;
    assert!(
        resumed.control().generation() > first_generation,
        "resume must start a higher generation"
    );
    let read = within("exec", resumed.exec("cat suspend-marker"))
        .await
        .expect("exec");
    assert_eq!(
        read.stdout.trim(),
        "kept-across-suspend",
        "storage must survive suspend: {read:?}"
    );
    drop(resumed);
    target.cleanup(&id).await;
    Verdict::Passed
}

/// Close applies the retention policy for its reason; a new session under the same identity
/// starts with fresh storage either way.
pub async fn close_applies_retention_by_reason(target: &Target) -> Verdict {
    for reason in [CloseReason::Reset, CloseReason::Ended, CloseReason::Expired] {
        let identity = target.identity("close_applies_retention_by_reason");
        let id = within("create", target.runtime.create(&identity, &CreateOptions::new()))
            .await
            .expect("create")
            .id;
        let client = target.client(&id).await;
        let control = client.control();
        let wrote = exec(&client, "echo before-close > close-marker").await;
        assert!(wrote.success(), "{wrote:?}");
        drop(client);
        within("close", target.runtime.close(&id, reason))
            .await
            .expect("close");
        assert!(!control.is_alive(), "close must stop the worker ({reason})");
        let expected = target.retention.for_reason(reason);
        let listed = within("list", target.runtime.list())
            .await
            .expect("list")
            .into_iter()
            .find(|status| status.id == id);
        if expected == Retention::Retain {
            let listed = listed.unwrap_or_else(|| panic!("list must show a retained session ({reason})"));
            assert_eq!(listed.state, SessionState::Closed, "listed after close({reason})");
        }
        match target.runtime.status(&id).await {
            Ok(status) => {
                assert_eq!(status.state, SessionState::Closed);
                assert_eq!(status.close_reason, Some(reason));
                match (expected, status.storage) {
                    (Retention::Delete, StorageState::Deleted) => {}
                    (Retention::Retain, StorageState::Retained { .. }) => {}
                    (expected, got) => {
                        panic!("close({reason}) with policy {expected:?} left storage {got:?}")
                    }
                }
            }
            Err(Error::NotFound { .. }) => {
                assert_eq!(
                    expected,
                    Retention::Delete,
                    "a retained session must keep its record ({reason})"
                )
            }
            Err(e) => panic!("status after close failed: {e}"),
        }
        let again = within("create", target.runtime.create(&identity, &CreateOptions::new()))
            .await
            .expect("re-create");
        assert!(again.created, "create after close must start a new session");
        let client = target.client(&id).await;
        let probe = exec(&client, "test -e close-marker && echo present || echo absent").await;
        assert_eq!(
            probe.stdout.trim(),
            "absent",
            "a new session must not see closed storage ({reason})"
        );
        drop(client);
        target.cleanup(&id).await;
    }
    Verdict::Passed
}

/// Repeated suspends and closes succeed and change nothing; so does closing an unknown session.
pub async fn close_and_suspend_are_idempotent(target: &Target) -> Verdict {
    let id = target.create("close_and_suspend_are_idempotent").await;
    target
        .runtime
        .suspend(&id, SuspendReason::Capacity)
        .await
        .expect("suspend before any attach");
    let client = target.client(&id).await;
    drop(client);
    target
        .runtime
        .suspend(&id, SuspendReason::Idle)
        .await
        .expect("suspend");
    let generation = target.runtime.status(&id).await.expect("status").generation;
    target
        .runtime
        .suspend(&id, SuspendReason::Shutdown)
        .await
        .expect("second suspend");
    let status = target.runtime.status(&id).await.expect("status");
    assert_eq!(
        (status.state, status.generation),
        (SessionState::Suspended, generation)
    );
    assert_eq!(
        status.suspend_reason,
        Some(SuspendReason::Idle),
        "a repeated suspend must change nothing"
    );
    target
        .runtime
        .close(&id, CloseReason::Ended)
        .await
        .expect("close");
    target
        .runtime
        .close(&id, CloseReason::Reset)
        .await
        .expect("second close");
    if let Ok(status) = target.runtime.status(&id).await {
        assert_eq!(
            status.close_reason,
            Some(CloseReason::Ended),
            "the first close reason wins"
        );
    }
    let unknown = target.identity("never-created").id();
    target
        .runtime
        .close(&unknown, CloseReason::Reset)
        .await
        .expect("closing an unknown session is a no-op");
    Verdict::Passed
}

/// Operations on unknown sessions give `NotFound`; on closed sessions `InvalidState` (or
/// `NotFound` where the record is gone).
pub async fn unknown_and_closed_sessions_give_right_errors(target: &Target) -> Verdict {
    let unknown = target.identity("unknown").id();
    assert!(
        matches!(target.runtime.attach(&unknown).await, Err(Error::NotFound { .. })),
        "attach unknown"
    );
    assert!(
        matches!(
            target.runtime.suspend(&unknown, SuspendReason::Idle).await,
            Err(Error::NotFound { .. })
        ),
        "suspend unknown"
    );
    assert!(
        matches!(target.runtime.status(&unknown).await, Err(Error::NotFound { .. })),
        "status unknown"
    );

    let id = target.create("closed").await;
    target
        .runtime
        .close(&id, CloseReason::Ended)
        .await
        .expect("close");
    match target.runtime.attach(&id).await {
        Err(
            Error::InvalidState {
                state: SessionState::Closed,
                operation: "attach",
                ..
            }
            | Error::NotFound { .. },
        ) => {}
        other => panic!("attach on a closed session must be refused, got {other:?}"),
    }
    match target.runtime.suspend(&id, SuspendReason::Idle).await {
        Err(
            Error::InvalidState {
                state: SessionState::Closed,
                ..
            }
            | Error::NotFound { .. },
        ) => {}
        other => panic!("suspend on a closed session must be refused, got {other:?}"),
    }
    Verdict::Passed
}

/// `reconcile` kills a worker whose record says it should not run.
pub async fn reconcile_reclaims_stray_worker(target: &Target) -> Verdict {
    let Some(faults) = &target.faults else {
        return Verdict::Skipped("needs a FaultInjector to leave a stray worker behind".into());
    };
    let id = target.create("reconcile_reclaims_stray_worker").await;
    let client = target.client(&id).await;
    let control = client.control();
    faults
        .record_suspended_keep_worker(&id)
        .await
        .expect("inject the fault");
    assert!(
        control.is_alive(),
        "the injected fault must leave the worker running"
    );
    let report = within("reconcile", target.runtime.reconcile())
        .await
        .expect("reconcile");
    assert!(
        report.killed_workers.iter().any(|(killed, _)| *killed == id),
        "reconcile must kill the stray worker: {report:?}"
    );
    within("stray worker exit", control.wait()).await.expect("wait");
    assert!(!control.is_alive());
    let again = within("reconcile", target.runtime.reconcile())
        .await
        .expect("second reconcile");
    assert!(
        !again.killed_workers.iter().any(|(killed, _)| *killed == id),
        "a second pass must find nothing: {again:?}"
    );
    assert_eq!(
        target.runtime.status(&id).await.expect("status").state,
        SessionState::Suspended
    );
    drop(client);
    target.cleanup(&id).await;
    Verdict::Passed
}

/// `reconcile` finishes a close whose intent was recorded before a crash.
pub async fn reconcile_finishes_interrupted_close(target: &Target) -> Verdict {
    let Some(faults) = &target.faults else {
        return Verdict::Skipped("needs a FaultInjector to interrupt a close".into());
    };
    let id = target.create("reconcile_finishes_interrupted_close").await;
    let client = target.client(&id).await;
    let control = client.control();
    faults
        .record_closing(&id, CloseReason::Reset)
        .await
        .expect("inject the fault");
    let report = within("reconcile", target.runtime.reconcile())
        .await
        .expect("reconcile");
    assert!(
        report.finished_closes.contains(&id),
        "reconcile must finish the close: {report:?}"
    );
    assert!(!control.is_alive(), "a finished close leaves no worker");
    match target.runtime.status(&id).await {
        Ok(status) => {
            assert_eq!(status.state, SessionState::Closed);
            assert_eq!(
                status.close_reason,
                Some(CloseReason::Reset),
                "the recorded reason must be kept"
            );
        }
        Err(Error::NotFound { .. }) => {}
        Err(e) => panic!("status after a finished close: {e}"),
    }
    drop(client);
    Verdict::Passed
}

/// The environment variable the overlay behaviours set.
const OVERLAY_VARIABLE: &str = "OAB_CONFORMANCE_OVERLAY";

/// The working directory the overlay behaviours ask for, and what the agent's should end with.
fn overlay_working_dir(target: &Target) -> (PathBuf, PathBuf) {
    match &target.overlay_host_dir {
        Some(dir) => {
            let made = dir.join("conformance-overlay");
            std::fs::create_dir_all(&made)
                .unwrap_or_else(|e| panic!("making the overlay directory {}: {e}", made.display()));
            let ends = Path::new("conformance-overlay").to_owned();
            (made, ends)
        }
        None => {
            let relative = Path::new("conformance-overlay").join("nested");
            (relative.clone(), relative)
        }
    }
}

/// What the agent sees from inside: its working directory and the overlay's variable.
async fn seen_from_inside(client: &AcpClient) -> (String, String) {
    let probe = exec(client, &format!("pwd; printf '%s' \"${OVERLAY_VARIABLE}\"")).await;
    assert!(
        probe.success(),
        "the probe of cwd and environment failed: {probe:?}"
    );
    let (cwd, value) = probe
        .stdout
        .split_once('\n')
        .unwrap_or((probe.stdout.as_str(), ""));
    (cwd.to_owned(), value.to_owned())
}

/// A [`SessionOverlay`] given at create is applied by every attach: the agent runs in its
/// working directory (the one the attachment reports) with its variable, after a suspend too,
/// and a later create replaces it for the next attach. A runtime that does not declare
/// [`Capabilities::overlay`](crate::Capabilities) refuses it with
/// [`Error::Unsupported`] naming the field, and creates nothing.
pub async fn overlay_is_applied_at_every_attach(target: &Target) -> Verdict {
    let identity = target.identity("overlay_is_applied_at_every_attach");
    let (working_dir, ends_with) = overlay_working_dir(target);
    let overlay = |value: &str| {
        SessionOverlay::new()
            .working_dir(&working_dir)
            .env(OVERLAY_VARIABLE, value)
    };
    if !target.runtime.capabilities().overlay {
        for (refused, field) in [
            (overlay("first"), WORKING_DIR_FIELD),
            (SessionOverlay::new().env(OVERLAY_VARIABLE, "first"), ENV_FIELD),
        ] {
            let options = CreateOptions::new().with_overlay(refused);
            match within("create", target.runtime.create(&identity, &options)).await {
                Err(Error::Unsupported { operation, .. }) => assert_eq!(
                    operation, field,
                    "an overlay the runtime cannot apply must be refused naming its field"
                ),
                other => panic!("a runtime without overlays must refuse one as Unsupported, got {other:?}"),
            }
        }
        assert_not_created(target, &identity).await;
        return Verdict::Passed;
    }
    let options = CreateOptions::new().with_overlay(overlay("first"));
    let id = within("create", target.runtime.create(&identity, &options))
        .await
        .unwrap_or_else(|e| panic!("create with an overlay failed: {e}"))
        .id;
    for attempt in ["first attach", "attach after suspend"] {
        let client = target.client(&id).await;
        let reported = client.working_dir().to_owned();
        assert!(
            Path::new(&reported).ends_with(&ends_with),
            "{attempt}: the attachment must report the overlay's working directory {}, got {reported:?}",
            ends_with.display()
        );
        let (cwd, value) = seen_from_inside(&client).await;
        assert_eq!(
            cwd, reported,
            "{attempt}: the agent must run where the attachment says"
        );
        assert_eq!(
            value, "first",
            "{attempt}: the agent must get the overlay's variable"
        );
        drop(client);
        within("suspend", target.runtime.suspend(&id, SuspendReason::Idle))
            .await
            .expect("suspend");
    }
    let again = within(
        "create",
        target
            .runtime
            .create(&identity, &CreateOptions::new().with_overlay(overlay("second"))),
    )
    .await
    .expect("create of an existing session with a new overlay");
    assert!(!again.created, "an existing session is not created again");
    let client = target.client(&id).await;
    let (_, value) = seen_from_inside(&client).await;
    assert_eq!(
        value, "second",
        "a later create's overlay must replace the session's"
    );
    drop(client);
    target.cleanup(&id).await;
    Verdict::Passed
}

/// A malformed overlay (a bad variable name, a NUL in a value, a working directory the runtime
/// cannot allow) is refused at create with [`Error::InvalidOverlay`] naming the field (or, by a
/// runtime without overlays, [`Error::Unsupported`] naming one), and nothing is created.
pub async fn invalid_overlays_are_rejected(target: &Target) -> Verdict {
    let identity = target.identity("invalid_overlays_are_rejected");
    let mut cases = vec![
        (SessionOverlay::new().env("NOT-A-NAME", "v"), ENV_FIELD),
        (SessionOverlay::new().env("A_NAME", "nul\0inside"), ENV_FIELD),
    ];
    match &target.overlay_host_dir {
        Some(dir) => {
            cases.push((
                SessionOverlay::new().working_dir("relative/dir"),
                WORKING_DIR_FIELD,
            ));
            cases.push((
                SessionOverlay::new().working_dir(dir.join("does-not-exist")),
                WORKING_DIR_FIELD,
            ));
        }
        None => {
            cases.push((SessionOverlay::new().working_dir("/etc"), WORKING_DIR_FIELD));
            cases.push((
                SessionOverlay::new().working_dir("inside/../../outside"),
                WORKING_DIR_FIELD,
            ));
        }
    }
    let supported = target.runtime.capabilities().overlay;
    for (overlay, field) in cases {
        let shown = format!("{overlay:?}");
        let options = CreateOptions::new().with_overlay(overlay);
        match within("create", target.runtime.create(&identity, &options)).await {
            Err(Error::InvalidOverlay { field: got, .. }) if supported => {
                assert_eq!(got, field, "the wrong field was blamed for {shown}")
            }
            Err(Error::Unsupported { operation, .. }) if !supported => {
                assert!(
                    [WORKING_DIR_FIELD, ENV_FIELD].contains(&operation),
                    "Unsupported must name the overlay's field, got {operation}"
                )
            }
            other => panic!("the overlay {shown} must be refused, got {other:?}"),
        }
    }
    assert_not_created(target, &identity).await;
    Verdict::Passed
}

async fn assert_not_created(target: &Target, identity: &SessionIdentity) {
    match target.runtime.status(&identity.id()).await {
        Err(Error::NotFound { .. }) => {}
        Ok(status) if status.state == SessionState::Closed => {}
        other => panic!("a refused create must create nothing, got {other:?}"),
    }
}
