//! The session runtime of upstream OpenAB's own behaviour, unchanged: what `storage = "shared"`
//! (the default of an absent `[session_runtime]` section) selects.
//!
//! Each session's agent is a child process of the broker, started the way upstream's
//! `AcpConnection::spawn` starts it:
//!
//! - in the configured working directory ([`AgentCommand::working_dir`](session_runtime::AgentCommand),
//!   upstream's `[agent].working_dir`; default the system's temporary directory), which is also
//!   the `cwd` the attachment reports; or in the session overlay's working directory
//!   ([`SessionOverlay`](session_runtime::SessionOverlay), upstream's `[[ws:...]]`), an existing
//!   host directory at or beneath `local.working_dirs` (default: the configured working directory),
//!   links resolved, checked at create and again at every attach;
//! - with an environment cleared, then a baseline (`HOME` = the broker's, else the working
//!   directory; `PATH` = the broker's, else `/usr/local/bin:/usr/bin:/bin`; on unix `USER` = the
//!   broker's, else `agent`; on Windows `USERPROFILE`, `USERNAME`, and `SystemRoot` and
//!   `SystemDrive` when set), then `[agent].env`, then each `inherit_env` name not set explicitly
//!   that the broker has, then the session overlay's variables;
//! - in a process group of its own (unix `setpgid(0, 0)`; Windows `CREATE_NEW_PROCESS_GROUP`);
//! - with its stderr `/dev/null`, as upstream v0.8.x (later upstream code logs it at WARN), unless
//!   `local.agent_stderr` names a level to log each line at ([`AgentStderr`]);
//! - stopped with SIGTERM to the group, then SIGKILL to the group after the grace
//!   (`terminate_grace`, default 1.5 s as upstream). Windows has no SIGTERM: the agent is
//!   terminated at once.
//!
//! # What it isolates: nothing
//!
//! Every session's agent shares the broker's HOME (and so its credentials), working directory,
//! filesystem, network and user. [`Capabilities::isolation`](session_runtime::Capabilities) is
//! [`IsolationLevel::None`](session_runtime::IsolationLevel), building one logs a WARN that says
//! so, and `oab-runtime verify` refuses to call it isolated. There is no storage of a session's
//! own either: nothing is created at `create` and nothing deleted at `close`; workspace seeds are
//! [`Error::Unsupported`](session_runtime::Error).
//!
//! # Records
//!
//! Session records live in memory, as upstream's pool maps do: after a broker restart the runtime
//! knows no session, `create` starts each again and the broker resumes with `session/load`, as
//! upstream does. Workers do not outlive the runtime: dropping it stops every worker it started.
//!
//! # Platforms
//!
//! Linux, macOS and Windows: no part of this crate is Linux-only.

mod overlay_dir;
mod process;
mod runtime;
mod spawn;

pub use runtime::{SharedRuntime, SharedRuntimeBuilder};
pub use session_runtime::config::AgentStderr;

/// The name this runtime reports in errors and logs.
pub const RUNTIME: &str = "shared";
