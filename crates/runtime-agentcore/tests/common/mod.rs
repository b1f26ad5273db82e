//! Test support: an AgentCore emulator whose workers are `oab-relay serve --agentcore --
//! acp-test-agent` under the local sandbox, and an [`AgentCoreRuntime`] pointed at it with the
//! emulator's static credentials.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use agentcore_emulator::{
    Emulator, EmulatorBuilder, IamPolicy, LocalLauncher, Operation, StorageEnforcement, TestCredentials,
    WorkerCommand, DEFAULT_RUNTIME_ID,
};
use aws_credential_types::provider::SharedCredentialsProvider;
use aws_credential_types::Credentials;
use runtime_agentcore::{AgentCoreRuntime, AgentCoreRuntimeBuilder};
use session_runtime::config::AgentCoreConfig;
use session_runtime::{CreateOptions, SessionId, SessionIdentity, SessionRuntime};
use worker_relay::BrokerKey;

/// How long any single step may take before a test calls it hung.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The installation every test's identities name.
pub const INSTALLATION: &str = "agentcore-tests";

/// An emulator, a runtime pointed at it, and the directory both keep their state in.
pub struct Harness {
    pub emulator: Emulator,
    pub runtime: Arc<AgentCoreRuntime>,
    pub config: AgentCoreConfig,
    pub key: BrokerKey,
    pub dir: tempfile::TempDir,
}

/// What a test may change before the harness starts.
pub struct Setup {
    pub emulator: EmulatorBuilder,
    /// The worker: `oab-relay serve --agentcore -- acp-test-agent` (add inputs here).
    pub worker: WorkerCommand,
    pub config: AgentCoreConfig,
    pub runtime: Box<dyn FnOnce(AgentCoreRuntimeBuilder) -> AgentCoreRuntimeBuilder + Send>,
}

/// Starts a harness with session storage on (the emulator keeps it across stops).
pub async fn start() -> Harness {
    start_with(|setup| setup).await
}

/// Logs to stderr when `AGENTCORE_TEST_LOG` is set (e.g. `debug`).
pub fn init_tracing() {
    if let Ok(filter) = std::env::var("AGENTCORE_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
}

/// Starts a harness after `tweak` changed the setup.
pub async fn start_with(tweak: impl FnOnce(Setup) -> Setup + Send) -> Harness {
    init_tracing();
    let dir = tempfile::tempdir().expect("a state directory");
    let (relay, agent) = relay_and_agent();
    let worker = WorkerCommand::relay(
        &relay,
        [
            agent.to_string_lossy().into_owned(),
            "--exec-dir".into(),
            ".".into(),
            "--state-dir".into(),
            ".acp-test-agent".into(),
        ],
    )
    .env(
        "OAB_RELAY_LOG",
        std::env::var("OAB_RELAY_LOG").unwrap_or_else(|_| "info".into()),
    );
    let mut config =
        AgentCoreConfig::new("arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/placeholder");
    config.state_dir = dir.path().join("broker");
    config.session_storage = true;
    config.start_timeout = Duration::from_secs(30);
    // The broker's credentials get exactly the policy the operator guide tells operators to
    // attach (its example runtime replaced by the emulator's), and the front forwards every
    // invocation chunked: a container must read both framings. A stopped microVM terminates
    // for a second (AgentCore: up to 15 s), so resumes meet 409 conflicts.
    let emulator = Emulator::builder()
        .credentials(TestCredentials::default().with_policy(documented_policy()))
        .chunk_invocation_bodies(true)
        .stop_latency(Duration::from_secs(1));
    let setup = tweak(Setup {
        emulator,
        worker,
        config,
        runtime: Box::new(|builder| builder),
    });
    // A worker that silently ran unsandboxed would make the isolation suite prove nothing.
    let launcher = LocalLauncher::builder(setup.worker)
        .require_sandbox(true)
        .storage_rules_helper(storage_rules())
        .build()
        .expect("the emulator's workers need a working sandbox: install bubblewrap");
    // So would a session storage without AgentCore's limits make the suites prove less.
    assert_eq!(
        launcher.storage_enforcement(),
        StorageEnforcement {
            size_cap: true,
            absent_during_startup: true,
            refuse_special_files: true,
        },
        "the emulator enforces session storage limits as root, with mount and mkfs.ext4"
    );
    let emulator = setup
        .emulator
        .launcher(launcher)
        .start()
        .await
        .expect("the emulator starts");
    let mut config = setup.config;
    config.runtime_arn = emulator.runtime_arn().to_string();
    config.endpoint_url = Some(emulator.endpoint_url());
    let key = BrokerKey::new(b"runtime-agentcore tests' key, 32b".to_vec());
    let creds = emulator.credentials();
    let credentials = Credentials::new(
        creds.access_key_id(),
        creds.secret_access_key(),
        creds.session_token().map(str::to_owned),
        None,
        "agentcore-tests",
    );
    let builder = AgentCoreRuntime::builder(config.clone())
        .installation(INSTALLATION)
        .broker_key(key.clone())
        .credentials(SharedCredentialsProvider::new(credentials));
    let runtime = (setup.runtime)(builder).build().expect("the runtime builds");
    Harness {
        emulator,
        runtime: Arc::new(runtime),
        config,
        key,
        dir,
    }
}

/// The example runtime the operator guide's policy names.
const DOCUMENTED_RUNTIME_ID: &str = "my_agent-AbCdEf1234";

/// The IAM policy in `docs/agentcore.md` ("Permissions"), for the emulator's default runtime.
pub fn documented_policy() -> IamPolicy {
    let guide = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/agentcore.md");
    let text = std::fs::read_to_string(&guide).expect("docs/agentcore.md");
    let section = text
        .split("\n## Permissions\n")
        .nth(1)
        .expect("a Permissions section in docs/agentcore.md");
    let json = section
        .split("```json\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("a json block in the Permissions section");
    assert!(
        json.contains(DOCUMENTED_RUNTIME_ID),
        "the documented policy names the example runtime {DOCUMENTED_RUNTIME_ID}"
    );
    IamPolicy::from_json(&json.replace(DOCUMENTED_RUNTIME_ID, DEFAULT_RUNTIME_ID))
        .expect("the documented policy parses")
}

impl Harness {
    /// The runtime session id of `id`'s `incarnation`, as the emulator sees it.
    pub fn runtime_session(&self, id: &SessionId, incarnation: u64) -> String {
        self.runtime.runtime_session_id(id, incarnation)
    }
}

/// A fresh identity per call.
pub fn identity(name: &str) -> SessionIdentity {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    SessionIdentity::new(
        INSTALLATION,
        "agent",
        "test",
        format!("{name}-{}-{n}", std::process::id()),
    )
    .expect("a valid identity")
}

/// Runs `f` with the standard patience.
pub async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {PATIENCE:?}"))
}

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary in <target>/<profile>/deps")
        .to_path_buf()
}

/// `oab-relay` and `acp-test-agent` of this workspace, built first (cargo brings them up to date).
pub fn relay_and_agent() -> (PathBuf, PathBuf) {
    static PATHS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    PATHS
        .get_or_init(|| {
            let profile = profile_dir();
            let target = profile.parent().expect("target dir").to_path_buf();
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut build = Command::new(cargo);
            build
                .args(["build", "--quiet", "-p", "worker-relay", "--bin", "oab-relay"])
                .args(["-p", "acp-test-agent", "--bin", "acp-test-agent"])
                .args([
                    "-p",
                    "agentcore-emulator",
                    "--bin",
                    "oab-storage-rules",
                    "--target-dir",
                ])
                .arg(&target);
            if profile.file_name().is_some_and(|name| name == "release") {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo build");
            assert!(
                status.success(),
                "building oab-relay, acp-test-agent and oab-storage-rules failed"
            );
            (
                outside_tmp(&profile.join("oab-relay")),
                outside_tmp(&profile.join("acp-test-agent")),
            )
        })
        .clone()
}

/// `oab-storage-rules` of this workspace (built with the relay), which puts the session
/// storage's refusals in front of every emulated worker.
pub fn storage_rules() -> PathBuf {
    relay_and_agent();
    outside_tmp(&profile_dir().join("oab-storage-rules"))
}

/// `binary`, or a copy of it under `/var/tmp` when it lies under `/tmp` (the target directory of a
/// checkout there): a sandboxed worker has a `/tmp` of its own and could not see it.
fn outside_tmp(binary: &Path) -> PathBuf {
    if !binary.starts_with("/tmp") {
        return binary.to_owned();
    }
    let meta = std::fs::metadata(binary).expect("the built binary");
    let stamp = meta
        .modified()
        .ok()
        .and_then(|m| m.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let dir = PathBuf::from(format!("/var/tmp/oab-agentcore-tests/{stamp}-{}", meta.len()));
    let copy = dir.join(binary.file_name().expect("a file name"));
    if copy.exists() {
        return copy;
    }
    std::fs::create_dir_all(&dir).expect("a directory under /var/tmp");
    // Copied beside, then renamed: test processes running at once never see half a binary.
    let partial = dir.join(format!(
        ".{}-{}",
        std::process::id(),
        binary.display().to_string().len()
    ));
    std::fs::copy(binary, &partial).expect("copy the binary");
    std::fs::rename(&partial, &copy).expect("rename the copy");
    copy
}

/// Creates the session of thread `name`; its id.
pub async fn created(harness: &Harness, name: &str) -> SessionId {
    let identity = identity(name);
    within("create", harness.runtime.create(&identity, &CreateOptions::new()))
        .await
        .expect("create")
        .id
}

/// The HTTP statuses of the emulator's answers to `operation`, in order.
pub fn attempts(harness: &Harness, operation: Operation) -> Vec<u16> {
    harness
        .emulator
        .requests()
        .iter()
        .filter(|r| r.operation == Some(operation))
        .map(|r| r.status)
        .collect()
}
