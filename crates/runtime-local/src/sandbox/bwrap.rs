//! The bubblewrap command line.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use parking_lot::Mutex;
use session_runtime::config::{NetworkMode, ReadonlyMount};
use session_runtime::Error;

use super::host::{self, HostLayout, SystemEntry};
use super::needs::{Needed, Why};
use super::storage::IdentityFiles;
use super::{
    cannot_switch, invalid, LaunchSpec, READONLY_KEY, SANDBOX_HOME, SANDBOX_STATE, SANDBOX_TMP,
    SANDBOX_WORKSPACE,
};

/// The sandbox's host name (it has its own uts namespace, so the host's name does not leak).
pub(crate) const SANDBOX_HOSTNAME: &str = "openab";

/// The paths a bubblewrap sandbox creates itself besides the system directories; a read-only
/// input may not cover them.
const OWN_PATHS: [&str; 11] = [
    "/proc",
    "/dev",
    "/home",
    SANDBOX_HOME,
    SANDBOX_WORKSPACE,
    SANDBOX_TMP,
    SANDBOX_STATE,
    HOST_PROGRAMS,
    SANDBOX_FORWARDER,
    SANDBOX_EGRESS_SOCKETS,
    SANDBOX_SCOPER,
];

/// The namespace and lifetime options, shared by the sandbox and its probe.
fn isolation_args(network: NetworkMode) -> Vec<&'static str> {
    let mut args = vec![
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
    ];
    if network != NetworkMode::Host {
        args.push("--unshare-net");
    }
    args
}

/// Where a bubblewrap sandbox shows the `oab-egress-forward` helper.
pub(crate) const SANDBOX_FORWARDER: &str = "/run/openab/egress-forward";
/// Where a bubblewrap sandbox shows the directory of the session's proxy sockets.
pub(crate) const SANDBOX_EGRESS_SOCKETS: &str = "/run/openab/egress";
/// Where a bubblewrap sandbox that shares the host's network namespace shows the
/// `oab-landlock-exec` helper, which confines the agent to Landlock's scopes before it runs.
pub(crate) const SANDBOX_SCOPER: &str = "/run/openab/landlock-exec";

/// `setpriv`'s options that switch to `uid` and drop every privilege; the program follows.
fn setpriv_args(uid: u32) -> Vec<String> {
    vec![
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".to_owned(),
        "--inh-caps=-all".to_owned(),
        "--ambient-caps=-all".to_owned(),
        "--bounding-set=-all".to_owned(),
        "--no-new-privs".to_owned(),
        "--".to_owned(),
    ]
}

/// Probe results by `bwrap` path and whether the network is unshared.
type ProbeResults = HashMap<(PathBuf, bool), Result<(), String>>;

/// Results of probes: each runs once per process.
static PROBES: OnceLock<Mutex<ProbeResults>> = OnceLock::new();

/// A `bwrap` that works here with the namespaces sessions use: `explicit`, else the one on
/// `PATH`, else `/usr/bin/bwrap`. As root it must also be able to drop to an unprivileged uid
/// with `setpriv` inside.
///
/// # Errors
///
/// Why not, in a few words.
pub(super) fn find_working(
    explicit: Option<&Path>,
    network: NetworkMode,
    layout: &HostLayout,
) -> Result<PathBuf, String> {
    let bwrap = match explicit {
        Some(path) if host::is_executable(path) => path.to_path_buf(),
        Some(path) => return Err(format!("{} is not an executable file", path.display())),
        None => host::find_program("bwrap", &[Path::new("/usr/bin/bwrap")])
            .ok_or_else(|| "`bwrap` is not on PATH nor at /usr/bin/bwrap".to_owned())?,
    };
    if layout.root && layout.setpriv.is_none() {
        return Err(
            "the broker runs as root, and dropping to a per-session uid inside the sandbox needs \
                    util-linux `setpriv` under /usr or /bin, which was not found"
                .to_owned(),
        );
    }
    let key = (bwrap.clone(), network != NetworkMode::Host);
    let probes = PROBES.get_or_init(Mutex::default);
    if let Some(result) = probes.lock().get(&key) {
        return result.clone().map(|()| bwrap);
    }
    let mut args: Vec<OsString> = vec!["--ro-bind".into(), "/".into(), "/".into()];
    args.extend(isolation_args(network).into_iter().map(OsString::from));
    args.extend(["--dev", "/dev", "--proc", "/proc", "--"].map(OsString::from));
    match &layout.setpriv {
        Some(setpriv) if layout.root => {
            args.push(setpriv.clone().into_os_string());
            args.extend(setpriv_args(65534).into_iter().map(OsString::from));
        }
        _ => {}
    }
    args.push("true".into());
    let result = host::probe(&bwrap, &args);
    probes.lock().insert(key, result.clone());
    result.map(|()| bwrap)
}

/// Refuses read-only inputs whose sandbox path would cover, or sit inside, a directory the
/// sandbox sets up itself (system directories, `/proc`, `/dev`, the session's storage): bubblewrap
/// would hide that directory, or create a mount point inside the session's or the host's files.
pub(super) fn check_mounts(layout: &HostLayout, readonly: &[ReadonlyMount]) -> Result<(), Error> {
    let system = layout.system.iter().map(|entry| entry.path().to_path_buf());
    let own = OWN_PATHS.iter().map(PathBuf::from);
    let reserved: Vec<PathBuf> = system.chain(own).collect();
    for (index, mount) in readonly.iter().enumerate() {
        let target = mount.target();
        let clash = reserved.iter().find(|path| {
            // `/home` itself is only a parent: inputs may live beside `/home/agent`.
            (target.starts_with(path) && path.as_path() != Path::new("/home")) || path.starts_with(target)
        });
        if let Some(path) = clash {
            return Err(invalid(
                READONLY_KEY,
                format!(
                    "entry {} ({mount}): sandbox path {} overlaps {}, which the sandbox sets up itself; \
                     choose another sandbox path, e.g. /skills or /opt/<name>",
                    index + 1,
                    target.display(),
                    path.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Sandbox paths that replace whatever the host has there.
const REPLACED: [&str; 6] = [
    "/proc",
    "/dev",
    SANDBOX_HOME,
    SANDBOX_WORKSPACE,
    SANDBOX_TMP,
    SANDBOX_STATE,
];

/// Where a program from a replaced host directory is shown: `/run/host/<its host path>`.
pub(crate) const HOST_PROGRAMS: &str = "/run/host";

/// Where a bubblewrap sandbox shows the host path `real`: at the same path, or under
/// [`HOST_PROGRAMS`] when that path is one the sandbox replaces.
fn shown_at(real: &Path) -> PathBuf {
    if REPLACED.iter().any(|p| real.starts_with(p)) {
        Path::new(HOST_PROGRAMS).join(real.strip_prefix("/").unwrap_or(real))
    } else {
        real.to_path_buf()
    }
}

/// Whether the sandbox shows `path` as the host has it, with the system directories and their
/// links (`/bin/sh` through `/bin -> usr/bin`).
fn shown_as_system(layout: &HostLayout, path: &Path) -> bool {
    layout.system.iter().any(|entry| path.starts_with(entry.path()))
}

/// Refuses what the agent needs (besides its program, the program's directory and its package,
/// which are moved under [`HOST_PROGRAMS`]) that lies under a directory the sandbox replaces with
/// its own: it could not be shown where the agent looks for it.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the path's key, the path and the directory.
pub(super) fn check_showable(needed: &[Needed]) -> Result<(), Error> {
    let replaced: Vec<&str> = REPLACED.iter().copied().chain([HOST_PROGRAMS]).collect();
    check_not_under(
        needed,
        &replaced,
        "the bubblewrap sandbox replaces it with its own, so the agent could not find it there",
    )
}

/// The host directories that no sandbox shows to an agent as the host has them: bubblewrap
/// replaces them with its own, so Landlock refuses them too, for a configuration to mean the
/// same in both (granting the host's `/tmp` would show every file any user left there).
pub(super) const HOST_PRIVATE: [&str; 3] = ["/tmp", "/proc", "/dev"];

/// Refuses what the agent needs (besides its program and the program's directory) that lies
/// under one of `directories`, saying `why`.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the path's key, the path and the directory.
pub(super) fn check_not_under(needed: &[Needed], directories: &[&str], why: &str) -> Result<(), Error> {
    for need in needed {
        if matches!(need.why, Why::Command | Why::CommandDir | Why::PackageRoot) {
            continue;
        }
        for path in [&need.named, &need.real] {
            if let Some(directory) = directories.iter().find(|directory| path.starts_with(directory)) {
                return Err(invalid(
                    need.why.key(),
                    format!(
                        "{} lies under {directory}: {why}; install it elsewhere",
                        path.display()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// How a bubblewrap sandbox shows what the agent needs.
#[derive(Debug, Default, PartialEq, Eq)]
struct NeedMounts {
    /// Host paths (directories or files) and where they are shown, read-only.
    binds: Vec<(PathBuf, PathBuf)>,
    /// Links to create: target, then where (a need named through a link the sandbox lacks).
    links: Vec<(PathBuf, PathBuf)>,
}

/// The binds and links that show `needed`: each real path at its own path (see [`shown_at`]),
/// unless the system directories or an enclosing needed directory already show it, and a link at
/// each named path that is not the real one and would otherwise be missing (e.g. a virtual
/// environment's `bin/python` linking to the interpreter).
fn need_mounts(layout: &HostLayout, needed: &[Needed]) -> NeedMounts {
    let mut candidates: Vec<(PathBuf, PathBuf)> = needed
        .iter()
        // The program is shown with its directory, or by `program_mount`.
        .filter(|need| need.why != Why::Command && !shown_as_system(layout, &need.real))
        .map(|need| (need.real.clone(), shown_at(&need.real)))
        .collect();
    // Enclosing directories first: what lies inside one is shown by it.
    candidates.sort_by_key(|(_, shown)| shown.components().count());
    let mut mounts = NeedMounts::default();
    for (host, shown) in candidates {
        if !mounts.binds.iter().any(|(_, outer)| shown.starts_with(outer)) {
            mounts.binds.push((host, shown));
        }
    }
    for need in needed {
        let missing = need.named != need.real
            && !shown_as_system(layout, &need.named)
            && !REPLACED.iter().any(|p| need.named.starts_with(p))
            && !mounts
                .binds
                .iter()
                .any(|(_, outer)| need.named.starts_with(outer))
            && !mounts.links.iter().any(|(_, at)| *at == need.named);
        if missing && need.why != Why::Command {
            mounts.links.push((shown_at(&need.real), need.named.clone()));
        }
    }
    mounts
}

/// Creates every directory leading to `at` that the sandbox does not have yet, mode 0755, so a
/// session running as its own user can pass them whatever the host's modes are.
fn need_parents(args: &mut Args, layout: &HostLayout, at: &Path, created: &mut Vec<PathBuf>) {
    let parents: Vec<&Path> = at.ancestors().skip(1).collect();
    for parent in parents.into_iter().rev() {
        let exists = parent == Path::new("/")
            || parent == Path::new("/home")
            || layout.system.iter().any(|entry| parent.starts_with(entry.path()))
            || created.iter().any(|made| made == parent);
        if !exists {
            args.push("--perms").push("0755").push("--dir").push(parent);
            created.push(parent.to_path_buf());
        }
    }
}

/// How the agent program gets into the sandbox: its real file (links resolved, so
/// `/usr/local/bin/agent -> /opt/agent/bin/agent` binds the real file), bound read-only at the
/// same path, or under [`HOST_PROGRAMS`] when that path is one the sandbox replaces (e.g. an agent
/// built under the host's `/tmp`). Returns the host file
/// and the path to execute. A name without `/` (looked up on `PATH`), a missing file, and a path
/// under a read-only input's sandbox path, `/workspace`, `/home/agent` or `/state` (a file inside
/// the sandbox) need no mount; the caller binds nothing for a real file in the system
/// directories.
fn program_mount(readonly: &[ReadonlyMount], program: &str) -> Option<(PathBuf, PathBuf)> {
    let path = Path::new(program);
    let inside = [SANDBOX_WORKSPACE, SANDBOX_HOME, SANDBOX_STATE]
        .iter()
        .any(|p| path.starts_with(p))
        || readonly.iter().any(|mount| path.starts_with(mount.target()));
    if !path.is_absolute() || inside {
        return None;
    }
    // Missing: executing it fails with a clear "no such file" from bubblewrap.
    let real = std::fs::canonicalize(path).ok()?;
    let shown = shown_at(&real);
    Some((real, shown))
}

/// The path a bubblewrap sandbox executes the program by, configured as the absolute path `named`
/// (links not resolved) with its real file `real` shown at `shown`, and a link to create first
/// (target, then where), if any. It is `named` itself wherever the sandbox can have it: a program
/// may depend on the path it was started by, as a Python virtual environment's `bin/python` (a
/// link to an interpreter elsewhere) does to find its `pyvenv.cfg`. So `named` is used as the
/// sandbox shows it (a system directory, or a directory shown whole) or as a link created to the
/// real file; only a program moved under [`HOST_PROGRAMS`], or named under a directory the
/// sandbox replaces, is started by the path it is shown at.
fn exec_path(
    layout: &HostLayout,
    mounts: &NeedMounts,
    named: &Path,
    real: &Path,
    shown: &Path,
) -> (PathBuf, Option<(PathBuf, PathBuf)>) {
    let replaced = REPLACED
        .iter()
        .chain(&[HOST_PROGRAMS])
        .any(|replaced| named.starts_with(replaced));
    if named == real || shown != real || replaced {
        return (shown.to_path_buf(), None);
    }
    let visible = shown_as_system(layout, named)
        || mounts.binds.iter().any(|(_, at)| named.starts_with(at))
        || mounts.links.iter().any(|(_, at)| at == named);
    if visible {
        (named.to_path_buf(), None)
    } else {
        (
            named.to_path_buf(),
            Some((shown.to_path_buf(), named.to_path_buf())),
        )
    }
}

/// The arguments of `bwrap` (not `bwrap` itself) that run `spec` in a sandbox. With `scoper`
/// (the `oab-landlock-exec` helper, for a sandbox in the host's network namespace), the agent
/// runs through its `--scopes-only` mode, so it cannot reach the abstract UNIX sockets of
/// processes outside the session, which a network namespace of its own would otherwise hide.
///
/// # Errors
///
/// [`Error::Backend`] if `spec.uid` is set but the broker is not root (it cannot switch users),
/// or `setpriv` is missing.
pub(crate) fn bwrap_args(
    layout: &HostLayout,
    network: NetworkMode,
    readonly: &[ReadonlyMount],
    spec: &LaunchSpec<'_>,
    identity: Option<&IdentityFiles>,
    scoper: Option<&Path>,
) -> Result<Vec<OsString>, Error> {
    let setpriv = match spec.uid {
        None => None,
        Some(uid) if !layout.root => return Err(cannot_switch(spec.id, uid)),
        Some(uid) => match &layout.setpriv {
            Some(setpriv) => Some((setpriv, uid)),
            None => {
                return Err(Error::Backend {
                    runtime: crate::RUNTIME,
                    retryable: false,
                    message: format!(
                        "session {} needs util-linux `setpriv` to drop to uid {uid}; it was not found",
                        spec.id
                    ),
                    source: None,
                })
            }
        },
    };

    let mut args = Args::default();
    for flag in isolation_args(network) {
        args.push(flag);
    }
    args.push("--hostname").push(SANDBOX_HOSTNAME);
    if setpriv.is_none() {
        // Running as the broker's user: no capability (meaningful when that user is root).
        args.push("--cap-drop").push("ALL");
    }
    for entry in &layout.system {
        match entry {
            SystemEntry::Dir(path) => args.push("--ro-bind").push(path).push(path),
            SystemEntry::Symlink { path, target } => args.push("--symlink").push(target).push(path),
        };
    }
    if network == NetworkMode::Host {
        if let Some(resolv) = &layout.resolv_conf {
            args.push("--ro-bind").push(resolv).push(resolv);
        }
    }
    if let Some(identity) = identity {
        args.push("--ro-bind").push(&identity.passwd).push("/etc/passwd");
        args.push("--ro-bind").push(&identity.group).push("/etc/group");
    }
    args.push("--proc").push("/proc");
    args.push("--dev").push("/dev");
    args.push("--perms").push("0755").push("--dir").push("/home");
    args.push("--bind").push(&spec.dirs.home).push(SANDBOX_HOME);
    args.push("--bind")
        .push(&spec.dirs.workspace)
        .push(SANDBOX_WORKSPACE);
    args.push("--bind").push(&spec.dirs.tmp).push(SANDBOX_TMP);
    args.push("--bind").push(&spec.dirs.state).push(SANDBOX_STATE);
    for mount in readonly {
        traversable_parents(&mut args, mount.target());
        args.push("--ro-bind").push(mount.host()).push(mount.target());
    }
    let mounts = need_mounts(layout, spec.needs);
    let mut created = Vec::new();
    let mut mounted_needs: Vec<(PathBuf, String)> = Vec::new();
    for (host, shown) in &mounts.binds {
        need_parents(&mut args, layout, shown, &mut created);
        // bubblewrap resolves the source to a name again: the mount is checked inside.
        if let Some(identity) = spec.pinned.identity(host) {
            mounted_needs.push((shown.clone(), identity));
        }
        args.push("--ro-bind").push(host).push(shown);
    }
    for (target, at) in &mounts.links {
        need_parents(&mut args, layout, at, &mut created);
        args.push("--symlink").push(target).push(at);
    }
    let mut program = OsString::from(spec.program);
    // A name looked up on `PATH` is started by the path it was found at on the host (the
    // sandbox does not show that directory unless it is a system one).
    let configured = match spec.needs.iter().find(|need| need.why == Why::Command) {
        Some(found) if !spec.program.contains('/') => found.named.to_str().unwrap_or(spec.program),
        _ => spec.program,
    };
    if let Some((real, shown)) = program_mount(readonly, configured) {
        let with_its_directory = mounts.binds.iter().find_map(|(host, at)| {
            let inside = real.strip_prefix(host).ok()?;
            Some(at.join(inside))
        });
        let in_system = layout
            .system
            .iter()
            .any(|entry| matches!(entry, SystemEntry::Dir(dir) if real.starts_with(dir)));
        let shown = match with_its_directory {
            _ if in_system => real.clone(),
            Some(shown) => shown,
            None => {
                traversable_parents(&mut args, &shown);
                if let Some(identity) = spec.pinned.identity(&real) {
                    mounted_needs.push((shown.clone(), identity));
                }
                args.push("--ro-bind").push(&real).push(&shown);
                shown
            }
        };
        let (path, link) = exec_path(layout, &mounts, Path::new(configured), &real, &shown);
        if let Some((target, at)) = link {
            need_parents(&mut args, layout, &at, &mut created);
            args.push("--symlink").push(target).push(at);
        }
        program = path.into_os_string();
    }
    if let Some(egress) = spec.egress {
        traversable_parents(&mut args, Path::new(SANDBOX_EGRESS_SOCKETS));
        args.push("--ro-bind")
            .push(&egress.forwarder)
            .push(SANDBOX_FORWARDER);
        args.push("--ro-bind")
            .push(&egress.socket_dir)
            .push(SANDBOX_EGRESS_SOCKETS);
    }
    if let Some(scoper) = scoper {
        traversable_parents(&mut args, Path::new(SANDBOX_SCOPER));
        args.push("--ro-bind").push(scoper).push(SANDBOX_SCOPER);
    }
    let working_dir = match spec.working_dir {
        Some(relative) => Path::new(SANDBOX_WORKSPACE).join(relative),
        None => PathBuf::from(SANDBOX_WORKSPACE),
    };
    args.push("--chdir").push(working_dir);
    args.push("--");
    if !mounted_needs.is_empty() {
        // In the sandbox's own mount namespace, before anything of the agent's runs: each need
        // mounted is the file that was checked (a bind mount has its source's device and inode).
        args.push(NEEDS_CHECK_SHELL)
            .push("-c")
            .push(NEEDS_CHECK_SCRIPT)
            .push("oab-needs-check");
        for (shown, identity) in &mounted_needs {
            args.push(shown).push(identity);
        }
        args.push("--");
    }
    if let Some((setpriv, uid)) = setpriv {
        args.push(setpriv);
        for arg in setpriv_args(uid) {
            args.push(arg);
        }
    }
    if scoper.is_some() {
        // After `setpriv`, which sets `no_new_privs` (Landlock needs it, or the helper sets it).
        args.push(SANDBOX_SCOPER).push("--scopes-only").push("--");
    }
    if let Some(egress) = spec.egress {
        // The forwarder runs as the agent's user, then executes the agent in its place.
        args.push(SANDBOX_FORWARDER);
        for (address, socket) in &egress.listens {
            args.push("--listen").push(format!(
                "{address}={}",
                Path::new(SANDBOX_EGRESS_SOCKETS).join(socket).display()
            ));
        }
        args.push("--");
    }
    args.push(program);
    for arg in spec.args {
        args.push(arg);
    }
    Ok(args.0)
}

/// The shell that checks, inside the sandbox, that each need mounted is the file checked.
const NEEDS_CHECK_SHELL: &str = "/bin/sh";
/// Its script: `PATH DEVICE:INODE` pairs, `--`, then the command to execute when all match; exit
/// 126 saying which differs otherwise. `stat` is coreutils' (under `/usr`, always shown).
const NEEDS_CHECK_SCRIPT: &str = r#"while [ "$1" != -- ]; do
  found=$(/usr/bin/stat -c %d:%i -- "$1") || {
    echo "oab: cannot check $1 with /usr/bin/stat (coreutils), so it is not shown" >&2
    exit 126
  }
  [ "$found" = "$2" ] || {
    echo "oab: $1 is not what was checked (the host path changed while the sandbox was set up)" >&2
    exit 126
  }
  shift 2
done
shift
exec "$@""#;

/// Creates the missing parents of a mount target as 0755, so a session running as its own user
/// can reach it (bubblewrap would otherwise create them 0700, owned by root).
fn traversable_parents(args: &mut Args, target: &Path) {
    let parents: Vec<&Path> = target
        .ancestors()
        .skip(1)
        .filter(|p| p.parent().is_some())
        .collect();
    for parent in parents.into_iter().rev() {
        if ["/usr", "/etc", "/proc", "/dev", "/home", "/tmp"]
            .iter()
            .any(|system| parent.starts_with(system))
        {
            continue;
        }
        args.push("--perms").push("0755").push("--dir").push(parent);
    }
}

/// An argument list being built.
#[derive(Default)]
struct Args(Vec<OsString>);

impl Args {
    fn push(&mut self, arg: impl Into<OsString>) -> &mut Self {
        self.0.push(arg.into());
        self
    }
}
