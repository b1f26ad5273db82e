//! Binding a warm relay end to end: `oab-relay serve --unbound` processes bound by [`bind`],
//! then reached by the broker as relays started bound.

mod common;

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::{key, sh, within, RELAY};
use session_runtime::{Attachment, Error, Fence, SessionId, WorkerExit};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use worker_relay::channel::{self, ChannelKey, HandshakeError, SecureStream};
use worker_relay::protocol::{Bind, Frame, FrameReader, Hello, Peer};
use worker_relay::{
    bind, BindError, Binding, ClientConfig, Connector, ErrorCode, RelayClient, TcpConnector, Token, TokenHash,
};

/// The warm pool member every test's relay is.
const MEMBER: &str = "pool-member-0";

/// The bind token of [`MEMBER`].
fn bind_token() -> Token {
    key().bind_token(MEMBER)
}

/// A running `oab-relay serve --unbound`.
struct Unbound {
    child: Child,
    addr: SocketAddr,
}

impl Unbound {
    /// Starts an unbound relay running `agent` once bound, with `env` as the worker's own
    /// environment and its log (at `info`) in `log`.
    async fn start(agent: &[OsString], env: &[(&str, &str)], log: &Path) -> Self {
        let mut command = Command::new(RELAY);
        command
            .args([
                "serve",
                "--unbound",
                "--listen",
                "127.0.0.1:0",
                "--heartbeat",
                "2s",
            ])
            .arg("--")
            .args(agent)
            .env("OAB_RELAY_BIND_TOKEN_SHA256", bind_token().hash().to_hex())
            .env("OAB_RELAY_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).expect("a log file"))
            .kill_on_drop(true);
        let mut child = command.spawn().expect("start oab-relay");
        let stdout = child.stdout.take().expect("stdout");
        let line = within("the listening line", BufReader::new(stdout).lines().next_line())
            .await
            .expect("read stdout")
            .expect("the relay announces its listener");
        let addr = line
            .strip_prefix("oab-relay: listening on tcp ")
            .unwrap_or_else(|| panic!("unexpected relay output {line:?}"))
            .parse()
            .expect("an address");
        Self { child, addr }
    }

    fn connector(&self) -> Arc<dyn Connector> {
        Arc::new(TcpConnector::new(self.addr.to_string()))
    }

    async fn bind(&self, token: &Token, binding: &Binding) -> Result<(), BindError> {
        within(
            "bind",
            bind(&*self.connector(), token, binding, Duration::from_secs(10)),
        )
        .await
    }

    /// Attaches as the broker of `generation` of `session` would, presenting `token`.
    async fn attach_with(
        &self,
        session: SessionId,
        generation: u64,
        token: Token,
    ) -> Result<Attachment, Error> {
        let config = ClientConfig::new(session, generation, 1, token)
            .heartbeat(Duration::from_secs(2))
            .backoff(Duration::from_millis(5), Duration::from_millis(100))
            .give_up_after(Duration::from_secs(3));
        let (fence, _trigger) = Fence::new(session, generation);
        within("attach", RelayClient::new(config, self.connector()).attach(fence)).await
    }

    async fn attach(&self, session: SessionId, generation: u64) -> Result<Attachment, Error> {
        self.attach_with(session, generation, key().token(session.as_str(), generation))
            .await
    }

    /// A channel opened with `key` (for raw frames).
    async fn open(&self, key: &ChannelKey) -> Result<SecureStream<TcpStream>, HandshakeError> {
        let stream = TcpStream::connect(self.addr).await.expect("connect");
        within("the channel handshake", channel::initiate(stream, key)).await
    }

    /// Sends `bytes` on a fresh bind channel and returns the relay's one answer.
    async fn bind_raw(&self, bytes: &[u8]) -> Frame {
        let stream = self
            .open(&ChannelKey::for_bind(&bind_token().hash()))
            .await
            .expect("the bind channel opens");
        exchange(stream, bytes).await
    }

    fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    async fn exit_code(&mut self) -> Option<i32> {
        within("the relay's exit", self.child.wait())
            .await
            .expect("wait")
            .code()
    }
}

/// Sends `bytes` on `stream` and reads the one frame the relay answers.
async fn exchange(stream: SecureStream<TcpStream>, bytes: &[u8]) -> Frame {
    let (read_half, mut write_half) = tokio::io::split(stream);
    write_half.write_all(bytes).await.expect("send");
    write_half.flush().await.expect("flush");
    let mut reader = FrameReader::new(read_half, Peer::Relay);
    within("the answer", reader.next())
        .await
        .expect("a frame")
        .expect("an answer before the end")
}

fn session(name: &str) -> SessionId {
    common::session(name)
}

/// The binding to `generation` of `session` with `key()`'s token.
fn binding(session: SessionId, generation: u64) -> Binding {
    Binding::new(
        session.as_str(),
        generation,
        key().token(session.as_str(), generation).hash(),
    )
}

/// A bind frame as a broker that follows none of the binding's rules would send it (the frame
/// layout written out by hand, so that nothing checks it on the way).
fn raw_bind(token: &Token, binding: &Binding) -> Vec<u8> {
    let mut payload = Vec::new();
    payload.extend_from_slice(token.as_bytes());
    payload.push(binding.session.len() as u8);
    payload.extend_from_slice(binding.session.as_bytes());
    payload.extend_from_slice(&binding.generation.to_be_bytes());
    payload.extend_from_slice(binding.token_hash.as_bytes());
    payload.extend_from_slice(&(binding.working_dir.len() as u16).to_be_bytes());
    payload.extend_from_slice(binding.working_dir.as_bytes());
    payload.extend_from_slice(&(binding.env.len() as u16).to_be_bytes());
    for (name, value) in &binding.env {
        payload.extend_from_slice(&(name.len() as u16).to_be_bytes());
        payload.extend_from_slice(name.as_bytes());
        payload.extend_from_slice(&(value.len() as u32).to_be_bytes());
        payload.extend_from_slice(value.as_bytes());
    }
    let mut frame = vec![1, 11];
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(&payload);
    frame
}

/// The next line of the agent's output (read a byte at a time: nothing after it is taken).
async fn read_line(attachment: &mut Attachment) -> String {
    let mut line = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        let n = within(
            "a line of output",
            tokio::io::AsyncReadExt::read(&mut attachment.output(), &mut byte),
        )
        .await
        .expect("read output");
        if n == 0 || byte[0] == b'\n' {
            return String::from_utf8(line).expect("utf-8");
        }
        line.push(byte[0]);
    }
}

/// Closes the agent's stdin and waits for it and the relay to end.
async fn finish(mut attachment: Attachment, relay: &mut Unbound) {
    attachment.input().close().await.expect("close stdin");
    let mut rest = String::new();
    let _ = within(
        "the rest of the output",
        tokio::io::AsyncReadExt::read_to_string(&mut attachment.output(), &mut rest),
    )
    .await;
    assert_eq!(
        within("the agent's exit", attachment.control().wait())
            .await
            .expect("exit"),
        WorkerExit::Code(0)
    );
    assert_eq!(relay.exit_code().await, Some(0));
}

/// An agent that leaves `marker` behind when it starts, then echoes.
fn marking_agent(marker: &Path) -> Vec<OsString> {
    sh(&format!("touch '{}'; exec cat", marker.display()))
}

fn refused_at_the_channel(error: &BindError) -> bool {
    matches!(error, BindError::Unauthenticated(HandshakeError::Refused))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbound_relay_refuses_every_hello_and_starts_no_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("started");
    let id = session("unbound-hello");
    // The session's variables in the worker's environment change nothing: --unbound ignores them.
    let hash = key().token(id.as_str(), 1).hash().to_hex();
    let pod_env = [
        ("OAB_RELAY_SESSION", id.as_str()),
        ("OAB_RELAY_GENERATION", "1"),
        ("OAB_RELAY_TOKEN_SHA256", hash.as_str()),
    ];
    let mut relay = Unbound::start(&marking_agent(&marker), &pod_env, &dir.path().join("log")).await;
    // The session's own token (as if bound), the bind token as a session token, any token.
    for token in [
        key().token(id.as_str(), 1),
        bind_token(),
        Token::from_bytes([0; 32]),
    ] {
        match relay.attach_with(id, 1, token).await {
            Err(Error::Backend { retryable: false, .. }) => {}
            Err(other) => panic!("expected a refused channel, got {other}"),
            Ok(_) => panic!("an unbound relay accepted a hello"),
        }
    }
    // The refusal is the channel's own, the empty one a wrong token gets.
    let opened = relay
        .open(&ChannelKey::for_token(id.as_str(), &key().token(id.as_str(), 1)))
        .await;
    assert!(matches!(opened, Err(HandshakeError::Refused)), "{opened:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!marker.exists(), "no agent may start before the relay is bound");
    assert!(relay.is_running());
    // SIGTERM before any binding: the relay ends, cleanly.
    let pid = relay.child.id().expect("running");
    let status = std::process::Command::new("kill")
        .args(["-s", "TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    assert_eq!(relay.exit_code().await, Some(0));
    assert!(!marker.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_with_another_bind_token_is_refused_and_binds_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("started");
    let mut relay = Unbound::start(&marking_agent(&marker), &[], &dir.path().join("log")).await;
    let id = session("wrong-bind-token");
    let other = session("other");
    // Another member's bind token: the channel does not open.
    let error = relay
        .bind(&key().bind_token("pool-member-1"), &binding(other, 1))
        .await
        .expect_err("another member's bind token");
    assert!(refused_at_the_channel(&error), "{error}");
    assert!(!error.is_retryable());
    // A peer that holds the bind token's hash but not the token: bad-token.
    let answer = relay
        .bind_raw(&raw_bind(&Token::from_bytes([7; 32]), &binding(other, 1)))
        .await;
    assert!(
        matches!(
            answer,
            Frame::Error {
                code: ErrorCode::BadToken,
                ..
            }
        ),
        "{answer:?}"
    );
    // Nothing was bound: another binding is still free to take it.
    relay
        .bind(&bind_token(), &binding(id, 1))
        .await
        .expect("the real bind");
    assert!(!marker.exists());
    let attachment = relay.attach(id, 1).await.expect("attach");
    finish(attachment, &mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_relay_starts_the_agent_with_the_binding_s_directory_and_environment() {
    let dir = tempfile::tempdir().expect("tempdir");
    let workdir = dir.path().join("work");
    std::fs::create_dir(&workdir).expect("workdir");
    let log = dir.path().join("log");
    let agent = sh(
        "echo \"pwd=$(pwd)\"; echo \"shared=$SHARED\"; echo \"pod=$POD_ONLY\"; \
         echo \"secret=$API_KEY\"; echo \"relay=$(env | grep -c '^OAB_RELAY_')\"; exec cat",
    );
    let mut relay = Unbound::start(
        &agent,
        &[("SHARED", "from-the-pod"), ("POD_ONLY", "pod-only")],
        &log,
    )
    .await;
    let id = session("bound-env");
    let bound = binding(id, 3)
        .working_dir(workdir.to_str().expect("utf-8"))
        .env("SHARED", "from-the-binding")
        .env("API_KEY", "s3cr3t-value");
    relay.bind(&bind_token(), &bound).await.expect("bind");
    let mut attachment = relay.attach(id, 3).await.expect("attach");
    assert_eq!(attachment.working_dir(), workdir.to_str().expect("utf-8"));
    let real = workdir.canonicalize().expect("canonical");
    assert_eq!(
        read_line(&mut attachment).await,
        format!("pwd={}", real.display())
    );
    assert_eq!(read_line(&mut attachment).await, "shared=from-the-binding");
    assert_eq!(read_line(&mut attachment).await, "pod=pod-only");
    assert_eq!(read_line(&mut attachment).await, "secret=s3cr3t-value");
    // Neither the bind token's hash nor any other variable of the relay's.
    assert_eq!(read_line(&mut attachment).await, "relay=0");
    finish(attachment, &mut relay).await;
    let log = std::fs::read_to_string(&log).expect("the relay's log");
    assert!(
        log.contains("relay bound") && log.contains(id.as_str()),
        "the binding is logged: {log}"
    );
    for secret in [
        "s3cr3t-value".to_owned(),
        bind_token().hash().to_hex(),
        bound.token_hash.to_hex(),
        data_encoding_hex(bind_token().as_bytes()),
    ] {
        assert!(!log.contains(&secret), "the log shows {secret}: {log}");
    }
}

fn data_encoding_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_relay_refuses_other_generations_as_one_started_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("started");
    let mut relay = Unbound::start(&marking_agent(&marker), &[], &dir.path().join("log")).await;
    let id = session("bound-generation");
    relay.bind(&bind_token(), &binding(id, 2)).await.expect("bind");
    // Another generation's token: the channel does not open.
    match relay.attach(id, 1).await {
        Err(Error::Backend { retryable: false, .. }) => {}
        Err(other) => panic!("expected a refused channel, got {other}"),
        Ok(_) => panic!("generation 1 reached a relay bound to generation 2"),
    }
    // This generation's token in a hello naming another generation: stale-generation.
    let token = key().token(id.as_str(), 2);
    let stream = relay
        .open(&ChannelKey::for_token(id.as_str(), &token))
        .await
        .expect("the session channel opens");
    let hello = Frame::Hello(Hello {
        session: id.as_str().to_owned(),
        generation: 1,
        epoch: 1,
        nonce: 1,
        resume: 0,
        token,
    });
    let answer = exchange(stream, &hello.to_bytes().expect("encode")).await;
    assert!(
        matches!(
            answer,
            Frame::Error {
                code: ErrorCode::StaleGeneration,
                ..
            }
        ),
        "{answer:?}"
    );
    assert!(!marker.exists(), "no refused hello starts the agent");
    let attachment = relay.attach(id, 2).await.expect("attach");
    within("the agent's start", async {
        while !marker.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    finish(attachment, &mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_bind_again_is_bound_and_another_is_already_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = sh("echo \"value=$VALUE\"; exec cat");
    let mut relay = Unbound::start(&agent, &[], &dir.path().join("log")).await;
    let id = session("idempotent");
    let first = binding(id, 1).env("VALUE", "first");
    relay.bind(&bind_token(), &first).await.expect("bind");
    relay
        .bind(&bind_token(), &first)
        .await
        .expect("the same binding again (its first answer lost)");
    let others = [
        binding(id, 1).env("VALUE", "second"),
        binding(id, 2).env("VALUE", "first"),
        binding(session("another"), 1).env("VALUE", "first"),
        binding(id, 1).env("VALUE", "first").working_dir("/"),
        Binding::new(id.as_str(), 1, TokenHash::from_bytes([1; 32])).env("VALUE", "first"),
    ];
    for other in &others {
        let error = relay
            .bind(&bind_token(), other)
            .await
            .expect_err("another binding");
        assert!(
            matches!(error, BindError::AlreadyBound { .. }),
            "{other:?}: {error}"
        );
        assert!(!error.is_retryable());
    }
    // The first binding still serves, with its environment.
    let mut attachment = relay.attach(id, 1).await.expect("attach");
    assert_eq!(read_line(&mut attachment).await, "value=first");
    // Once the agent runs too.
    relay
        .bind(&bind_token(), &first)
        .await
        .expect("the same binding again");
    let error = relay
        .bind(&bind_token(), &others[0])
        .await
        .expect_err("another binding");
    assert!(matches!(error, BindError::AlreadyBound { .. }), "{error}");
    finish(attachment, &mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_that_breaks_a_rule_is_refused_and_binds_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("started");
    let mut relay = Unbound::start(&marking_agent(&marker), &[], &dir.path().join("log")).await;
    let id = session("bad-binding");
    let other = session("bad");
    // The hand-written layout is the protocol's.
    let valid = binding(id, 1).env("A", "b").working_dir("/tmp");
    let encoded = Frame::Bind(Bind {
        bind_token: bind_token(),
        binding: valid.clone(),
    })
    .to_bytes()
    .expect("encode");
    assert_eq!(raw_bind(&bind_token(), &valid), encoded.to_vec());
    let oversized = "v".repeat(worker_relay::protocol::MAX_BIND_ENV_BYTES);
    let broken = [
        binding(other, 1).env("A=B", "v"),
        binding(other, 1).env("", "v"),
        binding(other, 1).env("OAB_RELAY_TOKEN_SHA256", "v"),
        binding(other, 1).env("OAB_RELAY_BIND_TOKEN_SHA256", "v"),
        binding(other, 1).env("BIG", oversized.as_str()),
        binding(other, 1).env("A", "1").env("A", "2"),
        binding(other, 1).working_dir("relative"),
    ];
    for bad in &broken {
        // The client does not send it ...
        let error = relay.bind(&bind_token(), bad).await.expect_err("invalid");
        assert!(matches!(error, BindError::Invalid { .. }), "{bad:?}: {error}");
        // ... and the relay refuses it when another client does.
        let answer = relay.bind_raw(&raw_bind(&bind_token(), bad)).await;
        assert!(
            matches!(
                answer,
                Frame::Error {
                    code: ErrorCode::BadFrame,
                    ..
                }
            ),
            "{bad:?}: {answer:?}"
        );
    }
    // Nothing was bound: the valid binding takes.
    relay.bind(&bind_token(), &valid).await.expect("bind");
    assert!(!marker.exists());
    let attachment = relay.attach(id, 1).await.expect("attach");
    finish(attachment, &mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_and_a_hello_on_each_other_s_connections_are_unexpected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut relay = Unbound::start(&["cat".into()], &[], &dir.path().join("log")).await;
    let id = session("crossed");
    let bound = binding(id, 1);
    let bind_frame = Frame::Bind(Bind {
        bind_token: bind_token(),
        binding: bound.clone(),
    })
    .to_bytes()
    .expect("encode");
    let token = key().token(id.as_str(), 1);
    let hello = |nonce| {
        Frame::Hello(Hello {
            session: id.as_str().to_owned(),
            generation: 1,
            epoch: 1,
            nonce,
            resume: 0,
            token,
        })
        .to_bytes()
        .expect("encode")
    };
    // A hello on a bind connection, before and after binding.
    let answer = relay.bind_raw(&hello(1)).await;
    assert!(
        matches!(
            answer,
            Frame::Error {
                code: ErrorCode::UnexpectedFrame,
                ..
            }
        ),
        "{answer:?}"
    );
    relay.bind(&bind_token(), &bound).await.expect("bind");
    let answer = relay.bind_raw(&hello(2)).await;
    assert!(
        matches!(
            answer,
            Frame::Error {
                code: ErrorCode::UnexpectedFrame,
                ..
            }
        ),
        "{answer:?}"
    );
    // A bind on a session connection, first and after the hello.
    let session_key = ChannelKey::for_token(id.as_str(), &token);
    let stream = relay.open(&session_key).await.expect("the session channel");
    let answer = exchange(stream, &bind_frame).await;
    assert!(
        matches!(
            answer,
            Frame::Error {
                code: ErrorCode::UnexpectedFrame,
                ..
            }
        ),
        "{answer:?}"
    );
    let stream = relay.open(&session_key).await.expect("the session channel");
    let (read_half, mut write_half) = tokio::io::split(stream);
    write_half.write_all(&hello(3)).await.expect("hello");
    write_half.write_all(&bind_frame).await.expect("bind");
    write_half.flush().await.expect("flush");
    let mut reader = FrameReader::new(read_half, Peer::Relay);
    let mut refused = None;
    while let Some(frame) = within("frames", reader.next()).await.expect("a frame") {
        if let Frame::Error { code, .. } = frame {
            refused = Some(code);
            break;
        }
    }
    assert_eq!(refused, Some(ErrorCode::UnexpectedFrame));
    drop((reader, write_half));
    let attachment = relay.attach(id, 1).await.expect("attach");
    finish(attachment, &mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_bound_refuses_a_bind_at_the_channel() {
    let id = session("started-bound");
    let relay = common::RelayProcess::start(id, &["cat".into()], common::RelayOptions::default()).await;
    let error = within(
        "bind",
        bind(
            &*relay.connector(),
            &bind_token(),
            &binding(id, 1),
            Duration::from_secs(10),
        ),
    )
    .await
    .expect_err("a relay started bound has no bind key");
    assert!(refused_at_the_channel(&error), "{error}");
    let mut attachment = relay.attach().await;
    attachment
        .input()
        .write_line("still serving")
        .await
        .expect("write");
    assert_eq!(read_line(&mut attachment).await, "still serving");
    attachment.input().close().await.expect("close");
    let mut relay = relay;
    assert_eq!(relay.exit_code().await, Some(0));
}

fn serve(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = std::process::Command::new(RELAY);
    command
        .arg("serve")
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--", "cat"])
        .env_remove("OAB_RELAY_BIND_TOKEN_SHA256")
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the relay");
    // A relay that does not refuse to start would serve for ever: give up on it.
    let started = std::time::Instant::now();
    while child.try_wait().expect("try_wait").is_none() {
        if started.elapsed() > common::PATIENCE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("oab-relay serve {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().expect("the relay ends");
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("listening"),
        "it must not listen: {output:?}"
    );
    output
}

#[test]
fn unbound_without_its_bind_token_hash_exits_2_naming_the_variable() {
    // Session variables are no substitute.
    let session_env = [
        ("OAB_RELAY_SESSION", "s"),
        ("OAB_RELAY_GENERATION", "1"),
        ("OAB_RELAY_TOKEN_SHA256", "00"),
    ];
    for env in [
        &session_env[..],
        &[("OAB_RELAY_BIND_TOKEN_SHA256", "not hex")],
        &[("OAB_RELAY_BIND_TOKEN_SHA256", "abcd")],
    ] {
        let output = serve(&["--unbound"], env);
        assert_eq!(output.status.code(), Some(2), "{env:?}: {output:?}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("OAB_RELAY_BIND_TOKEN_SHA256"),
            "{env:?}: {output:?}"
        );
    }
}

#[test]
fn unbound_conflicts_with_a_session_a_generation_agentcore_and_http() {
    let hash = "00".repeat(32);
    for args in [
        &["--unbound", "--session", "x"][..],
        &["--unbound", "--generation", "1"],
        &["--unbound", "--agentcore"],
        &["--unbound", "--http", "127.0.0.1:0"],
    ] {
        let output = serve(args, &[("OAB_RELAY_BIND_TOKEN_SHA256", &hash)]);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("cannot be used with"),
            "{args:?}: {output:?}"
        );
    }
}
