//! Making a session's storage private to it.

use std::ffi::CString;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags};
use rustix::process::{Gid, Uid};
use session_runtime::Error;

use crate::layout::SessionDirs;

/// The generated `/etc/passwd` of a bubblewrap sandbox, in the session's base directory.
const PASSWD_FILE: &str = "sandbox-passwd";
/// The generated `/etc/group` of a bubblewrap sandbox, in the session's base directory.
const GROUP_FILE: &str = "sandbox-group";

fn storage_error(what: String, error: io::Error) -> Error {
    crate::backend_error(true, what, error)
}

fn chmod(path: &Path, mode: u32) -> Result<(), Error> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| storage_error(format!("setting the permissions of {}", path.display()), e))
}

/// See [`Sandbox::prepare_storage`](super::Sandbox::prepare_storage).
pub(super) fn prepare(dirs: &SessionDirs, uid: Option<u32>) -> Result<(), Error> {
    let (base_mode, agent_mode) = private_modes(uid);
    if let Some(uid) = uid {
        std::os::unix::fs::chown(&dirs.base, None, Some(uid))
            .map_err(|e| storage_error(format!("giving {} to gid {uid}", dirs.base.display()), e))?;
    }
    chmod(&dirs.base, base_mode)?;
    for dir in [&dirs.workspace, &dirs.home, &dirs.state, &dirs.tmp] {
        if let Some(uid) = uid {
            let owner = std::fs::symlink_metadata(dir)
                .map_err(|e| storage_error(format!("inspecting {}", dir.display()), e))?
                .uid();
            if owner != uid {
                chown_tree(dir, uid)
                    .map_err(|e| storage_error(format!("giving {} to uid {uid}", dir.display()), e))?;
            }
        }
        chmod(dir, agent_mode)?;
    }
    Ok(())
}

/// The modes [`prepare`] gives: the base directory's (0710 with a session uid, whose group may
/// pass it; else 0700), then each agent directory's (0700).
fn private_modes(uid: Option<u32>) -> (u32, u32) {
    (if uid.is_some() { 0o710 } else { 0o700 }, 0o700)
}

/// Narrows back every session directory whose mode was widened beyond what [`prepare`] gives
/// (e.g. `chmod -R 0777` by hand, or a restored backup), before a worker starts; returns each
/// repaired directory with the mode it had. A narrower mode is left as it is.
///
/// # Errors
///
/// [`Error::Backend`] if a directory cannot be inspected or changed.
pub(super) fn repair_modes(dirs: &SessionDirs, uid: Option<u32>) -> Result<Vec<(PathBuf, u32)>, Error> {
    let (base_mode, agent_mode) = private_modes(uid);
    let mut repaired = Vec::new();
    let all = std::iter::once((&dirs.base, base_mode))
        .chain([&dirs.workspace, &dirs.home, &dirs.state, &dirs.tmp].map(|dir| (dir, agent_mode)));
    for (dir, allowed) in all {
        let mode = std::fs::symlink_metadata(dir)
            .map_err(|e| storage_error(format!("inspecting {}", dir.display()), e))?
            .mode()
            & 0o7777;
        if mode & !allowed != 0 {
            chmod(dir, allowed)?;
            repaired.push((dir.clone(), mode));
        }
    }
    Ok(repaired)
}

/// Gives `top` and everything beneath it to `uid:uid`, never following a symbolic link: each
/// directory is opened relative to its parent with `O_NOFOLLOW`, so a link swapped in cannot
/// redirect the walk out of `top`.
fn chown_tree(top: &Path, uid: u32) -> io::Result<()> {
    let (owner, group) = (Some(Uid::from_raw(uid)), Some(Gid::from_raw(uid)));
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::open(top, flags, Mode::empty())?;
    rustix::fs::fchown(&fd, owner, group)?;
    let mut stack = vec![Dir::new(fd)?];
    while let Some(dir) = stack.last_mut() {
        let Some(entry) = dir.read() else {
            stack.pop();
            continue;
        };
        let entry = entry?;
        let name = entry.file_name();
        if is_dot(name) {
            continue;
        }
        let parent = dir.fd()?;
        rustix::fs::chownat(parent, name, owner, group, AtFlags::SYMLINK_NOFOLLOW)?;
        if is_directory(parent, &entry)? != Some(true) {
            continue;
        }
        let child = match rustix::fs::openat(parent, name, flags, Mode::empty()) {
            Ok(child) => child,
            // Replaced by something that is not a directory meanwhile: nothing to descend into.
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR | rustix::io::Errno::NOENT) => continue,
            Err(e) => return Err(e.into()),
        };
        stack.push(Dir::new(child)?);
    }
    Ok(())
}

/// Deletes the directory `top` and everything beneath it, never following a symbolic link (a
/// link is removed, not what it points to), as `std::fs::remove_dir_all` does, with fewer system
/// calls for what session storage mostly holds: each subdirectory is first removed as if empty,
/// and only opened and emptied when it is not.
///
/// # Errors
///
/// The first error other than a missing entry (something else may be deleting it too).
pub(crate) fn remove_tree(top: &Path) -> io::Result<()> {
    use rustix::io::Errno;
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = match rustix::fs::open(top, flags, Mode::empty()) {
        Ok(fd) => fd,
        // A link or a file where the directory was: removed itself, as `remove_dir_all` does.
        Err(Errno::LOOP | Errno::NOTDIR) => return std::fs::remove_file(top),
        Err(e) => return Err(e.into()),
    };
    let gone = |result: rustix::io::Result<()>| match result {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(io::Error::from(e)),
    };
    // Each directory being emptied, with its name in the one below it on the stack.
    let mut stack: Vec<(Dir, Option<CString>)> = vec![(Dir::new(fd)?, None)];
    while let Some((dir, _)) = stack.last_mut() {
        let Some(entry) = dir.read() else {
            if let Some((_, Some(name))) = stack.pop() {
                if let Some((parent, _)) = stack.last() {
                    gone(rustix::fs::unlinkat(parent.fd()?, &name, AtFlags::REMOVEDIR))?;
                }
            }
            continue;
        };
        let entry = entry?;
        let name = entry.file_name();
        if is_dot(name) {
            continue;
        }
        let parent = dir.fd()?;
        let Some(is_dir) = is_directory(parent, &entry)? else {
            continue;
        };
        if !is_dir {
            gone(rustix::fs::unlinkat(parent, name, AtFlags::empty()))?;
            continue;
        }
        match rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => continue,
            Err(Errno::NOTEMPTY | Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        let child = match rustix::fs::openat(parent, name, flags, Mode::empty()) {
            Ok(child) => child,
            Err(Errno::NOENT) => continue,
            // Replaced by something that is not a directory meanwhile: that is removed instead.
            Err(Errno::LOOP | Errno::NOTDIR) => {
                gone(rustix::fs::unlinkat(parent, name, AtFlags::empty()))?;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let name = name.to_owned();
        stack.push((Dir::new(child)?, Some(name)));
    }
    std::fs::remove_dir(top)
}

/// Whether a directory entry is `.` or `..`.
fn is_dot(name: &std::ffi::CStr) -> bool {
    matches!(name.to_bytes(), b"." | b"..")
}

/// Whether `entry` of the directory `parent` is itself a directory (a link to one is not), as
/// its type says or, where the file system does not say, as `lstat` finds it; `None` if it is
/// gone meanwhile.
fn is_directory(
    parent: rustix::fd::BorrowedFd<'_>,
    entry: &rustix::fs::DirEntry,
) -> io::Result<Option<bool>> {
    match entry.file_type() {
        FileType::Directory => Ok(Some(true)),
        FileType::Unknown => match rustix::fs::statat(parent, entry.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(Some(FileType::from_raw_mode(stat.st_mode) == FileType::Directory)),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        },
        _ => Ok(Some(false)),
    }
}

/// The generated identity files of a bubblewrap sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IdentityFiles {
    /// Bound over `/etc/passwd`.
    pub(crate) passwd: PathBuf,
    /// Bound over `/etc/group`.
    pub(crate) group: PathBuf,
}

impl IdentityFiles {
    /// Where they live for a session whose base directory is `base`.
    pub(crate) fn at(base: &Path) -> Self {
        IdentityFiles {
            passwd: base.join(PASSWD_FILE),
            group: base.join(GROUP_FILE),
        }
    }
}

/// Writes (atomically, if changed) the `/etc/passwd` and `/etc/group` a bubblewrap sandbox shows:
/// `root`, the session's user `agent` (uid and gid `uid`, HOME `/home/agent`) and `nobody`.
pub(super) fn write_identity_files(base: &Path, uid: u32) -> Result<IdentityFiles, Error> {
    let files = IdentityFiles::at(base);
    let home = super::SANDBOX_HOME;
    let passwd = format!(
        "root:x:0:0:root:/root:/usr/sbin/nologin\n\
         agent:x:{uid}:{uid}:openab session agent:{home}:/bin/sh\n\
         nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    );
    let group = format!("root:x:0:\nagent:x:{uid}:\nnogroup:x:65534:\n");
    for (path, content) in [(&files.passwd, passwd), (&files.group, group)] {
        if std::fs::read(path).is_ok_and(|existing| existing == content.as_bytes()) {
            continue;
        }
        let temp = path.with_extension(format!("new-{}", std::process::id()));
        std::fs::write(&temp, content)
            .and_then(|()| std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o644)))
            .and_then(|()| std::fs::rename(&temp, path))
            .map_err(|e| storage_error(format!("writing {}", path.display()), e))?;
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::symlink;

    use super::remove_tree;

    #[test]
    fn remove_tree_deletes_everything_beneath_and_follows_no_link() {
        let scratch = tempfile::tempdir().expect("scratch");
        let outside = scratch.path().join("outside");
        fs::create_dir(&outside).expect("outside");
        fs::write(outside.join("kept"), "not the session's").expect("outside file");
        let top = scratch.path().join("session");
        for dir in ["empty", "home/.agent/deep/er", "workspace/src"] {
            fs::create_dir_all(top.join(dir)).expect("dirs");
        }
        fs::write(top.join("record.json"), "{}").expect("file");
        fs::write(top.join("home/.agent/deep/state"), "x").expect("nested file");
        fs::write(top.join("workspace/src/main.rs"), "fn main() {}").expect("nested file");
        symlink(&outside, top.join("workspace/link-to-dir")).expect("link");
        symlink(outside.join("kept"), top.join("home/link-to-file")).expect("link");
        symlink("/nonexistent", top.join("dangling")).expect("link");

        remove_tree(&top).expect("removed");

        assert!(fs::symlink_metadata(&top).is_err(), "the tree is gone");
        assert_eq!(
            fs::read_to_string(outside.join("kept")).expect("what a link pointed to is left"),
            "not the session's"
        );
        assert_eq!(fs::read_dir(&outside).expect("outside").count(), 1);
    }

    #[test]
    fn remove_tree_removes_a_link_in_place_of_the_directory_not_its_target() {
        let scratch = tempfile::tempdir().expect("scratch");
        let target = scratch.path().join("target");
        fs::create_dir(&target).expect("target");
        fs::write(target.join("kept"), "x").expect("file");
        let top = scratch.path().join("session");
        symlink(&target, &top).expect("link");

        remove_tree(&top).expect("removed");

        assert!(fs::symlink_metadata(&top).is_err(), "the link is gone");
        assert!(target.join("kept").exists(), "its target is untouched");
        let missing = remove_tree(&top).expect_err("nothing to remove");
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    }
}
