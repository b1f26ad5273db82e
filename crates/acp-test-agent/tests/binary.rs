//! Runs the built `acp-test-agent` binary as a child process.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::{chunk_texts, Client, STEP};
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

const AGENT: &str = env!("CARGO_BIN_EXE_acp-test-agent");

fn spawn(args: &[&str], home: &Path) -> (Client, Child) {
    let mut child = Command::new(AGENT)
        .args(args)
        .env("HOME", home)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    (Client::new(stdout, stdin), child)
}

async fn exit_code(child: &mut Child) -> Option<i32> {
    tokio::time::timeout(STEP, child.wait())
        .await
        .expect("agent did not exit")
        .unwrap()
        .code()
}

#[tokio::test]
async fn binary_serves_stdio_and_persists_sessions_across_restarts() {
    let home = tempfile::tempdir().unwrap();
    let (mut client, mut child) = spawn(&["--name", "bin-agent", "--chunks", "2"], home.path());

    let (_, init) = client.call("initialize", json!({"protocolVersion": 1})).await;
    assert_eq!(init["result"]["agentInfo"]["name"], "bin-agent");
    assert_eq!(init["result"]["agentCapabilities"]["loadSession"], true);

    let session = client.new_session().await;
    let id = client.prompt(&session, "from the binary").await;
    let (updates, response) = client.until_response(&id).await;
    assert_eq!(
        chunk_texts(&updates, &session),
        ["echo[0]: from the binary", "echo[1]: from the binary"]
    );
    assert_eq!(response["result"]["stopReason"], "end_turn");

    // The exec probe runs inside the agent process's environment.
    let (_, exec) = client
        .call(
            acp_test_agent::EXEC_METHOD,
            json!({"command": "echo \"$HOME\"; echo $PPID"}),
        )
        .await;
    let pid = child.id().unwrap();
    assert_eq!(
        exec["result"]["stdout"],
        format!("{}\n{pid}\n", home.path().display())
    );
    assert_eq!(exec["result"]["exitCode"], 0);

    client.send_raw("garbage").await;
    assert_eq!(client.recv().await["error"]["code"], -32700);

    // Stdin EOF ends the process cleanly.
    client.close_input().await;
    assert_eq!(client.next_line().await, None);
    assert_eq!(exit_code(&mut child).await, Some(0));

    // The default state dir is $HOME/.acp-test-agent; a new process loads
    // the session from there.
    assert!(home.path().join(".acp-test-agent").join(&session).is_file());
    let (mut client, mut child) = spawn(&[], home.path());
    let (updates, loaded) = client
        .call(
            "session/load",
            json!({"sessionId": session, "cwd": "/", "mcpServers": []}),
        )
        .await;
    assert_eq!(loaded["result"], Value::Null, "{loaded}");
    assert_eq!(chunk_texts(&updates, &session), [format!("loaded {session}")]);
    client.close_input().await;
    assert_eq!(exit_code(&mut child).await, Some(0));
}

#[tokio::test]
async fn binary_cancel_mid_turn() {
    let home = tempfile::tempdir().unwrap();
    let state = home.path().join("state");
    let (mut client, mut child) = spawn(&["--state-dir", state.to_str().unwrap()], home.path());
    let session = client.new_session().await;
    assert!(state.join(&session).is_file());
    let id = client.prompt(&session, "/delay_ms=200 /chunks=50 slow").await;
    client.recv().await;
    client
        .notify("session/cancel", json!({"sessionId": session}))
        .await;
    let (updates, response) = client.until_response(&id).await;
    assert!(updates.len() < 49);
    assert_eq!(response["result"]["stopReason"], "cancelled");
    client.close_input().await;
    assert_eq!(exit_code(&mut child).await, Some(0));
}

#[tokio::test]
async fn binary_ignore_stdin_eof_keeps_running() {
    let home = tempfile::tempdir().unwrap();
    let (mut client, mut child) = spawn(&["--ignore-stdin-eof"], home.path());
    let (_, init) = client.call("initialize", json!({"protocolVersion": 1})).await;
    assert_eq!(init["result"]["protocolVersion"], 1);
    client.close_input().await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), child.wait())
            .await
            .is_err(),
        "agent exited on stdin EOF"
    );
    child.kill().await.unwrap();
}

#[tokio::test]
async fn binary_rejects_bad_flags_with_exit_code_2() {
    for args in [
        &["--bogus"][..],
        &["--chunks", "many"],
        &["--delay-ms"],
        &["--ignore-stdin-eof=yes"],
    ] {
        let output = Command::new(AGENT)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(output.stdout.is_empty(), "{args:?}");
        assert!(!output.stderr.is_empty(), "{args:?}");
    }
}

#[tokio::test]
async fn binary_help_prints_usage() {
    let mut child = Command::new(AGENT)
        .arg("--help")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut usage = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut usage)
        .await
        .unwrap();
    assert_eq!(exit_code(&mut child).await, Some(0));
    assert!(usage.contains("--ignore-stdin-eof"));
    assert!(usage.contains("--state-dir"));
}
