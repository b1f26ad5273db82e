//! A session's egress proxy against a hostile agent, driven directly through its Unix socket (as
//! the session's `oab-egress-forward` does), without a sandbox: so these run wherever the crate
//! builds.
//!
//! - A flood of idle connections and a slow-loris of unfinished request heads against session A
//!   (from a process of their own, `oab-egress-flood`, as an agent's would be), while session B's
//!   requests through its own proxy each complete within a generous bound; A's refusals are
//!   logged a few times, not once per connection; once the flood ends A is served again.
//! - A request head whose method carries a newline and terminal escapes cannot write a line of
//!   its own into the broker's log.
//! - A listed name that resolves to a loopback address is refused unless its entry says
//!   `loopback`, and the address connected is the one checked.
//! - A request head trickled a byte a second is cut off by a deadline for the whole head: the
//!   connection is closed without an answer, and the refusal logged.
//!
//! Every destination is a listener this test owns on loopback; the flood's processes are this
//! test's children and are ended by it.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use runtime_local::testing::EgressProxyUnderTest;
use session_runtime::config::EgressTarget;
use session_runtime::{SessionId, SessionIdentity};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// How long one request of the other session may take while the flood runs: a liveness bound
/// (a stuck proxy never answers), not a performance figure (that is the benchmark's).
const REQUEST_BOUND: Duration = Duration::from_secs(10);
/// Connections each flood process opens.
const FLOOD: usize = 1500;
/// The descriptor limit the test process runs with: a broker near its limit, reached by the
/// flood well before the flood ends unless the proxy bounds it per session.
const NOFILE_LIMIT: u64 = 1024;

/// Log lines, captured for every test of this binary.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log lock").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log lock")).into_owned()
    }
}

/// The log of this test binary (a global subscriber: the proxy's tasks run on any thread).
fn log() -> &'static Captured {
    static LOG: OnceLock<Captured> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer({
                let log = log.clone();
                move || log.clone()
            })
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this binary");
        log
    })
}

fn session(thread: &str) -> SessionId {
    SessionIdentity::new("egress-proxy", "agent", "discord", thread)
        .expect("identity")
        .id()
}

fn target(text: &str) -> EgressTarget {
    EgressTarget::parse(text).expect("target")
}

/// A loopback HTTP service that answers every request with `word`.
async fn service(word: &'static str) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = stream.read(&mut request).await;
                let body = format!("{word}\n");
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    address
}

/// Sends `head` to the proxy at `socket`; returns everything it answered until it closed.
async fn exchange(socket: &Path, head: &[u8]) -> std::io::Result<String> {
    let mut stream = UnixStream::connect(socket).await?;
    stream.write_all(head).await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// A CONNECT tunnel to `authority` through the proxy at `socket`, then a GET through it; returns
/// the proxy's status line and, when it connected, the destination's answer.
async fn tunnel(socket: &Path, authority: &str) -> std::io::Result<(String, String)> {
    let stream = UnixStream::connect(socket).await?;
    let mut stream = BufReader::new(stream);
    stream
        .get_mut()
        .write_all(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await?;
    let mut status = String::new();
    stream.read_line(&mut status).await?;
    if !status.starts_with("HTTP/1.1 200") {
        let mut rest = String::new();
        let _ = stream.read_to_string(&mut rest).await;
        return Ok((status.trim_end().to_owned(), rest));
    }
    loop {
        let mut line = String::new();
        if stream.read_line(&mut line).await? == 0 || line == "\r\n" {
            break;
        }
    }
    stream
        .get_mut()
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await?;
    Ok((status.trim_end().to_owned(), answer))
}

/// A running `oab-egress-flood`: killed and reaped when dropped.
struct Flood(std::process::Child);

impl Flood {
    /// Starts a flood of `count` connections of `mode` against `socket`.
    fn start(socket: &Path, count: usize, mode: &str) -> Self {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_oab-egress-flood"))
            .arg(socket)
            .arg(count.to_string())
            .arg(mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("oab-egress-flood");
        Flood(child)
    }

    /// Waits until the flood has tried all its connections; returns its report.
    fn report(&mut self) -> String {
        let stdout = self.0.stdout.take().expect("stdout");
        let mut report = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut report).expect("report");
        report.trim_end().to_owned()
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Lowers this process's soft descriptor limit to `limit` while alive; restores it when dropped.
struct NofileLimit(rustix::process::Rlimit);

impl NofileLimit {
    fn lower_to(limit: u64) -> Self {
        let before = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        let lowered = rustix::process::Rlimit {
            current: Some(before.current.map_or(limit, |current| current.min(limit))),
            maximum: before.maximum,
        };
        rustix::process::setrlimit(rustix::process::Resource::Nofile, lowered).expect("setrlimit");
        NofileLimit(before)
    }
}

impl Drop for NofileLimit {
    fn drop(&mut self) {
        let _ = rustix::process::setrlimit(rustix::process::Resource::Nofile, self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_session_is_bounded_while_another_sessions_requests_complete() {
    let log = log();
    let upstream = service("served").await;
    let dir = tempfile::Builder::new()
        .prefix("oab-flood-")
        .tempdir_in("/tmp")
        .expect("dir");
    let (flooder, other) = (session("flooder"), session("other"));
    let entry = [target(&upstream.to_string())];
    let proxy_a = EgressProxyUnderTest::start(flooder, &entry, &dir.path().join("a")).expect("proxy A");
    let proxy_b = EgressProxyUnderTest::start(other, &entry, &dir.path().join("b")).expect("proxy B");
    let authority = upstream.to_string();
    let (status, answer) = tunnel(proxy_b.socket(), &authority).await.expect("B before");
    assert!(
        status.starts_with("HTTP/1.1 200") && answer.ends_with("served\n"),
        "{status} {answer}"
    );

    let limit = NofileLimit::lower_to(NOFILE_LIMIT);
    let mut idle = Flood::start(proxy_a.socket(), FLOOD, "idle");
    let mut slow = Flood::start(proxy_a.socket(), FLOOD, "slow");
    let (idle_report, slow_report) = (idle.report(), slow.report());
    eprintln!("flood: idle {idle_report}; slow-loris {slow_report}");
    // The proxy holds no more of the flood than the session's limit; the rest was refused (or
    // waits in the kernel's queue, where it costs the broker nothing).
    let held = proxy_a.open_connections();
    assert!(held <= 64, "the proxy holds {held} of A's connections");
    assert!(proxy_a.refused() > 0, "nothing of the flood was refused");
    for request in 0..20 {
        let result = tokio::time::timeout(REQUEST_BOUND, tunnel(proxy_b.socket(), &authority)).await;
        match result {
            Ok(Ok((status, answer))) => assert!(
                status.starts_with("HTTP/1.1 200") && answer.ends_with("served\n"),
                "B's request {request} during A's flood: {status} {answer}"
            ),
            Ok(Err(error)) => panic!("B's request {request} during A's flood failed: {error}"),
            Err(_) => panic!("B's request {request} during A's flood took over {REQUEST_BOUND:?}"),
        }
    }
    let started = std::time::Instant::now();
    drop((idle, slow));
    // The flood's connections end; give the proxy time to notice them all.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let seconds = started.elapsed().as_secs() + 1;
    drop(limit);

    // A is served again once its flood is gone.
    let (status, answer) = tokio::time::timeout(REQUEST_BOUND, tunnel(proxy_a.socket(), &authority))
        .await
        .expect("A after its flood: in time")
        .expect("A after its flood");
    assert!(
        status.starts_with("HTTP/1.1 200") && answer.ends_with("served\n"),
        "{status} {answer}"
    );

    // Refusals and ended connections of A are logged a few times a second, counted, not once
    // per connection (3000 of them).
    let text = log.text();
    let lines = text
        .lines()
        .filter(|line| line.contains(&format!("session={flooder}")))
        .count();
    assert!(
        lines as u64 <= 8 + 2 * seconds,
        "{lines} log lines of the flooding session in about {seconds} s:\n{}",
        text.lines().take(20).collect::<Vec<_>>().join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_chosen_request_cannot_forge_a_log_line() {
    let log = log();
    let dir = tempfile::Builder::new()
        .prefix("oab-forge-")
        .tempdir_in("/tmp")
        .expect("dir");
    let id = session("forger");
    let proxy = EgressProxyUnderTest::start(id, &[target("api.example.com:443")], dir.path()).expect("proxy");
    // No spaces: the request line is split at them.
    let forged = "2026-01-01T00:00:00.000000Z-WARN-forged";
    let heads = [
        // A method with a newline and a terminal escape, in a request the proxy does not serve.
        format!("GET\n{forged}\x1b[2K /index.html HTTP/1.1\r\n\r\n"),
        format!("GET\n{forged}\x1b[2K http://api.example.com/ HTTP/1.1\r\n\r\n"),
        // A destination with them: not in the allowlist.
        format!("CONNECT a\n{forged}\x1b[2K:443 HTTP/1.1\r\n\r\n"),
        format!("GET http://x.example.com/\n{forged}\x1b[31m HTTP/1.1\r\n\r\n"),
        format!("G\rET http://x.example.com/ HTTP/1.1\r\nHost: \n{forged}\r\n\r\n"),
    ];
    for head in &heads {
        let answer = exchange(proxy.socket(), head.as_bytes()).await.expect("exchange");
        assert!(
            answer.starts_with("HTTP/1.1 4"),
            "{head:?} was not refused: {answer}"
        );
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let text = log.text();
    let ours: Vec<&str> = text
        .lines()
        .filter(|line| line.contains(&id.to_string()) || line.contains(forged))
        .collect();
    assert!(!ours.is_empty(), "no refusal of {id} logged:\n{text}");
    for line in &ours {
        // Every line the proxy writes is the subscriber's: its own timestamp and level, then
        // the proxy's target; a line that starts with what the agent sent is a forged one.
        assert!(
            !line.starts_with(forged) && line.contains(" WARN egress_proxy"),
            "a log line that is not the proxy's own: {line:?}"
        );
        assert!(
            !line.chars().any(char::is_control),
            "a control character in a log line: {line:?}"
        );
    }
}

/// A name other than `localhost` that this host maps to an IPv4 loopback address in
/// `/etc/hosts`, if there is one.
fn loopback_name() -> Option<String> {
    let hosts = std::fs::read_to_string("/etc/hosts").ok()?;
    hosts
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            // IPv4 only: the service this test listens with is on 127.0.0.1.
            let address: std::net::Ipv4Addr = words.next()?.parse().ok()?;
            address.is_loopback().then_some(words)
        })
        .flatten()
        .find(|name| *name != "localhost" && EgressTarget::parse(&format!("{name}:80")).is_ok())
        .map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_name_resolving_to_loopback_reaches_it_only_when_its_entry_says_loopback() {
    let _ = log();
    let name = loopback_name().expect(
        "a name other than localhost that /etc/hosts maps to an address in 127.0.0.0/8 \
         (add one, e.g. `127.0.0.1 vm`): the test needs a listed name that resolves to loopback",
    );
    let upstream = service("host-loopback").await;
    let port = upstream.port();
    let dir = tempfile::Builder::new()
        .prefix("oab-rebind-")
        .tempdir_in("/tmp")
        .expect("dir");
    let plain = EgressProxyUnderTest::start(
        session("rebind-plain"),
        &[target(&format!("{name}:{port}"))],
        &dir.path().join("plain"),
    )
    .expect("proxy");
    let (status, answer) = tunnel(plain.socket(), &format!("{name}:{port}"))
        .await
        .expect("tunnel");
    assert!(
        status.starts_with("HTTP/1.1 403"),
        "{name}:{port}, listed without `loopback`, reached the host's loopback: {status} {answer}"
    );
    let explicit = EgressProxyUnderTest::start(
        session("rebind-explicit"),
        &[target(&format!("{name}:{port} loopback"))],
        &dir.path().join("explicit"),
    )
    .expect("proxy");
    let (status, _) = tunnel(explicit.socket(), &format!("{name}:{port}"))
        .await
        .expect("tunnel");
    // 200 when the name resolves to the IPv4 loopback service; a refused connection (502) to ::1
    // when only that is its address and nothing listens there: either way it was let through.
    assert!(
        status.starts_with("HTTP/1.1 200") || status.starts_with("HTTP/1.1 502"),
        "{name}:{port} loopback: {status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_trickled_a_byte_at_a_time_is_cut_off_by_a_whole_head_deadline() {
    let log = log();
    let id = session("trickle");
    let dir = tempfile::Builder::new()
        .prefix("oab-trickle-")
        .tempdir_in("/tmp")
        .expect("dir");
    let proxy = EgressProxyUnderTest::start(id, &[target("api.example.com:443")], dir.path()).expect("proxy");
    let mut stream = UnixStream::connect(proxy.socket()).await.expect("connect");
    // One byte a second never lets a per-read timeout fire; only a deadline for the whole head
    // ends it. The bound is a liveness one (three times the proxy's 10 s), not a figure.
    let trickle = async {
        for byte in b"CONNECT api.example.com:443 HTTP/1.1\r\nX-Slow: ".iter().cycle() {
            if stream.write_all(&[*byte]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let mut answer = [0u8; 64];
            match tokio::time::timeout(Duration::from_millis(1), stream.read(&mut answer)).await {
                Ok(Ok(read)) if read > 0 => return String::from_utf8_lossy(&answer[..read]).into_owned(),
                Ok(_) => return String::new(),
                Err(_) => {}
            }
        }
        String::new()
    };
    let answer = tokio::time::timeout(Duration::from_secs(30), trickle)
        .await
        .expect("the proxy still waits for a head trickled for 30 s");
    // Closed without an answer (hyper's whole-head deadline), and the refusal logged.
    assert!(answer.is_empty(), "answered instead of closed: {answer:?}");
    assert_eq!(proxy.refused(), 1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let text = log.text();
    assert!(
        text.lines()
            .any(|line| line.contains(&id.to_string()) && line.contains("no complete request head within")),
        "the cut-off head was not logged:\n{text}"
    );
}
