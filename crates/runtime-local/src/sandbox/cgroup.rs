//! Per-session cgroups: memory, pids and cpu limits on cgroup v2, v1, or a hybrid of both.
//!
//! A session's cgroup is `openab-<session id>`, created beside the broker's own cgroup in each
//! hierarchy it uses (the broker's cgroup is read from `/proc/self/cgroup`, the hierarchies'
//! mount points from `/proc/self/mountinfo`). Each controller comes from the unified (v2)
//! hierarchy when it offers it, else from the v1 hierarchy it is mounted in, so hybrid hosts
//! (v1 controllers plus a v2 hierarchy with few or none) work too.
//!
//! On cgroup v2 a cgroup with processes cannot also hand controllers to its children (the "no
//! internal processes" rule). If enabling the controllers for the sessions' cgroups fails for that
//! reason, the processes of the broker's cgroup are moved into a leaf child, `openab-broker`, as
//! container managers do; the sessions' cgroups are then its siblings. That needs the broker's
//! cgroup to be delegated to it (e.g. systemd `Delegate=yes`) or the broker to be root.

use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use session_runtime::config::ResourceLimits;
use session_runtime::{Error, SessionId};

/// The configuration key of limits.
const LIMITS_KEY: &str = "session_runtime.local.limits";

/// The v2 leaf the broker's own processes move to when its cgroup must delegate controllers.
const BROKER_LEAF: &str = "openab-broker";

/// The CFS period used for cpu limits, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;

/// How long removing a cgroup keeps killing its members and trying again.
const REMOVE_WAIT: Duration = Duration::from_secs(1);

/// The first pause before trying again; each next one is twice as long, up to
/// [`REMOVE_STEP_MAX`]. A killed process leaves within microseconds, and the usual straggler is
/// one already exiting (a sandbox's inner process, whose `/proc` entry no longer shows the
/// worker's marker): short first steps keep a stop quick.
const REMOVE_STEP_MIN: Duration = Duration::from_micros(100);

/// The longest pause between two attempts.
const REMOVE_STEP_MAX: Duration = Duration::from_millis(5);

/// How many times the worker's process tree is rescanned until every member is in the cgroup.
const MOVE_ROUNDS: usize = 20;

/// A resource controller this runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Controller {
    /// Memory use (and, with a limit, swap: none).
    Memory,
    /// Number of processes and threads.
    Pids,
    /// CPU time.
    Cpu,
}

impl Controller {
    const ALL: [Controller; 3] = [Controller::Memory, Controller::Pids, Controller::Cpu];

    /// The kernel's name for it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Cpu => "cpu",
        }
    }

    /// Whether `limits` limits it.
    fn limited_by(self, limits: &ResourceLimits) -> bool {
        match self {
            Controller::Memory => limits.memory.is_some(),
            Controller::Pids => limits.pids.is_some(),
            Controller::Cpu => limits.cpu.is_some(),
        }
    }
}

/// The unified hierarchy, as far as this broker can use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CgroupV2 {
    /// The directory sessions' cgroups are created in: the broker's own cgroup (or its parent,
    /// once the broker has moved into [`BROKER_LEAF`]).
    pub(crate) parent: PathBuf,
}

/// One v1 hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CgroupV1 {
    /// The controllers it holds (e.g. `["cpu", "cpuacct"]`).
    pub(crate) controllers: Vec<String>,
    /// The directory sessions' cgroups are created in: the broker's own cgroup in it.
    pub(crate) parent: PathBuf,
}

/// The cgroup hierarchies of this host, as seen by the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CgroupHost {
    /// The unified hierarchy, if mounted and the broker has a cgroup in it.
    pub(crate) v2: Option<CgroupV2>,
    /// The v1 hierarchies the broker has a cgroup in.
    pub(crate) v1: Vec<CgroupV1>,
}

/// One cgroup of a session: a directory in one hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Group {
    dir: PathBuf,
    v2: bool,
    controllers: Vec<Controller>,
}

/// A session's cgroups. Dropping the handle leaves them; [`LimitsHandle::remove`] removes them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LimitsHandle {
    groups: Vec<Group>,
    /// What was written into them (for error messages).
    limits: ResourceLimits,
}

/// What a session's processes use now; `None` where the controller is not in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct LimitsUsage {
    /// Memory in bytes (page cache included).
    pub(crate) memory_bytes: Option<u64>,
    /// Processes and threads.
    pub(crate) pids: Option<u64>,
    /// How many processes the kernel killed for exceeding the memory limit.
    pub(crate) oom_kills: Option<u64>,
}

/// The name of the cgroups of session `id` of the runtime whose root is `root_tag` (its device
/// and inode, see `LocalRuntime::root_tag`): two runtimes of one installation on different
/// roots compute the same session ids, and must never share, limit or kill each other's
/// cgroups.
pub(crate) fn group_name(id: &SessionId, root_tag: &str) -> String {
    format!("openab-{id}-{root_tag}")
}

/// The shell that joins a worker to its cgroups before it executes anything else.
const SHELL: &str = "/bin/sh";

/// `$0` of that shell: what its own error messages are prefixed with.
const JOIN_NAME: &str = "oab-join-cgroup";

/// Writes its own pid into each of the `$1` files that follow, announces the join on stdout
/// with [`JOINED`], then executes the rest of its arguments. Only shell built-ins run before the
/// `exec`, so the worker is in its cgroups before its first instruction (and before anything it
/// could fork). 125: a cgroup could not be joined (and nothing was announced).
const JOIN_SCRIPT: &str = r#"n=$1; shift
while [ "$n" -gt 0 ]; do
  echo $$ > "$1" || exit 125
  n=$((n - 1)); shift
done
printf J
exec "$@""#;

/// The byte the joining shell writes to the worker's stdout once it is in every cgroup, before
/// the program starts: the runtime reads it off (see `wait_joined`) instead of polling
/// `cgroup.procs`, so `attach` learns of the join the moment it happens, and the program's own
/// output, which can only follow the `exec`, starts right after it.
pub(crate) const JOINED: u8 = b'J';

/// Whether [`join_at_exec`] can be used on this host.
pub(crate) fn can_join_at_exec() -> bool {
    super::host::is_executable(Path::new(SHELL))
}

/// `command` (a program and arguments, nothing else set yet), run so that it joins the cgroups
/// whose `cgroup.procs` files are `procs` before its program starts: through `/bin/sh`, which
/// writes its pid into each and then executes the program in its place (same pid, same
/// environment, same descriptors).
///
/// No `unsafe` `pre_exec` hook is needed (this crate forbids `unsafe`), and cgroup v2's
/// `CLONE_INTO_CGROUP` is not available to `std`'s spawn.
pub(crate) fn join_at_exec(command: &tokio::process::Command, procs: &[PathBuf]) -> tokio::process::Command {
    let inner = command.as_std();
    let mut joined = tokio::process::Command::new(SHELL);
    joined
        .arg("-c")
        .arg(JOIN_SCRIPT)
        .arg(JOIN_NAME)
        .arg(procs.len().to_string())
        .args(procs)
        .arg(inner.get_program())
        .args(inner.get_args());
    joined
}

/// The error for limits that cannot be applied on this host.
pub(super) fn unusable(limits: &ResourceLimits, why: &str) -> Error {
    let configured: Vec<&str> = Controller::ALL
        .iter()
        .filter(|c| c.limited_by(limits))
        .map(|c| c.name())
        .collect();
    Error::InvalidConfig {
        key: LIMITS_KEY.to_owned(),
        reason: format!(
            "per-session limits ({}) cannot be applied on this host: {why}; run the broker as root or in a \
             cgroup v2 subtree delegated to it (systemd: Delegate=yes), or remove [session_runtime.local.limits]",
            if configured.is_empty() { "none set".to_owned() } else { configured.join(", ") }
        ),
    }
}

/// Turns a filesystem failure on a cgroup into the right error: no permission (or a read-only
/// cgroupfs) means the limits are unusable here; anything else is a backend failure.
fn cgroup_error(limits: &ResourceLimits, what: String, error: io::Error) -> Error {
    match error.kind() {
        io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem => {
            unusable(limits, &format!("{what}: {error}"))
        }
        _ => crate::backend_error(true, what, error),
    }
}

fn write(path: &Path, value: &str) -> io::Result<()> {
    std::fs::write(path, value)
}

/// This process's mount table as last read, with `/proc/self/mountinfo` kept open: the kernel
/// marks that open file (`POLLPRI`) when a mount or unmount changes the table, so a poll that
/// does not wait tells whether to read it again (reading it costs the kernel a walk of every
/// mount, several times a plain `/proc` file). The descriptor is close-on-exec, as every one of
/// the broker's: no worker inherits it.
struct MountTable {
    file: std::fs::File,
    text: String,
}

impl MountTable {
    /// Opens the table and reads it; changes from then on mark the file.
    fn read() -> io::Result<Self> {
        let mut file = std::fs::File::open("/proc/self/mountinfo")?;
        let text = crate::process::read_all(&mut file, 16 * 1024)?;
        Ok(Self { file, text })
    }

    /// Whether the table changed since it was read (or cannot be told: then it counts as
    /// changed, and is read again).
    fn changed(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(&self.file, PollFlags::PRI)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match poll(&mut fds, Some(&now)) {
            Ok(0) => false,
            Ok(_) | Err(_) => true,
        }
    }
}

/// One mount of `/proc/self/mountinfo`.
struct Mount<'a> {
    /// The directory of the hierarchy that is mounted (relative to the hierarchy's root).
    root: &'a str,
    mount_point: &'a str,
    fs_type: &'a str,
    super_options: &'a str,
}

fn parse_mountinfo(text: &str) -> Vec<Mount<'_>> {
    text.lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let fields: Vec<&str> = before.split(' ').collect();
            let mut after = after.split(' ');
            Some(Mount {
                root: fields.get(3)?,
                mount_point: fields.get(4)?,
                fs_type: after.next()?,
                super_options: after.nth(1).unwrap_or(""),
            })
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && (b'0'..=b'3').contains(&bytes[i + 1])
            && bytes[i + 2..i + 4].iter().all(|b| (b'0'..=b'7').contains(b))
        {
            let value = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    use std::os::unix::ffi::OsStringExt;
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// The directory of cgroup `path` (as in `/proc/self/cgroup`) under a mount of `mount_root` at
/// `mount_point`, if the mount shows it.
fn locate(mount_point: &str, mount_root: &str, path: &str) -> Option<PathBuf> {
    let mount_root = unescape(mount_root);
    let relative = Path::new(path).strip_prefix(&mount_root).ok()?;
    Some(unescape(mount_point).join(relative))
}

impl CgroupHost {
    /// Reads this process's mounts and cgroups.
    ///
    /// # Errors
    ///
    /// Why no hierarchy is usable.
    pub(crate) fn detect() -> Result<Self, String> {
        /// What was read and parsed last. The cgroup file is read again every time (a move of
        /// the broker to another cgroup is seen at once); the mount table only when the kernel
        /// says it changed ([`MountTable`]). Parsing, most of what detecting cost per worker
        /// start, is done only when either changed.
        static LAST: parking_lot::Mutex<Option<(MountTable, String, CgroupHost)>> =
            parking_lot::Mutex::new(None);
        let cgroups = crate::process::read_proc("/proc/self/cgroup", 1024)
            .map_err(|e| format!("reading /proc/self/cgroup: {e}"))?;
        let mut last = LAST.lock();
        // Polled once: a poll that reports a change also clears the mark.
        let seen = last.take().filter(|(mounts, _, _)| !mounts.changed());
        let host = match seen {
            Some((mounts, seen_cgroups, host)) if seen_cgroups == cgroups => {
                *last = Some((mounts, cgroups, host.clone()));
                host
            }
            seen => {
                let mounts = match seen {
                    Some((mounts, _, _)) => mounts,
                    None => MountTable::read().map_err(|e| format!("reading /proc/self/mountinfo: {e}"))?,
                };
                let host = Self::parse(&mounts.text, &cgroups);
                *last = Some((mounts, cgroups, host.clone()));
                host
            }
        };
        drop(last);
        if host.v2.is_none() && host.v1.is_empty() {
            return Err("no cgroup filesystem is mounted where this process can see it".to_owned());
        }
        Ok(host)
    }

    /// The hierarchies described by the contents of `/proc/self/mountinfo` and `/proc/self/cgroup`.
    pub(crate) fn parse(mountinfo: &str, cgroups: &str) -> Self {
        let memberships: Vec<(&str, &str)> = cgroups
            .lines()
            .filter_map(|line| {
                let mut parts = line.splitn(3, ':');
                let _id = parts.next()?;
                Some((parts.next()?, parts.next()?))
            })
            .collect();
        let mounts = parse_mountinfo(mountinfo);
        let v2 = memberships
            .iter()
            .find(|(controllers, _)| controllers.is_empty())
            .and_then(|(_, path)| {
                mounts
                    .iter()
                    .filter(|m| m.fs_type == "cgroup2")
                    .find_map(|m| locate(m.mount_point, m.root, path))
            })
            .map(|own| {
                let parent = match own.file_name() {
                    Some(name) if name == BROKER_LEAF => own.parent().map(Path::to_path_buf).unwrap_or(own),
                    _ => own,
                };
                CgroupV2 { parent }
            });
        let mut v1: Vec<CgroupV1> = Vec::new();
        for mount in mounts.iter().filter(|m| m.fs_type == "cgroup") {
            let options: HashSet<&str> = mount.super_options.split(',').collect();
            let Some((controllers, path)) = memberships.iter().find(|(controllers, _)| {
                !controllers.is_empty() && controllers.split(',').all(|c| options.contains(c))
            }) else {
                continue;
            };
            let controllers: Vec<String> = controllers.split(',').map(str::to_owned).collect();
            if v1.iter().any(|h| h.controllers == controllers) {
                continue;
            }
            if let Some(parent) = locate(mount.mount_point, mount.root, path) {
                v1.push(CgroupV1 { controllers, parent });
            }
        }
        CgroupHost { v2, v1 }
    }

    /// Which hierarchy provides each controller: the session's groups (without directories
    /// created), or why a configured limit cannot be had.
    fn plan(&self, id_name: &str, limits: &ResourceLimits) -> Result<Vec<Group>, String> {
        let v2_available: HashSet<String> = self
            .v2
            .as_ref()
            .and_then(|v2| crate::process::read_proc(v2.parent.join("cgroup.controllers"), 256).ok())
            .map(|text| text.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default();
        let mut groups: Vec<Group> = Vec::new();
        let mut missing: Vec<&str> = Vec::new();
        for controller in Controller::ALL {
            let name = controller.name();
            let (dir, v2) = if let (Some(v2), true) = (&self.v2, v2_available.contains(name)) {
                (v2.parent.join(id_name), true)
            } else if let Some(v1) = self.v1.iter().find(|h| h.controllers.iter().any(|c| c == name)) {
                (v1.parent.join(id_name), false)
            } else {
                if controller.limited_by(limits) {
                    missing.push(name);
                }
                continue;
            };
            if !controller.limited_by(limits) && controller == Controller::Cpu {
                // Usage is reported for memory and pids only; cpu is used just to limit.
                continue;
            }
            match groups.iter_mut().find(|g| g.dir == dir) {
                Some(group) => group.controllers.push(controller),
                None => groups.push(Group {
                    dir,
                    v2,
                    controllers: vec![controller],
                }),
            }
        }
        if !missing.is_empty() {
            return Err(format!(
                "no cgroup v2 or v1 hierarchy here offers the {} controller{}",
                missing.join(" and "),
                if missing.len() > 1 { "s" } else { "" }
            ));
        }
        if limits.memory.is_none() && limits.pids.is_none() && limits.cpu.is_none() {
            // Without limits a cgroup only holds the session's processes together, to be found
            // and killed: one group does that. On v1 the cheapest is the pids hierarchy's (a
            // memory cgroup costs the kernel several times more to create and remove).
            match groups
                .iter()
                .position(|group| group.controllers.contains(&Controller::Pids))
            {
                Some(pids) => groups = vec![groups.swap_remove(pids)],
                None => groups.truncate(1),
            }
        }
        Ok(groups)
    }

    /// Creates the groups of `plan` and writes `limits`; on failure removes what it created.
    fn create(&self, groups: &[Group], limits: &ResourceLimits) -> Result<(), Error> {
        let mut created: Vec<&Path> = Vec::new();
        let result = (|| {
            for group in groups {
                if group.v2 {
                    let parent = group.dir.parent().unwrap_or(&group.dir);
                    enable_v2(parent, &group.controllers).map_err(|e| {
                        cgroup_error(limits, format!("enabling controllers in {}", parent.display()), e)
                    })?;
                }
                let fresh = match std::fs::create_dir(&group.dir) {
                    Ok(()) => {
                        created.push(&group.dir);
                        true
                    }
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
                    Err(e) => {
                        return Err(cgroup_error(
                            limits,
                            format!("creating {}", group.dir.display()),
                            e,
                        ))
                    }
                };
                write_limits(group, limits, fresh).map_err(|e| {
                    cgroup_error(limits, format!("writing limits in {}", group.dir.display()), e)
                })?;
            }
            Ok(())
        })();
        if result.is_err() {
            for dir in created.iter().rev() {
                let _ = std::fs::remove_dir(dir);
            }
        }
        result
    }

    /// See [`Sandbox::prepare_limits`](super::Sandbox::prepare_limits).
    pub(crate) fn prepare(&self, name: &str, limits: &ResourceLimits) -> Result<LimitsHandle, Error> {
        let groups = self.plan(name, limits).map_err(|why| unusable(limits, &why))?;
        self.create(&groups, limits)?;
        Ok(LimitsHandle {
            groups,
            limits: limits.clone(),
        })
    }

    /// See [`Sandbox::apply_limits`](super::Sandbox::apply_limits).
    pub(crate) fn apply(&self, name: &str, limits: &ResourceLimits, pid: u32) -> Result<LimitsHandle, Error> {
        let handle = self.prepare(name, limits)?;
        if let Err(error) = handle.adopt(pid) {
            let _ = handle.remove();
            return Err(error);
        }
        Ok(handle)
    }

    /// See [`Sandbox::check_limits`](super::Sandbox::check_limits).
    #[allow(dead_code)] // see `Sandbox::check_limits`
    pub(crate) fn check(&self, limits: &ResourceLimits) -> Result<(), Error> {
        let groups = self
            .plan(&format!("openab-probe-{}", std::process::id()), limits)
            .map_err(|why| unusable(limits, &why))?;
        self.create(&groups, limits)?;
        LimitsHandle {
            groups,
            limits: limits.clone(),
        }
        .remove()
    }

    /// The cgroups named for `id` that exist, if any.
    #[allow(dead_code)] // see `Sandbox::existing_limits`
    pub(crate) fn existing(&self, name: &str) -> Option<LimitsHandle> {
        let v2 = self.v2.iter().map(|v2| Group {
            dir: v2.parent.join(name),
            v2: true,
            controllers: Controller::ALL.to_vec(),
        });
        let v1 = self.v1.iter().map(|h| Group {
            dir: h.parent.join(name),
            v2: false,
            controllers: Controller::ALL
                .into_iter()
                .filter(|c| h.controllers.iter().any(|n| n == c.name()))
                .collect(),
        });
        let groups: Vec<Group> = v2.chain(v1).filter(|g| g.dir.is_dir()).collect();
        (!groups.is_empty()).then_some(LimitsHandle {
            groups,
            limits: ResourceLimits::default(),
        })
    }
}

/// Enables `controllers` for the children of the v2 cgroup `parent`. If the kernel refuses
/// because `parent` has processes, moves them into the leaf [`BROKER_LEAF`] and tries again.
fn enable_v2(parent: &Path, controllers: &[Controller]) -> io::Result<()> {
    let subtree = parent.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&subtree).unwrap_or_default();
    let enabled: HashSet<&str> = enabled.split_whitespace().collect();
    let wanted: Vec<String> = controllers
        .iter()
        .filter(|c| !enabled.contains(c.name()))
        .map(|c| format!("+{}", c.name()))
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    let wanted = wanted.join(" ");
    match write(&subtree, &wanted) {
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) => {
            let leaf = parent.join(BROKER_LEAF);
            match std::fs::create_dir(&leaf) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            for pid in members(parent)? {
                match write(&leaf.join("cgroup.procs"), &pid.to_string()) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()) => {}
                    Err(e) => return Err(e),
                }
            }
            tracing::info!(
                cgroup = %leaf.display(),
                "moved the broker into a leaf cgroup so that sessions can have limits"
            );
            write(&subtree, &wanted)
        }
        other => other,
    }
}

/// The processes in the cgroup `dir`.
fn members(dir: &Path) -> io::Result<Vec<u32>> {
    match crate::process::read_proc(dir.join("cgroup.procs"), 256) {
        Ok(text) => Ok(text.split_whitespace().filter_map(|p| p.parse().ok()).collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Writes `limits` (or "no limit") for the group's controllers. A `fresh` group (just created)
/// already has no limit, so only configured limits are written to it: a session without limits
/// costs no writes.
fn write_limits(group: &Group, limits: &ResourceLimits, fresh: bool) -> io::Result<()> {
    let dir = &group.dir;
    for controller in &group.controllers {
        if fresh && !controller.limited_by(limits) {
            continue;
        }
        match (controller, group.v2) {
            (Controller::Memory, true) => {
                write(
                    &dir.join("memory.max"),
                    &limits.memory.map_or("max".to_owned(), |m| m.to_string()),
                )?;
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    write(&swap, if limits.memory.is_some() { "0" } else { "max" })?;
                }
            }
            (Controller::Memory, false) => {
                // memsw (memory plus swap) must never be below the memory limit: lift it first.
                let memsw = dir.join("memory.memsw.limit_in_bytes");
                let has_memsw = memsw.exists();
                if has_memsw {
                    write(&memsw, "-1")?;
                }
                let limit = limits.memory.map_or("-1".to_owned(), |m| m.to_string());
                write(&dir.join("memory.limit_in_bytes"), &limit)?;
                if has_memsw {
                    write(&memsw, &limit)?;
                }
            }
            (Controller::Pids, _) => {
                write(
                    &dir.join("pids.max"),
                    &limits.pids.map_or("max".to_owned(), |p| p.to_string()),
                )?;
            }
            (Controller::Cpu, v2) => {
                let quota = limits.cpu.map(cpu_quota_us);
                if v2 {
                    let quota = quota.map_or("max".to_owned(), |q| q.to_string());
                    write(&dir.join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?;
                } else {
                    write(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                    write(
                        &dir.join("cpu.cfs_quota_us"),
                        &quota.map_or("-1".to_owned(), |q| q.to_string()),
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// The kernel's smallest CFS quota, in microseconds.
const MIN_CPU_QUOTA_US: u64 = 1000;
/// The kernel's largest CFS quota, in microseconds.
const MAX_CPU_QUOTA_US: u64 = (1 << 44) - 1;

/// The CFS quota per [`CPU_PERIOD_US`] for `cores`, within what the kernel accepts. `cores` is
/// validated ([`ResourceLimits::validate`]) to need no clamping; the clamp only keeps a value
/// that slipped through from turning into a different limit than the nearest one (never the
/// minimum for a huge value).
pub(crate) fn cpu_quota_us(cores: f64) -> u64 {
    let quota = (cores * CPU_PERIOD_US as f64).round();
    if quota.is_nan() {
        return MIN_CPU_QUOTA_US;
    }
    quota.clamp(MIN_CPU_QUOTA_US as f64, MAX_CPU_QUOTA_US as f64) as u64
}

/// `pid`'s parent, from `/proc/<pid>/stat`.
fn parent_of(pid: u32) -> Option<u32> {
    crate::process::stat(pid).map(|stat| stat.ppid)
}

/// `root` and all its descendants now living.
fn process_tree(root: u32) -> io::Result<Vec<u32>> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc")? {
        let Some(pid) = entry?.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(parent) = parent_of(pid) {
            children.entry(parent).or_default().push(pid);
        }
    }
    let mut tree = vec![root];
    let mut next = 0;
    while let Some(&pid) = tree.get(next) {
        next += 1;
        tree.extend(children.get(&pid).into_iter().flatten().copied());
    }
    Ok(tree)
}

impl LimitsHandle {
    /// Whether a worker spawned by the calling thread can be born inside the groups
    /// ([`LimitsHandle::spawn_inside`]): every group is in a cgroup v1 hierarchy, which places
    /// single threads, and the thread is not its process's leader.
    ///
    /// A thread that is not the leader is neither listed in a v1 `cgroup.procs` nor weighed by
    /// the OOM killer of a v1 memory cgroup (both look at thread group leaders), and what it
    /// allocates meanwhile is charged to its leader's cgroup. The broker's leader must never be
    /// a member, even for a moment; and no other thread spawns for it, because the worker must
    /// be the child of a thread that lives on: bubblewrap's `--die-with-parent` ends it when the
    /// thread that created it exits.
    pub(crate) fn can_be_born_in(&self) -> bool {
        self.groups.iter().all(|group| !group.v2) && rustix::thread::gettid() != rustix::process::getpid()
    }

    /// Spawns `command` so that the worker is born in the groups (every one cgroup v1, see
    /// [`LimitsHandle::can_be_born_in`]): the calling thread joins them, spawns the command (a
    /// child starts in the cgroups of the thread that created it) and leaves them again. A limit
    /// holds from the worker's first instruction, with neither a joining shell to execute first
    /// nor a move of a running process. A thread joins by writing `0` (itself) to each `tasks`
    /// file, which the kernel does without the global lock a move of a whole process takes.
    ///
    /// While the thread is a member it counts against `pids.max`, which is raised by one for that
    /// moment, so the worker alone is never allowed more than its limit.
    ///
    /// # Errors
    ///
    /// The outer error if the groups could not be joined, left or their pids limit restored (a
    /// worker already spawned is killed); the inner one if the spawn itself failed.
    pub(crate) fn spawn_inside(
        &self,
        command: &mut tokio::process::Command,
    ) -> Result<io::Result<tokio::process::Child>, Error> {
        let fail = |what: &str, error: io::Error| cgroup_error(&self.limits, what.to_owned(), error);
        if !self.can_be_born_in() {
            // `cgroup_entry` chose birth on another thread, or on a v2 host: never join there.
            return Err(fail(
                "spawning inside the cgroups",
                io::Error::other("not possible from this thread or on this hierarchy"),
            ));
        }
        let pids = self
            .limits
            .pids
            .and_then(|limit| Some((self.pids_group()?, limit)));
        if let Some((group, limit)) = pids {
            write(&group.join("pids.max"), &(u64::from(limit) + 1).to_string())
                .map_err(|e| fail("making room for the spawning thread in pids.max", e))?;
        }
        let (joined, spawned, left) = self.spawn_from_this_thread(command);
        let restored = match pids {
            Some((group, limit)) => write(&group.join("pids.max"), &limit.to_string()),
            None => Ok(()),
        };
        let checks = joined
            .map_err(|e| fail("joining the cgroups", e))
            .and_then(|()| left.map_err(|e| fail("leaving the cgroups after the spawn", e)))
            .and_then(|()| restored.map_err(|e| fail("restoring pids.max", e)));
        match checks {
            Ok(()) => Ok(spawned),
            Err(error) => {
                if let Ok(mut child) = spawned {
                    let _ = child.start_kill();
                }
                Err(error)
            }
        }
    }

    /// [`LimitsHandle::spawn_inside`] on the calling thread: whether it joined the groups, the
    /// spawn, and whether it left them. It leaves them even if the spawn panics (and the panic
    /// then goes on).
    fn spawn_from_this_thread(
        &self,
        command: &mut tokio::process::Command,
    ) -> (io::Result<()>, io::Result<tokio::process::Child>, io::Result<()>) {
        let joined = self.move_current_thread(|group| group.dir.clone());
        let spawned = match &joined {
            Ok(()) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| command.spawn())),
            Err(_) => Ok(Err(io::Error::other("not spawned: the cgroups were not joined"))),
        };
        // Also after a partial join: a parent's `tasks` takes the thread back either way.
        let left = self.move_current_thread(|group| {
            group
                .dir
                .parent()
                .map_or_else(|| group.dir.clone(), Path::to_path_buf)
        });
        let spawned = spawned.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (joined, spawned, left)
    }

    /// Moves the calling thread into the directory `target` gives for each group.
    fn move_current_thread(&self, target: impl Fn(&Group) -> PathBuf) -> io::Result<()> {
        for group in &self.groups {
            write(&target(group).join("tasks"), "0")?;
        }
        Ok(())
    }

    /// The directory of the group holding the pids controller, if any.
    fn pids_group(&self) -> Option<&Path> {
        self.groups
            .iter()
            .find(|group| group.controllers.contains(&Controller::Pids))
            .map(|group| group.dir.as_path())
    }

    /// The `cgroup.procs` file of every group, for [`join_at_exec`].
    pub(crate) fn procs_files(&self) -> Vec<PathBuf> {
        self.groups.iter().map(|g| g.dir.join("cgroup.procs")).collect()
    }

    /// Moves the running `pid` and all its descendants in (when the worker could not join at
    /// exec: it ran, briefly, outside).
    ///
    /// # Errors
    ///
    /// As for [`Sandbox::apply_limits`](super::Sandbox::apply_limits).
    pub(crate) fn adopt(&self, pid: u32) -> Result<(), Error> {
        self.adopt_tree(pid).map_err(|error| {
            cgroup_error(
                &self.limits,
                format!("moving worker {pid} into its cgroup"),
                error,
            )
        })
    }

    /// Whether the kernel killed a process in these cgroups for exceeding the memory limit.
    pub(crate) fn saw_oom_kill(&self) -> bool {
        self.usage().oom_kills.is_some_and(|kills| kills > 0)
    }

    /// Moves `pid` and its descendants into every group, rescanning until a scan finds no process
    /// not yet moved: a process forked by a member after the member moved is born inside, so the
    /// last scan proves the whole tree is in (e.g. bubblewrap's sandbox children).
    fn adopt_tree(&self, pid: u32) -> io::Result<()> {
        let mut moved: HashSet<u32> = HashSet::new();
        for _ in 0..MOVE_ROUNDS {
            let fresh: Vec<u32> = process_tree(pid)?
                .into_iter()
                .filter(|p| !moved.contains(p))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for process in fresh {
                for group in &self.groups {
                    match write(&group.dir.join("cgroup.procs"), &process.to_string()) {
                        Ok(()) => {}
                        // Exited meanwhile.
                        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()) => {}
                        Err(e) => return Err(e),
                    }
                }
                moved.insert(process);
            }
        }
        Ok(())
    }

    /// The cgroup directories.
    #[allow(dead_code)] // offered to the runtime: logs and records
    pub(crate) fn paths(&self) -> Vec<&Path> {
        self.groups.iter().map(|g| g.dir.as_path()).collect()
    }

    /// Current usage, from the controllers in use (`None` for those not in use or unreadable).
    pub(crate) fn usage(&self) -> LimitsUsage {
        let read_u64 =
            |path: PathBuf| -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
        let read_key = |path: PathBuf, key: &str| -> Option<u64> {
            std::fs::read_to_string(path).ok()?.lines().find_map(|line| {
                let (name, value) = line.split_once(' ')?;
                (name == key).then(|| value.trim().parse().ok())?
            })
        };
        let mut usage = LimitsUsage::default();
        for group in &self.groups {
            let dir = &group.dir;
            if group.controllers.contains(&Controller::Memory) {
                if group.v2 {
                    usage.memory_bytes = read_u64(dir.join("memory.current"));
                    usage.oom_kills = read_key(dir.join("memory.events"), "oom_kill");
                } else {
                    usage.memory_bytes = read_u64(dir.join("memory.usage_in_bytes"));
                    usage.oom_kills = read_key(dir.join("memory.oom_control"), "oom_kill");
                }
            }
            if group.controllers.contains(&Controller::Pids) {
                usage.pids = read_u64(dir.join("pids.current"));
            }
        }
        usage
    }

    /// Sends `signal` to every process in the groups (all hold the same processes: those of
    /// the first are signalled).
    pub(crate) fn signal_members(&self, signal: rustix::process::Signal) {
        if let Some(group) = self.groups.first() {
            signal_members(&group.dir, signal);
        }
    }

    /// Removes the cgroups, first killing (SIGKILL) any process still in them. Call it once the
    /// worker has ended; it waits up to a second for killed processes to leave. Idempotent.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if a cgroup cannot be removed.
    pub(crate) fn remove(&self) -> Result<(), Error> {
        let deadline = std::time::Instant::now() + REMOVE_WAIT;
        for group in &self.groups {
            let mut step = REMOVE_STEP_MIN;
            loop {
                match std::fs::remove_dir(&group.dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e)
                        if e.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error())
                            && std::time::Instant::now() < deadline =>
                    {
                        kill_members(&group.dir);
                        std::thread::sleep(step);
                        step = (step * 2).min(REMOVE_STEP_MAX);
                    }
                    Err(e) => {
                        return Err(crate::backend_error(
                            true,
                            format!("removing cgroup {}", group.dir.display()),
                            e,
                        ))
                    }
                }
            }
        }
        Ok(())
    }
}

/// Kills every process in the cgroup `dir` (with `cgroup.kill` where the kernel has it).
fn kill_members(dir: &Path) {
    let kill = dir.join("cgroup.kill");
    if kill.exists() && write(&kill, "1").is_ok() {
        return;
    }
    signal_members(dir, rustix::process::Signal::KILL);
}

/// Sends `signal` to every process in the cgroup `dir`. A v1 `cgroup.procs` lists the process of
/// any thread inside: never the broker's own.
fn signal_members(dir: &Path, signal: rustix::process::Signal) {
    let broker = std::process::id();
    for pid in members(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|&pid| pid != broker)
    {
        if let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::MountTable;

    /// A mount in this process's namespace marks the table once; the mark is gone after the poll
    /// that saw it. Mounting needs root: elsewhere the mount is refused, and the table must then
    /// read as unchanged.
    #[test]
    fn a_mount_marks_the_mount_table_as_changed_once() {
        let table = MountTable::read().expect("mountinfo");
        assert!(!table.changed(), "nothing was mounted yet");
        let point = tempfile::tempdir().expect("mount point");
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "oab-mount-table-test"])
            .arg(point.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        let seen = table.changed();
        let seen_again = table.changed();
        if mounted {
            let unmounted = std::process::Command::new("umount").arg(point.path()).status();
            assert!(unmounted.is_ok_and(|status| status.success()), "unmounted");
        }
        assert_eq!((seen, seen_again), (mounted, false), "mounted: {mounted}");
        if mounted {
            assert!(table.changed(), "the unmount is a change too");
            let fresh = MountTable::read().expect("mountinfo");
            assert!(
                !fresh.text.contains("oab-mount-table-test"),
                "read again, as it is now"
            );
        }
    }
}
