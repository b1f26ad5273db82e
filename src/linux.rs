//! The one boundary around what only Linux has: per-session storage and the sandboxes
//! (`runtime-local`: bubblewrap, Landlock, cgroups, `/proc`, and rustix's Linux process calls).
//!
//! On every other platform the same function exists and returns [`Error::Unsupported`], so a
//! broker built for macOS or Windows compiles unchanged, runs upstream's behaviour
//! (`storage = "shared"`), and refuses `storage = "per-session"` with an error that says why.

use std::sync::Arc;

#[cfg(not(target_os = "linux"))]
use session_runtime::Error;
use session_runtime::{config::SessionRuntimeConfig, AgentCommand, Result, SessionRuntime};

/// The local runtime with `storage = "per-session"` (plain or sandboxed).
///
/// # Errors
/// As `LocalRuntimeBuilder::build`; elsewhere than Linux, always [`Error::Unsupported`].
#[cfg(target_os = "linux")]
pub(crate) fn per_session_runtime(
    config: &SessionRuntimeConfig,
    agent: &AgentCommand,
) -> Result<Arc<dyn SessionRuntime>> {
    Ok(Arc::new(
        runtime_local::LocalRuntimeBuilder::from_config(config, agent.clone()).build()?,
    ))
}

/// Per-session storage needs Linux: refused here, never approximated.
///
/// # Errors
/// Always [`Error::Unsupported`].
#[cfg(not(target_os = "linux"))]
pub(crate) fn per_session_runtime(
    _config: &SessionRuntimeConfig,
    _agent: &AgentCommand,
) -> Result<Arc<dyn SessionRuntime>> {
    Err(Error::Unsupported {
        operation: "local.storage = \"per-session\" (per-session storage and sandboxes need Linux; \
                    storage = \"shared\" runs here)",
        runtime: "local",
    })
}
