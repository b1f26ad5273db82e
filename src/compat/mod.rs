//! What openab-core's `AcpConnection` and `SessionPool` need from a session, taken from an
//! [`Attachment`](crate::Attachment) instead of a child process: the switch from `AcpConnection::spawn` to a
//! [`SessionRuntime`](crate::SessionRuntime) as a small, reviewable change.
//!
//! | openab-core today (child process) | here |
//! |---|---|
//! | `AcpConnection::spawn(command, args, working_dir, env, inherit_env)` | [`ThreadSessions::open`] (create + attach) |
//! | `ChildStdout` handed to `run_reader_loop` | [`AgentTransport::reader`] |
//! | `Arc<Mutex<ChildStdin>>` (requests, permission replies, the lock-free `cancel_handles`) | [`AgentTransport::writer`], an `AsyncWrite` of whole lines, cloneable |
//! | `child_pgid` and `kill(-pgid)` for hung sessions | [`SessionControl::kill`] |
//! | `alive()` (`!reader_handle.is_finished()`) | [`SessionControl::is_alive`] |
//! | `working_dir` sent as `cwd` in `session/new` | [`AgentTransport::cwd`] (the directory *inside* the worker) |
//! | `get_or_create(thread_id, working_dir_override)`, the minted `OPENAB_SESSION_TOKEN` | [`thread_overlay`] in the [`CreateOptions`](crate::CreateOptions) given to [`ThreadSessions::open`] |
//! | matching `"timeout waiting for"` / `"channel closed"` | [`AcpCallError::is_transient`] |
//! | `format_user_error` sorting messages by substring | [`user_error_kind`] / [`UserError`] first, then `format_user_error` for other errors |
//! | dropping the last `Arc<Mutex<AcpConnection>>` | [`PoolPath::apply`]: an explicit `suspend` or `close` with a reason |
//!
//! The adoption guide, `docs/openab-core.md`, walks through the change file by file.

mod control;
mod errors;
mod overlay;
mod paths;
mod sessions;
mod writer;

pub use control::{SessionControl, CANCEL_BOUND};
pub use errors::{user_error_kind, AcpCallError, UserError, UserErrorKind};
pub use overlay::{thread_overlay, SESSION_TOKEN_VAR};
pub use paths::{PoolPath, RuntimeCall};
pub use sessions::{AgentTransport, ThreadSessions, TurnWait};
pub use writer::LineWriter;
