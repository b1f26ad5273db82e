//! Making a session's storage private to it.

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
    match uid {
        Some(uid) => {
            std::os::unix::fs::chown(&dirs.base, None, Some(uid))
                .map_err(|e| storage_error(format!("giving {} to gid {uid}", dirs.base.display()), e))?;
            chmod(&dirs.base, 0o710)?;
        }
        None => chmod(&dirs.base, 0o700)?,
    }
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
        chmod(dir, 0o700)?;
    }
    Ok(())
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
        if name.to_bytes() == b"." || name.to_bytes() == b".." {
            continue;
        }
        let parent = dir.fd()?;
        rustix::fs::chownat(parent, name, owner, group, AtFlags::SYMLINK_NOFOLLOW)?;
        let is_dir = match entry.file_type() {
            FileType::Directory => true,
            FileType::Unknown => {
                let stat = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)?;
                FileType::from_raw_mode(stat.st_mode) == FileType::Directory
            }
            _ => false,
        };
        if !is_dir {
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
