//! The AWS Bedrock AgentCore session runtime: one AgentCore Runtime microVM per session, reached
//! through the worker relay over a SigV4-signed WebSocket.
//!
//! See [`AgentCoreRuntime`] for how the lifecycle maps onto AgentCore, `docs/agentcore.md` for
//! the IAM permissions, what AgentCore isolates and what it does not, and the worker image
//! (`deploy/agentcore/`).
//!
//! ```no_run
//! # async fn example() -> session_runtime::Result<()> {
//! use runtime_agentcore::AgentCoreRuntime;
//! use session_runtime::config::AgentCoreConfig;
//!
//! let config = AgentCoreConfig::new("arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/example");
//! let runtime = AgentCoreRuntime::builder(config).installation("prod-bot").build()?;
//! # Ok(()) }
//! ```

mod connect;
mod control;
mod errors;
mod key;
pub mod record;
mod runtime;
mod trust;

pub use record::{FileRecordStore, RecordStore, SessionRecord, StoreError};
pub use runtime::{
    AgentCoreRuntime, AgentCoreRuntimeBuilder, DEFAULT_CLOSED_RECORD_TTL, SESSION_STORAGE_EXPIRY,
};

/// The name this runtime reports in errors and logs.
pub const RUNTIME: &str = "agentcore";
