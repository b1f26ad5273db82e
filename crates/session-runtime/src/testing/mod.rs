//! Test support: [`FakeRuntime`], an in-memory runtime that passes the conformance suite, and
//! [`AcpClient`], a small ACP client that drives an agent over an attachment.

mod acp_client;
mod fake;

pub use acp_client::{
    AcpClient, ClientError, ExecOutput, PermissionAnswer, PromptOutcome, DEFAULT_REQUEST_TIMEOUT, EXEC_METHOD,
};
pub use fake::{FakeRuntime, FakeRuntimeBuilder};
