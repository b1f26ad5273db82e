//! A `/proc` of the session's own under Landlock: what hides other processes' command lines.
//!
//! Landlock restricts paths, not processes: granting `/proc` (which programs need for their
//! own entries) grants every process's `/proc/<pid>/cmdline`, the broker's and other sessions'
//! included (a raw thread id on a command line, say). A Landlock worker of a broker running as
//! root therefore starts in a mount namespace of its own (util-linux `unshare --mount`), where a
//! new instance of procfs is mounted on `/proc` with `hidepid=invisible`: the agent, which then
//! runs as its session's own uid, sees only its own user's processes, its own children
//! included. The mount happens before Landlock's rules are applied, so the rules grant the
//! private `/proc`, not the host's.
//!
//! A broker that is not root cannot mount (and its sessions share its uid anyway): there, every
//! process's command line stays readable to every session, which [`shared_processes`] says at
//! startup and `oab-runtime verify` reports.

use std::path::{Path, PathBuf};

use super::host::{find_program, HostLayout, SystemEntry};

/// The shell that mounts the private `/proc` and executes the Landlock helper.
const SHELL: &str = "/bin/sh";
/// Its script: `MOUNT` (util-linux `mount`), then the command to execute. Without the mount the
/// worker never starts (exit 126): it never runs with the host's `/proc` where it was to have
/// its own.
const SCRIPT: &str = r#"mount="$1"; shift
"$mount" -t proc -o hidepid=invisible,nosuid,nodev,noexec proc /proc || {
  echo "oab: cannot mount the session's private /proc" >&2
  exit 126
}
exec "$@""#;

/// The util-linux programs a private `/proc` needs, when the broker can mount one: it runs as
/// root, and `unshare` and `mount` are in the system directories.
pub(crate) fn tools(layout: &HostLayout) -> Option<(PathBuf, PathBuf)> {
    if !layout.root {
        return None;
    }
    let in_system = |path: &Path| {
        layout
            .system
            .iter()
            .any(|entry| matches!(entry, SystemEntry::Dir(dir) if path.starts_with(dir)))
    };
    let unshare = find_program(
        "unshare",
        &[Path::new("/usr/bin/unshare"), Path::new("/bin/unshare")],
    )
    .filter(|path| in_system(path))?;
    let mount = find_program("mount", &[Path::new("/usr/bin/mount"), Path::new("/bin/mount")])
        .filter(|path| in_system(path))?;
    Some((unshare, mount))
}

/// `helper` with `args`, run with a private `/proc` when `tools` are given (see [`tools`]).
pub(crate) fn command(
    tools: Option<&(PathBuf, PathBuf)>,
    helper: &Path,
    args: Vec<std::ffi::OsString>,
) -> tokio::process::Command {
    match tools {
        Some((unshare, mount)) => {
            let mut command = tokio::process::Command::new(unshare);
            // `slave`: the host's later mounts still reach the session; its own never leave.
            command
                .args([
                    "--mount",
                    "--propagation",
                    "slave",
                    "--",
                    SHELL,
                    "-c",
                    SCRIPT,
                    "oab-private-proc",
                ])
                .arg(mount)
                .arg(helper)
                .args(args);
            command
        }
        None => {
            let mut command = tokio::process::Command::new(helper);
            command.args(args);
            command
        }
    }
}

/// What sessions of a Landlock sandbox can see of other processes, in one sentence for the
/// startup log and `verify`; `None` when each has a private `/proc` (`tools` found).
pub(crate) fn shared_processes(tools: Option<&(PathBuf, PathBuf)>, root: bool) -> Option<String> {
    if tools.is_some() {
        return None;
    }
    let why = if root {
        "util-linux `unshare` and `mount` were not found under /usr or /bin"
    } else {
        "the broker does not run as root, so it cannot mount one (and its sessions share its uid)"
    };
    Some(format!(
        "landlock without a private /proc ({why}): every session's agent can list the host's \
         processes and read each one's command line under /proc, the broker's and other \
         sessions' agents' included (their files stay hidden); use bubblewrap, or run the broker \
         as root, for a /proc of each session's own"
    ))
}
