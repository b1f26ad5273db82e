//! A real third-party ACP agent through the local runtime, in plain mode and in bubblewrap mode:
//! the example echo agent shipped in the source distribution of the Python ACP SDK
//! (`agent-client-protocol` on PyPI). Each test runs `initialize`, `session/new` in the
//! attachment's working directory and one prompt turn, and expects the prompt echoed back and the
//! turn ended with `end_turn`.
//!
//! The agent is not vendored: `tests/fixtures/python-acp-echo-agent.sh` fetches the pinned sdist
//! (SHA-256 checked) and installs the SDK into `<target dir>/python-acp-echo-agent`, once; it is
//! run from here (a no-op when that directory is up to date) and from `scripts/test`. It needs
//! Python >= 3.10 with pip (`PYTHON` selects the interpreter) and, the first time, access to PyPI;
//! without them these tests fail and say what to install.
//!
//! In bubblewrap mode the sandbox shows only the system directories, so the fixture directory is
//! mounted read-only at [`SANDBOX_AGENT_DIR`], and the interpreter's installation prefix at its own
//! path when it lies outside the system directories (e.g. pyenv under `/root/.pyenv`: the
//! interpreter finds `libpython` there by absolute path).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use runtime_local::LocalRuntime;
use session_runtime::config::{ReadonlyMount, SandboxMode};
use session_runtime::testing::AcpClient;
use session_runtime::{
    AgentCommand, CloseReason, CreateOptions, IsolationLevel, SessionIdentity, SessionRuntime,
};

/// The fixture script.
const FIXTURE_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/python-acp-echo-agent.sh"
);
/// Where the fixture directory is mounted inside a bubblewrap sandbox.
const SANDBOX_AGENT_DIR: &str = "/opt/python-acp-echo-agent";
/// The directories a bubblewrap sandbox shows read-only from the host (runtime-local's system
/// paths): an interpreter installed under one of them needs no mount.
const SYSTEM_DIRS: [&str; 8] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
];
const INSTALLATION: &str = "third-party";

/// The prepared echo agent.
#[derive(Debug)]
struct EchoAgent {
    /// The fixture directory on the host.
    dir: PathBuf,
    /// The interpreter's real path.
    interpreter: String,
    /// Its installation prefix.
    prefix: PathBuf,
}

/// The target directory this test binary was built into (`<target>/<profile>/deps/<binary>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.ancestors()
        .nth(3)
        .expect("the test binary lives in <target>/<profile>/deps")
        .to_path_buf()
}

/// Runs the fixture script once per test binary and reads what it prepared.
fn echo_agent() -> &'static EchoAgent {
    static AGENT: OnceLock<Result<EchoAgent, String>> = OnceLock::new();
    let prepared = AGENT.get_or_init(|| {
        let dir = target_dir().join("python-acp-echo-agent");
        let output = Command::new("bash")
            .arg(FIXTURE_SCRIPT)
            .arg(&dir)
            .output()
            .map_err(|e| format!("cannot run bash {FIXTURE_SCRIPT}: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "{FIXTURE_SCRIPT} {} failed ({}):\n{}",
                dir.display(),
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .map(|text| text.trim_end_matches('\n').to_owned())
                .map_err(|e| format!("reading {name} of the prepared agent in {}: {e}", dir.display()))
        };
        Ok(EchoAgent {
            interpreter: read("interpreter")?,
            prefix: read("prefix")?.into(),
            dir,
        })
    });
    match prepared {
        Ok(agent) => agent,
        Err(message) => panic!(
            "the Python ACP SDK's echo agent could not be prepared; this test needs Python >= 3.10 \
             with pip and, the first time, network access to PyPI:\n{message}"
        ),
    }
}

impl EchoAgent {
    /// The agent command and the read-only inputs a runtime in `sandbox` mode needs to run it.
    fn launch(&self, sandbox: SandboxMode) -> (AgentCommand, Vec<ReadonlyMount>) {
        let (agent_dir, mounts) = match sandbox {
            SandboxMode::None => (self.dir.clone(), Vec::new()),
            _ => {
                let mut mounts =
                    vec![ReadonlyMount::new(&self.dir, SANDBOX_AGENT_DIR).expect("a valid agent mount")];
                if !SYSTEM_DIRS.iter().any(|dir| self.prefix.starts_with(dir)) {
                    mounts
                        .push(ReadonlyMount::new(&self.prefix, &self.prefix).expect("a valid prefix mount"));
                }
                (PathBuf::from(SANDBOX_AGENT_DIR), mounts)
            }
        };
        let path = |name: &str| agent_dir.join(name).display().to_string();
        let command = AgentCommand::new(&self.interpreter)
            .args([path("echo_agent.py")])
            .env("PYTHONPATH", path("site"))
            .env("PYTHONDONTWRITEBYTECODE", "1");
        (command, mounts)
    }
}

/// Runs one session of the echo agent in `sandbox` mode: a prompt turn, then close.
async fn echo_turn(sandbox: SandboxMode, expected_isolation: IsolationLevel) {
    let agent = echo_agent();
    let root = tempfile::tempdir().expect("temporary root");
    let (command, readonly) = agent.launch(sandbox);
    let runtime = LocalRuntime::builder(command)
        .root(root.path())
        .installation(INSTALLATION)
        .sandbox(sandbox)
        .readonly(readonly)
        .build()
        .expect("local runtime");
    assert_eq!(runtime.capabilities().isolation, expected_isolation);

    let identity =
        SessionIdentity::new(INSTALLATION, "python-echo", "test", "thread-1").expect("valid identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let attachment = runtime.attach(&id).await.expect("attach");
    let cwd = attachment.working_dir().to_owned();
    let client = AcpClient::new(attachment);

    let initialized = client.initialize().await.expect("initialize");
    assert_eq!(
        serde_json::to_value(initialized.protocol_version).expect("serializable"),
        serde_json::json!(1),
        "the echo agent answers with the protocol version it was offered"
    );
    let session = client.new_session(&cwd).await.expect("session/new");
    assert!(!session.is_empty(), "session/new returned an empty session id");
    let text = "hello from openab, through the local runtime";
    let outcome = client.prompt(&session, text).await.expect("session/prompt");
    assert_eq!(outcome.stop_reason, "end_turn");
    assert_eq!(outcome.chunks, vec![text.to_owned()], "the prompt echoed back");

    let control = client.control();
    runtime.close(&id, CloseReason::Ended).await.expect("close");
    assert!(!control.is_alive(), "close stopped the agent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_echo_agent_in_plain_mode() {
    echo_turn(SandboxMode::None, IsolationLevel::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_echo_agent_in_bubblewrap_mode() {
    echo_turn(SandboxMode::Bubblewrap, IsolationLevel::Namespaces).await;
}

/// The fixture is what the tests claim: the example of the SDK's sdist, world-readable.
#[test]
fn the_fixture_is_the_sdk_example() {
    let agent = echo_agent();
    let source = std::fs::read_to_string(agent.dir.join("echo_agent.py")).expect("echo_agent.py");
    assert!(
        source.contains("class EchoAgent(Agent)"),
        "not the SDK's echo agent"
    );
    assert!(Path::new(&agent.interpreter).is_absolute());
    use std::os::unix::fs::PermissionsExt;
    for file in ["echo_agent.py", "site/acp/__init__.py"] {
        let mode = std::fs::metadata(agent.dir.join(file))
            .expect("fixture file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o004, 0o004, "{file} is not world-readable");
    }
}
