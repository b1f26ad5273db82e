//! Seeds applied at create: a copy of another session's storage, the administrator's HOME
//! template, and a git clone into the workspace.

use std::fs;
use std::io;
use std::path::Path;
use std::process::Stdio;

use session_runtime::{CreateOptions, Error, Result, WorkspaceSeed};

use crate::layout::SessionDirs;
use crate::{LocalSettings, RUNTIME};

pub(crate) async fn provision(
    settings: &LocalSettings,
    dirs: &SessionDirs,
    options: &CreateOptions,
    copy_from: Option<&SessionDirs>,
    uid: Option<u32>,
) -> Result<()> {
    // The copy first, so the administrator's template has the last word on HOME.
    if let Some(source) = copy_from {
        for (from, to) in [(&source.workspace, &dirs.workspace), (&source.home, &dirs.home)] {
            copy_tree(from, to)
                .map_err(|e| crate::backend_error(false, "copying another session's storage", e))?;
        }
    }
    if let Some(template) = &settings.home_template {
        copy_tree(template, &dirs.home)
            .map_err(|e| crate::backend_error(false, "copying the HOME template into the session", e))?;
    }
    if let Some(WorkspaceSeed::GitClone { url, reference }) = &options.workspace_seed {
        clone(url, reference.as_deref(), dirs).await?;
    }
    if let Some(uid) = uid {
        for dir in [&dirs.home, &dirs.workspace] {
            chown_tree(dir, uid)
                .map_err(|e| crate::backend_error(false, "handing seeded files to the session", e))?;
        }
    }
    Ok(())
}

/// Gives everything under `path` (not following symlinks) to `uid`, so a session running as its own
/// user owns its seeded files.
fn chown_tree(path: &Path, uid: u32) -> io::Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))?;
    if fs::symlink_metadata(path)?.is_dir() {
        for entry in fs::read_dir(path)? {
            chown_tree(&entry?.path(), uid)?;
        }
    }
    Ok(())
}

/// Copies directories, regular files (with their permission bits) and symlinks (as symlinks, never
/// followed); anything else is skipped. What `from` has replaces what `to` has under the same
/// name, and is never written through a link there: a copied session's HOME may hold links an
/// agent planted where the template's files go.
fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        match fs::symlink_metadata(&target) {
            Ok(existing) if existing.is_dir() && kind.is_dir() => {}
            Ok(existing) if existing.is_dir() => fs::remove_dir_all(&target)?,
            Ok(_) => fs::remove_file(&target)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            fs::copy(entry.path(), &target)?;
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(entry.path())?, &target)?;
        }
    }
    Ok(())
}

async fn clone(url: &str, reference: Option<&str>, dirs: &SessionDirs) -> Result<()> {
    let mut command = tokio::process::Command::new("git");
    command.arg("clone").arg("--quiet");
    if let Some(reference) = reference {
        command.arg("--branch").arg(reference);
    }
    command
        .arg("--")
        .arg(url)
        .arg(&dirs.workspace)
        .env_clear()
        .env(
            "PATH",
            std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
        )
        .env("HOME", &dirs.home)
        .env("GIT_TERMINAL_PROMPT", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let output = command
        .output()
        .await
        .map_err(|e| crate::backend_error(false, "running git clone", e))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    Err(Error::Backend {
        runtime: RUNTIME,
        retryable: false,
        message: format!("git clone into the session workspace failed: {}", stderr.trim()),
        source: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_replaces_links_at_its_names_and_never_writes_through_them() {
        let scratch = tempfile::tempdir().expect("scratch");
        let (from, to, outside) = (
            scratch.path().join("from"),
            scratch.path().join("to"),
            scratch.path().join("outside"),
        );
        fs::create_dir_all(from.join("dir")).expect("from");
        fs::create_dir_all(&to).expect("to");
        fs::create_dir_all(&outside).expect("outside");
        fs::write(from.join("file"), "copied").expect("file");
        fs::write(from.join("dir/inner"), "inner").expect("inner");
        fs::write(outside.join("victim"), "untouched").expect("victim");
        std::os::unix::fs::symlink(outside.join("victim"), to.join("file")).expect("file link");
        std::os::unix::fs::symlink(&outside, to.join("dir")).expect("dir link");

        copy_tree(&from, &to).expect("copy");

        assert_eq!(
            fs::read_to_string(outside.join("victim")).expect("victim"),
            "untouched"
        );
        assert!(
            !outside.join("inner").exists(),
            "nothing written through the directory link"
        );
        assert!(fs::symlink_metadata(to.join("file")).expect("file").is_file());
        assert!(fs::symlink_metadata(to.join("dir")).expect("dir").is_dir());
        assert_eq!(fs::read_to_string(to.join("dir/inner")).expect("inner"), "inner");
    }
}
