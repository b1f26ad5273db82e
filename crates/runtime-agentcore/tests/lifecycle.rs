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
    assert!(
        attachment.working_dir().ends_with("workspace")
            || std::path::Path::new(attachment.working_dir()) == storage,
        "the working directory is the session storage: {} vs {}",
        attachment.working_dir(),
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
    harness.emulator.shutdown().await.expect("stop");
}
