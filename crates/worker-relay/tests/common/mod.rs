//! Process-level harness: starts `oab-relay serve` binaries and connects clients to them.

#![allow(dead_code, unreachable_pub)]

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use session_runtime::{Attachment, Fence, FenceTrigger, SessionId, SessionIdentity};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use worker_relay::channel::{self, ChannelKey, SecureStream};
use worker_relay::{BrokerKey, ClientConfig, Connector, RelayClient, TcpConnector};

pub mod proxy;
pub mod runtime;

/// The relay binary under test.
pub const RELAY: &str = env!("CARGO_BIN_EXE_oab-relay");

/// How long any single step may take before a test calls it hung.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The broker key every test uses.
pub fn key() -> BrokerKey {
    BrokerKey::new(b"worker-relay-tests-broker-key-32".to_vec())
}

/// A fresh session id per call.
pub fn session(name: &str) -> SessionId {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    SessionIdentity::new(
        "relay-tests",
        "agent",
        "test",
        format!("{name}-{}-{n}", std::process::id()),
    )
    .expect("valid identity")
    .id()
}

/// The ACP test agent binary, built (or brought up to date) on first use.
pub fn acp_test_agent() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        // Test binaries live in <target>/<profile>/deps/.
        let exe = std::env::current_exe().expect("current exe");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test binary in <target>/<profile>/deps")
            .to_path_buf();
        let target_dir = profile_dir.parent().expect("target dir").to_path_buf();
        let path = profile_dir.join("acp-test-agent");
        // `cargo test --workspace` has built it already; rebuild only when its sources are newer.
        let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("../acp-test-agent");
        if let (Ok(built), Some(newest)) = (
            std::fs::metadata(&path).and_then(|m| m.modified()),
            newest_mtime(&sources),
        ) {
            if built >= newest {
                return path;
            }
        }
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut build = std::process::Command::new(cargo);
        build
            .args([
                "build",
                "--quiet",
                "-p",
                "acp-test-agent",
                "--bin",
                "acp-test-agent",
            ])
            .arg("--target-dir")
            .arg(&target_dir);
        if profile_dir.file_name().is_some_and(|name| name == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build for acp-test-agent");
        assert!(status.success(), "building acp-test-agent failed");
        assert!(path.exists(), "{} missing after the build", path.display());
        path
    })
    .clone()
}

/// The newest modification time of the files under `dir`.
fn newest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
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

/// Options of a relay process.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    pub generation: u64,
    pub http: bool,
    pub tcp: bool,
    pub extra: Vec<String>,
    pub workdir: Option<PathBuf>,
    /// Token hash override (default: the hash of `key()`'s token).
    pub token_hash: Option<String>,
    /// AgentCore mode (`--agentcore`): HTTP only, the session comes from each request's header.
    pub agentcore: bool,
    /// No `--listen` and no `--http`: the relay's default listener (port 7780).
    pub default_listener: bool,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            generation: 1,
            http: false,
            tcp: true,
            extra: Vec::new(),
            workdir: None,
            token_hash: None,
            agentcore: false,
            default_listener: false,
        }
    }
}

/// A running `oab-relay serve`.
pub struct RelayProcess {
    pub child: Child,
    pub session: SessionId,
    pub generation: u64,
    pub tcp: Option<SocketAddr>,
    pub http: Option<SocketAddr>,
}

impl RelayProcess {
    /// Starts a relay for `session` running `agent`.
    pub async fn start(session: SessionId, agent: &[OsString], options: RelayOptions) -> Self {
        let mut command = Command::new(RELAY);
        command.arg("serve");
        if options.agentcore {
            command.args(["--http", "127.0.0.1:0", "--agentcore"]);
        } else if !options.default_listener {
            if options.tcp {
                command.args(["--listen", "127.0.0.1:0"]);
            }
            if options.http {
                command.args(["--http", "127.0.0.1:0"]);
            }
        }
        if let Some(workdir) = &options.workdir {
            command.arg("--workdir").arg(workdir);
        }
        command.args(&options.extra).arg("--").args(agent);
        let hash = options
            .token_hash
            .clone()
            .unwrap_or_else(|| key().token(session.as_str(), options.generation).hash().to_hex());
        if !options.agentcore {
            command
                .env("OAB_RELAY_SESSION", session.as_str())
                .env("OAB_RELAY_GENERATION", options.generation.to_string())
                .env("OAB_RELAY_TOKEN_SHA256", hash);
        }
        command
            .env(
                "OAB_RELAY_LOG",
                std::env::var("OAB_RELAY_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("start oab-relay");
        let stdout = child.stdout.take().expect("relay stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut tcp = None;
        let mut http = None;
        let wanted = if options.agentcore || options.default_listener {
            1
        } else {
            usize::from(options.tcp) + usize::from(options.http)
        };
        for _ in 0..wanted {
            let line = tokio::time::timeout(PATIENCE, lines.next_line())
                .await
                .expect("relay announces its listeners")
                .expect("read relay stdout")
                .expect("relay exited before listening");
            let rest = line
                .strip_prefix("oab-relay: listening on ")
                .unwrap_or_else(|| panic!("unexpected relay output {line:?}"));
            let (kind, addr) = rest.split_once(' ').expect("kind and address");
            let addr: SocketAddr = addr.parse().expect("socket address");
            match kind {
                "tcp" => tcp = Some(addr),
                "http" => http = Some(addr),
                other => panic!("unknown listener kind {other}"),
            }
        }
        Self {
            child,
            session,
            generation: options.generation,
            tcp,
            http,
        }
    }

    /// The channel key a broker of `key()` uses for this relay.
    pub fn channel_key(&self) -> ChannelKey {
        ChannelKey::for_token(
            self.session.as_str(),
            &key().token(self.session.as_str(), self.generation),
        )
    }

    /// A TCP connection with the channel open, as a broker's (for raw frames).
    pub async fn open_channel(&self) -> SecureStream<TcpStream> {
        let stream = TcpStream::connect(self.tcp.expect("tcp listener"))
            .await
            .expect("connect");
        tokio::time::timeout(PATIENCE, channel::initiate(stream, &self.channel_key()))
            .await
            .expect("handshake in time")
            .expect("the channel opens")
    }

    /// A connector to the TCP listener.
    pub fn connector(&self) -> Arc<dyn Connector> {
        Arc::new(TcpConnector::new(self.tcp.expect("tcp listener").to_string()))
    }

    /// A client config for this relay with fast timers.
    pub fn config(&self, epoch: u64) -> ClientConfig {
        ClientConfig::with_key(self.session, self.generation, epoch, &key())
            .heartbeat(Duration::from_secs(2))
            .backoff(Duration::from_millis(5), Duration::from_millis(100))
            .give_up_after(Duration::from_secs(5))
    }

    /// Attaches through `connector` with `config`.
    pub async fn attach_with(
        &self,
        config: ClientConfig,
        connector: Arc<dyn Connector>,
    ) -> Result<(Attachment, FenceTrigger), session_runtime::Error> {
        let (fence, trigger) = Fence::new(self.session, self.generation);
        let attachment = tokio::time::timeout(PATIENCE, RelayClient::new(config, connector).attach(fence))
            .await
            .expect("attach finishes")?;
        Ok((attachment, trigger))
    }

    /// Attaches over TCP with epoch 1.
    pub async fn attach(&self) -> Attachment {
        self.attach_with(self.config(1), self.connector())
            .await
            .expect("attach")
            .0
    }

    /// Waits for the relay process to exit and returns its exit code.
    pub async fn exit_code(&mut self) -> Option<i32> {
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("relay exits")
            .expect("wait for relay")
            .code()
    }

    /// Sends a signal to the relay process.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("relay running");
        let status = std::process::Command::new("kill")
            .args(["-s", signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }
}

/// `sh -c <script>` as an agent argv.
pub fn sh(script: &str) -> Vec<OsString> {
    vec!["/bin/sh".into(), "-c".into(), script.into()]
}

/// Logs the client side to stderr when `RELAY_TEST_LOG` is set (e.g. `debug`).
pub fn init_tracing() {
    if let Ok(filter) = std::env::var("RELAY_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
}

/// Runs `f` with the standard patience.
pub async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {PATIENCE:?}"))
}
