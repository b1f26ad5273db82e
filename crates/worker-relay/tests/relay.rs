//! The relay binary end to end: streams, exits, signals, reaping, heartbeats, the HTTP/WebSocket
//! mode and the `connect` bridge.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{sh, within, RelayOptions, RelayProcess, PATIENCE, RELAY};
use session_runtime::{Attachment, Error, WorkerExit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use worker_relay::protocol::{Frame, FrameReader, Hello, Peer};
use worker_relay::{ClientConfig, CommandConnector, ErrorCode, RelayClient, WebSocketConnector};

async fn read_line(attachment: &mut Attachment) -> String {
    let mut line = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        let n = within("read", attachment.output().read(&mut byte))
            .await
            .expect("read output");
        if n == 0 || byte[0] == b'\n' {
            return String::from_utf8(line).expect("utf-8");
        }
        line.push(byte[0]);
    }
}

async fn read_to_end(attachment: &mut Attachment) -> String {
    let mut out = String::new();
    within("read to end", attachment.output().read_to_string(&mut out))
        .await
        .expect("read to end");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoes_both_ways_and_reports_the_working_dir() {
    let dir = tempfile::tempdir().expect("tempdir");
    let relay = RelayProcess::start(
        common::session("echo"),
        &["cat".into()],
        RelayOptions {
            workdir: Some(dir.path().to_path_buf()),
            ..RelayOptions::default()
        },
    )
    .await;
    let mut attachment = relay.attach().await;
    assert_eq!(attachment.working_dir(), dir.path().to_str().expect("utf-8 path"));
    let input = attachment.input();
    for i in 0..100 {
        input.write_line(format!("line {i}")).await.expect("write");
    }
    for i in 0..100 {
        assert_eq!(read_line(&mut attachment).await, format!("line {i}"));
    }
    input.close().await.expect("close stdin");
    assert_eq!(read_to_end(&mut attachment).await, "");
    let control = attachment.control();
    assert_eq!(
        within("wait", control.wait()).await.expect("wait"),
        WorkerExit::Code(0)
    );
    assert!(!control.is_alive());
    match input.write_line("late").await {
        Err(Error::Disconnected { .. }) => {}
        other => panic!("a write after the exit must be Disconnected, got {other:?}"),
    }
    let mut relay = relay;
    assert_eq!(
        relay.exit_code().await,
        Some(0),
        "the relay exits with the agent's code"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_exit_code_reaches_the_broker() {
    let mut relay = RelayProcess::start(
        common::session("exit"),
        &sh("echo hello; exit 3"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    assert_eq!(read_to_end(&mut attachment).await, "hello\n");
    let exit = within("wait", attachment.control().wait()).await.expect("wait");
    assert_eq!(exit, WorkerExit::Code(3));
    assert_eq!(relay.exit_code().await, Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_fails_at_once_says_why_with_its_exit() {
    let mut relay = RelayProcess::start(
        common::session("last-words"),
        &sh("seq 1 30 | sed 's/^/noise /' >&2; echo 'error: unexpected argument --no-such-flag' >&2; exit 2"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    assert_eq!(read_to_end(&mut attachment).await, "");
    let control = attachment.control();
    let exit = within("wait", control.wait()).await.expect("wait");
    assert_eq!(exit, WorkerExit::Code(2));
    let tail = control
        .stderr_tail()
        .expect("the agent's stderr came with its exit");
    assert!(
        tail.ends_with("error: unexpected argument --no-such-flag"),
        "{tail}"
    );
    assert_eq!(tail.lines().count(), 20, "the last 20 lines: {tail}");
    assert!(tail.starts_with("noise 12\n"), "{tail}");
    assert_eq!(relay.exit_code().await, Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_wrote_nothing_to_stderr_has_no_tail() {
    let relay = RelayProcess::start(
        common::session("no-words"),
        &sh("exit 0"),
        RelayOptions::default(),
    )
    .await;
    let attachment = relay.attach().await;
    let control = attachment.control();
    assert_eq!(
        within("wait", control.wait()).await.expect("wait"),
        WorkerExit::Code(0)
    );
    assert_eq!(control.stderr_tail(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_from_outside_is_reported_with_its_signal() {
    let mut relay = RelayProcess::start(
        common::session("killed"),
        &sh("echo $$; exec sleep 1000"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    let pid = read_line(&mut attachment).await;
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .expect("kill");
    assert!(status.success());
    let exit = within("wait", attachment.control().wait()).await.expect("wait");
    assert_eq!(exit, WorkerExit::Signal(9));
    assert_eq!(relay.exit_code().await, Some(128 + 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_kill_and_terminate_go_through_the_relay() {
    let relay = RelayProcess::start(
        common::session("kill"),
        &sh("echo ready; exec sleep 1000"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    assert_eq!(read_line(&mut attachment).await, "ready");
    let control = attachment.control();
    assert!(control.is_alive());
    assert_eq!(
        within("kill", control.kill()).await.expect("kill"),
        WorkerExit::Signal(9)
    );
    assert!(!control.is_alive());
    // Idempotent.
    assert_eq!(control.kill().await.expect("kill again"), WorkerExit::Signal(9));

    let relay = RelayProcess::start(
        common::session("terminate"),
        &sh("echo ready; exec sleep 1000"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    assert_eq!(read_line(&mut attachment).await, "ready");
    let exit = within(
        "terminate",
        attachment.control().terminate(Duration::from_secs(20)),
    )
    .await
    .expect("terminate");
    assert_eq!(exit, WorkerExit::Signal(15));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_ignoring_stdin_eof_and_sigterm_is_killed_after_the_grace() {
    let relay = RelayProcess::start(
        common::session("stubborn"),
        &sh("trap '' TERM; echo ready; while :; do sleep 0.05; done"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    assert_eq!(read_line(&mut attachment).await, "ready");
    let control = attachment.control();
    attachment.input().close().await.expect("close stdin");
    // The agent ignores EOF: it is still running after a while.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), control.wait())
            .await
            .is_err(),
        "the agent ignores stdin EOF"
    );
    assert!(control.is_alive());
    let exit = within("terminate", control.terminate(Duration::from_millis(200)))
        .await
        .expect("terminate");
    assert_eq!(exit, WorkerExit::Signal(9), "SIGKILL follows the grace period");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acp_agent_ignoring_stdin_eof_is_terminated() {
    let agent = common::acp_test_agent();
    let relay = RelayProcess::start(
        common::session("acp-eof"),
        &[agent.into(), "--ignore-stdin-eof".into()],
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    let input = attachment.input();
    input
        .write_line(r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}"#)
        .await
        .expect("write");
    let answer = read_line(&mut attachment).await;
    assert!(answer.contains(r#""id":1"#), "{answer}");
    input.close().await.expect("close stdin");
    let control = attachment.control();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), control.wait())
            .await
            .is_err(),
        "the agent ignores stdin EOF"
    );
    let exit = within("terminate", control.terminate(Duration::from_secs(20)))
        .await
        .expect("terminate");
    assert_eq!(exit, WorkerExit::Signal(15));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_the_relay_is_forwarded_to_the_agent() {
    let mut relay = RelayProcess::start(
        common::session("sigterm"),
        &sh("echo ready; exec sleep 1000"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    assert_eq!(read_line(&mut attachment).await, "ready");
    relay.signal("TERM");
    let exit = within("wait", attachment.control().wait()).await.expect("wait");
    assert_eq!(exit, WorkerExit::Signal(15));
    assert_eq!(relay.exit_code().await, Some(128 + 15));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_before_any_broker_ends_the_relay() {
    let mut relay = RelayProcess::start(
        common::session("idle-term"),
        &["cat".into()],
        RelayOptions::default(),
    )
    .await;
    relay.signal("TERM");
    assert_eq!(relay.exit_code().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_cannot_start_is_a_spawn_failure() {
    let mut relay = RelayProcess::start(
        common::session("spawn"),
        &["/nonexistent/agent".into()],
        RelayOptions::default(),
    )
    .await;
    match relay.attach_with(relay.config(1), relay.connector()).await {
        Err(Error::WorkerFailed {
            cause: session_runtime::WorkerFailure::Spawn(why),
            ..
        }) => assert!(why.contains("/nonexistent/agent"), "{why}"),
        other => panic!("expected a spawn failure, got {:?}", other.map(|_| ())),
    }
    assert_eq!(relay.exit_code().await, Some(127));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_of_the_agent_are_reaped() {
    let relay = RelayProcess::start(
        common::session("orphans"),
        &sh("(sleep 2 & echo $!); exec cat"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    let orphan = read_line(&mut attachment).await;
    let proc_dir = std::path::PathBuf::from(format!("/proc/{orphan}"));
    let relay_pid = relay.child.id().expect("relay pid").to_string();
    // Its parent exited, so the orphan is re-parented to the relay (a child subreaper)...
    within("orphan re-parented to the relay", async {
        loop {
            let stat = std::fs::read_to_string(proc_dir.join("stat")).expect("orphan still exists");
            // pid (comm) state ppid ...
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().nth(1));
            if ppid == Some(relay_pid.as_str()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // ...which must reap it when it exits, so its /proc entry disappears instead of staying a
    // zombie.
    within("orphan reaped", async {
        while proc_dir.exists() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    attachment.input().close().await.expect("close");
    assert_eq!(
        within("wait", attachment.control().wait()).await.expect("wait"),
        WorkerExit::Code(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detaching_keeps_the_agent_and_a_new_broker_resumes() {
    let relay = RelayProcess::start(
        common::session("detach"),
        &["cat".into()],
        RelayOptions::default(),
    )
    .await;
    let mut first = relay.attach().await;
    first.input().write_line("one").await.expect("write");
    assert_eq!(read_line(&mut first).await, "one");
    let pid_before = first.control().worker_id().to_owned();
    drop(first);
    // A restarted broker: a newer epoch, a fresh client.
    let (mut second, _) = relay
        .attach_with(relay.config(2), relay.connector())
        .await
        .expect("re-attach");
    assert_eq!(second.control().worker_id(), pid_before, "the same agent process");
    second.input().write_line("two").await.expect("write");
    let mut next = read_line(&mut second).await;
    if next == "one" {
        // The first broker's last acknowledgement can lose the race with the second broker's
        // hello; output no broker acknowledged is replayed, never lost.
        next = read_line(&mut second).await;
    }
    assert_eq!(next, "two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_output_is_replayed_to_the_next_broker() {
    let relay = RelayProcess::start(
        common::session("replay"),
        &sh("read x; i=0; while [ $i -lt 50 ]; do echo out-$i; i=$((i+1)); done; exec cat"),
        RelayOptions::default(),
    )
    .await;
    // A broker that never acknowledges: raw hello, one input line, then gone.
    let mut raw = relay.open_channel().await;
    let token = common::key().token(relay.session.as_str(), relay.generation);
    let hello = Frame::Hello(Hello {
        session: relay.session.as_str().to_owned(),
        generation: relay.generation,
        epoch: 1,
        nonce: 1,
        resume: 0,
        token,
    });
    raw.write_all(&hello.to_bytes().expect("encode"))
        .await
        .expect("hello");
    raw.flush().await.expect("flush");
    let go = Frame::Data {
        seq: 1,
        payload: bytes::Bytes::from_static(b"go\n"),
    };
    raw.write_all(&go.to_bytes().expect("encode"))
        .await
        .expect("data");
    raw.flush().await.expect("flush");
    let (read_half, _write_half) = tokio::io::split(raw);
    let mut reader = FrameReader::new(read_half, Peer::Relay);
    let mut seen = 0;
    while seen < 50 {
        match within("frame", reader.next()).await.expect("frame") {
            Some(Frame::Data { payload, .. }) => {
                seen += payload.iter().filter(|b| **b == b'\n').count();
            }
            Some(_) => {}
            None => panic!("relay closed"),
        }
    }
    drop(reader);
    let (mut attachment, _) = relay
        .attach_with(relay.config(2), relay.connector())
        .await
        .expect("attach");
    for i in 0..50 {
        assert_eq!(read_line(&mut attachment).await, format!("out-{i}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_pings_and_drops_silent_connections() {
    let relay = RelayProcess::start(
        common::session("heartbeat"),
        &["cat".into()],
        RelayOptions {
            extra: vec!["--heartbeat".into(), "100ms".into()],
            ..RelayOptions::default()
        },
    )
    .await;
    let mut raw = relay.open_channel().await;
    let hello = Frame::Hello(Hello {
        session: relay.session.as_str().to_owned(),
        generation: relay.generation,
        epoch: 1,
        nonce: 1,
        resume: 0,
        token: common::key().token(relay.session.as_str(), relay.generation),
    });
    raw.write_all(&hello.to_bytes().expect("encode"))
        .await
        .expect("hello");
    raw.flush().await.expect("flush");
    let mut reader = FrameReader::new(raw, Peer::Relay);
    let mut pings = 0;
    let closing = loop {
        match within("frame", reader.next()).await.expect("frame") {
            Some(Frame::Ping { .. }) => pings += 1,
            Some(Frame::Error { code, .. }) => break code,
            Some(_) => {}
            None => panic!("closed without an error frame"),
        }
    };
    assert!(pings >= 1, "the relay sends heartbeats");
    assert_eq!(closing, ErrorCode::IdleTimeout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_mode_serves_ping_and_the_protocol_over_websocket() {
    let relay = RelayProcess::start(
        common::session("http"),
        &["cat".into()],
        RelayOptions {
            http: true,
            tcp: false,
            ..RelayOptions::default()
        },
    )
    .await;
    let http = relay.http.expect("http listener");
    let (status, body) = http_get(http, "/ping").await;
    assert_eq!(status, 200);
    assert!(body.starts_with(r#"{"status":"Healthy""#), "{body}");
    assert_eq!(http_get(http, "/nothing").await.0, 404);

    let connector = Arc::new(WebSocketConnector::new(format!("ws://{http}/ws")));
    let (mut attachment, _) = relay
        .attach_with(relay.config(1), connector)
        .await
        .expect("attach over websocket");
    let input = attachment.input();
    for i in 0..20 {
        input.write_line(format!("ws {i}")).await.expect("write");
    }
    for i in 0..20 {
        assert_eq!(read_line(&mut attachment).await, format!("ws {i}"));
    }
    let (status, body) = http_post(http, "/invocations", "{}").await;
    assert_eq!(status, 200);
    assert!(body.contains(r#""agent":"running""#), "{body}");
    input.close().await.expect("close");
    assert_eq!(
        within("wait", attachment.control().wait()).await.expect("wait"),
        WorkerExit::Code(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_bridges_stdio_to_the_relay() {
    let relay = RelayProcess::start(
        common::session("bridge"),
        &["cat".into()],
        RelayOptions::default(),
    )
    .await;
    let connector = Arc::new(CommandConnector::new(
        RELAY,
        ["connect".to_owned(), relay.tcp.expect("tcp").to_string()],
    ));
    let (mut attachment, _) = relay
        .attach_with(relay.config(1), connector)
        .await
        .expect("attach through the bridge");
    attachment.input().write_line("bridged").await.expect("write");
    assert_eq!(read_line(&mut attachment).await, "bridged");
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http_request(addr, &format!("GET {path} HTTP/1.1\r\nHost: relay\r\n\r\n")).await
}

async fn http_post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    http_request(
        addr,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: relay\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    )
    .await
}

async fn http_request(addr: std::net::SocketAddr, request: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("request");
    stream.flush().await.expect("flush");
    let mut response = String::new();
    tokio::time::timeout(PATIENCE, stream.read_to_string(&mut response))
        .await
        .expect("response in time")
        .expect("response");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// A terminate requested twice (a client resends its request after a reconnect) reaches the agent
/// as one SIGTERM; the SIGKILL after the grace period still follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_terminate_is_one_sigterm() {
    let relay = RelayProcess::start(
        common::session("one-term"),
        &sh("trap 'echo TERM' TERM; echo ready; while :; do sleep 0.05; done"),
        RelayOptions::default(),
    )
    .await;
    let mut attachment = relay.attach().await;
    assert_eq!(read_line(&mut attachment).await, "ready");
    let (first, second) = (attachment.control(), attachment.control());
    let grace = Duration::from_millis(1500);
    let (a, b) = within("two terminates", async {
        let first = tokio::spawn(async move { first.terminate(grace).await });
        // The first request is on the wire before the second is made: two signal frames.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let second = second.terminate(grace).await;
        (first.await.expect("first terminate"), second)
    })
    .await;
    assert_eq!(
        a.expect("terminate"),
        WorkerExit::Signal(9),
        "SIGKILL after the grace"
    );
    assert_eq!(b.expect("terminate"), WorkerExit::Signal(9));
    let mut rest = String::new();
    let _ = within(
        "the rest of the output",
        attachment.output().read_to_string(&mut rest),
    )
    .await;
    assert_eq!(rest.matches("TERM").count(), 1, "the agent saw: {rest:?}");
}

#[test]
fn prepare_makes_private_session_directories() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().expect("a temporary directory");
    let home = root.path().join("volume/home");
    let workspace = root.path().join("volume/workspace");
    for _ in 0..2 {
        // Twice: an existing directory is fine (a replaced Pod prepares the same volume again).
        let output = std::process::Command::new(RELAY)
            .arg("prepare")
            .args([&home, &workspace])
            .output()
            .expect("run the relay");
        assert!(output.status.success(), "{output:?}");
    }
    for dir in [&home, &workspace] {
        let mode = std::fs::metadata(dir).expect("made").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", dir.display());
    }

    // Something that is not a directory in the way is an error that names it.
    let blocked = root.path().join("file");
    std::fs::write(&blocked, b"").expect("a file");
    let output = std::process::Command::new(RELAY)
        .arg("prepare")
        .arg(&blocked)
        .output()
        .expect("run the relay");
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("prepare"),
        "{output:?}"
    );
}

/// `serve --make-dir` makes the session's directories before the relay listens (a worker whose
/// volume is mounted whole needs no init container); one it cannot make ends it before it
/// listens, naming the directory.
#[test]
fn serve_makes_its_directories_before_it_listens() {
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().expect("a temporary directory");
    let workspace = root.path().join("volume/workspace");
    let home = root.path().join("volume/home");
    let serve = |dirs: &[&std::path::Path]| {
        let mut command = std::process::Command::new(RELAY);
        command
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--session",
                "s",
                "--generation",
                "1",
            ])
            .env("OAB_RELAY_TOKEN_SHA256", "00".repeat(32))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for dir in dirs {
            command.arg("--make-dir").arg(dir);
        }
        command.args(["--", "/bin/cat"]).spawn().expect("run the relay")
    };
    let mut relay = serve(&[&workspace, &home]);
    let mut line = String::new();
    std::io::BufReader::new(relay.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the relay's first line");
    let made: Vec<Option<u32>> = [&workspace, &home]
        .iter()
        .map(|dir| {
            std::fs::metadata(dir)
                .ok()
                .map(|m| m.permissions().mode() & 0o777)
        })
        .collect();
    let _ = relay.kill();
    let _ = relay.wait();
    assert!(line.contains("listening on"), "{line:?}");
    assert_eq!(made, [Some(0o700), Some(0o700)]);

    let blocked = root.path().join("file");
    std::fs::write(&blocked, b"").expect("a file");
    let output = serve(&[&blocked]).wait_with_output().expect("the relay ends");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("listening"),
        "{output:?}"
    );
    assert!(
        String::from_utf8_lossy(&output.stderr).contains(&blocked.display().to_string()),
        "{output:?}"
    );
}

/// A connector that is refused the same way every time.
#[derive(Debug)]
struct Refused(worker_relay::Refusal);

#[async_trait::async_trait]
impl worker_relay::Connector for Refused {
    async fn connect(&self) -> std::io::Result<worker_relay::Transport> {
        Err(self.0.clone().into_io())
    }
}

/// A connector's refusal ends the attach at once with its own retryable flag and message, where
/// any other connect error is retried until the reconnect budget runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connector_refusal_is_not_retried() {
    let session = common::session("refused");
    for retryable in [false, true] {
        let connector = Arc::new(Refused(worker_relay::Refusal::new(
            retryable,
            "access denied by the service",
        )));
        let config =
            ClientConfig::with_key(session, 1, 1, &common::key()).give_up_after(Duration::from_secs(60));
        let started = std::time::Instant::now();
        let (fence, _trigger) = session_runtime::Fence::new(session, 1);
        let error = within("attach", RelayClient::new(config, connector).attach(fence))
            .await
            .expect_err("refused");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "not retried for the budget"
        );
        match error {
            session_runtime::Error::Backend {
                retryable: got,
                message,
                ..
            } => {
                assert_eq!(got, retryable);
                assert_eq!(message, "access denied by the service");
            }
            other => panic!("expected a backend error, got {other:?}"),
        }
    }
}

/// A client told its worker is gone ends at once with that cause, instead of reconnecting to a
/// relay that is no longer there for its whole reconnect budget (here ten minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_its_placer_reports_lost_ends_the_attachment_at_once_with_the_cause() {
    let mut relay =
        RelayProcess::start(common::session("lost"), &["cat".into()], RelayOptions::default()).await;
    let config = relay.config(1).give_up_after(Duration::from_secs(600));
    let (report, lost) = tokio::sync::oneshot::channel::<()>();
    let lost = async move {
        let _ = lost.await;
        session_runtime::WorkerFailure::Evicted("the worker Pod was deleted".into())
    };
    let (fence, _trigger) = session_runtime::Fence::new(relay.session, relay.generation);
    let mut attachment = within(
        "attach",
        RelayClient::new(config, relay.connector()).attach_until(fence, lost),
    )
    .await
    .expect("attach");
    attachment.input().write_line("before").await.expect("write");
    assert_eq!(read_line(&mut attachment).await, "before");

    // The relay vanishes without a word (SIGKILL, as with a lost node): the client reconnects.
    relay.child.start_kill().expect("kill the relay");
    relay.child.wait().await.expect("reap the relay");
    tokio::time::sleep(Duration::from_millis(200)).await;
    report.send(()).expect("the watcher still listens");

    let mut byte = [0u8; 1];
    let error = within("the output ends", attachment.output().read(&mut byte))
        .await
        .expect_err("the output ends with the loss");
    match Error::from_io(&error) {
        Some(Error::WorkerFailed {
            cause: session_runtime::WorkerFailure::Evicted(why),
            ..
        }) => assert!(why.contains("deleted"), "{why}"),
        other => panic!("expected the placer's cause, got {other:?} ({error})"),
    }
    match within("wait", attachment.control().wait()).await {
        Err(Error::WorkerFailed { .. }) => {}
        other => panic!("wait must give the loss, got {other:?}"),
    }
}

/// A loss reported before the relay ever answered fails the attach itself with the cause; a
/// loss that never comes leaves a normal exit alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_before_the_first_connection_fails_the_attach_and_none_leaves_an_exit_alone() {
    let relay = RelayProcess::start(
        common::session("lost-early"),
        &["cat".into()],
        RelayOptions::default(),
    )
    .await;
    let unreachable = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr")
    };
    let config = relay.config(1).give_up_after(Duration::from_secs(600));
    let (fence, _trigger) = session_runtime::Fence::new(relay.session, relay.generation);
    let lost = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        session_runtime::WorkerFailure::Evicted("its node is gone".into())
    };
    let connector = Arc::new(worker_relay::TcpConnector::new(unreachable.to_string()));
    match within(
        "attach",
        RelayClient::new(config, connector).attach_until(fence, lost),
    )
    .await
    {
        Err(Error::WorkerFailed {
            cause: session_runtime::WorkerFailure::Evicted(why),
            ..
        }) => assert!(why.contains("node"), "{why}"),
        other => panic!("expected the loss, got {other:?}"),
    }

    let (fence, _trigger) = session_runtime::Fence::new(relay.session, relay.generation);
    let mut attachment = within(
        "attach",
        RelayClient::new(relay.config(1), relay.connector()).attach_until(fence, std::future::pending()),
    )
    .await
    .expect("attach");
    attachment.input().close().await.expect("close stdin");
    assert_eq!(read_to_end(&mut attachment).await, "");
    assert_eq!(
        within("wait", attachment.control().wait()).await.expect("exit"),
        WorkerExit::Code(0)
    );
}
