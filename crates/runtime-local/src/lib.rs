//! The local session runtime (work in progress).
//!
//! Each session's agent runs as a child process of the broker, with its own workspace, HOME and
//! agent state under `root/<session id>/`:
//!
//! - **plain** mode keeps upstream OpenAB's process handling and isolates nothing (and says so in
//!   its capabilities, at startup and in `oab-runtime verify`);
//! - **sandboxed** mode runs the agent under bubblewrap (new mount, pid, ipc and uts namespaces,
//!   read-only system directories, the session's storage at fixed in-sandbox paths), or restricted by
//!   Landlock where bubblewrap is absent.
//!
//! This crate currently only names the backend; the runtime itself is being built (see the
//! project's issue list). [`RUNTIME`] is the name it will report.

/// The name this runtime reports in errors and logs.
pub const RUNTIME: &str = "local";
