//! The attachment's line writer over an in-memory pipe: whole lines even when the caller gives
//! up, no interleaving between writers, and a fence or the last handle lets go of the stdin.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use session_runtime::{
    Attachment, AttachmentParts, Error, Fence, FenceTrigger, Generation, Result, SessionId, SessionIdentity,
    WorkerControl, WorkerExit,
};
use tokio::io::{AsyncReadExt, DuplexStream};

/// A worker that is never asked anything here.
#[derive(Debug)]
struct Idle;

#[async_trait]
impl WorkerControl for Idle {
    fn worker_id(&self) -> &str {
        "idle"
    }
    fn generation(&self) -> Generation {
        1
    }
    fn is_alive(&self) -> bool {
        true
    }
    async fn terminate(&self, _grace: Duration) -> Result<WorkerExit> {
        Ok(WorkerExit::Code(0))
    }
    async fn kill(&self) -> Result<WorkerExit> {
        Ok(WorkerExit::Code(0))
    }
    async fn wait(&self) -> Result<WorkerExit> {
        Ok(WorkerExit::Code(0))
    }
}

fn id() -> SessionId {
    SessionIdentity::new("test", "agent", "discord", "attachment")
        .expect("identity")
        .id()
}

/// An attachment whose stdin is a pipe of `capacity` bytes; returns the agent's end of it.
fn attachment(capacity: usize) -> (Attachment, DuplexStream, FenceTrigger) {
    let (fence, trigger) = Fence::new(id(), 1);
    let (stdin, agent_stdin) = tokio::io::duplex(capacity);
    let (_agent_stdout, stdout) = tokio::io::duplex(64);
    let parts = AttachmentParts::new(fence, "/workspace", stdout, stdin, Arc::new(Idle));
    (Attachment::new(parts), agent_stdin, trigger)
}

async fn read_all(mut agent_stdin: DuplexStream) -> String {
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(10), agent_stdin.read_to_string(&mut text))
        .await
        .expect("the agent's stdin ends")
        .expect("read");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_given_up_by_its_caller_still_writes_the_whole_line() {
    let (attachment, agent_stdin, _trigger) = attachment(64);
    let input = attachment.input();
    let big = "b".repeat(200_000);
    // The pipe holds 64 bytes and nobody reads yet: the caller gives up mid-line.
    let gave_up = tokio::time::timeout(Duration::from_millis(20), input.write_line(&big)).await;
    assert!(
        gave_up.is_err(),
        "a 200 KB line cannot fit a 64-byte pipe at once"
    );
    let reader = tokio::spawn(read_all(agent_stdin));
    input.write_line("next").await.expect("the next line");
    drop(input);
    drop(attachment);
    let text = reader.await.expect("reader");
    assert_eq!(text, format!("{big}\nnext\n"), "whole lines, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_never_interleave() {
    let (attachment, agent_stdin, _trigger) = attachment(256);
    let reader = tokio::spawn(read_all(agent_stdin));
    let mut writers = Vec::new();
    for writer in 0..8 {
        let input = attachment.input();
        writers.push(tokio::spawn(async move {
            for line in 0..50 {
                let text = format!("{writer}:{line}:{}", "x".repeat(100 + writer * 37));
                input.write_line(text).await.expect("write");
            }
        }));
    }
    for writer in writers {
        writer.await.expect("writer");
    }
    drop(attachment);
    let text = reader.await.expect("reader");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 8 * 50);
    for line in lines {
        let mut parts = line.split(':');
        let writer: usize = parts.next().and_then(|w| w.parse().ok()).expect("writer");
        let _line: usize = parts.next().and_then(|l| l.parse().ok()).expect("line");
        assert_eq!(parts.next().map(str::len), Some(100 + writer * 37), "{line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_fails_writes_and_lets_go_of_the_stdin() {
    let (attachment, agent_stdin, trigger) = attachment(1024);
    let input = attachment.input();
    input.write_line("before").await.expect("write");
    trigger.fence(2);
    match input.write_line("after").await {
        Err(Error::Fenced {
            generation, current, ..
        }) => assert_eq!((generation, current), (1, 2)),
        other => panic!("a write after the fence must be Fenced, got {other:?}"),
    }
    // The handles are still alive, yet the agent's stdin ends: the fence released it.
    assert_eq!(read_all(agent_stdin).await, "before\n");
    drop((input, attachment));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_ends_the_stdin_and_later_writes_are_disconnected() {
    let (attachment, agent_stdin, _trigger) = attachment(1024);
    let input = attachment.input();
    input.write_line("only").await.expect("write");
    input.close().await.expect("close");
    input.close().await.expect("close is idempotent");
    assert_eq!(read_all(agent_stdin).await, "only\n");
    match input.write_line("late").await {
        Err(Error::Disconnected { .. }) => {}
        other => panic!("a write after close must be Disconnected, got {other:?}"),
    }
    match input.write_line("two\nlines").await {
        Err(Error::InvalidArgument { .. }) => {}
        other => panic!("an embedded newline must be refused, got {other:?}"),
    }
}

/// A stdin whose every write fails the way a transport does when it knows why: with the
/// contract's error inside the `io::Error`.
struct FailingStdin;

impl tokio::io::AsyncWrite for FailingStdin {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        _buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let cause = Error::WorkerFailed {
            id: id(),
            cause: session_runtime::WorkerFailure::Evicted("its Pod was deleted".into()),
        };
        std::task::Poll::Ready(Err(cause.into_io()))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn a_write_the_transport_fails_with_a_reason_gives_that_reason_once() {
    let (fence, _trigger) = Fence::new(id(), 1);
    let (_agent_stdout, stdout) = tokio::io::duplex(64);
    let parts = AttachmentParts::new(fence, "/workspace", stdout, FailingStdin, Arc::new(Idle));
    let attachment = Attachment::new(parts);
    match attachment.input().write_line("hello").await {
        Err(Error::WorkerFailed {
            cause: session_runtime::WorkerFailure::Evicted(why),
            ..
        }) => assert_eq!(why, "its Pod was deleted"),
        other => panic!("the transport's reason, got {other:?}"),
    }
    match attachment.input().write_line("again").await {
        Err(Error::Disconnected { .. }) => {}
        other => panic!("the stdin is gone after a failed write, got {other:?}"),
    }
}
