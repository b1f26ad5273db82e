//! The local session runtime: each session's agent runs as a child process of the broker, with
//! its own workspace, HOME and agent state under `root/<session id>/`.
//!
//! # Modes
//!
//! | `sandbox` | what runs | isolation between sessions |
//! |---|---|---|
//! | `none` | the agent, as upstream OpenAB runs it (own process group, cleared environment) | **none**: any session can read and delete any other's files; logged at startup |
//! | `bubblewrap` | the agent in new mount, pid, ipc and uts namespaces; only its own storage is mounted (`/workspace`, `/home/agent`), system directories read-only | OS-enforced ([`IsolationLevel::Namespaces`](session_runtime::IsolationLevel)) |
//! | `landlock` | the agent restricted by Landlock to its own storage and read-only system paths | OS-enforced; hides other sessions' existence only with a distinct uid per session |
//! | `auto` | bubblewrap if it works here, else Landlock, else refuses to create isolated sessions and says how to install bubblewrap | |
//!
//! # Durability
//!
//! Every session has a durable record (`record.json`, replaced atomically with fsync) that is
//! the authority on its state and generation, and a lock file: the broker process that runs a
//! session's worker holds an exclusive `flock` on it, so two broker processes on one host never
//! both run a session's worker. A worker's generation is recorded, with the intent to launch,
//! before its process starts; its pid and start time right after. After a broker is killed,
//! [`reconcile`](session_runtime::SessionRuntime::reconcile) kills every orphaned worker tree of
//! this installation (by recorded pid and start time, or by the marker its environment carries
//! when no pid was recorded), finishes interrupted closes, suspends idle workers and expires
//! retained storage.
//!
//! # Capabilities
//!
//! Persistent storage: yes. Workers survive a broker restart: no (plain workers are reclaimed by
//! `reconcile`, sandboxed ones die with the broker). Replay on re-attach: no (re-attaching starts a
//! new generation; the broker uses `session/load`).

mod layout;
mod process;
mod reconcile;
mod record;
mod runtime;
mod sandbox;
mod seed;
mod settings;
#[cfg(feature = "testing")]
mod testing;
mod worker;

pub use runtime::LocalRuntime;
pub use settings::LocalRuntimeBuilder;
pub(crate) use settings::LocalSettings;

/// The name this runtime reports in errors and logs.
pub const RUNTIME: &str = "local";
