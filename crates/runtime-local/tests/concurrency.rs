//! Concurrency of the local runtime:
//!
//! - [`fifty_concurrent_attaches_leave_one_worker_and_fence_every_loser`]: 50 attaches of one
//!   session at once. Exactly one worker process tree is left, of the session's current
//!   generation; every other attachment is fenced: its writes fail with `Error::Fenced` naming a
//!   newer generation, its output ends with `Fenced`, its worker is dead.
//! - [`two_hundred_sessions_through_their_whole_lifecycle_leak_nothing`]: 200 sessions created,
//!   attached (ACP `initialize`), suspended, resumed (attached again), and closed, up to
//!   [`IN_FLIGHT`] at a time. Afterwards no worker process of the root is left (environment
//!   marker scan), this process has no child left (not even a zombie), it holds no more file
//!   descriptors than before (measured after a warm-up, so the Tokio runtime's own descriptors
//!   are in both counts), and the root holds nothing but empty bookkeeping directories.
//!
//! Plain mode (the fastest) for both; the 200-session test also runs in bubblewrap mode where it
//! works. The tests in this file are serialized: the descriptor and child counts are of the
//! whole test process.

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::testing::AcpClient;
use session_runtime::{
    CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime, SessionState, SuspendReason,
};
use tokio::io::AsyncReadExt;

const INSTALLATION: &str = "concurrency";
/// Concurrent attaches of one session.
const ATTACHES: usize = 50;
/// Sessions taken through their whole lifecycle.
const SESSIONS: usize = 200;
/// How many of them are in flight at once.
const IN_FLIGHT: usize = 40;
/// Bound on waiting for processes and descriptors to go (only a hang fails the test).
const SETTLE: Duration = Duration::from_secs(20);

/// The tests of this file measure the whole process: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn runtime(root: &Path, mode: SandboxMode) -> Option<Arc<LocalRuntime>> {
    common::build_if_supported(
        common::builder(root, INSTALLATION, mode).terminate_grace(Duration::from_secs(2)),
        mode,
    )
}

fn identity(thread: &str) -> SessionIdentity {
    SessionIdentity::new(INSTALLATION, "agent", "concurrency", thread).expect("identity")
}

/// `<installation>@<dev>.<ino>` of the root: the scope in the runtime's worker marker.
fn scope(root: &Path) -> String {
    let meta = std::fs::metadata(root).expect("root");
    format!("{INSTALLATION}@{}.{}", meta.dev(), meta.ino())
}

/// Live processes with this root's worker marker: (pid, session id, generation).
fn workers(scope: &str) -> Vec<(u32, String, u64)> {
    let prefix = format!("OPENAB_SESSION_WORKER={scope}:");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if let Some(value) = environ
            .split(|b| *b == 0)
            .find_map(|e| e.strip_prefix(prefix.as_bytes()))
        {
            let value = String::from_utf8_lossy(value);
            if let Some((id, generation)) = value.split_once(':') {
                found.push((pid, id.to_owned(), generation.parse().unwrap_or(u64::MAX)));
            }
        }
    }
    found
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

/// Children of this process (every thread's), zombies included.
fn children() -> Vec<u32> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("tasks").flatten() {
        if let Ok(list) = std::fs::read_to_string(task.path().join("children")) {
            found.extend(list.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
        }
    }
    found
}

/// Polls `check` until it returns `None` or [`SETTLE`] passes; returns its last complaint.
async fn settle<T>(mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + SETTLE;
    loop {
        let complaint = check();
        if complaint.is_none() || Instant::now() > deadline {
            return complaint;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_attaches_leave_one_worker_and_fence_every_loser() {
    let _serial = SERIAL.lock().await;
    let root = tempfile::tempdir().expect("root");
    let runtime = runtime(root.path(), SandboxMode::None).expect("plain mode always builds");
    let scope = scope(root.path());
    let id = runtime
        .create(&identity("fifty"), &CreateOptions::new())
        .await
        .expect("create")
        .id;

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..ATTACHES {
        let runtime = Arc::clone(&runtime);
        tasks.spawn(async move { runtime.attach(&id).await });
    }
    let mut attachments = Vec::new();
    let mut fenced_at_attach = 0;
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("attach task") {
            Ok(attachment) => attachments.push(attachment),
            Err(Error::Fenced { .. }) => fenced_at_attach += 1,
            Err(error) => panic!("a concurrent attach may only win or be fenced, got {error}"),
        }
    }
    assert_eq!(attachments.len() + fenced_at_attach, ATTACHES);
    let generations: BTreeSet<u64> = attachments.iter().map(|a| a.generation()).collect();
    assert_eq!(
        generations.len(),
        attachments.len(),
        "every attachment has a generation of its own"
    );

    let status = runtime.status(&id).await.expect("status");
    assert_eq!(status.state, SessionState::Running);
    assert_eq!(
        Some(&status.generation),
        generations.last(),
        "the newest attachment is current"
    );

    // Exactly one worker process tree, of the current generation.
    let running: BTreeSet<u64> = workers(&scope).into_iter().map(|(_, _, g)| g).collect();
    assert_eq!(
        running,
        BTreeSet::from([status.generation]),
        "one worker, of the current generation"
    );
    let alive = attachments.iter().filter(|a| a.control().is_alive()).count();
    assert_eq!(alive, 1, "exactly one attachment's worker is alive");

    // Every loser is fenced, on both directions; the winner speaks ACP.
    let mut winner = None;
    let probe = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}"#;
    for mut attachment in attachments {
        if attachment.generation() == status.generation {
            winner = Some(attachment);
            continue;
        }
        match attachment.input().write_line(probe).await {
            Err(Error::Fenced {
                id: fenced,
                generation,
                current,
                ..
            }) => {
                assert_eq!(fenced, id);
                assert_eq!(generation, attachment.generation());
                assert!(
                    current > generation,
                    "fenced by a newer generation: {current} > {generation}"
                );
            }
            other => panic!("a losing attachment's write must be fenced, got {other:?}"),
        }
        let mut buf = [0u8; 64];
        let read = attachment.output().read(&mut buf).await;
        let error = read.expect_err("a losing attachment's output ends with an error");
        assert!(
            matches!(Error::from_io(&error), Some(Error::Fenced { .. })),
            "a losing attachment's output must end with Fenced, got {error}"
        );
        assert!(!attachment.control().is_alive());
    }
    let client = AcpClient::new(winner.expect("a winner"));
    client.initialize().await.expect("the winner speaks ACP");

    runtime.close(&id, CloseReason::Reset).await.expect("close");
    drop(client);
    let left = settle(|| Some(workers(&scope)).filter(|w| !w.is_empty())).await;
    assert_eq!(left, None, "no worker is left after close");
}

/// One session's whole life: create, attach and initialize, suspend, attach again (resume, a new
/// generation) and initialize, close.
async fn lifecycle(runtime: Arc<LocalRuntime>, n: usize) -> Result<(), String> {
    let id = runtime
        .create(&identity(&format!("s{n}")), &CreateOptions::new())
        .await
        .map_err(|e| format!("create {n}: {e}"))?
        .id;
    let first = runtime
        .attach(&id)
        .await
        .map_err(|e| format!("attach {n}: {e}"))?;
    let generation = first.generation();
    let client = AcpClient::new(first);
    client
        .initialize()
        .await
        .map_err(|e| format!("initialize {n}: {e}"))?;
    runtime
        .suspend(&id, SuspendReason::Idle)
        .await
        .map_err(|e| format!("suspend {n}: {e}"))?;
    drop(client);
    let status = runtime
        .status(&id)
        .await
        .map_err(|e| format!("status {n}: {e}"))?;
    if status.state != SessionState::Suspended || status.worker.is_some() {
        return Err(format!("session {n} after suspend: {status:?}"));
    }
    let second = runtime
        .attach(&id)
        .await
        .map_err(|e| format!("resume {n}: {e}"))?;
    if second.generation() <= generation {
        return Err(format!(
            "session {n} resumed with generation {}",
            second.generation()
        ));
    }
    let client = AcpClient::new(second);
    client
        .initialize()
        .await
        .map_err(|e| format!("initialize {n} again: {e}"))?;
    let reason = if n.is_multiple_of(2) {
        CloseReason::Reset
    } else {
        CloseReason::Ended
    };
    runtime
        .close(&id, reason)
        .await
        .map_err(|e| format!("close {n}: {e}"))?;
    drop(client);
    Ok(())
}

async fn two_hundred_sessions(mode: SandboxMode) {
    let _serial = SERIAL.lock().await;
    let root = tempfile::tempdir().expect("root");
    let Some(runtime) = runtime(root.path(), mode) else {
        return;
    };
    let scope = scope(root.path());
    // Warm-up: the first worker makes Tokio set up its process driver (signal pipe, ...), which
    // then stays; the baseline is taken after it.
    lifecycle(Arc::clone(&runtime), SESSIONS).await.expect("warm-up");
    assert_eq!(settle(|| Some(children()).filter(|c| !c.is_empty())).await, None);
    let fds_before = open_fds();
    let started = Instant::now();

    let limit = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..SESSIONS {
        let runtime = Arc::clone(&runtime);
        let limit = Arc::clone(&limit);
        tasks.spawn(async move {
            let _permit = limit.acquire_owned().await.expect("semaphore");
            lifecycle(runtime, n).await
        });
    }
    let mut failures = Vec::new();
    let mut peak_workers = 0;
    while let Some(joined) = tasks.join_next().await {
        if let Err(failure) = joined.expect("lifecycle task") {
            failures.push(failure);
        }
        peak_workers = peak_workers.max(workers(&scope).len());
    }
    assert!(
        failures.is_empty(),
        "{} sessions failed: {failures:#?}",
        failures.len()
    );
    let elapsed = started.elapsed();

    // Every session is closed, and `list` knows none.
    assert!(runtime.list().await.expect("list").is_empty());
    let report = runtime.reconcile().await.expect("reconcile");
    assert!(report.is_clean(), "nothing is left for reconcile: {report:?}");

    // No process: no worker of this root anywhere, no child (or zombie) of this process.
    let left = settle(|| Some(workers(&scope)).filter(|w| !w.is_empty())).await;
    assert_eq!(left, None, "leaked worker processes");
    let left = settle(|| Some(children()).filter(|c| !c.is_empty())).await;
    assert_eq!(left, None, "leaked child processes");
    // No descriptor.
    let fds_after = settle(|| Some(open_fds()).filter(|n| *n > fds_before)).await;
    assert_eq!(
        fds_after,
        None,
        "descriptors leaked: {fds_before} before, {} after",
        open_fds()
    );
    // No directory: only bookkeeping, empty. (Default retention deletes for every reason.)
    let mut entries: Vec<String> = std::fs::read_dir(root.path())
        .expect("root")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    for entry in &entries {
        let path = root.path().join(entry);
        match entry.as_str() {
            ".reconcile.lock" => {}
            ".trash" | ".retained" | ".uids" => {
                // `.uids/.lock` is the claims' lock file, not a claim.
                let inside: Vec<_> = std::fs::read_dir(&path)
                    .expect("bookkeeping dir")
                    .flatten()
                    .map(|e| e.file_name())
                    .filter(|name| !(entry == ".uids" && name == ".lock"))
                    .collect();
                assert!(inside.is_empty(), "{entry} is not empty: {inside:?}");
            }
            ".counters" => {
                // One small file per deleted session, keeping its generation counting.
                for counter in std::fs::read_dir(&path).expect("counters").flatten() {
                    assert!(
                        counter.file_type().expect("type").is_file(),
                        "{:?}",
                        counter.path()
                    );
                }
            }
            other => panic!("leaked entry {other} in the root: {entries:?}"),
        }
    }
    println!(
        "{SESSIONS} sessions ({mode}), {IN_FLIGHT} in flight: {:.1} s, peak {peak_workers} worker processes, \
         {fds_before} descriptors before and after, root afterwards: {entries:?}",
        elapsed.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_sessions_through_their_whole_lifecycle_leak_nothing() {
    two_hundred_sessions(SandboxMode::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_bubblewrap_sessions_through_their_whole_lifecycle_leak_nothing() {
    two_hundred_sessions(SandboxMode::Bubblewrap).await;
}

/// A session created again after a close that deleted its storage continues counting generations,
/// so nothing of the old session can ever carry a current generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_keep_growing_across_a_deleting_close() {
    use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime};

    let root = tempfile::tempdir().expect("root");
    let runtime = common::builder(root.path(), "generations", SandboxMode::None)
        .build()
        .expect("runtime");
    let identity = SessionIdentity::new("generations", "agent", "discord", "1").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    drop(runtime.attach(&id).await.expect("attach"));
    let before = runtime.attach(&id).await.expect("attach again").generation();
    runtime.close(&id, CloseReason::Reset).await.expect("close");
    let again = runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create again");
    assert!(again.created);
    assert!(
        again.generation >= before,
        "generation went back from {before} to {}",
        again.generation
    );
    let after = runtime
        .attach(&id)
        .await
        .expect("attach the new session")
        .generation();
    assert!(
        after > before,
        "the new session's first worker ({after}) must be above the old one's ({before})"
    );
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}
