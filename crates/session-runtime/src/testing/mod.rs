//! Test support: [`FakeRuntime`], an in-memory runtime that passes the conformance suite, and
//! [`AcpClient`], a small ACP client that drives an agent over an attachment, and
//! [`CapturedLogs`], what a runtime logs.

mod acp_client;
mod fake;
mod logs;

pub use acp_client::{
    AcpClient, ClientError, ExecOutput, PermissionAnswer, PromptOutcome, DEFAULT_REQUEST_TIMEOUT, EXEC_METHOD,
};
pub use fake::{FakeRuntime, FakeRuntimeBuilder, LaunchRequest, WorkerLauncher};
pub use logs::CapturedLogs;

/// The path of the `acp-test-agent` binary of this workspace, building it first if needed.
///
/// For tests of backends that run the agent as a real process. It looks next to the running test
/// executable (`target/<profile>/`), where `cargo test --workspace` puts it, and otherwise runs
/// `cargo build -p acp-test-agent` into the same target directory and profile.
///
/// # Errors
/// If the binary is absent and cannot be built.
pub fn acp_test_agent_binary() -> std::io::Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test binary>
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .ok_or_else(|| std::io::Error::other("the test executable is not inside a cargo target directory"))?;
    let binary = profile_dir.join("acp-test-agent");
    if binary.is_file() {
        return Ok(binary);
    }
    let target_dir = profile_dir
        .parent()
        .ok_or_else(|| std::io::Error::other("the test executable is not inside a cargo target directory"))?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    build.args([
        "build",
        "--quiet",
        "-p",
        "acp-test-agent",
        "--bin",
        "acp-test-agent",
        "--target-dir",
    ]);
    build.arg(target_dir);
    if profile_dir.file_name().is_some_and(|name| name == "release") {
        build.arg("--release");
    }
    let status = build.status()?;
    if status.success() && binary.is_file() {
        Ok(binary)
    } else {
        Err(std::io::Error::other(format!(
            "building acp-test-agent failed ({status})"
        )))
    }
}
