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
//! for a runtime without session storage, `OAB_AGENTCORE_QUIET_MINUTES` (default 16: past the
//! runtime's default 15-minute idle timeout) for the quiet attach.
//!
//! The runtime's image must run `acp-test-agent` as its agent: build `deploy/agentcore/Dockerfile`
//! with the binary copied in (`COPY acp-test-agent /usr/local/bin/`) and
//! `CMD ["/usr/local/bin/acp-test-agent"]`. Its `/size=N` directive makes the agent's answer
//! lines larger than AgentCore's 32 KB frame quota.

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

/// Reads lines until the answer to `id`.
async fn until_answer(attachment: &mut session_runtime::Attachment, id: u64) -> Vec<String> {
    let mut reader = BufReader::new(attachment.output());
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        let read = tokio::time::timeout(Duration::from_secs(300), reader.read_line(&mut line))
            .await
            .expect("the agent answers within 5 minutes")
            .expect("read");
        assert!(read > 0, "the stream ended before the agent answered");
        let done = line.contains(&format!(r#""id":{id}"#)) && !line.contains(r#""method""#);
        lines.push(line);
        if done {
            return lines;
        }
    }
}

/// `session/new` in the attachment's working directory; the ACP session id.
async fn new_chat(attachment: &mut session_runtime::Attachment) -> String {
    let cwd = serde_json::to_string(attachment.working_dir()).expect("JSON");
    attachment
        .input()
        .write_line(format!(
            r#"{{"jsonrpc":"2.0","id":2,"method":"session/new","params":{{"cwd":{cwd},"mcpServers":[]}}}}"#
        ))
        .await
        .expect("write session/new");
    let lines = until_answer(attachment, 2).await;
    let answer: serde_json::Value = serde_json::from_str(lines.last().expect("an answer")).expect("JSON");
    answer["result"]["sessionId"]
        .as_str()
        .expect("a session id")
        .to_owned()
}

async fn prompt(
    attachment: &mut session_runtime::Attachment,
    chat: &str,
    id: u64,
    text: &str,
) -> Vec<String> {
    let text = serde_json::to_string(text).expect("JSON");
    attachment
        .input()
        .write_line(format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"session/prompt","params":{{"sessionId":"{chat}","prompt":[{{"type":"text","text":{text}}}]}}}}"#
        ))
        .await
        .expect("write the prompt");
    until_answer(attachment, id).await
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

    // A burst above AgentCore's 32 KB frame quota, both ways: a 40 KB prompt, answered by
    // chunks of 80 KB.
    let chat = new_chat(&mut attachment).await;
    let started = Instant::now();
    let lines = prompt(
        &mut attachment,
        &chat,
        3,
        &format!("/chunks=3 /size=40000 {}", "p".repeat(40_000)),
    )
    .await;
    let big = lines.iter().filter(|line| line.len() > 80_000).count();
    assert_eq!(big, 3, "three chunks of more than 80 KB each");
    println!("a 240 KB burst took {:?}", started.elapsed());

    // A quiet attach past the idle timeout: the relay's /ping says HealthyBusy while the broker
    // is attached, so AgentCore must not end the session.
    let quiet = std::env::var("OAB_AGENTCORE_QUIET_MINUTES")
        .ok()
        .and_then(|m| m.parse::<u64>().ok())
        .unwrap_or(16);
    println!("staying attached and quiet for {quiet} minutes");
    tokio::time::sleep(Duration::from_secs(quiet * 60)).await;
    let lines = prompt(&mut attachment, &chat, 4, "still there").await;
    assert!(
        lines.iter().any(|line| line.contains("still there")),
        "the same agent answers after the quiet attach: {lines:?}"
    );
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
