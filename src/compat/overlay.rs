//! What upstream's pool gives one thread's agent besides `[agent]`, as a [`SessionOverlay`].

use session_runtime::SessionOverlay;

/// The variable upstream's `acp-mcp` feature gives each agent: the token the MCP facade knows
/// the session by.
pub const SESSION_TOKEN_VAR: &str = "OPENAB_SESSION_TOKEN";

/// The overlay for `get_or_create(thread_id, working_dir_override)` on upstream's workspace
/// line, with the token its `acp-mcp` feature mints for the connection, if any.
///
/// The working directory is passed as the pool resolved it; the runtime checks it: with
/// `storage = "shared"` an absolute directory among `session_runtime.local.working_dirs`
/// (default `[agent].working_dir` and beneath), with per-session storage a directory relative to
/// the session's workspace. Pass the overlay to every
/// [`ThreadSessions::open`](super::ThreadSessions::open) of the thread: a newly minted token
/// then replaces the old one for the worker that `open` starts.
///
/// ```
/// use openab_runtime::compat::{thread_overlay, SESSION_TOKEN_VAR};
/// use openab_runtime::CreateOptions;
///
/// let overlay = thread_overlay(Some("/home/agent/projects/api"), Some("minted-token"));
/// assert!(overlay.env.contains_key(SESSION_TOKEN_VAR));
/// let options = CreateOptions::new().with_overlay(overlay);
/// # let _ = options;
/// ```
pub fn thread_overlay(working_dir_override: Option<&str>, session_token: Option<&str>) -> SessionOverlay {
    let mut overlay = SessionOverlay::new();
    if let Some(dir) = working_dir_override {
        overlay = overlay.working_dir(dir);
    }
    if let Some(token) = session_token {
        overlay = overlay.env(SESSION_TOKEN_VAR, token);
    }
    overlay
}
