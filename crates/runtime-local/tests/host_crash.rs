//! A host crash on a file system that does not flush a file renamed over another (issue 24,
//! item 8): records written without fsync (the transitional ones: `provisioning`, `running`,
//! `closing`) may come back empty. The session must stay usable, at its last record at rest,
//! never an empty `record.json` that the runtime reports as unusable.

mod common;

use std::path::Path;

use session_runtime::config::SandboxMode;
use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime, SessionState};

const INSTALLATION: &str = "host-crash";

/// What a host crash leaves of the files of `dir` written since its last record at rest: each
/// file that holds the `running` record is emptied (its data never reached the disk).
fn crash(dir: &Path) -> Vec<String> {
    let mut emptied = Vec::new();
    for entry in std::fs::read_dir(dir).expect("session directory").flatten() {
        let path = entry.path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        if text.contains("\"running\"") {
            std::fs::write(&path, "").expect("empty");
            emptied.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    emptied
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_crash_that_empties_records_written_without_fsync_leaves_the_session_usable() {
    let root = tempfile::tempdir().expect("root");
    let identity = SessionIdentity::new(INSTALLATION, "agent", "discord", "crash").expect("identity");
    let id = identity.id();
    {
        let runtime = common::build_if_supported(
            common::builder(root.path(), INSTALLATION, SandboxMode::None),
            SandboxMode::None,
        )
        .expect("plain mode builds");
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        let attachment = runtime.attach(&id).await.expect("attach");
        assert_eq!(
            runtime.status(&id).await.expect("status").state,
            SessionState::Running
        );
        // A host crash ends every worker.
        attachment.control().kill().await.expect("kill the worker");
    }
    let emptied = crash(&root.path().join(id.as_str()));
    assert!(!emptied.is_empty(), "the running session has a record");

    let runtime = common::build_if_supported(
        common::builder(root.path(), INSTALLATION, SandboxMode::None),
        SandboxMode::None,
    )
    .expect("plain mode builds");
    let status = runtime
        .status(&id)
        .await
        .unwrap_or_else(|e| panic!("after emptying {emptied:?}: {e}"));
    assert_eq!(status.state, SessionState::Created, "the last record at rest");
    let attachment = runtime.attach(&id).await.expect("attach after the crash");
    assert!(attachment.generation() >= 1);
    drop(attachment);
    runtime.close(&id, CloseReason::Ended).await.expect("close");
}
