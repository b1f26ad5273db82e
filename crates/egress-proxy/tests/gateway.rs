//! The egress gateway over loopback TCP, as a worker Pod reaches it: a request is served for the
//! session its proxy credential names, within that session's profile and limits; a missing,
//! malformed or borrowed credential, another profile, an unlisted destination and an oversized
//! head are each refused with their status and logged, and the gateway goes on serving. Every
//! destination is a listener this test owns on loopback.

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use egress_proxy::bounds::MAX_CONNECTIONS;
use egress_proxy::gateway::{
    load_profiles, profile_egress, Gateway, GatewayKey, ProfileEgress, ProxyCredential,
};
use egress_proxy::Allowlist;
use session_runtime::config::EgressTarget;
use session_runtime::{SessionId, SessionIdentity};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Everything the gateway logged in this test binary.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log() -> &'static Captured {
    static LOG: OnceLock<Captured> = OnceLock::new();
    LOG.get_or_init(|| {
        let captured = Captured::default();
        let writer = captured.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        captured
    })
}

fn logged() -> String {
    String::from_utf8_lossy(&log().0.lock().expect("log")).into_owned()
}

fn session(thread: &str) -> SessionId {
    SessionIdentity::new("gateway", "agent", "test", thread)
        .expect("identity")
        .id()
}

/// A loopback destination that answers `word` to whatever it is sent.
async fn destination(word: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 1024];
                let _ = stream.read(&mut request).await;
                let _ = stream.write_all(format!("{word}\n").as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    address
}

struct Running {
    address: SocketAddr,
    stop: CancellationToken,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A gateway serving profile `work` whose egress entries are `hosts`. They are loopback
/// destinations, the only ones this test may open, which a profile document may not list (at a
/// real gateway, loopback is the gateway's own), so the profile is made here rather than read.
async fn gateway(key: &GatewayKey, hosts: &[String]) -> Running {
    let targets = hosts
        .iter()
        .map(|host| EgressTarget::parse(host).expect("an egress entry"))
        .collect();
    let work = ProfileEgress {
        allowlist: Allowlist::new(targets),
        model_routes: Vec::new(),
    };
    start(key, [("work".to_owned(), work)].into(), Path::new("/nonexistent")).await
}

/// A gateway serving `profiles` (name and TOML document), its routes' Secrets under `secrets`.
async fn serve(key: &GatewayKey, profiles: &[(&str, &str)], secrets: &Path) -> Running {
    let profiles = profiles
        .iter()
        .map(|(name, document)| {
            (
                (*name).to_owned(),
                profile_egress(name, document).expect("a profile"),
            )
        })
        .collect();
    start(key, profiles, secrets).await
}

async fn start(key: &GatewayKey, profiles: HashMap<String, ProfileEgress>, secrets: &Path) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let stop = CancellationToken::new();
    tokio::spawn(Arc::new(Gateway::new(key.clone(), profiles, secrets)).serve(listener, stop.clone()));
    Running { address, stop }
}

/// A `CONNECT` to `target` with `authorization` (a `Proxy-Authorization` value), then a line
/// through the tunnel if it opened: the status line, and the destination's answer.
async fn connect(gateway: SocketAddr, target: &str, authorization: Option<&str>) -> (String, String) {
    let stream = TcpStream::connect(gateway).await.expect("connect to the gateway");
    let mut stream = BufReader::new(stream);
    let credential =
        authorization.map_or_else(String::new, |value| format!("Proxy-Authorization: {value}\r\n"));
    stream
        .get_mut()
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{credential}\r\n").as_bytes())
        .await
        .expect("send");
    let mut status = String::new();
    stream.read_line(&mut status).await.expect("status");
    let mut rest = String::new();
    if status.starts_with("HTTP/1.1 200") {
        // The blank line that ends the answer's head, then the tunnel.
        loop {
            let mut line = String::new();
            if stream.read_line(&mut line).await.expect("head") == 0 || line == "\r\n" {
                break;
            }
        }
        stream.get_mut().write_all(b"hello\n").await.expect("through");
        stream.read_to_string(&mut rest).await.expect("answer");
    } else {
        stream.read_to_string(&mut rest).await.expect("answer");
    }
    (status.trim_end().to_owned(), rest)
}

fn basic(user_and_token: &str) -> String {
    format!(
        "Basic {}",
        data_encoding::BASE64.encode(user_and_token.as_bytes())
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_reaches_what_its_profile_lists_with_its_own_credential_only() {
    let _ = log();
    let key = GatewayKey::new([7u8; 32]);
    let listed = destination("listed").await;
    let unlisted = destination("unlisted").await;
    let gateway = gateway(&key, &[format!("{listed} loopback")]).await;
    let (a, b) = (session("a"), session("b"));
    let own = key.credential(a, "work");
    let (status, answer) = connect(gateway.address, &listed.to_string(), Some(&own.header_value())).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert_eq!(answer, "listed\n");

    let a_token = own
        .proxy_url("x")
        .split(':')
        .nth(2)
        .and_then(|t| t.split('@').next())
        .map(str::to_owned);
    let a_token = a_token.expect("a token in the proxy URL");
    let refusals: Vec<(&str, Option<String>, &str, &str)> = vec![
        ("no credential", None, "407", "no proxy credential"),
        ("not Basic", Some("Bearer x".to_owned()), "407", "not Basic"),
        ("not base64", Some("Basic !!!".to_owned()), "407", "not base64"),
        (
            "no token",
            Some(basic(&format!("{a}.work"))),
            "407",
            "without a token",
        ),
        (
            "no profile",
            Some(basic(&format!("{a}:{a_token}"))),
            "407",
            "SESSION.PROFILE",
        ),
        (
            "another session's name with a's token",
            Some(basic(&format!("{b}.work:{a_token}"))),
            "407",
            "not its session's",
        ),
        (
            "another profile's name with a's token",
            Some(basic(&format!("{a}.other:{a_token}"))),
            "407",
            "not its session's",
        ),
        (
            "a profile the gateway does not serve",
            Some(key.credential(a, "absent").header_value()),
            "403",
            "no egress at this gateway",
        ),
    ];
    for (case, authorization, code, reason) in &refusals {
        let (status, answer) = connect(gateway.address, &listed.to_string(), authorization.as_deref()).await;
        assert!(
            status.starts_with(&format!("HTTP/1.1 {code}")),
            "{case}: {status}"
        );
        assert!(answer.contains(reason), "{case}: {answer:?}");
    }
    let (status, _) = connect(gateway.address, &unlisted.to_string(), Some(&own.header_value())).await;
    assert!(status.starts_with("HTTP/1.1 403"), "unlisted: {status}");
    let oversized = format!("{}\r\nX-Long: {}", own.header_value(), "a".repeat(20 * 1024));
    let (status, _) = connect(gateway.address, &listed.to_string(), Some(&oversized)).await;
    assert!(status.starts_with("HTTP/1.1 431"), "oversized: {status}");

    // The gateway goes on serving.
    let (status, answer) = connect(gateway.address, &listed.to_string(), Some(&own.header_value())).await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert_eq!(answer, "listed\n");

    // Each refusal is logged with the session when known, the destination when it got that far,
    // and the reason; the token never.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let text = logged();
    let token_shown = text.contains(&a_token);
    assert!(!token_shown, "a token in the log:\n{text}");
    assert!(
        text.lines().any(|line| line.contains("egress refused")
            && line.contains(&format!("session={a}"))
            && line.contains(&format!("destination={unlisted}"))
            && line.contains("reason=not in the session's allowlist")),
        "no refusal of the unlisted destination logged:\n{text}"
    );
    assert!(
        text.lines()
            .any(|line| line.contains("session=-") && line.contains("reason=no proxy credential")),
        "no refusal of the missing credential logged:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_at_its_connection_limit_does_not_stop_another() {
    let _ = log();
    let key = GatewayKey::new([9u8; 32]);
    // A destination that holds every connection open.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let held = listener.local_addr().expect("address");
    let stop_holding = CancellationToken::new();
    tokio::spawn({
        let stop = stop_holding.clone();
        async move {
            let mut open = Vec::new();
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => open.push(stream),
                        Err(_) => return,
                    },
                }
            }
        }
    });
    let answering = destination("served").await;
    let gateway = gateway(
        &key,
        &[format!("{held} loopback"), format!("{answering} loopback")],
    )
    .await;
    let flooding = key.credential(session("flooding"), "work");
    let mut tunnels = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        let mut stream = TcpStream::connect(gateway.address).await.expect("connect");
        stream
            .write_all(
                format!(
                    "CONNECT {held} HTTP/1.1\r\nProxy-Authorization: {}\r\n\r\n",
                    flooding.header_value()
                )
                .as_bytes(),
            )
            .await
            .expect("send");
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.expect("an answer");
        assert_eq!(&head, b"HTTP/1.1 200");
        tunnels.push(stream);
    }
    let (status, _) = connect(
        gateway.address,
        &answering.to_string(),
        Some(&flooding.header_value()),
    )
    .await;
    assert!(status.starts_with("HTTP/1.1 503"), "over its limit: {status}");
    let other: ProxyCredential = key.credential(session("other"), "work");
    let (status, answer) = connect(
        gateway.address,
        &answering.to_string(),
        Some(&other.header_value()),
    )
    .await;
    assert!(status.starts_with("HTTP/1.1 200"), "another session: {status}");
    assert_eq!(answer, "served\n");
    // Its tunnels closed, the flooding session is served again.
    drop(tunnels);
    let served = async {
        loop {
            let (status, _) = connect(
                gateway.address,
                &answering.to_string(),
                Some(&flooding.header_value()),
            )
            .await;
            if status.starts_with("HTTP/1.1 200") {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), served)
        .await
        .expect("the session is served once its tunnels closed");
    stop_holding.cancel();
}

#[test]
fn a_profiles_egress_hosts_are_refused_naming_the_key_and_the_rest_left_to_the_runtime() {
    for (document, key, problem) in [
        (
            "egress_hosts = [\"github.com:443\", \"github.com\"]\n",
            "profile/work.egress_hosts",
            "entry 2:",
        ),
        (
            "egress_hosts = \"github.com:443\"\n",
            "profile/work.egress_hosts",
            "array",
        ),
        (
            "egress_hosts = [\"a.example:443\", \"a.example:443\"]\n",
            "profile/work.egress_hosts",
            "twice",
        ),
        ("egress_hosts = [443]\n", "profile/work.egress_hosts", "entry 1:"),
        (
            "egress_hosts = [\"localhost:8080\"]\n",
            "profile/work.egress_hosts",
            "the gateway's own",
        ),
        ("egress_hosts = [", "profile/work", ""),
        (
            "[[model_routes]]\nprefix = \"openai\"\nupstream = \"https://a.example\"\nheader = \"Authorization\"\n\
             secret = { name = \"k\", key = \"v\" }\n",
            "profile/work.model_routes",
            "entry 1: prefix:",
        ),
        (
            "[[model_routes]]\nprefix = \"/o/\"\nupstream = \"https://a.example\"\nheader = \"Authorization\"\n\
             secret = { name = \"k\", key = \"v\" }\nsecrets = 1\n",
            "profile/work.model_routes",
            "unknown field `secrets`",
        ),
    ] {
        let error = profile_egress("work", document).expect_err(document);
        assert_eq!(error.key, key, "{document}: {error}");
        assert!(error.problem.contains(problem), "{document}: {error}");
    }
    let egress = profile_egress(
        "work",
        "image = \"w\"\n[resources]\ncpu_limit = \"1\"\negress_hosts = [\"x:1\"]\n",
    )
    .expect("other keys are the runtime's");
    assert!(
        egress.allowlist.targets().is_empty(),
        "a key of [resources] is not the profile's egress_hosts"
    );
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(
        dir.path().join("work.toml"),
        "egress_hosts = [\"github.com:443\"]\n",
    )
    .expect("write");
    std::fs::write(dir.path().join("none.toml"), "image = \"w\"\n").expect("write");
    std::fs::write(dir.path().join("README"), "not a profile").expect("write");
    let profiles: HashMap<_, _> = load_profiles(dir.path()).expect("profiles");
    assert_eq!(profiles.len(), 2);
    assert_eq!(profiles["work"].allowlist.targets().len(), 1);
    assert!(profiles["none"].allowlist.targets().is_empty());
}

#[test]
fn the_binary_refuses_a_short_key_and_a_bad_profile_naming_them() {
    let dir = tempfile::tempdir().expect("dir");
    let (key, profiles) = (dir.path().join("key"), dir.path().join("profiles"));
    std::fs::write(&key, [1u8; 16]).expect("key");
    std::fs::create_dir(&profiles).expect("profiles");
    std::fs::write(profiles.join("work.toml"), "egress_hosts = [\"github.com\"]\n").expect("a profile");
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_oab-egress-gateway"))
            .args(["--listen", "127.0.0.1:0", "--key-file"])
            .arg(&key)
            .arg("--profiles")
            .arg(&profiles)
            .output()
            .expect("run the gateway")
    };
    let output = run();
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("16 bytes"),
        "{output:?}"
    );
    std::fs::write(&key, [1u8; 32]).expect("key");
    let output = run();
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("profile/work.egress_hosts: entry 1:"),
        "{output:?}"
    );
}

/// A loopback model upstream that records each request's head and answers `200 model`.
async fn model_upstream() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let heads: Arc<Mutex<Vec<String>>> = Arc::default();
    let recorded = Arc::clone(&heads);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let recorded = Arc::clone(&recorded);
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                let mut head = String::new();
                loop {
                    let mut line = String::new();
                    if stream.read_line(&mut line).await.unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    head.push_str(&line);
                }
                recorded.lock().expect("heads").push(head);
                let _ = stream
                    .get_mut()
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nmodel")
                    .await;
            });
        }
    });
    (address, heads)
}

/// `request` (a whole request head and body) sent to the gateway: the status line and the body.
async fn exchange(gateway: SocketAddr, request: &str) -> (String, String) {
    let mut stream = TcpStream::connect(gateway).await.expect("connect to the gateway");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("answer");
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    )
}

fn post(path: &str, header: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: gateway\r\n{header}Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_route_swaps_the_sessions_route_key_for_the_secret_and_refuses_anything_else() {
    let _ = log();
    let key = GatewayKey::new([5u8; 32]);
    let (upstream, heads) = model_upstream().await;
    let secrets = tempfile::tempdir().expect("dir");
    std::fs::create_dir(secrets.path().join("model-keys")).expect("a Secret's directory");
    std::fs::write(secrets.path().join("model-keys/openai"), "sk-openai-secret\n").expect("a key");
    std::fs::write(secrets.path().join("model-keys/anthropic"), "sk-ant-secret").expect("a key");
    let routes = format!(
        "[[model_routes]]\nprefix = \"/openai/\"\nupstream = \"http://{upstream}/v1\"\nheader = \"Authorization\"\n\
         secret = {{ name = \"model-keys\", key = \"openai\" }}\n\
         [[model_routes]]\nprefix = \"/anthropic/\"\nupstream = \"http://{upstream}\"\nheader = \"x-api-key\"\n\
         secret = {{ name = \"model-keys\", key = \"anthropic\" }}\n\
         [[model_routes]]\nprefix = \"/missing/\"\nupstream = \"http://{upstream}\"\nheader = \"Authorization\"\n\
         secret = {{ name = \"model-keys\", key = \"absent\" }}\n"
    );
    let gateway = serve(
        &key,
        &[("work", &routes), ("plain", "image = \"w\"\n")],
        secrets.path(),
    )
    .await;
    let (a, b) = (session("route-a"), session("route-b"));
    let a_key = key.credential(a, "work").route_key();

    let (status, body) = exchange(
        gateway.address,
        &post(
            "/openai/responses?stream=true",
            &format!("Authorization: Bearer {a_key}\r\nX-Api-Key: {a_key}\r\n"),
        ),
    )
    .await;
    assert_eq!((status.as_str(), body.as_str()), ("HTTP/1.1 200 OK", "model"));
    let head = heads
        .lock()
        .expect("heads")
        .pop()
        .expect("the upstream was asked");
    assert!(
        head.starts_with("POST /v1/responses?stream=true HTTP/1.1\r\n"),
        "{head}"
    );
    assert!(
        head.contains("authorization: Bearer sk-openai-secret\r\n"),
        "{head}"
    );
    assert!(head.contains(&format!("host: {upstream}\r\n")), "{head}");
    assert!(
        !head.contains(&a_key),
        "the route key reached the upstream: {head}"
    );

    let (status, _) = exchange(
        gateway.address,
        &post("/anthropic/v1/messages", &format!("x-api-key: {a_key}\r\n")),
    )
    .await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    let head = heads
        .lock()
        .expect("heads")
        .pop()
        .expect("the upstream was asked");
    assert!(head.starts_with("POST /v1/messages HTTP/1.1\r\n"), "{head}");
    assert!(head.contains("x-api-key: sk-ant-secret\r\n"), "{head}");

    let a_token = a_key.rsplit(':').next().expect("a token");
    let refusals = [
        ("no key", post("/openai/responses", ""), "407"),
        (
            "a key of no session",
            post("/openai/responses", "Authorization: Bearer sk-guess\r\n"),
            "407",
        ),
        (
            "another session's name with a's token",
            post(
                "/openai/responses",
                &format!("Authorization: Bearer {b}.work:{a_token}\r\n"),
            ),
            "407",
        ),
        (
            "a path no route serves",
            post("/google/v1", &format!("Authorization: Bearer {a_key}\r\n")),
            "404",
        ),
        (
            "a profile without routes",
            post(
                "/openai/responses",
                &format!(
                    "Authorization: Bearer {}\r\n",
                    key.credential(a, "plain").route_key()
                ),
            ),
            "404",
        ),
        (
            "a dot segment",
            post("/openai/../admin", &format!("Authorization: Bearer {a_key}\r\n")),
            "400",
        ),
        (
            "an encoded dot segment",
            post(
                "/openai/%2E%2E/admin",
                &format!("Authorization: Bearer {a_key}\r\n"),
            ),
            "400",
        ),
        (
            "a route whose Secret is not mounted",
            post("/missing/x", &format!("Authorization: Bearer {a_key}\r\n")),
            "502",
        ),
    ];
    for (case, request, code) in &refusals {
        let (status, _) = exchange(gateway.address, request).await;
        assert!(
            status.starts_with(&format!("HTTP/1.1 {code}")),
            "{case}: {status}"
        );
    }
    assert!(
        heads.lock().expect("heads").is_empty(),
        "a refused request reached the upstream"
    );

    // The session goes on being served, and the log holds neither credential.
    let (status, _) = exchange(
        gateway.address,
        &post("/openai/responses", &format!("Authorization: Bearer {a_key}\r\n")),
    )
    .await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let text = logged();
    assert!(
        !text.contains("sk-openai-secret") && !text.contains("sk-ant-secret"),
        "a Secret in the log:\n{text}"
    );
    assert!(!text.contains(a_token), "a route key in the log:\n{text}");
    assert!(
        text.lines().any(|line| line.contains("model route")
            && line.contains(&format!("session={a}"))
            && line.contains("route=\"/openai/\"")
            && line.contains("status=200")),
        "no log line of the route's use:\n{text}"
    );
    assert!(
        text.lines().any(|line| line.contains("egress refused")
            && line.contains(&format!("session={a}"))
            && line.contains("reason=a dot segment")),
        "no log line of the dot segment's refusal:\n{text}"
    );
}
