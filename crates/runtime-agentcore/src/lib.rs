//! The AWS Bedrock AgentCore session runtime (work in progress).
//!
//! Each session runs in its own AgentCore Runtime microVM, addressed by a `runtimeSessionId`
//! derived from the session id and generation, and reached through the worker relay over a
//! SigV4-signed WebSocket. Close stops the runtime session and bumps the generation so a later
//! session never remounts old session storage.
//!
//! This crate currently only names the backend; the runtime itself is being built (see the
//! project's issue list). [`RUNTIME`] is the name it will report.

/// The name this runtime reports in errors and logs.
pub const RUNTIME: &str = "agentcore";
