//! Agents that fail: a missing program, in every sandbox mode.
//!
//! - [`a_missing_agent_fails_attach_with_enoent_in_every_mode`]: an agent program that does not
//!   exist (by path, or by name on `PATH`) fails `attach` with `WorkerFailed` / `Spawn` saying
//!   `ENOENT`, the same in plain, bubblewrap and Landlock modes (where the failed exec would
//!   otherwise happen inside the sandbox, after the worker started, and Landlock would turn the
//!   search of `PATH` into `EACCES`), and the session is left as it was.

mod common;

use session_runtime::config::SandboxMode;
use session_runtime::{
    AgentCommand, CreateOptions, Error, SessionIdentity, SessionRuntime, SessionState, WorkerFailure,
};

/// Names the Landlock helper that Cargo built for these tests, unless the runtime finds it
/// beside the test binary's directory by itself.
fn use_built_landlock_helper() {
    let helper = std::path::Path::new(env!("CARGO_BIN_EXE_oab-landlock-exec"));
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("oab-landlock-exec")));
    if beside.as_deref() != Some(helper) {
        std::env::set_var("OAB_LANDLOCK_EXEC", helper);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_agent_fails_attach_with_enoent_in_every_mode() {
    use_built_landlock_helper();
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        for program in ["no-such-agent-anywhere", "/no/such/dir/agent"] {
            let root = tempfile::tempdir().expect("root");
            let builder = runtime_local::LocalRuntime::builder(AgentCommand::new(program))
                .root(root.path())
                .installation("missing")
                .sandbox(mode);
            let Some(runtime) = common::build_if_supported(builder, mode) else {
                continue;
            };
            let identity = SessionIdentity::new("missing", "agent", "discord", program).expect("identity");
            let id = identity.id();
            runtime
                .create(&identity, &CreateOptions::new())
                .await
                .expect("create");
            match runtime.attach(&id).await {
                Err(Error::WorkerFailed {
                    cause: WorkerFailure::Spawn(why),
                    ..
                }) => assert!(
                    why.contains("No such file or directory"),
                    "{mode}, {program}: {why}"
                ),
                Err(other) => panic!("{mode}, {program}: not a spawn failure: {other}"),
                Ok(_) => panic!("{mode}, {program}: a missing agent attached"),
            }
            let status = runtime.status(&id).await.expect("status");
            assert_eq!(status.state, SessionState::Created, "{mode}, {program}");
            assert!(status.worker.is_none(), "{mode}, {program}: {status:?}");
        }
    }
}
