//! A session overlay's working directory inside the session's own workspace.

use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};
use session_runtime::overlay::WORKING_DIR_FIELD;
use session_runtime::Error;

/// Makes `relative` (a path from [`SessionOverlay::relative_working_dir`]) a directory inside
/// `workspace`, creating what is missing (mode 0700, owned by the session's `uid` if it has one),
/// and returns its host path.
///
/// Every component is opened relative to its parent without following a symbolic link, so a link
/// planted in the workspace (by a seed, or an earlier worker) cannot lead the agent's working
/// directory out of it. Called with no worker of the session running.
///
/// # Errors
/// [`Error::InvalidOverlay`] naming the working directory if a component is a symbolic link or
/// not a directory; [`Error::Backend`] if the file system fails otherwise.
///
/// [`SessionOverlay::relative_working_dir`]: session_runtime::SessionOverlay::relative_working_dir
pub(crate) fn ensure_within(workspace: &Path, relative: &Path, uid: Option<u32>) -> Result<PathBuf, Error> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let failed = |what: &str, errno: Errno| {
        crate::backend_error(
            true,
            format!("{what} the overlay's working directory {}", relative.display()),
            std::io::Error::from(errno),
        )
    };
    let mut dir = rustix::fs::open(workspace, flags, Mode::empty()).map_err(|e| failed("opening", e))?;
    let mut walked = PathBuf::new();
    for component in relative.components() {
        let Component::Normal(name) = component else {
            return Err(refused(relative, "is not a plain relative path"));
        };
        walked.push(name);
        let next = match rustix::fs::openat(&dir, name, flags, Mode::empty()) {
            Ok(next) => next,
            Err(Errno::NOENT) => {
                match rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700)) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(failed("creating", e)),
                }
                let made = rustix::fs::openat(&dir, name, flags, Mode::empty())
                    .map_err(|e| escape_or(relative, &walked, e, |e| failed("opening", e)))?;
                if let Some(uid) = uid {
                    rustix::fs::fchown(&made, Some(Uid::from_raw(uid)), Some(Gid::from_raw(uid)))
                        .map_err(|e| failed("giving the session's user", e))?;
                }
                made
            }
            Err(e) => return Err(escape_or(relative, &walked, e, |e| failed("opening", e))),
        };
        dir = next;
    }
    Ok(workspace.join(relative))
}

/// A link or non-directory on the way is the caller's input leading out of the workspace.
fn escape_or(relative: &Path, walked: &Path, errno: Errno, otherwise: impl Fn(Errno) -> Error) -> Error {
    match errno {
        Errno::LOOP | Errno::NOTDIR | Errno::MLINK => refused(
            relative,
            &format!(
                "is not a directory inside the session's workspace: {} is a symbolic link or not a directory",
                walked.display()
            ),
        ),
        other => otherwise(other),
    }
}

fn refused(relative: &Path, problem: &str) -> Error {
    Error::InvalidOverlay {
        field: WORKING_DIR_FIELD,
        problem: format!("{} {problem}", relative.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_directories_are_made_and_links_refused() {
        let workspace = tempfile::tempdir().expect("temporary workspace");
        let made = ensure_within(workspace.path(), Path::new("a/b"), None).expect("made");
        assert!(made.is_dir() && made.starts_with(workspace.path()));
        let elsewhere = tempfile::tempdir().expect("a directory outside");
        std::os::unix::fs::symlink(elsewhere.path(), workspace.path().join("out")).expect("link");
        for escaping in ["out", "out/x"] {
            match ensure_within(workspace.path(), Path::new(escaping), None) {
                Err(Error::InvalidOverlay { field, .. }) => assert_eq!(field, WORKING_DIR_FIELD),
                other => panic!("{escaping}: expected InvalidOverlay, got {other:?}"),
            }
        }
        assert!(
            !elsewhere.path().join("x").exists(),
            "nothing is made through a link"
        );
        std::fs::write(workspace.path().join("file"), b"").expect("a file");
        assert!(matches!(
            ensure_within(workspace.path(), Path::new("file/x"), None),
            Err(Error::InvalidOverlay { .. })
        ));
    }
}
