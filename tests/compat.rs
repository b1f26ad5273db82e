//! The openab-core compatibility layer against the reference runtime.

use std::sync::Arc;
use std::time::Duration;

use openab_runtime::compat::{AcpCallError, LineWriter, PoolPath, RuntimeCall, ThreadSessions};
use openab_runtime::testing::FakeRuntime;
use openab_runtime::{CloseReason, CreateOptions, Error, SessionRuntime, SessionState, SuspendReason};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

fn sessions() -> (Arc<FakeRuntime>, ThreadSessions) {
    let runtime = Arc::new(FakeRuntime::builder().build().expect("fake runtime"));
    let sessions = ThreadSessions::new(
        Arc::<FakeRuntime>::clone(&runtime),
        runtime.installation(),
        "claude",
    );
    (runtime, sessions)
}

#[test]
fn pool_keys_map_to_identities() {
    let (_, sessions) = sessions();
    let identity = sessions
        .identity("slack:C0123ABC:1712345678.000100")
        .expect("slack key");
    assert_eq!(
        (identity.platform(), identity.thread()),
        ("slack", "C0123ABC:1712345678.000100")
    );
    assert_eq!(
        sessions.session_id("discord:42").expect("id"),
        sessions.identity("discord:42").expect("id").id()
    );
    assert_ne!(
        sessions.session_id("discord:42").expect("id"),
        sessions.session_id("slack:42").expect("id")
    );
    for bad in ["no-separator", ":thread", "Discord:1", "discord:"] {
        assert!(
            matches!(sessions.identity(bad), Err(Error::InvalidIdentity { .. })),
            "{bad:?} must be refused"
        );
    }
}

#[test]
fn every_pool_path_makes_the_documented_call() {
    let table: Vec<(PoolPath, RuntimeCall, bool)> = PoolPath::ALL
        .iter()
        .map(|path| (*path, path.call(), path.resumable()))
        .collect();
    assert_eq!(
        table,
        vec![
            (
                PoolPath::ExplicitReset,
                RuntimeCall::Close(CloseReason::Reset),
                false
            ),
            (
                PoolPath::IdleEviction,
                RuntimeCall::Suspend(SuspendReason::Idle),
                true
            ),
            (
                PoolPath::CapacityEviction,
                RuntimeCall::Suspend(SuspendReason::Capacity),
                true
            ),
            (
                PoolPath::HungEviction,
                RuntimeCall::Suspend(SuspendReason::Hung),
                false
            ),
            (
                PoolPath::BrokerShutdown,
                RuntimeCall::Suspend(SuspendReason::Shutdown),
                true
            ),
            (
                PoolPath::ThreadArchived,
                RuntimeCall::Close(CloseReason::Ended),
                false
            ),
        ]
    );
}

#[test]
fn transient_errors_are_typed() {
    let timeout = AcpCallError::Timeout {
        method: "session/load".into(),
        after: Duration::from_secs(30),
    };
    let closed = AcpCallError::ChannelClosed {
        method: "session/load".into(),
    };
    let rpc = AcpCallError::Rpc {
        code: -32002,
        message: "unknown session".into(),
    };
    let id = openab_runtime::SessionId::parse("aaaaaaaaaaaaaaaaaaaa").expect("id");
    assert!(timeout.is_transient() && closed.is_transient());
    assert!(!rpc.is_transient());
    assert!(AcpCallError::Runtime(Error::Disconnected { id }).is_transient());
    assert!(!AcpCallError::Runtime(Error::Fenced {
        id,
        generation: 1,
        current: 2
    })
    .is_transient());
    // The messages stay what upstream logs today.
    assert_eq!(
        timeout.to_string(),
        "timeout waiting for session/load response after 30s"
    );
    assert_eq!(closed.to_string(), "channel closed waiting for session/load");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_speaks_acp_and_its_control_works_without_the_reader() {
    let (runtime, sessions) = sessions();
    let transport = sessions
        .open("discord:1234", &CreateOptions::new())
        .await
        .expect("open");
    assert!(transport.cwd.starts_with('/'));
    let mut writer = transport.writer.clone();
    let mut lines = BufReader::new(transport.reader).lines();
    writer
        .write_all(
            b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"initialize\",\"params\":{\"protocolVersion\":1}}\n",
        )
        .await
        .expect("write");
    writer.flush().await.expect("flush");
    let answer = lines.next_line().await.expect("read").expect("a line");
    assert!(
        answer.contains("\"id\":1") && answer.contains("protocolVersion"),
        "{answer}"
    );

    // The control handle cancels and kills while nothing reads; the runtime record is unchanged
    // until the pool says which path this is.
    transport
        .control
        .cancel("no-such-acp-session")
        .await
        .expect("cancel reaches stdin");
    assert!(transport.control.is_alive());
    transport.control.kill().await.expect("kill");
    assert!(!transport.control.is_alive());
    sessions
        .end("discord:1234", PoolPath::HungEviction)
        .await
        .expect("hung eviction");
    let status = runtime.status(&transport.session_id).await.expect("status");
    assert_eq!(
        (status.state, status.suspend_reason),
        (SessionState::Suspended, Some(SuspendReason::Hung))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn line_writer_clones_never_interleave_lines() {
    let (_, sessions) = sessions();
    let transport = sessions
        .open("discord:77", &CreateOptions::new())
        .await
        .expect("open");
    let mut tasks = Vec::new();
    for writer_index in 0..8 {
        let mut writer: LineWriter = transport.writer.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0..50 {
                // Each message is written in three pieces, as a careless caller might.
                let id = writer_index * 1000 + n;
                let message = format!(
                    "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"method\":\"initialize\",\"params\":{{\"protocolVersion\":1}}}}\n"
                );
                let (a, rest) = message.split_at(10);
                let (b, c) = rest.split_at(20);
                for piece in [a, b, c] {
                    writer.write_all(piece.as_bytes()).await.expect("write");
                }
                writer.flush().await.expect("flush");
            }
        }));
    }
    for task in tasks {
        task.await.expect("writer task");
    }
    let mut lines = BufReader::new(transport.reader).lines();
    let mut answered = 0;
    while answered < 400 {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("answers keep coming")
            .expect("read")
            .expect("a line");
        // A torn line would be answered with a parse error instead.
        assert!(
            !line.contains("-32700") && !line.contains("-32600"),
            "a line was torn: {line}"
        );
        answered += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_connection_is_replaced_by_opening_again() {
    let (_, sessions) = sessions();
    let first = sessions
        .open("slack:C1:1.2", &CreateOptions::new())
        .await
        .expect("open");
    first.control.kill().await.expect("kill");
    let second = sessions
        .open("slack:C1:1.2", &CreateOptions::new())
        .await
        .expect("reopen");
    assert_eq!(second.session_id, first.session_id);
    assert!(
        second.generation > first.generation,
        "a replacement is a new generation"
    );
    match first.control.cancel("x").await {
        Err(Error::Fenced { .. } | Error::Disconnected { .. }) => {}
        other => panic!("the old connection must be fenced or gone, got {other:?}"),
    }
}
