//! The Kubernetes session runtime: one worker Pod and one volume per session.
//!
//! Each session has an anchor, the custom resource `OabSession` `oab-s-<session id>` (its
//! authoritative record: generation, state, close reason and retention intent, the UIDs of what
//! it made; see [`anchor`]), one worker Pod
//! `oab-w-<session id>` owned by the anchor and running the worker relay as its entrypoint, and a
//! PersistentVolumeClaim `oab-d-<session id>-<incarnation>` for its workspace and HOME that no
//! cascade deletes. The broker reaches the relay over the Pod IP or through `pods/exec`;
//! everything security-sensitive comes from a cluster-owned profile (an `OabProfile`, see
//! [`profile`]) that chat messages cannot select or alter.
//!
//! ```no_run
//! # async fn demo() -> session_runtime::Result<()> {
//! use session_runtime::config::KubernetesConfig;
//! let client = kube::Client::try_default().await.map_err(|e| session_runtime::Error::backend("kubernetes", true, "no client", e))?;
//! let runtime = runtime_kubernetes::KubernetesRuntime::builder(
//!     client,
//!     KubernetesConfig::new("openab-sessions", "isolated-worker"),
//! )
//! .installation("prod-bot")
//! .build()?;
//! # let _ = runtime; Ok(()) }
//! ```

mod abandon;
pub mod anchor;
mod api;
mod clone_source;
pub mod controller;
mod events;
pub mod leader;
mod loss;
mod metered;
mod names;
mod network;
mod pod;
mod pool;
pub mod profile;
mod profile_watch;
mod reach;
mod recall;
mod reconcile;
mod record;
mod runtime;
mod seed;
mod start;
mod storage_loss;
#[cfg(feature = "testing")]
mod testing;
mod workload_identity;

pub use anchor::{OabSession, OabSessionSpec, OabSessionStatus, SessionCondition, CLOSE_FINALIZER};
pub use controller::{Controller, ControllerEvent};
/// The kube-rs version this crate speaks, for building a [`kube::Client`] to hand it.
pub use kube;
pub use leader::{LeaderElection, Term};
pub use metered::metered_client;
pub use runtime::{KubernetesRuntime, KubernetesRuntimeBuilder};

/// The name this runtime reports in errors and logs.
pub const RUNTIME: &str = "kubernetes";
