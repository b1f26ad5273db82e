//! Which host directories a session overlay's working directory may be in the shared mode.

use std::path::{Path, PathBuf};

use session_runtime::overlay::WORKING_DIR_FIELD;
use session_runtime::{Error, Result};

/// An allowed directory from the configuration, links resolved.
///
/// # Errors
/// Why it cannot be one (not absolute, not an existing directory), for an
/// [`Error::InvalidConfig`] naming its key.
pub(crate) fn root(dir: &Path) -> std::result::Result<PathBuf, String> {
    if !dir.is_absolute() {
        return Err(format!("{} is not an absolute path", dir.display()));
    }
    match dir.canonicalize() {
        Ok(resolved) if resolved.is_dir() => Ok(resolved),
        Ok(_) => Err(format!("{} is not a directory", dir.display())),
        Err(e) => Err(format!("{}: {e}", dir.display())),
    }
}

/// `dir` with links resolved, if it is an existing directory at or beneath one of `roots`.
///
/// # Errors
/// [`Error::InvalidOverlay`] naming the working directory for a relative path, one that is not an
/// existing directory, or one outside every allowed directory (links resolved first, so a link
/// cannot lead out).
pub(crate) fn allowed(dir: &Path, roots: &[PathBuf]) -> Result<PathBuf> {
    let refuse = |problem: String| Error::InvalidOverlay {
        field: WORKING_DIR_FIELD,
        problem,
    };
    if !dir.is_absolute() {
        return Err(refuse(format!(
            "{} is relative; with shared storage it must be an absolute host directory",
            dir.display()
        )));
    }
    let resolved = match dir.canonicalize() {
        Ok(resolved) if resolved.is_dir() => resolved,
        Ok(_) => return Err(refuse(format!("{} is not a directory", dir.display()))),
        Err(e) => return Err(refuse(format!("{}: {e}", dir.display()))),
    };
    if roots.iter().any(|root| resolved.starts_with(root)) {
        Ok(resolved)
    } else {
        Err(refuse(format!(
            "{} is outside the directories session_runtime.local.working_dirs allows (default: \
             [agent].working_dir)",
            dir.display()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(result: Result<PathBuf>) -> bool {
        matches!(result, Err(Error::InvalidOverlay { field, .. }) if field == WORKING_DIR_FIELD)
    }

    #[cfg(unix)]
    #[test]
    fn only_existing_directories_beneath_a_root_are_allowed() {
        let top = tempfile::tempdir().expect("temporary directory");
        let allowed_root = top.path().join("allowed");
        let outside = top.path().join("outside");
        std::fs::create_dir_all(allowed_root.join("project")).expect("dirs");
        std::fs::create_dir_all(&outside).expect("dirs");
        std::os::unix::fs::symlink(&outside, allowed_root.join("link")).expect("link");
        let roots = vec![root(&allowed_root).expect("a root")];
        assert!(allowed(&allowed_root.join("project"), &roots).is_ok());
        assert!(refused(allowed(&outside, &roots)));
        assert!(
            refused(allowed(&allowed_root.join("link"), &roots)),
            "a link cannot lead out"
        );
        assert!(refused(allowed(
            &allowed_root.join("project/../../outside"),
            &roots
        )));
        assert!(refused(allowed(&allowed_root.join("missing"), &roots)));
        assert!(refused(allowed(Path::new("project"), &roots)));
    }
}
