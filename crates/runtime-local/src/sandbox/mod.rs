//! How a session's agent is confined: plain, bubblewrap or Landlock; a uid per session; private
//! storage; optional cgroup limits.
//!
//! [`Sandbox::detect`] turns the configured `sandbox` mode into a working mechanism (or a clear
//! [`Error::InvalidConfig`]), once, when the runtime is built. Per session, the runtime then calls,
//! in this order:
//!
//! 1. [`Sandbox::allocate_uid`]: a uid of the session's own when the broker runs as root;
//! 2. [`Sandbox::prepare_storage`]: the session's directories made private to that uid;
//! 3. [`Sandbox::check_needs`] (also before 1, at create): what the agent needs may be shown and
//!    can be reached by the session's user;
//! 4. [`Sandbox::command`]: the command that starts the agent confined (the caller adds the
//!    environment, stdio and process group, and spawns it);
//! 5. [`Sandbox::prepare_limits`] (before 4): the session's cgroups, with optional limits,
//!    which the worker is in before its program starts ([`Sandbox::cgroup_entry`]);
//! 6. [`Sandbox::release_uid`] when the session's storage is gone.
//!
//! # Modes
//!
//! **Plain** (`sandbox = "none"`): the agent is a plain child process running as the broker's
//! user, as upstream OpenAB runs it. Nothing is isolated, and [`Sandbox::isolation`] says so.
//!
//! **Bubblewrap**: the agent runs under `bwrap` in new pid, ipc and uts namespaces (and a new,
//! empty network namespace with `network = "none"`, the default; with `"allowlist"` too, where the
//! `oab-egress-forward` helper of [`EgressLaunch`] starts first and executes the agent; with
//! `"host"`, the host's network namespace, where the agent is started through
//! `oab-landlock-exec --scopes-only` when the kernel has Landlock's scopes, so sessions cannot
//! connect to each other's abstract UNIX sockets), in a new terminal session, killed when the
//! broker dies. Its root is an empty tmpfs holding only: the system directories read-only
//! ([`SYSTEM_PATHS`](host::SYSTEM_PATHS), links reproduced as links), a fresh `/proc` and `/dev`,
//! the session's workspace at `/workspace`, HOME at `/home/agent`, scratch directory at `/tmp`
//! and agent state at `/state` (read-write), the configured read-only inputs, and what the agent
//! needs ([`needs`]: `[agent] needs`, the directory of the program's file, its `#!` interpreter,
//! its package, files named in its arguments)
//! read-only at the same paths, when outside all of these (a program from a directory the sandbox
//! replaces, such as the host's `/tmp`, is shown with its directory under `/run/host`). No other session's storage exists in its
//! view, at any path. When the broker runs as root, bubblewrap sets up the sandbox as root and
//! util-linux `setpriv` then switches to the session's uid and gid, clears supplementary groups,
//! every capability set and sets `no_new_privs`, just before the agent is executed (bubblewrap's
//! own `--uid` needs a user namespace, which a root broker does not use). `/etc/passwd` and
//! `/etc/group` are covered by small generated files naming that uid `agent`, so programs that
//! look their user up work. Without a uid (a broker that is not root) the agent runs as the
//! broker's user with every capability dropped.
//!
//! **Landlock**: the agent is started through the `oab-landlock-exec` helper (a binary of this
//! crate: it keeps `unsafe` code out of the broker, as the lints require), which restricts itself
//! with Landlock and then executes the agent as the session's uid. The agent may read and execute
//! the system directories, `/proc` (a private one mounted `hidepid=invisible` when the broker
//! runs as root, see [`private_proc`]; otherwise the host's, with every process's command line),
//! the read-only inputs (at their host paths: Landlock cannot
//! move them) and what the agent needs ([`needs`]), read and write a few device files (`/dev/null`, `/dev/zero`, `/dev/full`,
//! `/dev/random`, `/dev/urandom`), and do anything in its own session directories; everything else
//! is denied, and it can neither signal nor reach the abstract UNIX sockets of processes outside
//! its sandbox. It sees host paths ([`Sandbox::worker_paths`]); `TMPDIR` must point at the
//! session's tmp. Landlock does not stop `stat` on a known path, so existence is hidden only by a
//! distinct uid per session plus private directories ([`Sandbox::prepare_storage`]). It cannot
//! provide `network = "none"` (it filters TCP but not UDP) nor `network = "allowlist"` (no network
//! namespace of its own), so those combinations are refused. The
//! helper is looked for in `OAB_LANDLOCK_EXEC`, then next to the broker's executable (and one
//! directory up, for test binaries in `target/*/deps`), then on `PATH`.
//!
//! # Per-session uids
//!
//! A broker running as root gives each session a uid (and a gid with the same number) from
//! [`UID_RANGE`], skipping numbers the host already uses (`/etc/passwd`, `/etc/group`,
//! `/etc/subuid`, `/etc/subgid`). A uid is claimed by atomically creating `root/.uids/<uid>`
//! (content: the session id), so any number of broker processes sharing `root` never hand one uid
//! to two live sessions. Plain mode allocates none: it keeps upstream's behaviour.
//!
//! # Limits
//!
//! [`Sandbox::prepare_limits`] creates one cgroup per session (`openab-<session id>-<root
//! device>.<root inode>`, beside the broker's own cgroup) on cgroup v2, v1, or both (hybrid
//! hosts: each controller from the hierarchy that has it, v2 preferred). The worker is in it
//! before its program starts ([`CgroupEntry`]: born inside on cgroup v1, through a joining shell
//! on v2), so a limit holds from the agent's first instruction and nothing it forks, detaches or
//! re-executes with a clean environment can leave the session: stopping the worker kills what is
//! left in the cgroup.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use session_runtime::config::{NetworkMode, ReadonlyMount, ResourceLimits, SandboxMode};
use session_runtime::{Error, IsolationLevel, SessionId};

use crate::layout::SessionDirs;

// The submodules are crate-visible for the tests in `tests/sandbox.rs`, which compile this module in.
pub(crate) mod bwrap;
pub(crate) mod cgroup;
pub(crate) mod host;
pub(crate) mod landlock_exec;
#[allow(dead_code)] // `restrict_self` and `parse` are for the helper binary, which shares the file
pub(crate) mod landlock_rules;
pub(crate) mod needs;
pub(crate) mod private_proc;
pub(crate) mod storage;
pub(crate) mod uids;

pub(crate) use cgroup::LimitsHandle;
pub(crate) use uids::UID_RANGE;

/// The configuration key every sandbox problem is reported under.
const SANDBOX_KEY: &str = "session_runtime.local.sandbox";
/// The configuration key of read-only inputs.
const READONLY_KEY: &str = "session_runtime.local.readonly";
/// The configuration key of the network mode.
const NETWORK_KEY: &str = "session_runtime.local.network";

/// The workspace inside a bubblewrap sandbox (the agent's working directory).
pub(crate) const SANDBOX_WORKSPACE: &str = "/workspace";
/// HOME inside a bubblewrap sandbox.
pub(crate) const SANDBOX_HOME: &str = "/home/agent";
/// The session's scratch directory inside a bubblewrap sandbox.
pub(crate) const SANDBOX_TMP: &str = "/tmp";
/// The session's agent state inside a bubblewrap sandbox.
pub(crate) const SANDBOX_STATE: &str = "/state";

/// How to install bubblewrap, for error messages.
const INSTALL_BUBBLEWRAP: &str = "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; \
    Fedora/RHEL: `dnf install bubblewrap`; Alpine: `apk add bubblewrap`)";

/// Whether the broker runs as root (effective uid 0).
pub(crate) fn running_as_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// The confinement mechanism a [`Sandbox`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum SandboxKind {
    /// None: plain child processes.
    None,
    /// Bubblewrap namespaces.
    Bubblewrap,
    /// Landlock filesystem rules.
    Landlock,
}

impl SandboxKind {
    /// The lower-case name: `none`, `bubblewrap` or `landlock`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SandboxKind::None => "none",
            SandboxKind::Bubblewrap => "bubblewrap",
            SandboxKind::Landlock => "landlock",
        }
    }
}

impl fmt::Display for SandboxKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the agent finds its storage, as paths it can use (in-sandbox paths for bubblewrap, host
/// paths otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkerPaths {
    /// The working directory (the `cwd` the broker sends in `session/new`).
    pub(crate) workspace: String,
    /// HOME.
    pub(crate) home: String,
    /// The scratch directory (`TMPDIR`).
    pub(crate) tmp: String,
    /// The agent state directory.
    pub(crate) state: String,
}

/// How a worker enters its cgroups ([`Sandbox::cgroup_entry`]); each way but `Adopt` has it in
/// them before its first instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CgroupEntry {
    /// Born inside ([`LimitsHandle::spawn_inside`]): cgroup v1 places single threads, so the
    /// spawning thread joins them for the spawn.
    Birth,
    /// Through the joining shell, which writes its pid into each `cgroup.procs` and executes
    /// the program ([`cgroup::join_at_exec`]): cgroup v2 places whole processes only, and `std`
    /// cannot spawn with `CLONE_INTO_CGROUP`.
    AtExec,
    /// Moved in once it runs ([`LimitsHandle::adopt`]).
    Adopt,
}

/// What to start for a session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaunchSpec<'a> {
    /// The session.
    pub(crate) id: &'a SessionId,
    /// The agent program: a path, or a name looked up on the `PATH` of the environment the
    /// caller sets.
    pub(crate) program: &'a str,
    /// Its arguments.
    pub(crate) args: &'a [String],
    /// The session's storage on the host.
    pub(crate) dirs: &'a SessionDirs,
    /// The session's uid from [`Sandbox::allocate_uid`], if any.
    pub(crate) uid: Option<u32>,
    /// The `cgroup.procs` files of cgroups the worker joins before its program starts
    /// ([`CgroupEntry::AtExec`]); `None` to start it where it is spawned.
    pub(crate) join_cgroups: Option<&'a [PathBuf]>,
    /// What of the host the program needs ([`needs::resolve`], checked by
    /// [`Sandbox::check_needs`]): shown read-only at the same paths.
    pub(crate) needs: &'a [needs::Needed],
    /// The same, each opened once ([`needs::PinnedNeeds::pin`]): what the sandbox shows is
    /// taken from these, never from the paths again.
    pub(crate) pinned: &'a needs::PinnedNeeds,
    /// With `network = "allowlist"`: the session's way out of its network namespace.
    pub(crate) egress: Option<&'a EgressLaunch>,
    /// The agent's working directory relative to its workspace (the session overlay's); `None`:
    /// the workspace itself.
    pub(crate) working_dir: Option<&'a Path>,
}

/// How a session of `network = "allowlist"` reaches its proxy: the `oab-egress-forward` helper
/// runs first inside the sandbox, listens on loopback addresses of the session's own network
/// namespace, and forwards each connection to a Unix socket of the session's proxy, bound into
/// the sandbox with their directory; then it executes the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EgressLaunch {
    /// The `oab-egress-forward` program on the host.
    pub(crate) forwarder: PathBuf,
    /// The host directory that holds the session's proxy sockets.
    pub(crate) socket_dir: PathBuf,
    /// Each address listened on inside the sandbox, and the file name, in `socket_dir`, of the
    /// socket it forwards to.
    pub(crate) listens: Vec<(std::net::SocketAddr, String)>,
}

/// Overrides for [`Sandbox::detect_with`]; the defaults find everything on the host.
#[derive(Debug, Clone, Default)]
pub(crate) struct DetectOptions {
    /// The `bwrap` to use instead of searching `PATH` and `/usr/bin/bwrap`.
    pub(crate) bwrap: Option<PathBuf>,
    /// The `oab-landlock-exec` helper to use instead of searching for it.
    pub(crate) landlock_helper: Option<PathBuf>,
    /// Whether the network mode is the default for an unset `network` key rather than a choice:
    /// a sandbox that cannot give a session a network of its own (Landlock) then applies
    /// `host` and says what it shares, where a choice of `none` or `allowlist` is refused.
    pub(crate) network_is_default: bool,
}

/// A working confinement mechanism and its settings. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub(crate) struct Sandbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    backend: Backend,
    network: NetworkMode,
    readonly: Vec<ReadonlyMount>,
    layout: host::HostLayout,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Backend {
    Plain,
    /// `scoper`: the `oab-landlock-exec` helper that confines the agent to Landlock's scopes, for
    /// a sandbox in the host's network namespace, where the kernel and helper offer it.
    Bubblewrap {
        bwrap: PathBuf,
        scoper: Option<PathBuf>,
    },
    Landlock {
        helper: PathBuf,
    },
}

impl Sandbox {
    /// Resolves `mode` into a working mechanism on this host.
    ///
    /// `auto` picks bubblewrap if a working `bwrap` is on `PATH` or at `/usr/bin/bwrap` (it is
    /// probed by running a trivial sandbox with the namespaces the sessions will use), else
    /// Landlock if the kernel enforces it and the `oab-landlock-exec` helper is found and works,
    /// else fails. `bubblewrap` and `landlock` insist on that mechanism. `none` is plain mode.
    /// Probes of one `bwrap` are run once per process.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] with key `session_runtime.local.sandbox` when the requested
    /// mechanism (or, for `auto`, every mechanism) does not work here, saying why and how to
    /// install bubblewrap or that `sandbox = "none"` accepts no isolation; with key
    /// `session_runtime.local.readonly` for a read-only input whose host path is missing or whose
    /// sandbox path would cover the sandbox's own directories; with key
    /// `session_runtime.local.network` for `network = "none"` with Landlock (it cannot block UDP)
    /// and for `network = "allowlist"` with Landlock (it has no network namespace to confine).
    #[allow(dead_code)] // the tests' shorthand; the runtime passes options (`detect_with`)
    pub(crate) fn detect(
        mode: SandboxMode,
        network: NetworkMode,
        readonly: &[ReadonlyMount],
    ) -> Result<Self, Error> {
        Self::detect_with(mode, network, readonly, &DetectOptions::default())
    }

    /// [`Sandbox::detect`] with explicit programs (tests, or a configured helper path).
    ///
    /// # Errors
    ///
    /// As for [`Sandbox::detect`].
    pub(crate) fn detect_with(
        mode: SandboxMode,
        network: NetworkMode,
        readonly: &[ReadonlyMount],
        options: &DetectOptions,
    ) -> Result<Self, Error> {
        let layout = host::HostLayout::detect();
        let backend = match mode {
            SandboxMode::None => Backend::Plain,
            SandboxMode::Bubblewrap => match bwrap::find_working(options.bwrap.as_deref(), network, &layout) {
                Ok(bwrap) => Backend::Bubblewrap { bwrap, scoper: None },
                Err(why) => {
                    let reason = format!(
                        "sandbox = \"bubblewrap\" does not work here: {why}; {INSTALL_BUBBLEWRAP}, \
                         or choose sandbox = \"landlock\" or \"auto\""
                    );
                    return Err(invalid(SANDBOX_KEY, reason));
                }
            },
            SandboxMode::Landlock => match landlock_exec::find_working(options.landlock_helper.as_deref()) {
                Ok(helper) => Backend::Landlock { helper },
                Err(why) => {
                    let reason = format!(
                        "sandbox = \"landlock\" does not work here: {why}; choose sandbox = \"bubblewrap\" \
                         ({INSTALL_BUBBLEWRAP}) or \"auto\""
                    );
                    return Err(invalid(SANDBOX_KEY, reason));
                }
            },
            SandboxMode::Auto => match bwrap::find_working(options.bwrap.as_deref(), network, &layout) {
                Ok(bwrap) => Backend::Bubblewrap { bwrap, scoper: None },
                Err(bwrap_problem) => match landlock_exec::find_working(options.landlock_helper.as_deref()) {
                    Ok(helper) => {
                        tracing::warn!(
                            problem = %bwrap_problem,
                            "bubblewrap does not work here; sandboxing sessions with landlock, which hides \
                             other sessions' files but not that they exist unless each session has its own uid"
                        );
                        Backend::Landlock { helper }
                    }
                    Err(landlock_problem) => {
                        return Err(invalid(
                            SANDBOX_KEY,
                            format!(
                                "sandbox = \"auto\" found no working sandbox, so isolated sessions cannot start: \
                                 bubblewrap: {bwrap_problem}; landlock: {landlock_problem}; {INSTALL_BUBBLEWRAP}, \
                                 or set sandbox = \"none\" to accept no isolation between sessions"
                            ),
                        ))
                    }
                },
            },
            // `SandboxMode` is non-exhaustive: a mode this code does not know is refused.
            other => {
                let reason = format!("sandbox = \"{other}\" is not supported by this runtime");
                return Err(invalid(SANDBOX_KEY, reason));
            }
        };
        let mut backend = backend;
        let mut network = network;
        match &mut backend {
            Backend::Plain => {}
            Backend::Bubblewrap { scoper, .. } => {
                bwrap::check_mounts(&layout, readonly)?;
                if network == NetworkMode::Host {
                    match landlock_exec::find_scoping(options.landlock_helper.as_deref()) {
                        Ok(helper) => *scoper = Some(helper),
                        Err(why) => tracing::warn!(
                            problem = %why,
                            "network = \"host\": bubblewrap sessions share the host's network namespace and \
                             landlock cannot scope them here, so each session can connect to the abstract \
                             UNIX sockets of every other session and of the host"
                        ),
                    }
                }
            }
            Backend::Landlock { .. } => {
                if network == NetworkMode::None && options.network_is_default {
                    // Landlock has no namespaces: the host's network is all it can give.
                    network = NetworkMode::Host;
                }
                if network == NetworkMode::Allowlist {
                    return Err(invalid(
                        NETWORK_KEY,
                        format!(
                            "network = \"allowlist\" needs bubblewrap, which does not work here: it gives \
                             each session a network namespace of its own whose only way out is the session's \
                             proxy; landlock has no namespaces and only filters TCP ports, not destinations \
                             or UDP, so it cannot confine egress to a list; {INSTALL_BUBBLEWRAP}, or choose \
                             network = \"host\""
                        ),
                    ));
                }
                if network == NetworkMode::None {
                    return Err(invalid(
                        NETWORK_KEY,
                        format!(
                            "network = \"none\" needs bubblewrap, which does not work here; landlock can \
                             only filter TCP, not UDP, so it cannot take the network away; {INSTALL_BUBBLEWRAP}, \
                             or choose network = \"host\""
                        ),
                    ));
                }
                for mount in readonly {
                    if mount.host() != mount.target() {
                        tracing::warn!(
                            mount = %mount,
                            "landlock cannot move a read-only input: the agent reads it at its host path"
                        );
                    }
                }
            }
        }
        check_readonly_sources(readonly)?;
        Ok(Self::from_parts(backend, network, readonly.to_vec(), layout))
    }

    /// The network mode sessions get: the one asked for, or `host` where the default `none`
    /// cannot be given (Landlock, see [`DetectOptions::network_is_default`]).
    pub(crate) fn network(&self) -> NetworkMode {
        self.inner.network
    }

    /// What sessions of this sandbox share through the network, in one sentence for the
    /// startup log and `verify`; `None` when each session has a network namespace of its own
    /// (or nothing is isolated anyway: plain mode says so on its own).
    pub(crate) fn shared_network(&self) -> Option<String> {
        if self.inner.network != NetworkMode::Host {
            return None;
        }
        let abstract_sockets = match &self.inner.backend {
            Backend::Plain => return None,
            Backend::Bubblewrap { scoper: Some(_), .. } | Backend::Landlock { .. } => {
                "abstract UNIX sockets are not shared (landlock scopes them to each session)"
            }
            Backend::Bubblewrap { scoper: None, .. } => {
                "and so is every abstract UNIX socket (landlock's scopes are not available here: they \
                 need Linux 6.12 or later and the oab-landlock-exec helper)"
            }
        };
        Some(format!(
            "network = \"host\" ({}): sessions share the host's network namespace: every loopback \
             port one session's agent listens on (a dev server on 127.0.0.1, say) is open to every other \
             session and to the host; {abstract_sockets}; for a network of each session's own, use \
             bubblewrap with network unset or \"none\", or \"allowlist\" with egress",
            match self.kind() {
                SandboxKind::Landlock => "landlock gives a session no network namespace of its own",
                _ => "chosen explicitly",
            }
        ))
    }

    /// What sessions of this sandbox see of other processes, in one sentence for the startup
    /// log and `verify`; `None` when each has a `/proc` of its own (bubblewrap always; Landlock
    /// with a broker running as root, see [`private_proc`]).
    pub(crate) fn shared_processes(&self) -> Option<String> {
        match self.inner.backend {
            Backend::Landlock { .. } => private_proc::shared_processes(
                private_proc::tools(&self.inner.layout).as_ref(),
                self.inner.layout.root,
            ),
            _ => None,
        }
    }

    /// A sandbox from already detected parts.
    fn from_parts(
        backend: Backend,
        network: NetworkMode,
        readonly: Vec<ReadonlyMount>,
        layout: host::HostLayout,
    ) -> Self {
        Sandbox {
            inner: Arc::new(Inner {
                backend,
                network,
                readonly,
                layout,
            }),
        }
    }

    /// The mechanism in use.
    pub(crate) fn kind(&self) -> SandboxKind {
        match self.inner.backend {
            Backend::Plain => SandboxKind::None,
            Backend::Bubblewrap { .. } => SandboxKind::Bubblewrap,
            Backend::Landlock { .. } => SandboxKind::Landlock,
        }
    }

    /// How strongly sessions are separated: `None` for plain mode, `Namespaces` for bubblewrap,
    /// `AccessControl` for Landlock (no namespaces: access rules on the host's own view).
    pub(crate) fn isolation(&self) -> IsolationLevel {
        match self.kind() {
            SandboxKind::None => IsolationLevel::None,
            SandboxKind::Bubblewrap => IsolationLevel::Namespaces,
            SandboxKind::Landlock => IsolationLevel::AccessControl,
        }
    }

    /// What the agent sees of its storage: with bubblewrap the fixed paths [`SANDBOX_WORKSPACE`],
    /// [`SANDBOX_HOME`], [`SANDBOX_TMP`] and [`SANDBOX_STATE`]; plain and Landlock: the host paths.
    pub(crate) fn worker_paths(&self, dirs: &SessionDirs) -> WorkerPaths {
        match self.kind() {
            SandboxKind::Bubblewrap => WorkerPaths {
                workspace: SANDBOX_WORKSPACE.to_owned(),
                home: SANDBOX_HOME.to_owned(),
                tmp: SANDBOX_TMP.to_owned(),
                state: SANDBOX_STATE.to_owned(),
            },
            SandboxKind::None | SandboxKind::Landlock => WorkerPaths {
                workspace: dirs.workspace.display().to_string(),
                home: dirs.home.display().to_string(),
                tmp: dirs.tmp.display().to_string(),
                state: dirs.state.display().to_string(),
            },
        }
    }

    /// Why the agent `program` cannot be found where the worker will look for it: as a path
    /// (relative ones from the working directory), or by name on `path_var` (the worker's `PATH`).
    /// `None` when it may be there. This only catches what is certainly missing, before anything
    /// starts, so that a missing agent fails the same way (`ENOENT`) in every mode: run by
    /// bubblewrap or Landlock, the failed exec would otherwise be reported by a helper inside the
    /// sandbox (after the worker started), and Landlock turns a search of `PATH` through
    /// directories it hides into `EACCES`.
    ///
    /// With bubblewrap, a path inside the sandbox's own directories or read-only inputs is
    /// checked at its host path.
    pub(crate) fn missing_program(
        &self,
        program: &str,
        path_var: &str,
        dirs: &SessionDirs,
    ) -> Option<std::io::Error> {
        let exists = |candidate: &Path| {
            let candidate = match self.kind() {
                SandboxKind::Bubblewrap => self.host_path_of(candidate, dirs),
                SandboxKind::None | SandboxKind::Landlock => candidate.to_path_buf(),
            };
            std::fs::metadata(candidate).is_ok_and(|meta| !meta.is_dir())
        };
        let in_workspace = |path: &Path| match self.kind() {
            SandboxKind::Bubblewrap => Path::new(SANDBOX_WORKSPACE).join(path),
            SandboxKind::None | SandboxKind::Landlock => dirs.workspace.join(path),
        };
        let path = Path::new(program);
        let found = if self.kind() == SandboxKind::Bubblewrap && path.is_absolute() && !self.shows_own(path) {
            // bubblewrap binds a program from outside the sandbox's own directories (see
            // `program_mount`), even from a host directory the sandbox replaces, such as /tmp.
            std::fs::metadata(path).is_ok_and(|meta| !meta.is_dir())
        } else if program.contains('/') {
            exists(&in_workspace(path))
        } else {
            std::env::split_paths(path_var).any(|dir| exists(&in_workspace(&dir.join(program))))
        };
        (!found).then(|| std::io::Error::from_raw_os_error(rustix::io::Errno::NOENT.raw_os_error()))
    }

    /// Whether `path` is inside what a bubblewrap sandbox shows of its own: the workspace, HOME,
    /// state or a read-only input.
    fn shows_own(&self, path: &Path) -> bool {
        [SANDBOX_WORKSPACE, SANDBOX_HOME, SANDBOX_STATE]
            .iter()
            .any(|own| path.starts_with(own))
            || self
                .inner
                .readonly
                .iter()
                .any(|mount| path.starts_with(mount.target()))
    }

    /// The host path behind `path` as a bubblewrap sandbox shows it: its own directories and
    /// read-only inputs are bound from elsewhere; everything else it shows is the host's.
    fn host_path_of(&self, path: &Path, dirs: &SessionDirs) -> PathBuf {
        let own = [
            (Path::new(SANDBOX_WORKSPACE), dirs.workspace.as_path()),
            (Path::new(SANDBOX_HOME), dirs.home.as_path()),
            (Path::new(SANDBOX_STATE), dirs.state.as_path()),
            (Path::new(SANDBOX_TMP), dirs.tmp.as_path()),
        ];
        let readonly = self.inner.readonly.iter().map(|m| (m.target(), m.host()));
        own.into_iter()
            .chain(readonly)
            .find_map(|(shown, host)| Some(host.join(path.strip_prefix(shown).ok()?)))
            .unwrap_or_else(|| path.to_path_buf())
    }

    /// Checks that what the agent needs (from [`needs::resolve`]) may be shown to a session under
    /// `root` and can be reached by the user the agent runs as: the session's `uid`, or, for a
    /// session that will get a uid of its own and has none yet, any such user. Plain mode shows
    /// nothing and needs nothing checked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming `agent.needs` or `agent.command`, with the path and why:
    /// it contains the session root or lies inside it; the session's user cannot reach it (as
    /// [`needs::check_reachable`] says); or it lies under a directory the sandbox replaces with
    /// its own (`/tmp`, `/proc`, `/dev`, and with bubblewrap the session's paths), where it
    /// cannot be shown at its path: Landlock refuses those too, so a configuration means the
    /// same in both sandboxes.
    pub(crate) fn check_needs(
        &self,
        needed: &[needs::Needed],
        root: &Path,
        uid: Option<u32>,
    ) -> Result<(), Error> {
        if self.kind() == SandboxKind::None {
            return Ok(());
        }
        needs::check_apart_from(needed, root)?;
        match self.kind() {
            SandboxKind::Bubblewrap => bwrap::check_showable(needed)?,
            SandboxKind::Landlock => bwrap::check_not_under(
                needed,
                &bwrap::HOST_PRIVATE,
                "the sandbox does not show it (bubblewrap replaces it with the session's own, and \
                 landlock refuses it alike, since granting it would show the host's)",
            )?,
            SandboxKind::None => {}
        }
        let who = match uid {
            Some(uid) => needs::Who::Uid(uid),
            None if self.allocates_uids() => needs::Who::NewSessionUser,
            None => return Ok(()),
        };
        let layout = &self.inner.layout;
        let on_host = |need: &needs::Needed| {
            self.kind() == SandboxKind::Landlock
                || layout
                    .system
                    .iter()
                    .any(|entry| matches!(entry, host::SystemEntry::Dir(dir) if need.real.starts_with(dir)))
        };
        needs::check_reachable(needed, who, on_host)
    }

    /// Whether sessions get a uid of their own: the broker runs as root and the mode isolates.
    fn allocates_uids(&self) -> bool {
        self.inner.layout.root && self.kind() != SandboxKind::None
    }

    /// The uid (and gid, the same number) the session's agent runs as, claimed under
    /// `root/.uids/` (see the module documentation), or `None` when the agent runs as the
    /// broker's user: the broker is not root, or the mode is plain.
    ///
    /// Idempotent: the session's existing uid is returned again. Calls for different sessions
    /// may run concurrently, in any number of broker processes sharing `root`; calls for one
    /// session must be serialized by the caller (its session lock).
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if `root/.uids` cannot be read or written, or every uid of
    /// [`UID_RANGE`] is taken.
    pub(crate) fn allocate_uid(&self, root: &Path, id: &SessionId) -> Result<Option<u32>, Error> {
        if !self.allocates_uids() {
            return Ok(None);
        }
        let host_used = uids::HostIds::read();
        uids::allocate_in(root, id, UID_RANGE, &host_used).map(Some)
    }

    /// Frees the uid claimed for `id`, if any, unless `has_storage` (asked while no claim can be
    /// made or released) says the session still has storage. Idempotent.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if `root/.uids` cannot be read or the claim cannot be removed.
    pub(crate) fn release_uid(
        &self,
        root: &Path,
        id: &SessionId,
        has_storage: impl FnOnce() -> bool,
    ) -> Result<(), Error> {
        uids::release_in(root, id, has_storage)
    }

    /// The holders (session ids, as written) of every uid claimed under `root`.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if `root/.uids` cannot be read.
    pub(crate) fn uid_holders(&self, root: &Path) -> Result<Vec<String>, Error> {
        let mut holders: Vec<String> = uids::claims_in(root)?
            .into_iter()
            .map(|(_, holder)| holder)
            .collect();
        holders.sort();
        holders.dedup();
        Ok(holders)
    }

    /// Makes the session's storage private before any of its processes starts: the agent
    /// directories (workspace, home, state, tmp) mode 0700 and, with a `uid`, owned by it
    /// (recursively, without following links, the first time: e.g. a copied HOME template); the
    /// session's base directory 0700 (with a `uid`: 0710, group `uid`, so the agent can reach its
    /// directories in Landlock mode but not list the base or read the record). The root is not
    /// changed (it may not be the runtime's to change).
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if a directory cannot be changed, or (not retryable) if Landlock would
    /// run the agent as the session's uid but the root does not let other users pass (no
    /// `o+x`), so the agent could not reach its own directories.
    pub(crate) fn prepare_storage(&self, dirs: &SessionDirs, uid: Option<u32>) -> Result<(), Error> {
        if let (SandboxKind::Landlock, Some(_), Some(root)) = (self.kind(), uid, dirs.base.parent()) {
            use std::os::unix::fs::MetadataExt;
            let mode = std::fs::metadata(root)
                .map_err(|e| crate::backend_error(true, format!("inspecting {}", root.display()), e))?
                .mode();
            if mode & 0o001 == 0 {
                return Err(Error::Backend {
                    runtime: crate::RUNTIME,
                    retryable: false,
                    message: format!(
                        "the session root {} does not let other users pass (mode {:o}), so a Landlock \
                         session's own user cannot reach its directories; allow it (chmod o+x, e.g. 0711)",
                        root.display(),
                        mode & 0o7777
                    ),
                    source: None,
                });
            }
        }
        storage::prepare(dirs, uid)
    }

    /// Makes the session's directories private again where their modes were widened since
    /// [`Sandbox::prepare_storage`] (a `chmod 0777` would open one session's files to the
    /// others' users), logging each at WARN with the mode it had; called before every worker
    /// starts.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if a directory cannot be inspected or changed.
    pub(crate) fn repair_storage_modes(
        &self,
        id: &SessionId,
        dirs: &SessionDirs,
        uid: Option<u32>,
    ) -> Result<(), Error> {
        for (dir, mode) in storage::repair_modes(dirs, uid)? {
            tracing::warn!(
                session = %id,
                directory = %dir.display(),
                "session storage was mode {mode:04o}, wider than the runtime gives it; made private again"
            );
        }
        Ok(())
    }

    /// The command that runs `spec.program` with `spec.args` for the session, confined by this
    /// sandbox. The caller sets the environment (clearing it first; `HOME`, `TMPDIR` from
    /// [`Sandbox::worker_paths`]), stdio, `process_group(0)`, and spawns it.
    ///
    /// Bubblewrap with a uid writes the sandbox's `/etc/passwd` and `/etc/group` into the
    /// session's base directory first.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] (not retryable) if the session has a uid but the broker is not root and
    /// cannot switch to it, or Landlock would run the agent as root (no uid while the broker is
    /// root); [`Error::Backend`] if the generated identity files cannot be written.
    pub(crate) fn command(&self, spec: &LaunchSpec<'_>) -> Result<tokio::process::Command, Error> {
        let command = self.confined_command(spec)?;
        Ok(match spec.join_cgroups {
            Some(procs) => cgroup::join_at_exec(&command, procs),
            _ => command,
        })
    }

    /// How the worker of a session with `uid` enters the cgroups of `limits`: born inside them
    /// where every one is cgroup v1 (and the caller is not the broker's main thread, see
    /// [`LimitsHandle::can_be_born_in`]); else through the joining shell before its program starts
    /// ([`LaunchSpec::join_cgroups`]), which runs as the broker (in plain mode with a uid it
    /// would run as that uid, which may not write to cgroups) and needs `/bin/sh`; else moved in
    /// once it runs. Birth is decided for the calling thread, which must then spawn the worker.
    pub(crate) fn cgroup_entry(&self, limits: &LimitsHandle, uid: Option<u32>) -> CgroupEntry {
        if limits.can_be_born_in() {
            CgroupEntry::Birth
        } else if self.joins_cgroups_at_exec(uid) {
            CgroupEntry::AtExec
        } else {
            CgroupEntry::Adopt
        }
    }

    /// Whether a worker of a session with `uid` can join its cgroups through the joining shell
    /// (see [`Sandbox::cgroup_entry`]).
    fn joins_cgroups_at_exec(&self, uid: Option<u32>) -> bool {
        !(self.kind() == SandboxKind::None && uid.is_some()) && cgroup::can_join_at_exec()
    }

    /// [`Sandbox::command`] before it is made to join cgroups.
    fn confined_command(&self, spec: &LaunchSpec<'_>) -> Result<tokio::process::Command, Error> {
        let inner = &*self.inner;
        match &inner.backend {
            Backend::Plain => {
                let mut command = tokio::process::Command::new(spec.program);
                command.args(spec.args);
                if let Some(uid) = spec.uid {
                    if !inner.layout.root {
                        return Err(cannot_switch(spec.id, uid));
                    }
                    command.uid(uid).gid(uid);
                }
                Ok(command)
            }
            Backend::Bubblewrap { bwrap, scoper } => {
                let identity = match spec.uid {
                    Some(uid) if inner.layout.root && inner.layout.etc_identity => {
                        Some(storage::write_identity_files(&spec.dirs.base, uid)?)
                    }
                    _ => None,
                };
                let args = bwrap::bwrap_args(
                    &inner.layout,
                    inner.network,
                    &inner.readonly,
                    spec,
                    identity.as_ref(),
                    scoper.as_deref(),
                )?;
                let mut command = tokio::process::Command::new(bwrap);
                command.args(args);
                Ok(command)
            }
            Backend::Landlock { helper } => {
                let args = landlock_exec::helper_args(&inner.layout, &inner.readonly, spec)?;
                let tools = private_proc::tools(&inner.layout);
                Ok(private_proc::command(tools.as_ref(), helper, args))
            }
        }
    }

    /// Creates the cgroups `name` (see [`cgroup::group_name`]) with `limits`, beside the
    /// broker's own cgroup, for a worker about to start: memory, pids and cpu from cgroup v2
    /// where the unified hierarchy offers them, else from their v1 hierarchies. The memory and
    /// pids controllers are used whenever available, even without a limit, so that
    /// [`LimitsHandle::usage`] can report them and the whole session can be killed at once. An
    /// existing cgroup of that name is reused.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming `session_runtime.local.limits` if a configured limit has
    /// no usable controller (not mounted, not delegated to the broker, no permission), saying
    /// which; [`Error::Backend`] for other failures. Nothing is left behind on error.
    pub(crate) fn prepare_limits(&self, name: &str, limits: &ResourceLimits) -> Result<LimitsHandle, Error> {
        let host = cgroup::CgroupHost::detect().map_err(|why| cgroup::unusable(limits, &why))?;
        host.prepare(name, limits)
    }

    /// [`Sandbox::prepare_limits`], then moves the running worker `pid` (and every descendant it
    /// has by then) in.
    ///
    /// # Errors
    ///
    /// As for [`Sandbox::prepare_limits`].
    #[allow(dead_code)] // the runtime joins at exec; kept for callers with a running process
    pub(crate) fn apply_limits(
        &self,
        name: &str,
        limits: &ResourceLimits,
        pid: u32,
    ) -> Result<LimitsHandle, Error> {
        let host = cgroup::CgroupHost::detect().map_err(|why| cgroup::unusable(limits, &why))?;
        host.apply(name, limits, pid)
    }

    /// Checks, without a worker, that [`Sandbox::apply_limits`] can apply `limits` here: the
    /// controllers exist and a cgroup can be created and removed.
    ///
    /// # Errors
    ///
    /// As for [`Sandbox::apply_limits`].
    #[allow(dead_code)] // offered to the runtime: check configured limits once at startup
    pub(crate) fn check_limits(&self, limits: &ResourceLimits) -> Result<(), Error> {
        let host = cgroup::CgroupHost::detect().map_err(|why| cgroup::unusable(limits, &why))?;
        host.check(limits)
    }

    /// The cgroup of a session left by an earlier broker process, if there is one (for
    /// `reconcile`: remove it once the session's processes are gone).
    pub(crate) fn existing_limits(&self, name: &str) -> Option<LimitsHandle> {
        cgroup::CgroupHost::detect().ok()?.existing(name)
    }
}

/// An [`Error::InvalidConfig`] for `key`.
fn invalid(key: &str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        key: key.to_owned(),
        reason: reason.into(),
    }
}

/// The error for a uid the broker cannot switch to.
fn cannot_switch(id: &SessionId, uid: u32) -> Error {
    Error::Backend {
        runtime: crate::RUNTIME,
        retryable: false,
        message: format!(
            "session {id} was provisioned to run as uid {uid}, but the broker is not root and cannot switch to it"
        ),
        source: None,
    }
}

/// Every read-only input's host path must exist.
fn check_readonly_sources(readonly: &[ReadonlyMount]) -> Result<(), Error> {
    for (index, mount) in readonly.iter().enumerate() {
        if let Err(error) = std::fs::metadata(mount.host()) {
            return Err(invalid(
                READONLY_KEY,
                format!(
                    "entry {} ({mount}): host path {}: {error}",
                    index + 1,
                    mount.host().display()
                ),
            ));
        }
    }
    Ok(())
}
