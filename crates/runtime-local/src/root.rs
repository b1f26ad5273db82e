//! The storage root: which directories may hold sessions, and creating one.
//!
//! The runtime changes the mode of a root only when it created that directory itself (0711:
//! sessions reach their own directory by name, nobody else can list it). A root that already
//! exists is used as it is, or refused:
//!
//! - `/`, a system directory (`/usr`, `/var/lib`, `/tmp`, ...), anything under `/proc`, `/sys`
//!   or `/dev`, or the broker's HOME: session storage and its bookkeeping (`.trash`, `.uids`,
//!   ...) would be mixed with the host's own files;
//! - a directory every user may write to (e.g. `/tmp`, mode 1777): another user could plant or
//!   replace session directories;
//! - a directory owned by another user: that user could do the same.
//!
//! Nothing here writes unless asked to create the root ([`ensure`]): reading sessions (`list`,
//! `status`) never creates or changes anything.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use session_runtime::{Error, Result};

/// The configuration key of the root.
const ROOT_KEY: &str = "session_runtime.local.root";

/// Directories of the host that never hold session storage themselves.
const SYSTEM_DIRS: &[&str] = &[
    "/",
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/media",
    "/mnt",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/srv",
    "/sys",
    "/tmp",
    "/usr",
    "/usr/bin",
    "/usr/lib",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/local",
    "/usr/local/bin",
    "/usr/local/lib",
    "/usr/sbin",
    "/usr/share",
    "/var",
    "/var/cache",
    "/var/lib",
    "/var/local",
    "/var/lock",
    "/var/log",
    "/var/mail",
    "/var/opt",
    "/var/run",
    "/var/spool",
    "/var/tmp",
];

/// Kernel filesystems: nothing under them is storage.
const PSEUDO_FS: &[&str] = &["/proc", "/sys", "/dev"];

fn refused(root: &Path, why: impl std::fmt::Display) -> Error {
    Error::InvalidConfig {
        key: ROOT_KEY.to_owned(),
        reason: format!("{} cannot hold session storage: {why}", root.display()),
    }
}

fn io_error(what: String, error: io::Error) -> Error {
    crate::backend_error(false, what, error)
}

/// `path` with `.` and `..` resolved and, as far as it exists, symbolic links too: where the
/// storage would really be.
fn resolved(path: &Path) -> io::Result<PathBuf> {
    let mut existing = path.to_path_buf();
    let mut missing = Vec::new();
    loop {
        match std::fs::canonicalize(&existing) {
            Ok(real) => {
                let mut real = real;
                for name in missing.iter().rev() {
                    real.push(name);
                }
                return Ok(real);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let Some(name) = existing.file_name().map(ToOwned::to_owned) else {
            return Ok(lexically_normal(path));
        };
        missing.push(name);
        existing.pop();
    }
}

/// `path` with `.` and `..` resolved without looking at the filesystem.
fn lexically_normal(path: &Path) -> PathBuf {
    let mut normal = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::ParentDir => {
                normal.pop();
            }
            Component::Normal(name) => normal.push(name),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    normal
}

/// Checks that `root` may hold session storage (see the module documentation), whether or not it
/// exists yet. Writes nothing.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming `session_runtime.local.root` and saying why it is refused;
/// [`Error::Backend`] if it cannot be inspected (with the OS error as its source).
pub(crate) fn check(root: &Path) -> Result<()> {
    let real = resolved(root).map_err(|e| io_error(format!("inspecting {}", root.display()), e))?;
    let shown = |real: &Path| {
        if real == root {
            String::new()
        } else {
            format!(" ({})", real.display())
        }
    };
    if real == Path::new("/") {
        return Err(refused(
            root,
            format!("it is the filesystem root{}", shown(&real)),
        ));
    }
    if SYSTEM_DIRS.iter().any(|dir| real == Path::new(dir)) {
        return Err(refused(
            root,
            format!(
                "it is a system directory{}; name a directory of its own, e.g. /var/lib/openab/sessions",
                shown(&real)
            ),
        ));
    }
    if PSEUDO_FS.iter().any(|dir| real.starts_with(dir)) {
        return Err(refused(
            root,
            format!("it is on a kernel filesystem{}", shown(&real)),
        ));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from);
    if home.and_then(|home| std::fs::canonicalize(home).ok()).as_deref() == Some(real.as_path()) {
        return Err(refused(
            root,
            "it is the broker's HOME; name a directory of its own below it",
        ));
    }
    let meta = match std::fs::metadata(&real) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(format!("inspecting {}", root.display()), e)),
    };
    if !meta.is_dir() {
        return Err(refused(root, "it is not a directory"));
    }
    if meta.mode() & 0o002 != 0 {
        return Err(refused(
            root,
            format!(
                "every user may write to it (mode {:o}), so another user could plant or replace session directories",
                meta.mode() & 0o7777
            ),
        ));
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(refused(
            root,
            format!(
                "it is owned by uid {}, not by this broker's uid {me}, so that user could plant or replace session directories",
                meta.uid()
            ),
        ));
    }
    Ok(())
}

/// Creates `root` unless it exists (its missing parents too, with the default mode), gives it
/// mode 0711 only if this call created it, and checks it (see [`check`]).
///
/// # Idempotency
///
/// An existing root is only checked, never changed.
///
/// # Errors
///
/// As for [`check`]; [`Error::Backend`] with the OS error as its source if it cannot be created.
pub(crate) fn ensure(root: &Path) -> Result<()> {
    check(root)?;
    if root.exists() {
        // Checked as it is: nothing to create.
        return Ok(());
    }
    let fail = |e| io_error(format!("creating the session root {}", root.display()), e);
    if let Some(parent) = root.parent() {
        std::fs::create_dir_all(parent).map_err(fail)?;
    }
    match std::fs::DirBuilder::new().mode(0o711).create(root) {
        // The umask may have taken bits away: this directory is ours to set.
        Ok(()) => std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).map_err(fail)?,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(e)),
    }
    // Made now, or by someone else meanwhile: checked again as it is.
    check(root)
}

/// A root [`ensure`] found usable, remembered by what its checks depend on, so that the next
/// `ensure` of the same directory in the same state costs one `stat`.
#[derive(Debug, Default)]
pub(crate) struct CheckedRoot(parking_lot::Mutex<Option<RootState>>);

/// What the checks of an existing root depend on: which directory the path leads to (device and
/// inode: a link changed to lead elsewhere leads to another), its mode and owner, and the
/// broker's `HOME`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RootState {
    path: PathBuf,
    device: u64,
    inode: u64,
    mode: u32,
    uid: u32,
    home: Option<std::ffi::OsString>,
}

impl RootState {
    fn of(root: &Path) -> Option<Self> {
        let meta = std::fs::metadata(root).ok()?;
        Some(Self {
            path: root.to_path_buf(),
            device: meta.dev(),
            inode: meta.ino(),
            mode: meta.mode(),
            uid: meta.uid(),
            home: std::env::var_os("HOME"),
        })
    }
}

impl CheckedRoot {
    /// [`ensure`], skipped when `root` is the directory it last passed, unchanged.
    ///
    /// # Errors
    ///
    /// As for [`ensure`].
    pub(crate) fn ensure(&self, root: &Path) -> Result<()> {
        let now = RootState::of(root);
        if now.is_some() && *self.0.lock() == now {
            return Ok(());
        }
        ensure(root)?;
        *self.0.lock() = RootState::of(root);
        Ok(())
    }
}

/// `<device>.<inode>` of `root`, if it exists (see `LocalRuntime::root_tag`).
pub(crate) fn tag_of(root: &Path) -> Option<String> {
    let meta = std::fs::metadata(root).ok()?;
    Some(format!("{}.{}", meta.dev(), meta.ino()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_directories_and_the_filesystem_root_are_refused() {
        for root in ["/", "/tmp", "/usr/../var/lib", "/proc/self", "/usr/local/"] {
            let error = check(Path::new(root)).expect_err(root);
            assert!(
                matches!(&error, Error::InvalidConfig { key, .. } if key == ROOT_KEY),
                "{root}: {error}"
            );
        }
    }

    #[test]
    fn a_world_writable_root_is_refused_and_left_unchanged() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        let error = ensure(dir.path()).expect_err("world-writable");
        assert!(error.to_string().contains("every user may write"), "{error}");
        let mode = std::fs::metadata(dir.path()).expect("meta").mode() & 0o7777;
        assert_eq!(mode, 0o1777);
    }

    #[test]
    fn an_existing_root_keeps_its_mode_and_a_created_one_gets_0711() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o750)).expect("chmod");
        ensure(dir.path()).expect("existing root");
        assert_eq!(
            std::fs::metadata(dir.path()).expect("meta").mode() & 0o7777,
            0o750
        );
        let created = dir.path().join("a/b/sessions");
        ensure(&created).expect("new root");
        assert_eq!(std::fs::metadata(&created).expect("meta").mode() & 0o7777, 0o711);
    }

    #[test]
    fn a_checked_root_is_checked_again_once_it_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("sessions");
        let checked = CheckedRoot::default();
        checked.ensure(&root).expect("created and checked");
        checked.ensure(&root).expect("unchanged");
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let error = checked.ensure(&root).expect_err("every user may write to it now");
        assert!(error.to_string().contains("every user may write"), "{error}");
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711)).expect("chmod");
        checked.ensure(&root).expect("usable again");
        // Another directory at the same path (a link retargeted, a root recreated).
        std::fs::remove_dir(&root).expect("rmdir");
        std::os::unix::fs::symlink("/usr", &root).expect("link");
        let error = checked
            .ensure(&root)
            .expect_err("the path now leads to a system directory");
        assert!(error.to_string().contains("system directory"), "{error}");
    }
}
