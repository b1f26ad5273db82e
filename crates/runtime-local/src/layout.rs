//! Where a session's storage lives on the host: `root/<session id>/`.
//!
//! ```text
//! root/
//!   <session id>/          0700, the session's storage (one incarnation)
//!     record.json          the durable session record (atomically replaced)
//!     lock                 flock(2) target: held by the broker process that owns the session
//!     workspace/           the agent's working directory
//!     home/                the agent's HOME
//!     state/               agent state the runtime keeps between generations
//!     tmp/                 scratch space (private /tmp in sandboxed mode)
//!   .retained/<id>.<n>/    storage of closed sessions kept by the retention policy
//!   .trash/<id>.<n>/       storage being deleted (renamed here first, so deletion is atomic)
//!   .counters/<id>         last generation and incarnation of a session whose storage was deleted
//! ```
//!
//! Only a [`SessionId`] ever appears in these paths.

use std::io;
use std::path::{Path, PathBuf};

use session_runtime::SessionId;

/// The host paths of one session's storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SessionDirs {
    /// `root/<session id>`.
    pub(crate) base: PathBuf,
    /// The agent's working directory.
    pub(crate) workspace: PathBuf,
    /// The agent's HOME.
    pub(crate) home: PathBuf,
    /// Agent state kept between generations.
    pub(crate) state: PathBuf,
    /// Scratch space.
    pub(crate) tmp: PathBuf,
}

impl SessionDirs {
    /// The layout of `id`'s storage under `base`.
    pub(crate) fn at(base: PathBuf) -> Self {
        Self {
            workspace: base.join("workspace"),
            home: base.join("home"),
            state: base.join("state"),
            tmp: base.join("tmp"),
            base,
        }
    }

    /// The layout of `id`'s live storage under `root`.
    pub(crate) fn live(root: &Path, id: &SessionId) -> Self {
        Self::at(root.join(id.as_str()))
    }

    /// The session record.
    pub(crate) fn record(&self) -> PathBuf {
        self.base.join("record.json")
    }

    /// The lock file.
    pub(crate) fn lock(&self) -> PathBuf {
        self.base.join("lock")
    }

    /// The directory of the session's egress proxy sockets (`network = "allowlist"`).
    pub(crate) fn egress(&self) -> PathBuf {
        self.base.join("egress")
    }

    /// The directories the agent may use, in creation order.
    pub(crate) fn agent_dirs(&self) -> [&Path; 4] {
        [&self.workspace, &self.home, &self.state, &self.tmp]
    }
}

/// Where closed sessions' retained storage is kept.
pub(crate) fn retained_dir(root: &Path) -> PathBuf {
    root.join(".retained")
}

/// Where storage is moved before it is deleted.
pub(crate) fn trash_dir(root: &Path) -> PathBuf {
    root.join(".trash")
}

/// Where the last generation and incarnation of sessions whose storage was deleted are kept, so
/// a later session under the same id continues counting (one small file per session id).
pub(crate) fn counters_dir(root: &Path) -> PathBuf {
    root.join(".counters")
}

/// Whether `path` exists as a directory itself: `Ok(false)` if nothing is there, an error if a
/// symbolic link (to anything) or something else is. The runtime never reaches storage or its
/// bookkeeping directories through a link: one planted under the root could point anywhere on
/// the host, and what the runtime then wrote or deleted would be there.
pub(crate) fn plain_dir(path: &Path) -> io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Ok(true),
        Ok(_) => Err(io::Error::other(format!(
            "{} is not a plain directory (a symbolic link, or not a directory)",
            path.display()
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Makes `path` a directory (with its missing parents) unless it is one, as
/// [`plain_dir`] sees it: a symbolic link or anything else there is an error.
pub(crate) fn ensure_plain_dir(path: &Path) -> io::Result<()> {
    if plain_dir(path)? {
        return Ok(());
    }
    std::fs::create_dir_all(path)?;
    plain_dir(path).map(drop)
}
