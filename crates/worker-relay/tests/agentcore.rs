//! `oab-relay serve --agentcore`: the relay learns its session from AgentCore's runtime session
//! header, admits only the broker's token for it, and runs one agent per worker generation, the
//! old one gone before the new one starts.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{key, sh, within, RelayOptions, RelayProcess};
use session_runtime::{Attachment, Error, Fence, FenceTrigger, SessionId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use worker_relay::agentcore::{RuntimeSessionId, SESSION_HEADER};
use worker_relay::{BrokerKey, ClientConfig, RelayClient, WebSocketConnector};

/// An agent that reports whether the previous generation's agent is still alive, then echoes.
const AGENT: &str = "if [ -f agent.pid ] && kill -0 \"$(cat agent.pid)\" 2>/dev/null; \
     then echo previous-alive; else echo previous-gone; fi; echo $$ > agent.pid; exec cat";

fn runtime_session(session: SessionId, incarnation: u64, key: &BrokerKey) -> RuntimeSessionId {
    RuntimeSessionId::new(
        session.as_str(),
        incarnation,
        &key.token(session.as_str(), incarnation),
    )
    .expect("a runtime session id")
}

async fn start(session: SessionId, workdir: &std::path::Path) -> (RelayProcess, SocketAddr) {
    let relay = RelayProcess::start(
        session,
        &sh(AGENT),
        RelayOptions {
            agentcore: true,
            workdir: Some(workdir.to_owned()),
            ..RelayOptions::default()
        },
    )
    .await;
    let http = relay.http.expect("an http listener");
    (relay, http)
}

/// Attaches as `generation` of `session`, through the header of `header`, with `key`'s token for
/// `incarnation`.
async fn attach(
    http: SocketAddr,
    header: &RuntimeSessionId,
    session: SessionId,
    generation: u64,
    incarnation: u64,
    key: &BrokerKey,
) -> Result<(Attachment, FenceTrigger), Error> {
    let connector =
        WebSocketConnector::new(format!("ws://{http}/ws")).header(SESSION_HEADER, header.to_string());
    let token = key.token(session.as_str(), incarnation);
    let config = ClientConfig::new(session, generation, generation, token)
        .backoff(Duration::from_millis(5), Duration::from_millis(100))
        .give_up_after(Duration::from_secs(3));
    let (fence, trigger) = Fence::new(session, generation);
    let attachment = within(
        "attach",
        RelayClient::new(config, Arc::new(connector)).attach(fence),
    )
    .await?;
    Ok((attachment, trigger))
}

async fn read_line(attachment: &mut Attachment) -> std::io::Result<String> {
    let mut line = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        let n = within("read", attachment.output().read(&mut byte)).await?;
        if n == 0 || byte[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.push(byte[0]);
    }
}

async fn http_status(http: SocketAddr, request: String) -> (u16, String) {
    let mut stream = TcpStream::connect(http).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("request");
    let mut response = String::new();
    within("response", stream.read_to_string(&mut response))
        .await
        .expect("response");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    (status, response)
}

fn upgrade_request(header: Option<&str>) -> String {
    let header = header
        .map(|value| format!("{SESSION_HEADER}: {value}\r\n"))
        .unwrap_or_default();
    format!(
        "GET /ws HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{header}\r\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_newer_generation_replaces_the_agent_after_the_old_one_is_gone() {
    let dir = tempfile::tempdir().expect("a workdir");
    let session = common::session("agentcore-generations");
    let (_relay, http) = start(session, dir.path()).await;
    let header = runtime_session(session, 1, &key());

    let (mut first, _) = attach(http, &header, session, 1, 1, &key())
        .await
        .expect("generation 1");
    assert_eq!(read_line(&mut first).await.expect("a line"), "previous-gone");
    first.input().write_line("one").await.expect("write");
    assert_eq!(read_line(&mut first).await.expect("echo"), "one");
    let (status, ping) = http_status(http, "GET /ping HTTP/1.1\r\nHost: relay\r\n\r\n".into()).await;
    assert_eq!(status, 200, "{ping}");

    let (mut second, _) = attach(http, &header, session, 2, 1, &key())
        .await
        .expect("generation 2");
    assert_eq!(
        read_line(&mut second).await.expect("a line"),
        "previous-gone",
        "generation 1's agent must be gone before generation 2's starts"
    );
    second.input().write_line("two").await.expect("write");
    assert_eq!(read_line(&mut second).await.expect("echo"), "two");
    // Generation 1's stream ended: it was superseded, so its broker learns it was fenced.
    let mut rest = Vec::new();
    let ended = within("the old stream ends", first.output().read_to_end(&mut rest)).await;
    let error = ended.expect_err("the old stream ends with an error");
    assert!(
        matches!(Error::from_io(&error), Some(Error::Fenced { .. })),
        "{error:?}"
    );

    // An older generation is refused; the current one keeps working.
    let stale = attach(http, &header, session, 1, 1, &key()).await;
    assert!(stale.is_err(), "generation 1 after 2 must be refused");
    second.input().write_line("still").await.expect("write");
    assert_eq!(read_line(&mut second).await.expect("echo"), "still");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_bound_runtime_session_and_its_token_are_admitted() {
    let dir = tempfile::tempdir().expect("a workdir");
    let session = common::session("agentcore-admission");
    let other = common::session("agentcore-other");
    let (_relay, http) = start(session, dir.path()).await;
    let header = runtime_session(session, 1, &key());

    // Not bound yet: healthy, and the header is required and checked.
    let (status, ping) = http_status(http, "GET /ping HTTP/1.1\r\nHost: relay\r\n\r\n".into()).await;
    assert_eq!(status, 200);
    assert!(ping.contains(r#""status":"Healthy""#), "{ping}");
    assert_eq!(http_status(http, upgrade_request(None)).await.0, 400);
    assert_eq!(
        http_status(
            http,
            upgrade_request(Some("not-ours-0000000000000000000000000000"))
        )
        .await
        .0,
        400
    );

    // A token derived with another key is refused, and binds the worker to nothing else.
    let intruder = BrokerKey::new(b"another broker's key, 32 bytes!!".to_vec());
    let refused = attach(http, &header, session, 1, 1, &intruder).await;
    assert!(
        matches!(refused, Err(Error::Backend { retryable: false, .. })),
        "{refused:?}"
    );
    // So is the token of another incarnation, and a hello for another session.
    let refused = attach(http, &header, session, 1, 2, &key()).await;
    assert!(
        matches!(refused, Err(Error::Backend { retryable: false, .. })),
        "{refused:?}"
    );
    let refused = attach(http, &header, other, 1, 1, &key()).await;
    assert!(
        matches!(refused, Err(Error::Backend { retryable: false, .. })),
        "{refused:?}"
    );

    let (mut attachment, _) = attach(http, &header, session, 1, 1, &key())
        .await
        .expect("the broker");
    assert_eq!(read_line(&mut attachment).await.expect("a line"), "previous-gone");

    // Once bound, another runtime session id is refused before the upgrade.
    let foreign = runtime_session(other, 1, &key()).to_string();
    let (status, response) = http_status(http, upgrade_request(Some(&foreign))).await;
    assert_eq!(status, 409, "{response}");
    attachment.input().write_line("alive").await.expect("write");
    assert_eq!(read_line(&mut attachment).await.expect("echo"), "alive");
}

fn invocation(header: &RuntimeSessionId, body: &[u8]) -> String {
    let body = String::from_utf8_lossy(body);
    format!(
        "POST /invocations HTTP/1.1\r\nHost: relay\r\n{SESSION_HEADER}: {header}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wipe_with_the_token_empties_the_storage_and_ends_the_runtime_session() {
    use worker_relay::agentcore::wipe_request;
    let dir = tempfile::tempdir().expect("a workdir");
    std::fs::create_dir(dir.path().join("repo")).expect("a directory");
    std::fs::write(dir.path().join("repo/file"), b"work").expect("a file");
    let outside = tempfile::tempdir().expect("a directory outside the storage");
    std::fs::write(outside.path().join("keep"), b"not the session's").expect("a file");
    std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).expect("a link");
    let session = common::session("agentcore-wipe");
    let (_relay, http) = start(session, dir.path()).await;
    let header = runtime_session(session, 1, &key());
    let (mut attachment, _) = attach(http, &header, session, 1, 1, &key())
        .await
        .expect("attach");
    assert_eq!(read_line(&mut attachment).await.expect("a line"), "previous-gone");

    let intruder = BrokerKey::new(b"another broker's key, 32 bytes!!".to_vec()).token(session.as_str(), 1);
    let (status, response) = http_status(http, invocation(&header, &wipe_request(&intruder))).await;
    assert_eq!(status, 403, "{response}");
    assert!(
        dir.path().join("repo/file").exists(),
        "a refused wipe deletes nothing"
    );

    let token = key().token(session.as_str(), 1);
    let (status, response) = http_status(http, invocation(&header, &wipe_request(&token))).await;
    assert_eq!(status, 200, "{response}");
    assert!(response.contains(r#""wiped":true"#), "{response}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("the dir")
        .map(|entry| entry.expect("an entry").file_name())
        .collect();
    assert_eq!(left, [".oab-relay"], "only the relay's closed marker is left");
    assert!(
        outside.path().join("keep").exists(),
        "a link is removed, never followed"
    );

    // The agent was retired, and no generation starts again.
    let mut rest = Vec::new();
    let ended = within("the stream ends", attachment.output().read_to_end(&mut rest)).await;
    assert!(ended.is_err(), "the wiped session's stream ends with an error");
    assert!(attach(http, &header, session, 2, 1, &key()).await.is_err());
}

/// A stopped microVM takes the relay's memory with it, but not the session storage: a relay that
/// starts on the same storage refuses the generations that already ran there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_that_ran_before_a_restart_stays_fenced_after_it() {
    let dir = tempfile::tempdir().expect("a workdir");
    let session = common::session("agentcore-floor");
    let header = runtime_session(session, 1, &key());
    let (mut relay, http) = start(session, dir.path()).await;
    let (mut first, _) = attach(http, &header, session, 1, 1, &key())
        .await
        .expect("generation 1");
    assert_eq!(read_line(&mut first).await.expect("a line"), "previous-gone");
    relay.child.kill().await.expect("the microVM stops");
    drop(first);

    let (_restarted, http) = start(session, dir.path()).await;
    let stale = attach(http, &header, session, 1, 1, &key()).await;
    assert!(
        matches!(stale, Err(Error::Backend { retryable: false, .. })),
        "generation 1 must not run again: {stale:?}"
    );
    let (mut second, _) = attach(http, &header, session, 2, 1, &key())
        .await
        .expect("generation 2");
    second.input().write_line("fresh").await.expect("write");
    let mut lines = Vec::new();
    for _ in 0..2 {
        lines.push(read_line(&mut second).await.expect("a line"));
    }
    assert!(lines.contains(&"fresh".to_owned()), "{lines:?}");
}

/// The AgentCore worker image (`deploy/agentcore/Dockerfile`) starts the relay with a command
/// line it accepts: run here with the image's entrypoint, only the address, the storage path and
/// the agent replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agentcore_images_entrypoint_is_a_command_line_the_relay_accepts() {
    use tokio::io::AsyncBufReadExt;
    let dockerfile =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/agentcore/Dockerfile");
    let text = std::fs::read_to_string(&dockerfile).expect("the Dockerfile");
    let line = text
        .lines()
        .find_map(|line| line.strip_prefix("ENTRYPOINT "))
        .expect("an ENTRYPOINT line");
    let entrypoint: Vec<String> = serde_json::from_str(line).expect("the exec form: a JSON array");
    assert_eq!(
        entrypoint.first().map(String::as_str),
        Some("/usr/local/bin/oab-relay")
    );
    assert_eq!(
        entrypoint.last().map(String::as_str),
        Some("--"),
        "the agent follows as CMD"
    );
    let dir = tempfile::tempdir().expect("a storage directory");
    let storage = dir.path().to_string_lossy().into_owned();
    let args: Vec<String> = entrypoint[1..]
        .iter()
        .map(|arg| match arg.as_str() {
            "0.0.0.0:8080" => "127.0.0.1:0".to_owned(),
            "/mnt/workspace" => storage.clone(),
            other => other.to_owned(),
        })
        .collect();
    let mut child = tokio::process::Command::new(common::RELAY)
        .args(&args)
        .arg("cat")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the relay starts");
    let stdout = child.stdout.take().expect("stdout");
    let line = within(
        "the announcement",
        tokio::io::BufReader::new(stdout).lines().next_line(),
    )
    .await
    .expect("read")
    .expect("the relay announces its listener");
    assert!(
        line.starts_with("oab-relay: listening on http 127.0.0.1:"),
        "{line}"
    );
}

/// `body` as a chunked `/invocations` request, in chunks of `size` bytes and with a trailer, as
/// a streaming front may forward it.
fn chunked_invocation(header: &RuntimeSessionId, body: &[u8], size: usize) -> String {
    let mut request = format!(
        "POST /invocations HTTP/1.1\r\nHost: relay\r\n{SESSION_HEADER}: {header}\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    for chunk in body.chunks(size) {
        request.push_str(&format!(
            "{:x}\r\n{}\r\n",
            chunk.len(),
            String::from_utf8_lossy(chunk)
        ));
    }
    request.push_str("0\r\nx-trailer: ignored\r\n\r\n");
    request
}

/// A wipe request whose body arrives chunked is read whole: close and reconcile would otherwise
/// retry it forever, each time starting a microVM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_wipe_request_is_read_and_honoured() {
    use worker_relay::agentcore::wipe_request;
    let dir = tempfile::tempdir().expect("a workdir");
    std::fs::write(dir.path().join("file"), b"work").expect("a file");
    let session = common::session("agentcore-chunked-wipe");
    let (_relay, http) = start(session, dir.path()).await;
    let header = runtime_session(session, 1, &key());
    let (mut attachment, _) = attach(http, &header, session, 1, 1, &key())
        .await
        .expect("attach");
    assert_eq!(read_line(&mut attachment).await.expect("a line"), "previous-gone");
    let token = key().token(session.as_str(), 1);
    let (status, response) = http_status(http, chunked_invocation(&header, &wipe_request(&token), 7)).await;
    assert_eq!(status, 200, "{response}");
    assert!(response.contains(r#""wiped":true"#), "{response}");
    assert!(!dir.path().join("file").exists(), "the storage was emptied");
}

/// AgentCore adds its platform headers and up to 20 allow-listed ones to a request: a head with
/// 60 headers is read, not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_the_platforms_many_headers_is_read() {
    let dir = tempfile::tempdir().expect("a workdir");
    let session = common::session("agentcore-headers");
    let (_relay, http) = start(session, dir.path()).await;
    let extra: String = (0..60)
        .map(|n| {
            format!(
                "X-Amzn-Bedrock-AgentCore-Runtime-Custom-H{n}: {}\r\n",
                "v".repeat(100)
            )
        })
        .collect();
    let (status, ping) = http_status(http, format!("GET /ping HTTP/1.1\r\nHost: relay\r\n{extra}\r\n")).await;
    assert_eq!(status, 200, "{ping}");
}

/// `/ping` says `HealthyBusy` while a broker is attached, however quiet, and `Healthy` once it
/// left, with the time it left as `time_of_last_update`, even though output is unacknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_is_busy_exactly_while_a_broker_is_attached() {
    let dir = tempfile::tempdir().expect("a workdir");
    let session = common::session("agentcore-ping");
    let (_relay, http) = start(session, dir.path()).await;
    let header = runtime_session(session, 1, &key());
    let ping = || http_status(http, "GET /ping HTTP/1.1\r\nHost: relay\r\n\r\n".into());
    let (mut attachment, _) = attach(http, &header, session, 1, 1, &key())
        .await
        .expect("attach");
    assert_eq!(read_line(&mut attachment).await.expect("a line"), "previous-gone");
    let (_, attached) = ping().await;
    assert!(attached.contains(r#""status":"HealthyBusy""#), "{attached}");
    // Input the agent echoes after the broker left stays unacknowledged.
    attachment.input().write_line("unread").await.expect("write");
    drop(attachment);
    let left = within("the relay sees the broker leave", async {
        loop {
            let (_, answer) = ping().await;
            if answer.contains(r#""status":"Healthy""#) {
                return answer;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let body = left.split("\r\n\r\n").nth(1).expect("a body");
    let value: serde_json::Value = serde_json::from_str(body).expect("JSON");
    assert!(
        value["time_of_last_update"].as_u64().is_some_and(|t| t > 0),
        "{left}"
    );
}
