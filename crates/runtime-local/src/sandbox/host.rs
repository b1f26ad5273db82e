//! What this host offers a sandbox: programs, system directories, and probes that run them.

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The system directories a sandbox may read (and execute from), in mount order. Only those that
/// exist are used; a symbolic link (e.g. `/bin -> usr/bin`) is reproduced as a link.
pub(crate) const SYSTEM_PATHS: [&str; 8] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
];

/// How long a probe (a trivial sandboxed `true`) may take before it counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// One system path as it exists on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SystemEntry {
    /// A directory, bound read-only at the same path.
    Dir(PathBuf),
    /// A symbolic link at `path` with content `target` (e.g. `/bin` -> `usr/bin`).
    Symlink {
        /// Where the link is.
        path: PathBuf,
        /// What it points to, verbatim.
        target: PathBuf,
    },
}

impl SystemEntry {
    /// The path of the directory or link.
    pub(crate) fn path(&self) -> &Path {
        match self {
            SystemEntry::Dir(path) | SystemEntry::Symlink { path, .. } => path,
        }
    }
}

/// Where a helper program of this crate is: `$env` if set, else next to the current executable
/// (or one directory up, for test binaries in `target/<profile>/deps`), else on `PATH`.
///
/// # Errors
///
/// Why it was not found, and how to install it.
pub(crate) fn locate_helper(name: &str, env: &str) -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(env) {
        return Ok(PathBuf::from(path));
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
        .map(|dir| {
            let up = dir.parent().map(|up| up.join(name));
            std::iter::once(dir.join(name)).chain(up).collect::<Vec<_>>()
        })
        .unwrap_or_default();
    beside
        .into_iter()
        .find(|candidate| is_executable(candidate))
        .or_else(|| find_program(name, &[]))
        .ok_or_else(|| {
            format!(
                "the `{name}` helper was not found next to the broker's executable, on PATH, or in \
                 ${env} (build it: `cargo build --release -p runtime-local --bin {name}`)"
            )
        })
}

/// The parts of the host a sandbox is built from. Detected once by [`HostLayout::detect`]; tests
/// build one by hand so that command lines are deterministic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostLayout {
    /// The system paths that exist, in [`SYSTEM_PATHS`] order.
    pub(crate) system: Vec<SystemEntry>,
    /// Whether `/etc/passwd` and `/etc/group` exist as files, so a sandbox can cover them with its
    /// own (naming the session's uid).
    pub(crate) etc_identity: bool,
    /// Where `/etc/resolv.conf` really is when it is a link out of `/etc` (e.g. into
    /// `/run/systemd/resolve`): the sandbox must see that file too for name resolution to work.
    pub(crate) resolv_conf: Option<PathBuf>,
    /// util-linux `setpriv`, which drops privileges inside a bubblewrap sandbox.
    pub(crate) setpriv: Option<PathBuf>,
    /// Whether the broker runs as root (effective uid 0).
    pub(crate) root: bool,
}

impl HostLayout {
    /// Reads this host.
    pub(crate) fn detect() -> Self {
        let system = SYSTEM_PATHS
            .iter()
            .filter_map(|path| {
                let path = PathBuf::from(path);
                let meta = std::fs::symlink_metadata(&path).ok()?;
                if meta.file_type().is_symlink() {
                    let target = std::fs::read_link(&path).ok()?;
                    Some(SystemEntry::Symlink { path, target })
                } else if meta.is_dir() {
                    Some(SystemEntry::Dir(path))
                } else {
                    None
                }
            })
            .collect::<Vec<_>>();
        let etc_identity = ["/etc/passwd", "/etc/group"]
            .iter()
            .all(|path| std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file()));
        let resolv_conf = std::fs::canonicalize("/etc/resolv.conf").ok().filter(|real| {
            !system
                .iter()
                .any(|entry| matches!(entry, SystemEntry::Dir(dir) if real.starts_with(dir)))
        });
        let setpriv = find_program(
            "setpriv",
            &[Path::new("/usr/bin/setpriv"), Path::new("/bin/setpriv")],
        )
        .filter(|path| {
            system
                .iter()
                .any(|entry| matches!(entry, SystemEntry::Dir(dir) if path.starts_with(dir)))
        });
        HostLayout {
            system,
            etc_identity,
            resolv_conf,
            setpriv,
            root: super::running_as_root(),
        }
    }
}

/// `name` on the broker's `PATH`, else the first of `fallbacks` that is an executable file.
pub(crate) fn find_program(name: &str, fallbacks: &[&Path]) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(name))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .filter(|candidate| candidate.is_absolute())
        .chain(fallbacks.iter().map(|p| p.to_path_buf()))
        .find(|candidate| is_executable(candidate))
}

/// Whether `path` is a regular file with an execute bit.
pub(crate) fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Runs `program args` with no input, waits up to [`PROBE_TIMEOUT`], and returns `Ok` if it
/// exited with 0, else what went wrong (its stderr, trimmed).
pub(crate) fn probe<I, S>(program: &Path, args: I) -> Result<(), String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < PROBE_TIMEOUT => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{} did not finish within {}s",
                    program.display(),
                    PROBE_TIMEOUT.as_secs()
                ));
            }
            Err(e) => return Err(format!("waiting for {}: {e}", program.display())),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.by_ref().take(4096).read_to_string(&mut stderr);
    }
    let stderr = stderr.trim();
    Err(if stderr.is_empty() {
        format!("{} failed ({status})", program.display())
    } else {
        format!("{} failed ({status}): {stderr}", program.display())
    })
}
