//! The backend against AgentCore's documented contract, as the emulator enforces it: the IAM
//! policy of the operator guide, the WebSocket quotas (32 KB frames, 250 frames per second, 60
//! minutes per connection), the `/ping` idle model, chunked invocation bodies, the termination
//! window after a stop (409), the active session quota (402) and the invocation rate (429).
//!
//! Every limit is the real one except where a test shortens a clock (idle timeout, stream cap,
//! termination window) so that it runs in seconds.

mod common;

use std::time::Duration;

use agentcore_emulator::{Fault, Operation, WebSocketLimits};
use common::{attempts, created, within};
use session_runtime::{CloseReason, Error, SessionRuntime, SuspendReason};
use tokio::io::AsyncReadExt;

/// One line of the agent's output (without the newline).
async fn read_line(attachment: &mut session_runtime::Attachment) -> String {
    let mut line = Vec::new();
    let mut buf = [0u8; 1];
    loop {
        let n = within("read", attachment.output().read(&mut buf))
            .await
            .expect("read");
        assert!(n > 0, "the stream ended in the middle of a line");
        if buf[0] == b'\n' {
            return String::from_utf8(line).expect("UTF-8 output");
        }
        line.push(buf[0]);
    }
}

/// Sends `request` (JSON-RPC with `"id":<id>`) and returns every line up to its answer.
async fn call(attachment: &mut session_runtime::Attachment, id: u64, request: String) -> Vec<String> {
    within("write", attachment.input().write_line(&request))
        .await
        .expect("write");
    let mut lines = Vec::new();
    loop {
        let line = read_line(attachment).await;
        let done = line.contains(&format!(r#""id":{id}"#)) && !line.contains(r#""method""#);
        lines.push(line);
        if done {
            return lines;
        }
    }
}

/// `initialize` and `session/new`; the ACP session id.
async fn open_chat(attachment: &mut session_runtime::Attachment) -> String {
    call(
        attachment,
        1,
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}"#.into(),
    )
    .await;
    let cwd = serde_json::to_string(attachment.working_dir()).expect("a JSON string");
    let answer = call(
        attachment,
        2,
        format!(
            r#"{{"jsonrpc":"2.0","id":2,"method":"session/new","params":{{"cwd":{cwd},"mcpServers":[]}}}}"#
        ),
    )
    .await;
    let answer: serde_json::Value = serde_json::from_str(answer.last().expect("an answer")).expect("JSON");
    answer["result"]["sessionId"]
        .as_str()
        .expect("a session id")
        .to_owned()
}

/// A prompt turn: every line up to the answer.
async fn prompt(
    attachment: &mut session_runtime::Attachment,
    chat: &str,
    id: u64,
    text: &str,
) -> Vec<String> {
    let text = serde_json::to_string(text).expect("a JSON string");
    call(
        attachment,
        id,
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"session/prompt","params":{{"sessionId":"{chat}","prompt":[{{"type":"text","text":{text}}}]}}}}"#
        ),
    )
    .await
}

/// The policy the operator guide gives the broker's role is enough for the whole lifecycle:
/// the WebSocket upgrade (its own IAM action), the stop, and the wipe invocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_policy_allows_attach_suspend_and_close() {
    let harness = common::start().await;
    let id = created(&harness, "policy").await;
    let mut attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("the documented policy allows the WebSocket upgrade");
    open_chat(&mut attachment).await;
    drop(attachment);
    within("suspend", harness.runtime.suspend(&id, SuspendReason::Idle))
        .await
        .expect("suspend");
    within("close", harness.runtime.close(&id, CloseReason::Ended))
        .await
        .expect("close");
    harness.emulator.shutdown().await.expect("stop");
}

/// A turn whose output lines are 40 KB each (a tool result with file contents), and a prompt of
/// 40 KB, cross the front's 32 KB frame quota as many frames: nothing is cut, nothing retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_above_the_frame_quota_cross_whole_both_ways() {
    let harness = common::start().await;
    let id = created(&harness, "burst").await;
    let mut attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let chat = open_chat(&mut attachment).await;
    let big_prompt = format!("/chunks=3 /size=40000 {}", "p".repeat(40_000));
    let lines = prompt(&mut attachment, &chat, 3, &big_prompt).await;
    let chunks: Vec<_> = lines
        .iter()
        .filter(|line| line.contains("agent_message_chunk"))
        .collect();
    assert_eq!(chunks.len(), 3, "three chunks");
    assert!(
        chunks.iter().all(|line| line.len() > 80_000),
        "each chunk carries the 40 KB prompt and 40 KB of filler"
    );
    assert_eq!(
        attempts(&harness, Operation::WebSocket),
        [101],
        "one connection, never cut"
    );
    harness.emulator.shutdown().await.expect("stop");
}

/// An attached chat that stays quiet for longer than the idle timeout is not ended: AgentCore
/// counts no WebSocket bytes as activity, so the relay's `/ping` must say busy while a broker is
/// attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_attached_chat_outlives_the_idle_timeout() {
    let idle = Duration::from_secs(2);
    let harness = common::start_with(|mut setup| {
        setup.emulator = setup.emulator.idle_timeout(idle);
        setup
    })
    .await;
    let id = created(&harness, "quiet").await;
    let mut attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let chat = open_chat(&mut attachment).await;
    prompt(&mut attachment, &chat, 3, "before").await;
    tokio::time::sleep(idle * 3).await;
    let rsid = harness.runtime_session(&id, 1);
    assert!(
        harness.emulator.is_running(&rsid),
        "the microVM of a quiet attached chat runs"
    );
    let lines = prompt(&mut attachment, &chat, 4, "after").await;
    assert!(
        lines.iter().any(|line| line.contains("echo[0]: after")),
        "{lines:?}"
    );
    assert_eq!(
        attempts(&harness, Operation::WebSocket),
        [101],
        "the same connection throughout"
    );
    harness.emulator.shutdown().await.expect("stop");
}

/// A broker that goes away with output unacknowledged (the agent kept writing after it left)
/// does not pin the microVM: one idle timeout after it left, AgentCore ends the session.
/// (A broker that is still running but dropped its attachment keeps its connection, so its
/// session counts as attached; its `idle_ttl` and `reconcile` suspend it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_broker_leaves_the_microvm_to_idle_out() {
    let harness = common::start_with(|mut setup| {
        setup.emulator = setup.emulator.idle_timeout(Duration::from_secs(2));
        setup
    })
    .await;
    let id = created(&harness, "vanished").await;
    let mut attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let chat = open_chat(&mut attachment).await;
    // The turn writes for a while after the broker is gone: that output is never acknowledged.
    let text = serde_json::to_string("/chunks=5 /delay_ms=300 unread").expect("JSON");
    attachment
        .input()
        .write_line(&format!(
            r#"{{"jsonrpc":"2.0","id":3,"method":"session/prompt","params":{{"sessionId":"{chat}","prompt":[{{"type":"text","text":{text}}}]}}}}"#
        ))
        .await
        .expect("write");
    // The broker goes away: its attachment and its runtime (which holds the connection for a
    // later suspend) are dropped, so its WebSocket closes and nobody reconnects.
    let rsid = harness.runtime_session(&id, 1);
    let common::Harness {
        emulator,
        runtime,
        dir: _dir,
        ..
    } = harness;
    drop(attachment);
    drop(runtime);
    within("the idle timeout", async {
        while emulator.is_running(&rsid) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    emulator.shutdown().await.expect("stop");
}

/// Every `/ws` is cut at the front's maximum duration; the stream resumes on a new connection
/// without loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_cut_at_its_maximum_duration_resumes() {
    let harness = common::start_with(|mut setup| {
        setup.emulator = setup.emulator.websocket_limits(WebSocketLimits {
            max_duration: Duration::from_secs(1),
            ..WebSocketLimits::default()
        });
        setup
    })
    .await;
    let id = created(&harness, "duration").await;
    let mut attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    let chat = open_chat(&mut attachment).await;
    let lines = prompt(&mut attachment, &chat, 3, "/chunks=8 /delay_ms=400 long").await;
    let chunks = lines.iter().filter(|l| l.contains("agent_message_chunk")).count();
    assert_eq!(chunks, 8, "every chunk arrives once: {lines:?}");
    assert!(
        attempts(&harness, Operation::WebSocket).len() >= 2,
        "the connection was cut and reopened: {:?}",
        attempts(&harness, Operation::WebSocket)
    );
    harness.emulator.shutdown().await.expect("stop");
}

/// Closing right after a suspend meets the termination window of the stopped microVM: the
/// wipe invocation is answered `409 RetryableConflictException` until it ends, and the close
/// waits it out instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_during_the_termination_window_waits_for_it() {
    let harness = common::start_with(|mut setup| {
        // Longer than the SDK's own three attempts last.
        setup.emulator = setup.emulator.stop_latency(Duration::from_secs(6));
        setup
    })
    .await;
    let id = created(&harness, "conflict").await;
    let mut attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    open_chat(&mut attachment).await;
    drop(attachment);
    within("suspend", harness.runtime.suspend(&id, SuspendReason::Idle))
        .await
        .expect("suspend");
    within("close", harness.runtime.close(&id, CloseReason::Ended))
        .await
        .expect("the close waits out the termination window");
    let conflicts = harness
        .emulator
        .requests()
        .iter()
        .filter(|r| r.status == 409)
        .count();
    assert!(
        conflicts > 0,
        "the window was met: {:?}",
        harness.emulator.requests()
    );
    harness.emulator.shutdown().await.expect("stop");
}

/// A resume right after a suspend meets the termination window at the upgrade and retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_during_the_termination_window_retries_the_upgrade() {
    let harness = common::start().await;
    let id = created(&harness, "resume-409").await;
    let attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    drop(attachment);
    within("suspend", harness.runtime.suspend(&id, SuspendReason::Idle))
        .await
        .expect("suspend");
    within("resume", harness.runtime.attach(&id))
        .await
        .expect("the resume retries through the window");
    assert!(
        attempts(&harness, Operation::WebSocket).contains(&409),
        "{:?}",
        attempts(&harness, Operation::WebSocket)
    );
    harness.emulator.shutdown().await.expect("stop");
}

/// At the account's cap on active microVMs a new session's attach is retried within
/// `start_timeout` and then fails retryable, naming the quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_active_session_quota_fails_an_attach_retryably() {
    let harness = common::start_with(|mut setup| {
        setup.emulator = setup.emulator.max_active_sessions(1);
        setup.config.start_timeout = Duration::from_secs(3);
        setup
    })
    .await;
    let first = created(&harness, "quota-a").await;
    let second = created(&harness, "quota-b").await;
    let _running = within("attach", harness.runtime.attach(&first))
        .await
        .expect("the first session fits the quota");
    match within("attach", harness.runtime.attach(&second)).await {
        Err(Error::Backend {
            retryable: true,
            message,
            ..
        }) => assert!(message.contains("ServiceQuotaExceededException"), "{message}"),
        other => panic!("expected a retryable quota error, got {other:?}"),
    }
    assert!(
        attempts(&harness, Operation::WebSocket).contains(&402),
        "{:?}",
        attempts(&harness, Operation::WebSocket)
    );
    harness.emulator.shutdown().await.expect("stop");
}

/// Attaches above the endpoint's invocation rate are throttled and retried until they pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attaches_above_the_invocation_rate_are_retried() {
    let harness = common::start_with(|mut setup| {
        setup.emulator = setup.emulator.invocations_per_second(1);
        setup
    })
    .await;
    let a = created(&harness, "rate-a").await;
    let b = created(&harness, "rate-b").await;
    let c = created(&harness, "rate-c").await;
    let (a, b, c) = within("attaches", async {
        tokio::join!(
            harness.runtime.attach(&a),
            harness.runtime.attach(&b),
            harness.runtime.attach(&c)
        )
    })
    .await;
    for result in [a, b, c] {
        result.expect("every attach gets through");
    }
    assert!(
        attempts(&harness, Operation::WebSocket).contains(&429),
        "{:?}",
        attempts(&harness, Operation::WebSocket)
    );
    harness.emulator.shutdown().await.expect("stop");
}

/// `UnauthorizedException` (401) at `StopRuntimeSession` is a permission problem: not retried,
/// not retryable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthorized_at_the_stop_is_not_retryable() {
    let harness = common::start().await;
    let id = created(&harness, "unauthorized").await;
    let attachment = within("attach", harness.runtime.attach(&id))
        .await
        .expect("attach");
    drop(attachment);
    harness
        .emulator
        .fail_next(Operation::Stop, 3, Fault::Unauthorized);
    match within("suspend", harness.runtime.suspend(&id, SuspendReason::Idle)).await {
        Err(Error::Backend {
            retryable: false,
            message,
            ..
        }) => assert!(message.contains("UnauthorizedException"), "{message}"),
        other => panic!("expected a backend error that is not retryable, got {other:?}"),
    }
    harness.emulator.shutdown().await.expect("stop");
}
