//! OpenAB session runtimes: one isolated runtime per chat thread, chosen by configuration.
//!
//! This is the package openab-core depends on. It re-exports the contract from
//! [`session_runtime`] and builds an `Arc<dyn SessionRuntime>` from the `[session_runtime]`
//! section of OpenAB's configuration with [`from_config`].
//!
//! # Feature flags
//!
//! | feature | default | backend |
//! |---|---|---|
//! | `local` | yes | `runtime-shared` (`storage = "shared"`, upstream's behaviour, every platform) and `runtime-local` (`storage = "per-session"`: plain or sandboxed, Linux) |
//! | `kubernetes` | no | `runtime-kubernetes`: one Pod and volume per session |
//! | `agentcore` | no | `runtime-agentcore`: one AgentCore microVM per session |
//!
//! Selecting a backend whose feature is not compiled in is an [`Error::InvalidConfig`] naming the
//! feature, never a silent fallback.
//!
//! # Example
//!
//! ```
//! use openab_runtime::{config::SessionRuntimeConfig, Error};
//!
//! let config = SessionRuntimeConfig::from_toml_document(
//!     r#"
//!     [agent]
//!     command = "claude-agent-acp"
//!
//!     [session_runtime]
//!     type = "agentcore"
//!     [session_runtime.agentcore]
//!     runtime_arn = "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/example"
//!     "#,
//! )?;
//! # #[cfg(not(feature = "agentcore"))]
//! match openab_runtime::from_config(&config, &openab_runtime::AgentCommand::new("claude-agent-acp")) {
//!     Err(Error::InvalidConfig { key, reason }) => {
//!         assert_eq!(key, "session_runtime.type");
//!         assert!(reason.contains("`agentcore`"));
//!     }
//!     other => panic!("{other:?}"),
//! }
//! # Ok::<(), Error>(())
//! ```

use std::sync::Arc;

pub mod compat;
#[cfg(feature = "local")]
mod linux;

/// The adoption guide, `docs/openab-core.md`: its Rust blocks are compiled (and run) as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/openab-core.md")]
mod openab_core_guide {}

pub use session_runtime::*;

#[cfg(all(feature = "local", target_os = "linux"))]
pub use runtime_local::{LocalRuntime, LocalRuntimeBuilder};

#[cfg(feature = "kubernetes")]
pub use runtime_kubernetes::{KubernetesRuntime, KubernetesRuntimeBuilder};

#[cfg(feature = "agentcore")]
pub use runtime_agentcore::{AgentCoreRuntime, AgentCoreRuntimeBuilder};

#[cfg(feature = "local")]
pub use runtime_shared::{AgentStderr, SharedRuntime, SharedRuntimeBuilder};

#[cfg(feature = "local")]
use session_runtime::config::StorageMode;
use session_runtime::config::{RuntimeKind, SessionRuntimeConfig};

/// Builds the runtime the `[session_runtime]` section selects, running `agent` in each session.
///
/// `type = "local"` (the default) with `local.storage = "shared"` (the default) is
/// [`SharedRuntime`]: upstream OpenAB's own behaviour, isolating nothing. With
/// `storage = "per-session"` it is `LocalRuntime`.
///
/// The Kubernetes runtime runs its cluster-owned profile's agent instead of `agent`, and finds
/// its API server on first use (`KUBECONFIG`, `~/.kube/config`, or the Pod's service account).
/// The AgentCore runtime runs the agent of its worker image (`deploy/agentcore/`), and takes
/// AWS credentials from the standard provider chain on first use.
///
/// # Errors
/// - [`Error::Unsupported`] for `local.storage = "per-session"` on a platform other than Linux:
///   per-session storage and the sandboxes exist only there.
/// - [`Error::InvalidConfig`] naming `session_runtime.type` if the selected backend's cargo
///   feature is not compiled into this build, or the backend is not available yet in this version.
/// - Whatever the backend's own validation reports, as [`Error::InvalidConfig`] naming the key.
pub fn from_config(config: &SessionRuntimeConfig, agent: &AgentCommand) -> Result<Arc<dyn SessionRuntime>> {
    config.validate()?;
    let kind = config.runtime;
    if !compiled_in(kind) {
        return Err(Error::InvalidConfig {
            key: "session_runtime.type".into(),
            reason: format!(
                "the {kind} runtime is not compiled into this build; enable the `{kind}` cargo feature of openab-runtime"
            ),
        });
    }
    match kind {
        #[cfg(feature = "local")]
        RuntimeKind::Local if config.local.storage == StorageMode::Shared => Ok(Arc::new(
            runtime_shared::SharedRuntimeBuilder::from_config(config, agent.clone()).build()?,
        )),
        #[cfg(feature = "local")]
        RuntimeKind::Local => linux::per_session_runtime(config, agent),
        // The agent a worker runs is the cluster-owned profile's, never the broker's `[agent]`.
        #[cfg(feature = "kubernetes")]
        RuntimeKind::Kubernetes => Ok(Arc::new(
            runtime_kubernetes::KubernetesRuntime::builder_from_config(config)?.build()?,
        )),
        // Likewise: the microVM runs the agent baked into the runtime's image.
        #[cfg(feature = "agentcore")]
        RuntimeKind::Agentcore => Ok(Arc::new(
            runtime_agentcore::AgentCoreRuntime::builder_from_config(config)?.build()?,
        )),
        _ => Err(Error::InvalidConfig {
            key: "session_runtime.type".into(),
            reason: format!(
                "the {kind} runtime is not available yet in openab-runtime {}",
                env!("CARGO_PKG_VERSION")
            ),
        }),
    }
}

/// Whether the backend for `kind` is compiled into this build.
// With every feature on, clippy sees a `matches!`; the arms differ per build.
#[allow(clippy::match_like_matches_macro)]
pub fn compiled_in(kind: RuntimeKind) -> bool {
    match kind {
        RuntimeKind::Local => cfg!(feature = "local"),
        RuntimeKind::Kubernetes => cfg!(feature = "kubernetes"),
        RuntimeKind::Agentcore => cfg!(feature = "agentcore"),
        _ => false,
    }
}
