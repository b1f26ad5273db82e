//! Session storage as AgentCore is reported to limit it ([`StorageLimits`]), and how the
//! [`LocalLauncher`](crate::LocalLauncher) enforces that on the worker itself:
//!
//! - **The size cap** is a file system of that size: a sparse ext4 image per session
//!   (`mkfs.ext4`, no journal, no reserved blocks), loop-mounted on the host while the launcher
//!   lives. A write beyond it fails with `ENOSPC` from the kernel, whatever program writes.
//! - **Absent while the worker starts**: the session's working directory is made a mount point
//!   of its own (a shared one) before the worker starts, so the worker's sandbox sees it through
//!   mount propagation; the storage is bound onto it only once the worker has announced its port,
//!   just before the first request is forwarded. During start-up the worker sees an empty
//!   directory that is not the storage (what it writes there is hidden once the storage comes).
//!   At a stop both are unmounted again, so the next start meets no storage either.
//! - **No hard links, FIFOs, UNIX sockets, extended attributes or `fallocate`**: a seccomp filter
//!   (`oab-storage-rules`, which execs the worker) on the whole worker: see
//!   [`storage_rules`](crate::storage_rules) for the calls and errors.
//!
//! Mounting needs root, `mount` and `mkfs.ext4`; without them the launcher warns and leaves the
//! cap and the start-up absence unenforced ([`StorageEnforcement`] says which hold).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::error::WorkerError;

/// AgentCore's session storage limits as the emulator applies them to every session (as
/// reported by an AWS sample and a third-party write-up, not the API reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageLimits {
    /// The storage's size in bytes; a write beyond it fails with `ENOSPC` (default 1 GB, read
    /// as 1 GiB). `None`: the storage is a plain host directory.
    pub max_bytes: Option<u64>,
    /// Refuse hard links, FIFOs, UNIX sockets, extended attributes and `fallocate` (default
    /// `true`).
    pub refuse_special_files: bool,
    /// Keep the storage away from the worker until it has started, i.e. until the session's
    /// first invocation of that microVM (default `true`: "not mounted during start-up").
    pub absent_during_startup: bool,
}

impl StorageLimits {
    /// The reported size of a session's storage: 1 GB (taken as 1 GiB).
    pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

    /// No limits: the storage is the plain host directory it was before the emulator modelled
    /// them.
    pub fn unlimited() -> Self {
        Self {
            max_bytes: None,
            refuse_special_files: false,
            absent_during_startup: false,
        }
    }

    /// Whether anything has to be mounted for these limits.
    pub(crate) fn mounts(&self) -> bool {
        self.max_bytes.is_some() || self.absent_during_startup
    }
}

impl Default for StorageLimits {
    fn default() -> Self {
        Self {
            max_bytes: Some(Self::DEFAULT_MAX_BYTES),
            refuse_special_files: true,
            absent_during_startup: true,
        }
    }
}

/// Which of the configured [`StorageLimits`] a launcher enforces on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageEnforcement {
    /// The size cap (an ext4 image of that size).
    pub size_cap: bool,
    /// The start-up absence (a mount made after the worker announced).
    pub absent_during_startup: bool,
    /// The refusals (the seccomp filter of `oab-storage-rules`).
    pub refuse_special_files: bool,
}

/// The name of the storage's host directory, beside the worker's working directory.
pub(crate) const VOLUME_DIR: &str = "agentcore-storage";

/// The storage of one session: its host paths.
#[derive(Debug, Clone)]
pub(crate) struct SessionPaths {
    /// The local session's base directory (`root/<id>`).
    pub(crate) base: PathBuf,
    /// The worker's working directory, where the storage appears.
    pub(crate) workspace: PathBuf,
}

impl SessionPaths {
    /// The ext4 image.
    fn image(&self) -> PathBuf {
        self.base.join("agentcore-storage.ext4")
    }

    /// Where the storage lives on the host: the image's mount point (or a plain directory
    /// without a cap).
    pub(crate) fn volume(&self) -> PathBuf {
        self.base.join(VOLUME_DIR)
    }
}

/// What is mounted for one session.
#[derive(Debug)]
struct Mounted {
    /// The session's paths.
    paths: SessionPaths,
    /// The image is mounted at the volume directory.
    volume: bool,
    /// Mounts stacked on the workspace (its own shared bind, then the storage), bottom first.
    on_workspace: Vec<&'static str>,
}

/// Mounts and unmounts session storage for a launcher.
#[derive(Debug)]
pub(crate) struct StorageMounts {
    limits: StorageLimits,
    enforced: StorageEnforcement,
    mounted: Mutex<HashMap<PathBuf, Mounted>>,
}

impl StorageMounts {
    /// The plan for `limits` on this host; `rules` says whether the refusals can be enforced,
    /// `late_mounts` whether a mount made after the worker started reaches it (not under
    /// Landlock: its rules do not extend to a file system mounted on an allowed directory
    /// later, so the worker would be refused its own storage).
    pub(crate) fn new(limits: StorageLimits, rules: bool, late_mounts: bool) -> Self {
        let can_mount = limits.mounts() && can_mount();
        if limits.mounts() && !can_mount {
            tracing::warn!(
                "session storage limits: not root, or mount/mkfs.ext4 missing: the size cap and the \
                 start-up absence are not enforced"
            );
        }
        if limits.absent_during_startup && can_mount && !late_mounts {
            tracing::warn!("session storage under Landlock: it is there while the worker starts");
        }
        let enforced = StorageEnforcement {
            size_cap: limits.max_bytes.is_some() && can_mount,
            absent_during_startup: limits.absent_during_startup && can_mount && late_mounts,
            refuse_special_files: limits.refuse_special_files && rules,
        };
        Self {
            limits,
            enforced,
            mounted: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn enforced(&self) -> StorageEnforcement {
        self.enforced
    }

    /// Whether the storage lives apart from the workspace (in [`SessionPaths::volume`]).
    pub(crate) fn separate(&self) -> bool {
        self.enforced.size_cap || self.enforced.absent_during_startup
    }

    /// Before the worker starts: the volume ready (the image made and mounted the first time),
    /// and the workspace either a shared mount point of its own (the storage comes after the
    /// announcement) or the storage already.
    pub(crate) async fn before_start(&self, paths: &SessionPaths) -> Result<(), WorkerError> {
        if !self.separate() {
            return Ok(());
        }
        self.ensure_volume(paths).await?;
        if self.enforced.absent_during_startup {
            self.stack(
                paths,
                "self",
                &["--bind", &display(&paths.workspace), &display(&paths.workspace)],
            )
            .await?;
            run("mount", &["--make-private", &display(&paths.workspace)]).await?;
            run("mount", &["--make-shared", &display(&paths.workspace)]).await?;
            Ok(())
        } else {
            self.bind_storage(paths).await
        }
    }

    /// Once the worker announced (before the first request reaches it): the storage appears.
    pub(crate) async fn after_announce(&self, paths: &SessionPaths) -> Result<(), WorkerError> {
        if self.enforced.absent_during_startup {
            self.bind_storage(paths).await
        } else {
            Ok(())
        }
    }

    /// After the worker is gone (a stop, or a start that failed): the workspace is unmounted;
    /// the volume stays for the host's view and the next start.
    pub(crate) async fn after_stop(&self, paths: &SessionPaths) -> Result<(), WorkerError> {
        let stacked = self
            .mounted
            .lock()
            .get_mut(&paths.base)
            .map(|mounted| std::mem::take(&mut mounted.on_workspace))
            .unwrap_or_default();
        let mut first_error = None;
        for _ in stacked.iter().rev() {
            if let Err(error) = unmount(&paths.workspace).await {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Before the session's storage is deleted: everything of it unmounted.
    pub(crate) async fn release(&self, paths: &SessionPaths) -> Result<(), WorkerError> {
        self.after_stop(paths).await?;
        let volume = self
            .mounted
            .lock()
            .remove(&paths.base)
            .is_some_and(|mounted| mounted.volume);
        if volume {
            unmount(&paths.volume()).await?;
        }
        Ok(())
    }

    /// Unmounts everything at once (the launcher is dropped), lazily where a process still
    /// holds a mount: nothing stays in the mount table, and each loop device is freed when its
    /// last user is gone.
    pub(crate) fn release_all(&self) {
        for (_, mounted) in self.mounted.lock().drain() {
            for _ in &mounted.on_workspace {
                unmount_now(&mounted.paths.workspace);
            }
            if mounted.volume {
                unmount_now(&mounted.paths.volume());
            }
        }
    }

    async fn ensure_volume(&self, paths: &SessionPaths) -> Result<(), WorkerError> {
        let volume = paths.volume();
        std::fs::create_dir_all(&volume).map_err(|e| start_error("making the storage directory", &e))?;
        let Some(size) = self.limits.max_bytes.filter(|_| self.enforced.size_cap) else {
            return Ok(());
        };
        if self.mounted.lock().get(&paths.base).is_some_and(|m| m.volume) {
            return Ok(());
        }
        let image = paths.image();
        let fresh = !image.exists();
        if fresh {
            let made = std::fs::File::create_new(&image).and_then(|file| file.set_len(size));
            if let Err(error) = made {
                let _ = std::fs::remove_file(&image);
                return Err(start_error("making the storage image", &error));
            }
            let formatted = run(
                "mkfs.ext4",
                &["-q", "-F", "-m", "0", "-O", "^has_journal", &display(&image)],
            )
            .await;
            if let Err(error) = formatted {
                let _ = std::fs::remove_file(&image);
                return Err(error);
            }
        }
        run(
            "mount",
            &[
                "-t",
                "ext4",
                "-o",
                "loop,nodev,nosuid",
                &display(&image),
                &display(&volume),
            ],
        )
        .await?;
        self.entry(paths, |mounted| mounted.volume = true);
        if fresh {
            // mkfs's lost+found is not part of an empty session storage.
            let _ = std::fs::remove_dir(volume.join("lost+found"));
        }
        Ok(())
    }

    /// Binds the volume onto the workspace, owned and moded as the workspace is (the local
    /// backend made that the worker's).
    async fn bind_storage(&self, paths: &SessionPaths) -> Result<(), WorkerError> {
        let volume = paths.volume();
        let meta =
            std::fs::metadata(&paths.workspace).map_err(|e| start_error("inspecting the workspace", &e))?;
        std::os::unix::fs::chown(&volume, Some(meta.uid()), Some(meta.gid()))
            .map_err(|e| start_error("handing the storage to the worker", &e))?;
        std::fs::set_permissions(&volume, meta.permissions())
            .map_err(|e| start_error("handing the storage to the worker", &e))?;
        self.stack(
            paths,
            "storage",
            &["--bind", &display(&volume), &display(&paths.workspace)],
        )
        .await
    }

    /// Mounts onto the workspace and records it.
    async fn stack(
        &self,
        paths: &SessionPaths,
        what: &'static str,
        args: &[&str],
    ) -> Result<(), WorkerError> {
        run("mount", args).await?;
        self.entry(paths, |mounted| mounted.on_workspace.push(what));
        Ok(())
    }

    /// Changes the record of what is mounted for `paths`' session.
    fn entry(&self, paths: &SessionPaths, change: impl FnOnce(&mut Mounted)) {
        let mut table = self.mounted.lock();
        let mounted = table.entry(paths.base.clone()).or_insert_with(|| Mounted {
            paths: paths.clone(),
            volume: false,
            on_workspace: Vec::new(),
        });
        change(mounted);
    }
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

fn start_error(what: &str, error: &std::io::Error) -> WorkerError {
    WorkerError::Start(format!("session storage: {what}: {error}"))
}

/// Whether this process can mount session storage: root, with `mount` and `mkfs.ext4`.
fn can_mount() -> bool {
    let root = std::fs::metadata("/proc/self").is_ok_and(|meta| meta.uid() == 0);
    root && ["mount", "umount", "mkfs.ext4"]
        .iter()
        .all(|tool| find_tool(tool).is_some())
}

/// `tool` on the PATH or in the sbin directories.
fn find_tool(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(tool))
        .find(|candidate| candidate.is_file())
}

/// Runs `tool args`, its failure (with its stderr) a start error.
async fn run(tool: &str, args: &[&str]) -> Result<(), WorkerError> {
    let program = find_tool(tool).ok_or_else(|| WorkerError::Start(format!("session storage: no {tool}")))?;
    let output = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| start_error(&format!("running {tool}"), &e))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(WorkerError::Start(format!(
            "session storage: {tool} {}: {} ({})",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim(),
            output.status
        )))
    }
}

/// Unmounts the top mount at `path`; lazily if it is busy.
async fn unmount(path: &Path) -> Result<(), WorkerError> {
    let target = display(path);
    if run("umount", &[&target]).await.is_ok() {
        return Ok(());
    }
    run("umount", &["--lazy", &target])
        .await
        .map_err(|e| WorkerError::Stop(e.to_string()))
}

/// [`unmount`], lazily and without waiting on a runtime (for `Drop`).
fn unmount_now(path: &Path) {
    if let Some(umount) = find_tool("umount") {
        let status = std::process::Command::new(umount)
            .arg("--lazy")
            .arg(path)
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        if !status.is_ok_and(|s| s.success()) {
            tracing::warn!(path = %path.display(), "could not unmount session storage");
        }
    }
}
