//! Seeds applied at create: the administrator's HOME template, and a git clone into the workspace.

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
    uid: Option<u32>,
) -> Result<()> {
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
/// followed); anything else is skipped.
fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
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
