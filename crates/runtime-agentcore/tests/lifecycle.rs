//! The lifecycle against the emulator, step by step: what AgentCore is asked, and what the
//! session sees.

mod common;

use common::within;
use session_runtime::{CreateOptions, SessionRuntime, SessionState};
use tokio::io::AsyncReadExt;

async fn read_line(attachment: &mut session_runtime::Attachment) -> String {
    let mut line = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        let n = within("read", attachment.output().read(&mut byte))
            .await
            .expect("read");
        if n == 0 || byte[0] == b'\n' {
            return String::from_utf8_lossy(&line).into_owned();
        }
        line.push(byte[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_provisions_nothing_remote_and_attach_reaches_the_agent() {
    let harness = common::start().await;
    let identity = common::identity("first-attach");
    let handle = within("create", harness.runtime.create(&identity, &CreateOptions::new()))
        .await
        .expect("create");
    assert!(handle.created);
    assert!(
        harness.emulator.requests().is_empty(),
        "create calls nothing: {:?}",
        harness.emulator.requests()
    );

    let mut attachment = within("attach", harness.runtime.attach(&handle.id))
        .await
        .expect("attach");
    let rsid = harness.runtime_session(&handle.id, 1);
    assert!(harness.emulator.is_running(&rsid), "the microVM of {rsid} runs");
    let storage = harness
        .emulator
        .session_storage(&rsid)
        .await
        .expect("session storage");
    // The relay reports the session storage as the agent sees it: bubblewrap shows it at
    // /workspace; without a mount namespace it is the host path.
    let expected = if harness.emulator.sandbox().isolation == session_runtime::IsolationLevel::Namespaces {
        std::path::PathBuf::from("/workspace")
    } else {
        storage.clone()
    };
    assert_eq!(
        std::path::Path::new(attachment.working_dir()),
        expected,
        "the working directory is the session storage ({})",
        storage.display()
    );
    attachment
        .input()
        .write_line(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}"#)
        .await
        .expect("write");
    let answer = read_line(&mut attachment).await;
    assert!(
        answer.contains(r#""id":1"#) && answer.contains("protocolVersion"),
        "{answer}"
    );
    let status = harness.runtime.status(&handle.id).await.expect("status");
    assert_eq!(status.state, SessionState::Running);
    // The relay's generation floor is on the session storage, written (and synced) under the
    // storage's limits: the emulator's 1 GiB ext4 and its refusals of links and fallocate.
    let floor = std::fs::read_to_string(storage.join(".oab-relay/generation")).expect("the generation floor");
    assert_eq!(floor.trim(), "1");
    harness.emulator.shutdown().await.expect("stop");
}

fn stops(harness: &common::Harness) -> usize {
    harness
        .emulator
        .requests()
        .iter()
        .filter(|r| r.operation == Some(agentcore_emulator::Operation::Stop))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suspend_stops_the_microvm_resume_finds_the_storage_and_close_deletes_it() {
    use session_runtime::{CloseReason, StorageState, SuspendReason};
    let harness = common::start().await;
    let identity = common::identity("storage");
    let id = within("create", harness.runtime.create(&identity, &CreateOptions::new()))
        .await
        .expect("create")
        .id;
    let rsid = harness.runtime_session(&id, 1);
    let attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let storage = harness.emulator.session_storage(&rsid).await.expect("storage");
    std::fs::write(storage.join("notes.txt"), b"kept").expect("a file in the session storage");
    drop(attachment);

    within("suspend", harness.runtime.suspend(&id, SuspendReason::Idle))
        .await
        .expect("suspend");
    assert!(
        !harness.emulator.is_running(&rsid),
        "suspend released the microVM"
    );
    let _resumed = within("attach", harness.runtime.attach(&id))
        .await
        .expect("resume");
    assert!(
        harness.emulator.is_running(&rsid),
        "the same runtime session runs again"
    );
    assert!(
        storage.join("notes.txt").exists(),
        "the session storage survived the stop"
    );

    within("close", harness.runtime.close(&id, CloseReason::Reset))
        .await
        .expect("close");
    assert!(!harness.emulator.is_running(&rsid));
    assert!(
        !storage.join("notes.txt").exists(),
        "the close deleted the storage's contents"
    );
    let status = harness.runtime.status(&id).await.expect("status");
    assert_eq!(status.storage, StorageState::Deleted);

    let again = within("create", harness.runtime.create(&identity, &CreateOptions::new()))
        .await
        .expect("create again");
    assert!(again.created);
    let _fresh = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let next = harness.runtime_session(&id, 2);
    assert_ne!(next, rsid, "a new incarnation is a new runtime session");
    assert!(harness.emulator.is_running(&next));
    let fresh_storage = harness.emulator.session_storage(&next).await.expect("storage");
    assert!(!fresh_storage.join("notes.txt").exists());
    harness.emulator.shutdown().await.expect("stop");
}

/// `session/cancel` travels over the stream to the agent, which ends its turn; the microVM is
/// never stopped for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_the_agent_in_band_and_never_stops_the_microvm() {
    let harness = common::start().await;
    let identity = common::identity("cancel");
    let id = within("create", harness.runtime.create(&identity, &CreateOptions::new()))
        .await
        .expect("create")
        .id;
    let mut attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let cwd = attachment.working_dir().to_owned();
    let input = attachment.input().clone();
    input
        .write_line(format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"session/new","params":{{"cwd":"{cwd}","mcpServers":[]}}}}"#
        ))
        .await
        .expect("write");
    let created = read_line(&mut attachment).await;
    let session: serde_json::Value = serde_json::from_str(&created).expect("json");
    let acp_session = session["result"]["sessionId"]
        .as_str()
        .expect("a session id")
        .to_owned();
    input
        .write_line(format!(
            r#"{{"jsonrpc":"2.0","id":2,"method":"session/prompt","params":{{"sessionId":"{acp_session}","prompt":[{{"type":"text","text":"/chunks=100000 /delay_ms=10 long turn"}}]}}}}"#
        ))
        .await
        .expect("write");
    for _ in 0..3 {
        let update = read_line(&mut attachment).await;
        assert!(update.contains("session/update"), "{update}");
    }
    let stops_before = stops(&harness);
    input
        .write_line(format!(
            r#"{{"jsonrpc":"2.0","method":"session/cancel","params":{{"sessionId":"{acp_session}"}}}}"#
        ))
        .await
        .expect("write");
    let answer = loop {
        let line = read_line(&mut attachment).await;
        if line.contains(r#""id":2"#) {
            break line;
        }
    };
    assert!(answer.contains("cancelled"), "{answer}");
    assert_eq!(
        stops(&harness),
        stops_before,
        "cancel never calls StopRuntimeSession"
    );
    assert!(harness.emulator.is_running(&harness.runtime_session(&id, 1)));
    harness.emulator.shutdown().await.expect("stop");
}

/// With `stop_on_suspend = false` a suspend stops the agent but leaves the microVM to idle out:
/// no `StopRuntimeSession`, not from `reconcile` either, and the next attach reuses the warm
/// microVM with a new generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detach_only_suspend_leaves_the_microvm_to_idle_out() {
    use session_runtime::SuspendReason;
    let harness = common::start_with(|mut setup| {
        setup.config.stop_on_suspend = false;
        setup
    })
    .await;
    let identity = common::identity("detach");
    let id = within("create", harness.runtime.create(&identity, &CreateOptions::new()))
        .await
        .expect("create")
        .id;
    let attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let control = attachment.control();
    within("suspend", harness.runtime.suspend(&id, SuspendReason::Idle))
        .await
        .expect("suspend");
    assert!(!control.is_alive(), "the agent was stopped");
    let rsid = harness.runtime_session(&id, 1);
    assert!(harness.emulator.is_running(&rsid), "the microVM idles on");
    let report = within("reconcile", harness.runtime.reconcile())
        .await
        .expect("reconcile");
    assert!(report.killed_workers.is_empty(), "{report:?}");
    assert_eq!(stops(&harness), 0, "nothing stopped the microVM");
    let resumed = within("attach", harness.runtime.attach(&id))
        .await
        .expect("resume");
    assert!(resumed.control().generation() > control.generation());
    harness.emulator.shutdown().await.expect("stop");
}
