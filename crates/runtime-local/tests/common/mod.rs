//! Helpers shared by the local runtime's integration tests.

#![allow(dead_code, unreachable_pub)]

use std::path::Path;
use std::sync::Arc;

use runtime_local::{LocalRuntime, LocalRuntimeBuilder};
use session_runtime::config::SandboxMode;
use session_runtime::testing::acp_test_agent_binary;
use session_runtime::{AgentCommand, Error};

/// The bundled ACP test agent.
pub fn test_agent() -> AgentCommand {
    AgentCommand::new(
        acp_test_agent_binary()
            .expect("acp-test-agent")
            .display()
            .to_string(),
    )
}

/// A builder for a runtime of `installation` under `root`, running the test agent in `mode`.
pub fn builder(root: &Path, installation: &str, mode: SandboxMode) -> LocalRuntimeBuilder {
    LocalRuntime::builder(test_agent())
        .root(root)
        .installation(installation)
        .sandbox(mode)
}

/// Builds `builder`, configured for sandbox `mode`; `None` when this machine cannot run that
/// sandbox, and only after checking that the refusal is the documented configuration error (the
/// skip is printed). Plain mode must always build.
pub fn build_if_supported(builder: LocalRuntimeBuilder, mode: SandboxMode) -> Option<Arc<LocalRuntime>> {
    match builder.build() {
        Ok(runtime) => Some(Arc::new(runtime)),
        Err(Error::InvalidConfig { key, reason }) if mode != SandboxMode::None => {
            assert_eq!(key, "session_runtime.local.sandbox", "{reason}");
            eprintln!("skipping sandbox {mode}: it does not work on this machine: {reason}");
            None
        }
        Err(error) => panic!("building the {mode} runtime: {error}"),
    }
}

/// Names the Landlock helper that Cargo built for these tests, unless the runtime finds it
/// beside the test binary's directory by itself.
pub fn use_built_landlock_helper() {
    let helper = std::path::Path::new(env!("CARGO_BIN_EXE_oab-landlock-exec"));
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("oab-landlock-exec")));
    if beside.as_deref() != Some(helper) {
        std::env::set_var("OAB_LANDLOCK_EXEC", helper);
    }
}

/// Names the `oab-egress-forward` helper that Cargo built for these tests, unless the runtime
/// finds it beside the test binary's directory by itself.
pub fn use_built_egress_forwarder() {
    let helper = std::path::Path::new(env!("CARGO_BIN_EXE_oab-egress-forward"));
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("oab-egress-forward")));
    if beside.as_deref() != Some(helper) {
        std::env::set_var("OAB_EGRESS_FORWARD", helper);
    }
}
