//! Session storage as AgentCore is reported to limit it, enforced on the worker itself: a size
//! cap (writes beyond it fail with ENOSPC), no hard links, FIFOs, UNIX sockets, extended
//! attributes or `fallocate`, and a storage that is not there while the worker starts.

mod common;

use std::path::Path;

use agentcore_emulator::{
    Emulator, LocalLauncher, SandboxMode, StorageEnforcement, StorageLimits, WorkerCommand,
};
use common::*;
use serde_json::{json, Value};

/// ENOSPC, EPERM, EOPNOTSUPP and EACCES on Linux.
const ENOSPC: i64 = 28;
const EPERM: i64 = 1;
const EOPNOTSUPP: i64 = 95;
const EACCES: i64 = 13;

/// The cap the tests use: small enough to fill quickly.
const TEST_CAP: u64 = 8 * 1024 * 1024;

/// An emulator on the test worker with the default storage limits but a cap of [`TEST_CAP`].
async fn storage_emulator(root: &Path) -> Emulator {
    storage_emulator_in(root, SandboxMode::Auto).await
}

/// [`storage_emulator`] with workers in sandbox `mode` (required to work).
async fn storage_emulator_in(root: &Path, mode: SandboxMode) -> Emulator {
    let launcher = LocalLauncher::builder(WorkerCommand::new(test_worker()))
        .root(root)
        .sandbox(mode)
        .require_sandbox(mode != SandboxMode::None)
        .storage_limits(StorageLimits {
            max_bytes: Some(TEST_CAP),
            ..StorageLimits::default()
        })
        .storage_rules_helper(env!("CARGO_BIN_EXE_oab-storage-rules"))
        .build()
        .expect("launcher");
    // Landlock cannot have the storage come after the worker started (see the crate docs).
    assert_eq!(
        launcher.storage_enforcement(),
        StorageEnforcement {
            size_cap: true,
            absent_during_startup: mode != SandboxMode::Landlock,
            refuse_special_files: true,
        },
        "this host cannot enforce the storage limits (root, mount and mkfs.ext4 are needed)"
    );
    Emulator::builder()
        .launcher(launcher)
        .stop_latency(std::time::Duration::ZERO)
        .start()
        .await
        .expect("emulator starts")
}

#[test]
fn the_defaults_are_agentcores_reported_limits() {
    let limits = StorageLimits::default();
    assert_eq!(limits.max_bytes, Some(1 << 30));
    assert!(limits.refuse_special_files && limits.absent_during_startup);
}

fn errno(answer: &Value, key: &str) -> i64 {
    answer[key]
        .as_i64()
        .unwrap_or_else(|| panic!("no {key} in {answer}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_beyond_the_cap_fails_with_enospc() {
    let root = tempfile::tempdir().expect("root");
    let emulator = storage_emulator(root.path()).await;
    let sdk = client(&emulator);
    let session = session_id("cap");
    let filled = invoke_json(
        &sdk,
        &emulator,
        &session,
        json!({"op": "fill", "bytes": 2 * TEST_CAP}),
    )
    .await;
    assert_eq!(errno(&filled, "errno"), ENOSPC, "{filled}");
    let written = filled["written"].as_u64().expect("written");
    assert!(
        written < TEST_CAP,
        "{written} bytes written under a cap of {TEST_CAP}"
    );
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_links_fifos_sockets_xattrs_and_fallocate_are_refused() {
    let root = tempfile::tempdir().expect("root");
    let emulator = storage_emulator(root.path()).await;
    let sdk = client(&emulator);
    let session = session_id("refusals");
    let probe = invoke_json(&sdk, &emulator, &session, json!({"op": "probe"})).await;
    assert_eq!(errno(&probe, "hard_link"), EPERM, "{probe}");
    // Landlock refuses making them on the storage alone.
    assert_eq!(errno(&probe, "fifo"), EACCES, "{probe}");
    assert_eq!(errno(&probe, "socket"), EACCES, "{probe}");
    assert_eq!(errno(&probe, "socket_elsewhere"), 0, "{probe}");
    assert_eq!(errno(&probe, "fifo_elsewhere"), 0, "{probe}");
    assert_eq!(errno(&probe, "xattr"), EOPNOTSUPP, "{probe}");
    assert_eq!(errno(&probe, "fallocate"), EOPNOTSUPP, "{probe}");
    // What the storage is not reported to refuse keeps working.
    assert_eq!(errno(&probe, "symlink"), 0, "{probe}");
    assert_eq!(errno(&probe, "rename"), 0, "{probe}");
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_storage_is_absent_while_the_worker_starts() {
    let root = tempfile::tempdir().expect("root");
    let emulator = storage_emulator(root.path()).await;
    let sdk = client(&emulator);
    let session = session_id("startup");
    invoke_json(
        &sdk,
        &emulator,
        &session,
        json!({"op": "write", "name": "kept", "content": "1"}),
    )
    .await;
    assert!(
        emulator.stop_session(&session).await.expect("stop"),
        "was running"
    );
    // The next microVM starts without the storage: it sees nothing of it then ...
    let startup = invoke_json(&sdk, &emulator, &session, json!({"op": "startup"})).await;
    let entries = startup["entries"].as_array().expect("entries");
    assert!(
        !entries.iter().any(|name| name == "kept"),
        "the storage was there during start-up: {startup}"
    );
    // ... and from its first invocation on, all of it, but not what it wrote during start-up.
    let read = invoke_json(&sdk, &emulator, &session, json!({"op": "read", "name": "kept"})).await;
    assert_eq!(read["content"], "1", "{read}");
    let marker = invoke_json(
        &sdk,
        &emulator,
        &session,
        json!({"op": "read", "name": "startup-marker"}),
    )
    .await;
    assert_eq!(
        marker["content"],
        Value::Null,
        "a start-up write reached the storage: {marker}"
    );
    emulator.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limits_hold_in_every_sandbox_mode() {
    let mut modes = vec![SandboxMode::Bubblewrap, SandboxMode::None];
    // The local backend finds its Landlock helper through this variable in a test binary.
    if std::env::var_os("OAB_LANDLOCK_EXEC").is_some() {
        modes.push(SandboxMode::Landlock);
    } else {
        eprintln!("Landlock mode not covered: set OAB_LANDLOCK_EXEC to an oab-landlock-exec");
    }
    for mode in modes {
        let root = tempfile::tempdir().expect("root");
        let emulator = storage_emulator_in(root.path(), mode).await;
        // Checked first, asserted after the shutdown: a worker outside a pid namespace would
        // outlive an emulator dropped by a failing assertion.
        let wrong = limits_in(&emulator, mode).await;
        emulator.shutdown().await.expect("shutdown");
        assert_eq!(wrong, Vec::<String>::new(), "{mode:?}");
        assert_eq!(
            left_behind(root.path()).await,
            (Vec::new(), Vec::new()),
            "{mode:?}"
        );
    }
}

/// What differs from the limits in a session of `emulator`, whose workers run in `mode`.
async fn limits_in(emulator: &Emulator, mode: SandboxMode) -> Vec<String> {
    let mut wrong = Vec::new();
    let mut expect = |what: &str, got: i64, want: i64, answer: &Value| {
        if got != want {
            wrong.push(format!("{what}: {got}, not {want}: {answer}"));
        }
    };
    let sdk = client(emulator);
    let session = session_id("modes");
    let filled = invoke_json(
        &sdk,
        emulator,
        &session,
        json!({"op": "fill", "bytes": 2 * TEST_CAP}),
    )
    .await;
    expect("fill", errno(&filled, "errno"), ENOSPC, &filled);
    let probe = invoke_json(&sdk, emulator, &session, json!({"op": "probe"})).await;
    expect("hard link", errno(&probe, "hard_link"), EPERM, &probe);
    expect("socket", errno(&probe, "socket"), EACCES, &probe);
    // Under Landlock the worker cannot list the directories on the way to its storage, so
    // nothing beside them is granted: sockets are refused everywhere (stricter, not looser).
    let elsewhere = if mode == SandboxMode::Landlock { EACCES } else { 0 };
    expect(
        "socket elsewhere",
        errno(&probe, "socket_elsewhere"),
        elsewhere,
        &probe,
    );
    match emulator.stop_session(&session).await {
        Ok(true) => {}
        other => wrong.push(format!("stop: {other:?}")),
    }
    // Under Landlock the storage cannot come after the worker started.
    let startup = invoke_json(&sdk, emulator, &session, json!({"op": "startup"})).await;
    let seen = startup["entries"]
        .as_array()
        .is_some_and(|entries| entries.iter().any(|name| name == "fill"));
    if seen != (mode == SandboxMode::Landlock) {
        wrong.push(format!("start-up saw {startup}"));
    }
    match emulator.session_storage(&session).await {
        Some(storage) if storage.join("fill").is_file() => {}
        other => wrong.push(format!("the worker wrote elsewhere than the storage ({other:?})")),
    }
    wrong
}

/// Mounts whose source or target lies under `root` (none may outlive the emulator).
fn mounts_under(root: &Path) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let root = root.display().to_string();
    table
        .lines()
        .filter(|line| line.contains(&root))
        .map(str::to_owned)
        .collect()
}

/// Loop devices backed by a file under `root`.
fn loops_under(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let backing = entry.path().join("loop/backing_file");
        if let Ok(file) = std::fs::read_to_string(backing) {
            if file.trim().starts_with(&root.display().to_string()) {
                found.push(format!(
                    "{}: {}",
                    entry.file_name().to_string_lossy(),
                    file.trim()
                ));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_left_mounted_after_a_stop_a_shutdown_or_a_drop() {
    let root = tempfile::tempdir().expect("root");
    let emulator = storage_emulator(root.path()).await;
    let sdk = client(&emulator);
    let (stopped, running) = (session_id("left-a"), session_id("left-b"));
    for session in [&stopped, &running] {
        invoke_json(
            &sdk,
            &emulator,
            session,
            json!({"op": "write", "name": "f", "content": "1"}),
        )
        .await;
    }
    assert!(
        emulator.stop_session(&stopped).await.expect("stop"),
        "was running"
    );
    emulator.shutdown().await.expect("shutdown");
    assert_eq!(
        left_behind(root.path()).await,
        (Vec::new(), Vec::new()),
        "after a shutdown"
    );

    // An emulator dropped without a shutdown, its worker still running, cleans up too.
    let emulator = storage_emulator(root.path()).await;
    let sdk = client(&emulator);
    let read = invoke_json(&sdk, &emulator, &running, json!({"op": "read", "name": "f"})).await;
    assert_eq!(read["content"], "1", "kept across emulators: {read}");
    drop(sdk);
    drop(emulator);
    // At once: a test that panics drops its emulator and then its temporary directory, which
    // could not be removed while the storage is still mounted in it.
    assert_eq!(
        mounts_under(root.path()),
        Vec::<String>::new(),
        "right after a drop"
    );
    assert_eq!(
        left_behind(root.path()).await,
        (Vec::new(), Vec::new()),
        "after a drop"
    );
}

/// Mounts and loop devices under `root`, once they are gone or after 5 s. A dropped emulator
/// unmounts when its tasks end, and the kernel frees a loop device after its last user, both
/// shortly after the call that caused it returns.
async fn left_behind(root: &Path) -> (Vec<String>, Vec<String>) {
    let mut left = (mounts_under(root), loops_under(root));
    for _ in 0..100 {
        if left.0.is_empty() && left.1.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        left = (mounts_under(root), loops_under(root));
    }
    left
}
