//! `network = "allowlist"`: from a shell inside each session (the test agent's exec probe), the
//! only ways out are the session's own listed destinations.
//!
//! Two sessions, A and B, of two runtimes sharing one root, each allowed one loopback service of
//! the test's (`a` and `b`) and the name `localhost` at a third port for A only (`named`, reached
//! through the proxy with CONNECT and with a plain absolute-form request). From each shell: its
//! own service answers; the other's is refused (the port is closed in its namespace, and the
//! proxy answers 403 for it); nothing but loopback exists; the proxy's refusals are logged with
//! the session id. Every destination is a listener this test owns on 127.0.0.1.

mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use runtime_local::LocalRuntime;
use session_runtime::config::{EgressTarget, NetworkMode, SandboxMode};
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime};
use tokio::io::AsyncWriteExt;

/// A loopback HTTP service that answers every request with `word`.
async fn service(word: &'static str) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = tokio::io::AsyncReadExt::read(&mut stream, &mut request).await;
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

/// Log lines, captured.
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

fn targets(list: &[String]) -> Vec<EgressTarget> {
    list.iter()
        .map(|t| EgressTarget::parse(t).expect("target"))
        .collect()
}

/// A bubblewrap runtime of `installation` under `root` allowing `egress`, or `None` where
/// bubblewrap does not work here (after checking the refusal is the documented one).
fn runtime(root: &Path, installation: &str, egress: Vec<EgressTarget>) -> Option<Arc<LocalRuntime>> {
    common::use_built_egress_forwarder();
    let builder = common::builder(root, installation, SandboxMode::Bubblewrap)
        .network(NetworkMode::Allowlist)
        .egress(egress);
    common::build_if_supported(builder, SandboxMode::Bubblewrap)
}

/// Runs `command` in the session's shell; returns its stdout (trimmed) and exit code.
async fn shell(client: &AcpClient, command: &str) -> (String, Option<i32>) {
    let out = client.exec(command).await.expect("exec");
    (out.stdout.trim().to_owned(), out.exit_code)
}

/// `curl` of `url`, with extra `options`, printing the body or `curl-exit=N` when it fails.
fn curl(options: &str, url: &str) -> String {
    format!("curl -sS --max-time 10 {options} {url} 2>&1 || echo curl-exit=$?")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sessions_allowlist_opens_nothing_for_another_and_refusals_are_logged() {
    let log = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let log = log.clone();
            move || log.clone()
        })
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    // Global: the proxy's tasks run on the runtime's worker threads.
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this test binary");

    let a_service = service("from-a").await;
    let b_service = service("from-b").await;
    let named = service("from-named").await;
    let root = tempfile::Builder::new()
        .prefix("oab-egress-")
        .tempdir_in("/tmp")
        .expect("root");
    let Some(runtime_a) = runtime(
        root.path(),
        "egress-a",
        targets(&[a_service.to_string(), format!("localhost:{}", named.port())]),
    ) else {
        return;
    };
    let Some(runtime_b) = runtime(root.path(), "egress-b", targets(&[b_service.to_string()])) else {
        return;
    };
    let a = SessionIdentity::new("egress-a", "agent", "discord", "a").expect("identity");
    let b = SessionIdentity::new("egress-b", "agent", "discord", "b").expect("identity");
    let mut clients = Vec::new();
    for (runtime, identity) in [(&runtime_a, &a), (&runtime_b, &b)] {
        runtime
            .create(identity, &CreateOptions::new())
            .await
            .expect("create");
        let client = AcpClient::new(runtime.attach(&identity.id()).await.expect("attach"));
        client.initialize().await.expect("initialize");
        clients.push(client);
    }
    let (client_a, client_b) = (&clients[0], &clients[1]);

    // Nothing but loopback: no interface leads anywhere else.
    for client in [client_a, client_b] {
        let (interfaces, code) = shell(client, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").await;
        assert_eq!(code, Some(0));
        assert_eq!(interfaces, "lo", "interfaces inside the session");
        let (proxy, _) = shell(client, "echo $HTTPS_PROXY $http_proxy $NO_PROXY").await;
        assert_eq!(
            proxy,
            "http://127.0.0.1:3128 http://127.0.0.1:3128 localhost,127.0.0.1,::1"
        );
    }

    // Each session reaches its own loopback service, at the same address as on the host...
    let (body, _) = shell(client_a, &curl("", &format!("http://{a_service}/"))).await;
    assert_eq!(body, "from-a");
    let (body, _) = shell(client_b, &curl("", &format!("http://{b_service}/"))).await;
    assert_eq!(body, "from-b");
    // ...and not the other's: the port is its own, closed loopback port (curl: couldn't connect).
    let (body, _) = shell(client_a, &curl("", &format!("http://{b_service}/"))).await;
    assert!(body.ends_with("curl-exit=7"), "A reached B's service: {body}");
    let (body, _) = shell(client_b, &curl("", &format!("http://{a_service}/"))).await;
    assert!(body.ends_with("curl-exit=7"), "B reached A's service: {body}");

    // A listed name goes through the proxy, as a CONNECT tunnel and as a plain request.
    let via_proxy = "--noproxy '' --proxy http://127.0.0.1:3128";
    let named_url = format!("http://localhost:{}/", named.port());
    let (body, _) = shell(client_a, &curl(&format!("{via_proxy} --proxytunnel"), &named_url)).await;
    assert_eq!(body, "from-named", "CONNECT to a listed name");
    let (body, _) = shell(client_a, &curl(via_proxy, &named_url)).await;
    assert_eq!(body, "from-named", "a plain request to a listed name");
    // B's allowlist does not have that name: its proxy refuses it, and A's destinations.
    let (body, _) = shell(client_b, &curl(&format!("{via_proxy} --proxytunnel"), &named_url)).await;
    assert!(
        body.contains("403"),
        "B's proxy let a CONNECT to A's name through: {body}"
    );
    let (body, _) = shell(
        client_b,
        &curl(
            &format!("{via_proxy} -w %{{http_code}}"),
            &format!("http://{a_service}/"),
        ),
    )
    .await;
    assert!(
        body.ends_with("403"),
        "B's proxy let a request to A's service through: {body}"
    );
    let (body, _) = shell(
        client_a,
        &curl(
            &format!("{via_proxy} --proxytunnel"),
            &format!("http://{b_service}/"),
        ),
    )
    .await;
    assert!(
        body.contains("403"),
        "A's proxy let a CONNECT to B's service through: {body}"
    );

    // Every refusal is logged with the session's id and the destination.
    let text = log.text();
    for (id, destination) in [
        (b.id(), format!("localhost:{}", named.port())),
        (b.id(), a_service.to_string()),
        (a.id(), b_service.to_string()),
    ] {
        assert!(
            text.lines().any(|line| line.contains("egress refused")
                && line.contains(&format!("session={id}"))
                && line.contains(&format!("destination={destination}"))),
            "no refusal of {destination} logged for {id}:\n{text}"
        );
    }

    for (runtime, identity) in [(&runtime_a, &a), (&runtime_b, &b)] {
        runtime
            .close(&identity.id(), CloseReason::Ended)
            .await
            .expect("close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlist_needs_a_sandbox_with_namespaces_and_egress_alone_selects_it() {
    common::use_built_egress_forwarder();
    common::use_built_landlock_helper();
    let root = tempfile::tempdir().expect("root");
    let egress = targets(&["127.0.0.1:8080".to_owned()]);
    for (mode, why) in [
        (SandboxMode::None, "needs a sandbox"),
        (SandboxMode::Landlock, "needs bubblewrap"),
    ] {
        let built = common::builder(root.path(), "egress", mode)
            .network(NetworkMode::Allowlist)
            .egress(egress.clone())
            .build();
        match built {
            Err(Error::InvalidConfig { key, reason }) if key == "session_runtime.local.sandbox" => {
                // Landlock itself does not work here: refused before the network is looked at.
                assert_eq!(mode, SandboxMode::Landlock, "{reason}");
            }
            Err(Error::InvalidConfig { key, reason }) => {
                assert_eq!(key, "session_runtime.local.network", "{mode}: {reason}");
                assert!(reason.contains(why), "{mode}: {reason}");
            }
            other => panic!("{mode}: allowlist accepted: {other:?}"),
        }
    }
    // A list with another mode chosen is a mistake, not ignored.
    match common::builder(root.path(), "egress", SandboxMode::Bubblewrap)
        .network(NetworkMode::Host)
        .egress(egress.clone())
        .build()
    {
        Err(Error::InvalidConfig { key, .. }) => assert_eq!(key, "session_runtime.local.egress"),
        other => panic!("egress with network = \"host\" accepted: {other:?}"),
    }
    // Without a network mode, a list is the one setting that selects the allowlist: the agent
    // is given its proxy.
    common::use_built_egress_forwarder();
    let Some(runtime) = common::build_if_supported(
        common::builder(root.path(), "egress", SandboxMode::Bubblewrap).egress(egress),
        SandboxMode::Bubblewrap,
    ) else {
        return;
    };
    let identity = SessionIdentity::new("egress", "agent", "discord", "only-egress").expect("identity");
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let client = AcpClient::new(runtime.attach(&identity.id()).await.expect("attach"));
    client.initialize().await.expect("initialize");
    let proxy = shell(&client, "printenv HTTPS_PROXY").await;
    drop(client);
    runtime
        .close(&identity.id(), CloseReason::Ended)
        .await
        .expect("close");
    assert_eq!(proxy, ("http://127.0.0.1:3128".to_owned(), Some(0)));
}
