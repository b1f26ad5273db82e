//! The session runtime contract of the OpenAB agent broker.
//!
//! # Overview
//!
//! Every chat thread (a Discord or Slack thread) talking to a coding agent gets its own
//! *session*: an isolated place where that thread's agent (an ACP command-line program) runs, with
//! its own workspace, HOME and agent state. Where that place is (a child process, a sandboxed
//! child process, a Kubernetes Pod, an AgentCore microVM) is a configuration choice behind one
//! lifecycle:
//!
//! ```text
//! create(identity) ─▶ attach ─▶ (suspend ─▶ attach)* ─▶ close(reason)
//!        │              │
//!        │              └─ Attachment: agent stdout / line writer to stdin / control / cwd
//!        └─ SessionId = base32(SHA-256(installation, agent, platform, thread))[..20]
//! ```
//!
//! This crate holds the contract only: [`SessionIdentity`] and [`SessionId`], the
//! [`SessionRuntime`] trait, [`Attachment`], the [`Error`] kinds, a session's own working
//! directory and environment ([`SessionOverlay`]), lifecycle data
//! ([`SessionState`], [`SessionStatus`], [`Capabilities`], ...) and the `[session_runtime]`
//! [`config`]. It depends on no backend.
//!
//! # Backends
//!
//! | crate | isolation | storage |
//! |---|---|---|
//! | `runtime-local` (plain) | none, and says so | directories under a root |
//! | `runtime-local` (sandboxed) | namespaces (bubblewrap) or Landlock | directories under a root |
//! | `runtime-kubernetes` | one Pod per session | one volume per session |
//! | `runtime-agentcore` | one microVM per session | AgentCore session storage |
//!
//! # Feature flags
//!
//! | feature | what it adds |
//! |---|---|
//! | `conformance` | the conformance suite (`conformance`), `testing::FakeRuntime` and the ACP test client |
//!
//! # Pitfalls
//!
//! - Send the attachment's [`working_dir`](Attachment::working_dir) as `cwd` in `session/new`,
//!   never a host path.
//! - Dropping an [`Attachment`] does not stop the worker; `suspend` or `close` does.
//! - Match on [`Error`] variants and [`Error::retryable`], never on messages.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod agent;
mod attachment;
pub mod config;
mod error;
mod identity;
pub mod overlay;
mod retention;
mod runtime;
mod state;
pub mod telemetry;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod testing;

pub use agent::AgentCommand;
pub use attachment::{
    AgentInput, AgentOutput, Attachment, AttachmentParts, ExitCell, Fence, FenceTrigger, WorkerControl,
};
pub use error::{BoxError, Error, Result, WorkerExit, WorkerFailure};
pub use identity::{SessionId, SessionIdentity};
pub use overlay::SessionOverlay;
pub use retention::*;
pub use runtime::{DynSessionRuntime, SessionRuntime};
pub use state::{
    Capabilities, CloseReason, CreateOptions, Generation, IsolationLevel, ReconcileAction, ReconcileReport,
    ResourceUsage, SessionHandle, SessionState, SessionStatus, StartFailure, StorageState, SuspendReason,
    WorkerInfo, WorkspaceSeed,
};
