//! The lifecycle against a real AgentCore runtime built from `deploy/agentcore/Dockerfile`.
//!
//! Needs AWS credentials in the standard provider chain with the permissions in
//! `docs/agentcore.md`, and the runtime's ARN:
//!
//! ```text
//! OAB_AGENTCORE_RUNTIME_ARN=arn:aws:bedrock-agentcore:<region>:<account>:runtime/<id> \
//!   cargo test -p runtime-agentcore --test live -- --ignored --nocapture
//! ```
//!
//! Optional: `OAB_AGENTCORE_QUALIFIER` (default `DEFAULT`), `OAB_AGENTCORE_SESSION_STORAGE=false`
//! for a runtime without session storage.

use std::time::{Duration, Instant};

use runtime_agentcore::AgentCoreRuntime;
use session_runtime::config::AgentCoreConfig;
use session_runtime::{
    CloseReason, CreateOptions, SessionIdentity, SessionRuntime, SessionState, SuspendReason,
};
use tokio::io::{AsyncBufReadExt, BufReader};

async fn initialize(attachment: &mut session_runtime::Attachment) -> String {
    attachment
        .input()
        .write_line(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1,"clientCapabilities":{}}}"#)
        .await
        .expect("write initialize");
    let mut reader = BufReader::new(attachment.output());
    loop {
        let mut line = String::new();
        let read = tokio::time::timeout(Duration::from_secs(120), reader.read_line(&mut line))
            .await
            .expect("the agent answers within 2 minutes")
            .expect("read");
        assert!(read > 0, "the stream ended before the agent answered");
        if line.contains(r#""id":1"#) {
            return line;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs AWS credentials and a runtime ARN: see docs/agentcore.md"]
async fn a_session_lives_suspends_resumes_and_closes_on_a_real_runtime() {
    let arn = std::env::var("OAB_AGENTCORE_RUNTIME_ARN").expect("set OAB_AGENTCORE_RUNTIME_ARN");
    let state = tempfile::tempdir().expect("a state directory");
    let mut config = AgentCoreConfig::new(arn);
    config.qualifier = std::env::var("OAB_AGENTCORE_QUALIFIER").ok();
    config.session_storage = std::env::var("OAB_AGENTCORE_SESSION_STORAGE").map_or(true, |v| v != "false");
    config.state_dir = state.path().to_owned();
    let runtime = AgentCoreRuntime::builder(config)
        .installation("oab-live-test")
        .build()
        .expect("the runtime builds");
    let identity = SessionIdentity::new(
        "oab-live-test",
        "agent",
        "live",
        format!("run-{}", std::process::id()),
    )
    .expect("an identity");
    let id = runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create")
        .id;

    let started = Instant::now();
    let mut attachment = runtime.attach(&id).await.expect("attach (a cold start)");
    println!(
        "attach took {:?}; working directory {}",
        started.elapsed(),
        attachment.working_dir()
    );
    println!("initialize: {}", initialize(&mut attachment).await.trim());
    drop(attachment);

    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    assert_eq!(
        runtime.status(&id).await.expect("status").state,
        SessionState::Suspended
    );
    let started = Instant::now();
    let mut resumed = runtime.attach(&id).await.expect("resume");
    println!("resume took {:?}", started.elapsed());
    println!("initialize again: {}", initialize(&mut resumed).await.trim());
    drop(resumed);

    runtime.close(&id, CloseReason::Reset).await.expect("close");
    let status = runtime.status(&id).await.expect("status");
    assert_eq!(status.state, SessionState::Closed);
    println!("closed: storage {:?}", status.storage);
}
