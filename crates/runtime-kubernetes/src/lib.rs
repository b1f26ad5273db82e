//! The Kubernetes session runtime (work in progress).
//!
//! Each session gets an anchor Lease `oab-s-<session id>` (its durable record), one worker Pod
//! `oab-w-<session id>` running the worker relay as its entrypoint, and one PersistentVolumeClaim
//! `oab-d-<session id>` for its workspace, HOME and agent state. The broker reaches the relay over
//! the Pod IP or through `pods/exec`; everything security-sensitive comes from a cluster-owned
//! profile that chat messages cannot select or alter.
//!
//! This crate currently only names the backend; the runtime itself is being built (see the
//! project's issue list). [`RUNTIME`] is the name it will report.

/// The name this runtime reports in errors and logs.
pub const RUNTIME: &str = "kubernetes";
