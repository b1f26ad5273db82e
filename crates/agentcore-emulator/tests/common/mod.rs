//! Shared test support: the test worker binary, emulators on it, SDK clients, signed requests.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use agentcore_emulator::{
    Emulator, EmulatorBuilder, LocalLauncher, SandboxMode, TestCredentials, WorkerCommand,
};
use aws_sdk_bedrockagentcore::config::retry::RetryConfig;
use aws_sdk_bedrockagentcore::config::{BehaviorVersion, Credentials, Region, StalledStreamProtectionConfig};
use aws_sdk_bedrockagentcore::primitives::Blob;
use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SignatureLocation, SigningSettings};
use aws_sigv4::sign::v4;

/// How long any single step may take before a test calls it hung.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A runtime session id unique to this test run (41+ characters).
pub fn session_id(name: &str) -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(
        "emu-{name}-{}-{n}-0000000000000000000000000000",
        std::process::id()
    )
}

/// The target directory's profile directory (`target/debug`) of this test binary.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary in <target>/<profile>/deps")
        .to_path_buf()
}

/// Builds (if needed) and locates a binary with `cargo build <args>`.
fn built(path: PathBuf, args: &[&str], sources: &[&str]) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let newest = sources
        .iter()
        .filter_map(|dir| newest_mtime(&manifest.join(dir)))
        .max();
    if let (Ok(built), Some(newest)) = (std::fs::metadata(&path).and_then(|m| m.modified()), newest) {
        if built >= newest {
            return path;
        }
    }
    let profile = profile_dir();
    let target = profile.parent().expect("target dir").to_path_buf();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    build
        .arg("build")
        .arg("--quiet")
        .args(args)
        .arg("--target-dir")
        .arg(&target);
    if profile.file_name().is_some_and(|name| name == "release") {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo build");
    assert!(status.success(), "cargo build {args:?} failed");
    assert!(path.exists(), "{} missing after the build", path.display());
    path
}

fn newest_mtime(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).ok()?.flatten() {
            let meta = entry.metadata().ok()?;
            if meta.is_dir() {
                pending.push(entry.path());
            } else if let Ok(modified) = meta.modified() {
                newest = newest.max(Some(modified));
            }
        }
    }
    newest
}

/// This crate's example worker (`examples/test_worker.rs`). `cargo test -p agentcore-emulator`
/// builds it with the tests; only when it is missing (a run filtered with `--test`) is it built
/// here. It is not rebuilt when merely older than its source: a nested cargo waiting for the
/// outer one's lock on the target directory would hang the test.
pub fn test_worker() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let path = profile_dir().join("examples/test_worker");
        if path.exists() {
            return path;
        }
        built(
            path,
            &["-p", "agentcore-emulator", "--example", "test_worker"],
            &["examples"],
        )
    })
    .clone()
}

/// `oab-relay` and `acp-test-agent` from this target directory. They are not built here (a
/// nested cargo would wait for the outer one's lock): build them first with
/// `cargo build -p worker-relay --bin oab-relay -p acp-test-agent`.
pub fn relay_and_agent() -> (PathBuf, PathBuf) {
    let profile = profile_dir();
    let (relay, agent) = (profile.join("oab-relay"), profile.join("acp-test-agent"));
    for path in [&relay, &agent] {
        assert!(
            path.exists(),
            "{} is missing: run `cargo build -p worker-relay --bin oab-relay -p acp-test-agent` first",
            path.display()
        );
    }
    (relay, agent)
}

/// A launcher running the test worker, sandboxed as `mode`, with storage under `root`.
pub fn worker_launcher(root: &Path, mode: SandboxMode) -> LocalLauncher {
    LocalLauncher::builder(WorkerCommand::new(test_worker()))
        .root(root)
        .sandbox(mode)
        .storage_rules_helper(env!("CARGO_BIN_EXE_oab-storage-rules"))
        .build()
        .expect("launcher")
}

/// A builder whose workers are the test worker in the best sandbox available, storage in `root`.
/// A stopped session terminates at once (tests of the termination window set their own).
pub fn emulator_on(root: &Path) -> EmulatorBuilder {
    Emulator::builder()
        .launcher(worker_launcher(root, SandboxMode::Auto))
        .stop_latency(Duration::ZERO)
}

/// Starts an emulator with defaults on the test worker; the temp dir holds its storage.
pub async fn emulator() -> (Emulator, tempfile::TempDir) {
    let root = tempfile::tempdir().expect("root");
    let emulator = emulator_on(root.path()).start().await.expect("emulator starts");
    (emulator, root)
}

/// An SDK client for `emulator` with `credentials`; retries and stall protection off unless asked.
pub fn client_with(
    emulator: &Emulator,
    credentials: &TestCredentials,
    retries: u32,
) -> aws_sdk_bedrockagentcore::Client {
    let retry = if retries <= 1 {
        RetryConfig::disabled()
    } else {
        RetryConfig::standard()
            .with_max_attempts(retries)
            .with_initial_backoff(Duration::from_millis(10))
    };
    let config = aws_sdk_bedrockagentcore::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(emulator.region().to_owned()))
        .credentials_provider(Credentials::new(
            credentials.access_key_id(),
            credentials.secret_access_key(),
            credentials.session_token().map(str::to_owned),
            None,
            "test",
        ))
        .endpoint_url(emulator.endpoint_url())
        .retry_config(retry)
        .stalled_stream_protection(StalledStreamProtectionConfig::disabled())
        .build();
    aws_sdk_bedrockagentcore::Client::from_conf(config)
}

/// An SDK client with the emulator's own credentials and no retries.
pub fn client(emulator: &Emulator) -> aws_sdk_bedrockagentcore::Client {
    client_with(emulator, emulator.credentials(), 1)
}

/// Invokes `session` with a JSON `payload` and collects the whole answer.
pub async fn invoke(
    client: &aws_sdk_bedrockagentcore::Client,
    emulator: &Emulator,
    session: &str,
    payload: serde_json::Value,
) -> Result<(String, Vec<u8>), String> {
    let out = client
        .invoke_agent_runtime()
        .agent_runtime_arn(emulator.runtime_arn().to_string())
        .qualifier("DEFAULT")
        .runtime_session_id(session)
        .content_type("application/json")
        .payload(Blob::new(payload.to_string()))
        .send()
        .await
        .map_err(|e| format!("{}", aws_sdk_bedrockagentcore::error::DisplayErrorContext(&e)))?;
    let content_type = out.content_type.clone();
    let body = out
        .response
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .into_bytes()
        .to_vec();
    Ok((content_type, body))
}

/// The JSON answer of an invocation.
pub async fn invoke_json(
    client: &aws_sdk_bedrockagentcore::Client,
    emulator: &Emulator,
    session: &str,
    payload: serde_json::Value,
) -> serde_json::Value {
    let (_, body) = invoke(client, emulator, session, payload)
        .await
        .expect("invocation succeeds");
    serde_json::from_slice(&body).expect("a JSON answer")
}

/// `ws://127.0.0.1:PORT/runtimes/<encoded arn>/ws?qualifier=DEFAULT` pieces: (authority, path and query).
pub fn ws_target(emulator: &Emulator) -> (String, String) {
    let arn = emulator
        .runtime_arn()
        .to_string()
        .replace(':', "%3A")
        .replace('/', "%2F");
    (emulator.local_addr().to_string(), format!("/runtimes/{arn}/ws"))
}

/// Signs a GET of `path_and_query` on `host` with `credentials` at `time`, in headers or as a
/// presigned query; returns (path and query to request, extra headers to send).
pub fn sign_get(
    host: &str,
    path_and_query: &str,
    headers: &[(&str, &str)],
    credentials: &TestCredentials,
    region: &str,
    time: SystemTime,
    presign: bool,
) -> (String, Vec<(String, String)>) {
    sign_raw(
        "GET",
        host,
        path_and_query,
        headers,
        b"",
        credentials,
        region,
        time,
        presign,
    )
}

/// Signs any request the way the SDK does; returns (path and query, headers to send).
#[allow(clippy::too_many_arguments)]
pub fn sign_raw(
    method: &str,
    host: &str,
    path_and_query: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    credentials: &TestCredentials,
    region: &str,
    time: SystemTime,
    presign: bool,
) -> (String, Vec<(String, String)>) {
    let identity = credentials.to_aws().into();
    let mut settings = SigningSettings::default();
    if presign {
        settings.signature_location = SignatureLocation::QueryParams;
        settings.expires_in = Some(Duration::from_secs(300));
    }
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("bedrock-agentcore")
        .time(time)
        .settings(settings)
        .build()
        .expect("signing params")
        .into();
    let uri = format!("http://{host}{path_and_query}");
    let mut all: Vec<(&str, &str)> = vec![("host", host)];
    all.extend_from_slice(headers);
    let signable = SignableRequest::new(method, uri.as_str(), all.into_iter(), SignableBody::Bytes(body))
        .expect("signable");
    let (instructions, _) = sign(signable, &params).expect("sign").into_parts();
    let mut request = http::Request::builder().uri(&uri).body(()).expect("request");
    for (name, value) in headers {
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
            http::HeaderValue::from_str(value).expect("value"),
        );
    }
    instructions.apply_to_request_http1x(&mut request);
    let target = request
        .uri()
        .path_and_query()
        .map(|pq| pq.as_str().to_owned())
        .unwrap_or_default();
    let extra = request
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().expect("ascii").to_owned()))
        .collect();
    (target, extra)
}

/// Sends one raw request on `stream` (a head from `target` and `headers`, then `body`).
pub async fn send_raw(
    stream: &mut tokio::net::TcpStream,
    method: &str,
    target: &str,
    headers: &[(String, String)],
    body: &[u8],
) {
    use tokio::io::AsyncWriteExt;
    let mut head = format!("{method} {target} HTTP/1.1\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.expect("write head");
    stream.write_all(body).await.expect("write body");
}

/// Reads from `stream` until `done` says the bytes so far are complete (or PATIENCE passes).
pub async fn read_until(
    stream: &mut tokio::net::TcpStream,
    done: impl Fn(&str) -> bool + Send + Sync,
) -> String {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let read = async {
        loop {
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&chunk[..n]);
            if done(&String::from_utf8_lossy(&seen)) {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(PATIENCE, read).await;
    String::from_utf8_lossy(&seen).into_owned()
}
