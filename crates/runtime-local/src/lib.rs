//! The local session runtime: each session's agent runs as a child process of the broker, with
//! its own workspace, HOME and agent state under `root/<session id>/`.
//!
//! # Modes
//!
//! | `sandbox` | what runs | isolation between sessions |
//! |---|---|---|
//! | `none` | the agent, as upstream OpenAB runs it (own process group, cleared environment) | **none**: any session can read and delete any other's files; logged at startup |
//! | `bubblewrap` | the agent in new mount, pid, ipc and uts namespaces; only its own storage is mounted (`/workspace`, `/home/agent`), system directories read-only | OS-enforced ([`IsolationLevel::Namespaces`](session_runtime::IsolationLevel)) |
//! | `landlock` | the agent restricted by Landlock to its own storage and read-only system paths | OS-enforced ([`IsolationLevel::AccessControl`](session_runtime::IsolationLevel)); hides other sessions' existence only with a distinct uid per session |
//! | `auto` | bubblewrap if it works here, else Landlock, else refuses to create isolated sessions and says how to install bubblewrap | |
//!
//! What the agent's program needs of the host ([`AgentCommand::needs`](session_runtime::AgentCommand),
//! the directory of its file, the interpreter of its `#!` line, the Python virtual environment or
//! the `node_modules` it is installed in, and the files its arguments name) is shown to it
//! read-only at the same paths in the sandboxed modes, and it is started by its configured path
//! in every mode; a path that would show the session root, or that the session's own user could
//! not reach, fails `create` and `attach` with an [`Error::InvalidConfig`](session_runtime::Error)
//! naming `agent.needs`, `agent.command` or `agent.args`.
//!
//! In every mode a worker inherits no descriptor of the broker's but its standard streams: the
//! runtime marks the broker's other descriptors close-on-exec before each start (those the broker
//! inherited from systemd or a supervisor included), so no agent holds a socket or file of the
//! broker's.
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
//! when no pid was recorded), records as suspended a running session whose worker died with the
//! broker, finishes interrupted closes, suspends idle workers, expires retained storage, and
//! releases what a killed broker left half-released (uid claims of sessions with no storage,
//! cgroups of stopped workers, killing what is left in them). Stopping a worker waits until no
//! process carrying its marker is left, so two generations of a session never run at once, not
//! even for a moment.
//!
//! # Cgroups
//!
//! Where the broker may create cgroups (root, or a delegated cgroup v2 subtree), every worker
//! gets its session's own (`openab-<session id>-<root device>.<root inode>`), with the
//! configured limits or none, and joins them before its program starts: a limit holds from the
//! agent's first instruction, a worker killed by its memory limit ends
//! [`WorkerExit::OutOfMemory`](session_runtime::WorkerExit), and stopping the worker kills
//! whatever is still in them, so nothing the agent starts outlives its session however it
//! detaches itself (a new session, a double fork, a cleared environment); stopping signals the
//! cgroup's members. Without limits a session needs only one cgroup to hold its processes
//! together: on cgroup v1 it gets the `pids` hierarchy's alone (the cheapest to create), so a
//! worker there that the host's OOM killer ends is reported as killed by `SIGKILL`, not as
//! out of memory (it has no memory limit to exceed). Elsewhere, without limits, a worker's
//! process group and the marker in its environment are all that tie its processes to the
//! session.
//!
//! # Hostile state on disk
//!
//! Everything under the root is untrusted input. A record that does not parse, has an unknown
//! version or field, or names another session is a typed error, and its storage is left in place
//! (nothing is deleted that the runtime cannot prove it created). Session directories, records,
//! lock files, the agent's directories and the bookkeeping directories (`.trash`, `.retained`,
//! `.uids`) are never used through a symbolic link: a link planted there is an error, so nothing
//! outside the root is ever created, written or deleted on its account.
//!
//! # Platforms
//!
//! Linux only: per-session storage relies on `/proc`, `flock`, pid start times and Linux process
//! calls, and the sandboxes on bubblewrap, Landlock and cgroups. `openab-runtime` depends on this
//! crate only on Linux (`src/linux.rs` is its one boundary) and answers `storage =
//! "per-session"` elsewhere with `Error::Unsupported`; upstream's behaviour (`runtime-shared`)
//! builds everywhere.
//!
//! # Capabilities
//!
//! Persistent storage: yes. Workers survive a broker restart: no (plain workers are reclaimed by
//! `reconcile`, sandboxed ones die with the broker). Replay on re-attach: no (re-attaching starts a
//! new generation; the broker uses `session/load`).

mod egress;
mod errors;
mod layout;
mod process;
mod reconcile;
mod record;
mod root;
mod runtime;
mod sandbox;
mod seed;
mod settings;
#[cfg(feature = "testing")]
pub mod testing;
mod workdir;
mod worker;

pub(crate) use errors::backend_error;
pub use runtime::LocalRuntime;
pub use settings::LocalRuntimeBuilder;
pub(crate) use settings::LocalSettings;

/// The name this runtime reports in errors and logs.
pub const RUNTIME: &str = "local";
