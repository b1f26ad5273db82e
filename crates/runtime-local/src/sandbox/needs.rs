//! What of the host an agent's program needs to run, and whether a session may be shown it.
//!
//! A program is rarely one file: a script needs its interpreter and the files next to it, a
//! Node or Python agent its packages. [`resolve`] gathers, with every link resolved:
//!
//! - the paths listed in `[agent] needs` ([`Why::Listed`]);
//! - the program's own file ([`Why::Command`]; a bare name is looked up on the agent's `PATH`)
//!   and the directory holding it ([`Why::CommandDir`]), so that what it loads from beside itself
//!   is there;
//! - the interpreter of its `#!` line ([`Why::Interpreter`]), and for `#!/usr/bin/env NAME`
//!   also `NAME` as found on the agent's `PATH`;
//! - the package the program or its interpreter belongs to ([`Why::PackageRoot`], see
//!   [`package_roots`]): a Python virtual environment (the directory of its `pyvenv.cfg`), or a
//!   Node package (the nearest directory above the program's file with a `package.json`, and,
//!   when that lies in a `node_modules` directory, the whole of the nearest one, where npm puts
//!   the package's dependencies, hoisted beside it or nested in it);
//! - each file named by an argument ([`Why::Argument`]): an absolute path to an existing regular
//!   file outside the directories a sandbox makes its own (a script given to an interpreter).
//!
//! The sandbox shows each at its own path, read-only; before that, [`check_apart_from`] refuses
//! any that contains the session root or lies inside it (it would show every session's storage
//! to every agent), and [`check_reachable`] refuses any that the session's own user could not
//! reach anyway, so that a program under a private home fails at once and says why.
//!
//! What is checked is what is shown: each path is opened once ([`PinnedNeeds::pin`], without
//! following any link, so a path swapped for a link since it was resolved is refused), checked,
//! found unchanged ([`PinnedNeeds::verify`]), and the sandbox shows that file: Landlock is given
//! the open file itself ([`PinnedNeeds::source`]: `/proc/<broker pid>/fd/<n>`, never the name
//! again); bubblewrap, which resolves every bind source to a name before it mounts it, mounts
//! by name and then, inside the new mount namespace and before the agent starts, each mount is
//! checked to be the file opened ([`PinnedNeeds::identity`]: device and inode), or the worker
//! ends. Whoever may write a directory on the way cannot swap in a link to `/` between the check
//! and the mount.

use std::fs::Metadata;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use session_runtime::Error;

use super::invalid;

/// The configuration key of the paths an agent needs.
pub(crate) const NEEDS_KEY: &str = "agent.needs";
/// The configuration key of the agent program.
pub(crate) const COMMAND_KEY: &str = "agent.command";
/// The configuration key of the agent program's arguments.
pub(crate) const ARGS_KEY: &str = "agent.args";

/// Paths a sandbox makes its own (the session's storage as a bubblewrap sandbox shows it, and
/// what every sandbox replaces): an argument naming one means the sandbox's, not the host's.
const SANDBOX_OWN: [&str; 8] = [
    "/tmp",
    "/proc",
    "/dev",
    "/run/host",
    super::SANDBOX_HOME,
    super::SANDBOX_WORKSPACE,
    super::SANDBOX_TMP,
    super::SANDBOX_STATE,
];

/// The most of a program's first line that is read for a `#!` line (Linux reads 256 bytes).
const SHEBANG_BYTES: u64 = 256;

/// Why the agent needs a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// Entry `n` (counted from 1) of `agent.needs`.
    Listed(usize),
    /// The agent program's own file.
    Command,
    /// The directory holding the agent program's file.
    CommandDir,
    /// The interpreter the program's `#!` line runs it with.
    Interpreter,
    /// The package (a Python virtual environment, a Node package's `node_modules`) the program
    /// or its interpreter belongs to.
    PackageRoot,
    /// The file named by argument `n` (counted from 1) of `agent.args`.
    Argument(usize),
}

impl Why {
    /// The configuration key a problem with the path is reported under.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Why::Listed(_) => NEEDS_KEY,
            Why::Command | Why::CommandDir | Why::Interpreter | Why::PackageRoot => COMMAND_KEY,
            Why::Argument(_) => ARGS_KEY,
        }
    }

    /// What the path is, for messages.
    fn describe(self) -> String {
        match self {
            Why::Listed(n) => format!("entry {n} of agent.needs"),
            Why::Command => "the agent program".to_owned(),
            Why::CommandDir => "the agent program's directory".to_owned(),
            Why::Interpreter => "the interpreter of the agent program's `#!` line".to_owned(),
            Why::PackageRoot => {
                "the package of the agent program or its interpreter (a virtual environment, or \
                 the node_modules it is installed in)"
                    .to_owned()
            }
            Why::Argument(n) => format!("the file named by argument {n} of agent.args"),
        }
    }

    /// Whether the path is executed (it must be executable, not only readable).
    fn executed(self) -> bool {
        matches!(self, Why::Command | Why::Interpreter)
    }
}

/// One path the agent needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Needed {
    /// The path as it is named: the `agent.needs` entry, the program as found, the `#!` line's.
    pub(crate) named: PathBuf,
    /// `named` with every link resolved: what is shown.
    pub(crate) real: PathBuf,
    /// Why it is needed.
    pub(crate) why: Why,
}

/// What the agent needs, each opened once: the files a worker's sandbox shows, held open until
/// the worker ends (its sandbox is set up from them, by descriptor, after it starts).
#[derive(Debug, Default)]
pub(crate) struct PinnedNeeds {
    /// Each real path, its open file (`O_PATH`), and why it is needed (for messages).
    pinned: Vec<(PathBuf, OwnedFd, Why)>,
}

impl PinnedNeeds {
    /// Opens every real path of `needed` once, as a path only (`O_PATH`), refusing to follow any
    /// link on the way: the paths are already resolved, so a link there now means one was
    /// swapped in since.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the need's key (e.g. `agent.needs`), with the path and
    /// why: it changed (a link now stands on its way) or cannot be opened.
    ///
    /// # Idempotency
    ///
    /// Opens new descriptors on every call; nothing else changes.
    pub(crate) fn pin(needed: &[Needed]) -> Result<Self, Error> {
        use rustix::fs::{Mode, OFlags, ResolveFlags, CWD};
        let mut pinned: Vec<(PathBuf, OwnedFd, Why)> = Vec::new();
        for need in needed {
            if pinned.iter().any(|(real, _, _)| *real == need.real) {
                continue;
            }
            let opened = rustix::fs::openat2(
                CWD,
                &need.real,
                // Not `O_NOFOLLOW`: with `O_PATH` it would open a link itself (which a mount of
                // the descriptor then follows); following is what `NO_SYMLINKS` refuses.
                OFlags::PATH | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            )
            .map_err(|errno| {
                invalid(
                    need.why.key(),
                    format!(
                        "{} ({}) changed while it was checked, or cannot be opened without \
                         following a link: {}",
                        need.why.describe(),
                        need.real.display(),
                        std::io::Error::from(errno)
                    ),
                )
            })?;
            pinned.push((need.real.clone(), opened, need.why));
        }
        Ok(PinnedNeeds { pinned })
    }

    /// Checks that each path still names the file opened for it (after the checks by path, so
    /// they were of the file that is shown).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the need's key, if a path names another file now or is
    /// gone.
    pub(crate) fn verify(&self) -> Result<(), Error> {
        for (real, opened, why) in &self.pinned {
            let same = match (
                rustix::fs::fstat(opened),
                rustix::fs::statat(rustix::fs::CWD, real, rustix::fs::AtFlags::SYMLINK_NOFOLLOW),
            ) {
                (Ok(held), Ok(now)) => held.st_dev == now.st_dev && held.st_ino == now.st_ino,
                _ => false,
            };
            if !same {
                return Err(invalid(
                    why.key(),
                    format!(
                        "{} ({}) changed while it was checked",
                        why.describe(),
                        real.display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The device and inode of the file opened for the real path `real`, as `stat -c %d:%i`
    /// writes them, or `None` if `real` was not pinned.
    pub(crate) fn identity(&self, real: &Path) -> Option<String> {
        let (_, opened, _) = self.pinned.iter().find(|(pinned, _, _)| pinned == real)?;
        let stat = rustix::fs::fstat(opened).ok()?;
        Some(format!("{}:{}", stat.st_dev, stat.st_ino))
    }

    /// The path a sandbox takes the real path `real` from: the open file of it, through this
    /// process's descriptor table (`/proc/<pid>/fd/<n>`, which leads to that file whatever its
    /// name leads to now), or `None` if `real` was not pinned.
    pub(crate) fn source(&self, real: &Path) -> Option<PathBuf> {
        self.pinned
            .iter()
            .find(|(pinned, _, _)| pinned == real)
            .map(|(_, opened, _)| {
                PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), opened.as_raw_fd()))
            })
    }
}

/// The resolved `agent.needs` entries.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming `agent.needs` for an entry that is not absolute or cannot be
/// resolved (it does not exist), saying which and why.
pub(crate) fn listed(paths: &[PathBuf]) -> Result<Vec<Needed>, Error> {
    paths
        .iter()
        .enumerate()
        .map(|(index, path)| {
            let entry = || format!("entry {} ({})", index + 1, path.display());
            if !path.is_absolute() {
                return Err(invalid(NEEDS_KEY, format!("{} is not an absolute path", entry())));
            }
            let real =
                std::fs::canonicalize(path).map_err(|e| invalid(NEEDS_KEY, format!("{}: {e}", entry())))?;
            Ok(Needed {
                named: path.clone(),
                real,
                why: Why::Listed(index + 1),
            })
        })
        .collect()
}

/// Everything `program` needs: the `listed` paths, its own file and directory, its `#!`
/// interpreter, the package either belongs to ([`package_roots`]), and the files its `args` name
/// ([`argument_files`]), with bare names looked up on `path_var` (the agent's `PATH`). A program
/// that cannot be found, or one named relative to the working directory (inside the session),
/// adds nothing of its own: starting it reports that.
///
/// # Errors
///
/// As for [`listed`].
pub(crate) fn resolve(
    program: &str,
    args: &[String],
    listed_paths: &[PathBuf],
    path_var: &str,
) -> Result<Vec<Needed>, Error> {
    let mut needs = listed(listed_paths)?;
    needs.extend(argument_files(args));
    let found = if program.contains('/') {
        Some(PathBuf::from(program)).filter(|path| path.is_absolute())
    } else {
        find_on_path(program, path_var)
    };
    let Some((named, real)) =
        found.and_then(|named| Some((named.clone(), std::fs::canonicalize(named).ok()?)))
    else {
        return Ok(needs);
    };
    if let Some(dir) = real.parent() {
        needs.push(Needed {
            named: dir.to_path_buf(),
            real: dir.to_path_buf(),
            why: Why::CommandDir,
        });
    }
    let mut packaged = vec![named.clone(), real.clone()];
    for interpreter in interpreters(&real, path_var) {
        if let Ok(real) = std::fs::canonicalize(&interpreter) {
            packaged.push(interpreter.clone());
            packaged.push(real.clone());
            needs.push(Needed {
                named: interpreter,
                real,
                why: Why::Interpreter,
            });
        }
    }
    for root in packaged.iter().flat_map(|path| package_roots(path)) {
        if needs
            .iter()
            .any(|need| need.why == Why::PackageRoot && need.real == root)
        {
            continue;
        }
        if let Ok(real) = std::fs::canonicalize(&root) {
            needs.push(Needed {
                named: root,
                real,
                why: Why::PackageRoot,
            });
        }
    }
    needs.push(Needed {
        named,
        real,
        why: Why::Command,
    });
    Ok(needs)
}

/// The packages an executable at `path` (as named, links not resolved: a virtual environment's
/// `bin/python` is a link to its base interpreter) belongs to:
///
/// - a Python virtual environment: the directory of `path`'s directory, or that directory
///   itself, when it holds a `pyvenv.cfg` (as Python looks for it);
/// - a Node package: the nearest directory above `path` holding a `package.json`, or, when that
///   lies inside a directory called `node_modules`, the nearest such directory instead, which
///   holds the package and whatever npm installed for it (nested in it, or hoisted beside it).
///
/// A directory the system directories hold, or `/`, is no package root here.
pub(crate) fn package_roots(path: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    let Some(dir) = path.parent() else {
        return roots;
    };
    let ignored = |root: &Path| {
        root.parent().is_none()
            || super::host::SYSTEM_PATHS
                .iter()
                .any(|system| Path::new(system).starts_with(root) || root.starts_with(system))
    };
    if let Some(venv) = [dir.parent(), Some(dir)]
        .into_iter()
        .flatten()
        .find(|candidate| candidate.join("pyvenv.cfg").is_file())
    {
        if !ignored(venv) {
            roots.push(venv.to_path_buf());
        }
    }
    if let Some(package) = dir
        .ancestors()
        .find(|candidate| candidate.join("package.json").is_file())
    {
        let modules = package
            .ancestors()
            .skip(1)
            .find(|candidate| candidate.file_name().is_some_and(|name| name == "node_modules"));
        let root = modules.unwrap_or(package);
        if !ignored(root) {
            roots.push(root.to_path_buf());
        }
    }
    roots
}

/// The files `args` name: each argument that is an absolute path to an existing regular file
/// (links followed) outside the paths a sandbox makes its own (`/tmp`, `/proc`, `/dev`, the
/// session's paths under bubblewrap), where an argument means the sandbox's file. Only the file is
/// shown, not its directory.
pub(crate) fn argument_files(args: &[String]) -> Vec<Needed> {
    args.iter()
        .enumerate()
        .filter_map(|(index, arg)| {
            let path = Path::new(arg);
            let own = SANDBOX_OWN.iter().any(|own| path.starts_with(own));
            if !path.is_absolute() || own || !path.is_file() {
                return None;
            }
            let real = std::fs::canonicalize(path).ok()?;
            Some(Needed {
                named: path.to_path_buf(),
                real,
                why: Why::Argument(index + 1),
            })
        })
        .collect()
}

/// The first executable file called `name` in the absolute directories of `path_var`.
fn find_on_path(name: &str, path_var: &str) -> Option<PathBuf> {
    std::env::split_paths(path_var)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|candidate| super::host::is_executable(candidate))
}

/// The interpreters the program `file` runs with: the one its `#!` line names and, when that is
/// `env`, the program `env` is told to run, as found on `path_var`. Empty for a program without
/// a `#!` line (or one that cannot be read).
fn interpreters(file: &Path, path_var: &str) -> Vec<PathBuf> {
    let mut head = Vec::new();
    let read = std::fs::File::open(file).and_then(|f| f.take(SHEBANG_BYTES).read_to_end(&mut head));
    let Some((interpreter, argument)) = read.ok().and_then(|_| parse_shebang(&head)) else {
        return Vec::new();
    };
    let via_env = std::fs::canonicalize(&interpreter)
        .ok()
        .is_some_and(|real| real.file_name().is_some_and(|name| name == "env"));
    let mut found = vec![interpreter];
    if via_env {
        let program = argument.as_deref().and_then(env_program);
        let program = program.and_then(|name| {
            if name.contains('/') {
                Some(PathBuf::from(name)).filter(|path| path.is_absolute())
            } else {
                find_on_path(name, path_var)
            }
        });
        found.extend(program);
    }
    found
}

/// The interpreter and its optional argument from a `#!` line at the start of `head`, as the
/// kernel splits it (the interpreter up to the first blank, the rest as one argument); `None`
/// without a `#!` line or with a relative interpreter.
pub(crate) fn parse_shebang(head: &[u8]) -> Option<(PathBuf, Option<String>)> {
    let line = head.strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = std::str::from_utf8(line).ok()?.trim_matches([' ', '\t', '\r']);
    let (interpreter, argument) = match line.split_once([' ', '\t']) {
        Some((interpreter, argument)) => (interpreter, Some(argument.trim_matches([' ', '\t']))),
        None => (line, None),
    };
    let interpreter = PathBuf::from(interpreter);
    interpreter
        .is_absolute()
        .then(|| (interpreter, argument.filter(|a| !a.is_empty()).map(str::to_owned)))
}

/// The program `env` runs, given its argument from a `#!` line (`node`, `-S node --flag`,
/// `-S VAR=1 python3 -u`): the first word that is neither an option nor an assignment.
pub(crate) fn env_program(argument: &str) -> Option<&str> {
    argument
        .split_whitespace()
        .find(|word| !word.starts_with('-') && !word.contains('='))
}

/// Refuses every needed path that contains the session `root` or lies inside it: showing it
/// would show sessions' storage to every agent.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the path's key ([`Why::key`]), the path and the root.
pub(crate) fn check_apart_from(needs: &[Needed], root: &Path) -> Result<(), Error> {
    let root = resolved_as_far_as_it_exists(root);
    for need in needs {
        let real = &need.real;
        let problem = if root.starts_with(real) {
            "contains the session root"
        } else if real.starts_with(&root) {
            "lies inside the session root"
        } else {
            continue;
        };
        return Err(invalid(
            need.why.key(),
            format!(
                "{} ({}, resolved: {}) {problem} {}: showing it would show sessions' storage to every \
                 agent; install the agent elsewhere, or name only the directories it needs",
                need.why.describe(),
                need.named.display(),
                real.display(),
                root.display()
            ),
        ));
    }
    Ok(())
}

/// `path` with links resolved in the part of it that exists (a root may not exist yet).
pub(crate) fn resolved_as_far_as_it_exists(path: &Path) -> PathBuf {
    let mut missing: Vec<Component<'_>> = Vec::new();
    for existing in path.ancestors() {
        if let Ok(real) = std::fs::canonicalize(existing) {
            return missing.iter().rev().fold(real, |acc, part| acc.join(part));
        }
        missing.extend(existing.components().next_back());
    }
    path.to_path_buf()
}

/// Who runs the agent, for [`check_reachable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Who {
    /// The session's own uid (and the gid of the same number, with no other group).
    Uid(u32),
    /// A uid (and gid) of a session's own not allocated yet: it owns nothing outside the
    /// session, so only what every user may do counts.
    NewSessionUser,
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Who::Uid(uid) => write!(f, "the session's own user (uid {uid})"),
            Who::NewSessionUser => f.write_str("a session's own user"),
        }
    }
}

/// The access a path needs, as permission bits of one class (`r` 4, `w` 2, `x` 1).
const READ: u32 = 4;
const EXECUTE: u32 = 1;

/// Refuses every needed path that `who` cannot reach: along the whole path (each directory it
/// passes must let `who` search it) when `whole_path(need)` says the agent walks the host's own
/// directories to it, else only the path itself (a sandbox that creates the directories leading
/// to it). A directory must be readable and searchable, a file readable, an executed file
/// executable (and readable when it is a script). Only the permission bits are read (not ACLs).
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the path's key, the path, the directory or file in the way,
/// its mode and owner, and what to change.
pub(crate) fn check_reachable(
    needs: &[Needed],
    who: Who,
    whole_path: impl Fn(&Needed) -> bool,
) -> Result<(), Error> {
    let script = needs.iter().any(|need| need.why == Why::Interpreter);
    for need in needs {
        let mut walked: Vec<&Path> = vec![&need.real];
        if whole_path(need) {
            walked.push(&need.named);
        }
        let wanted = if need.why.executed() {
            EXECUTE
                | if need.why == Why::Command && script {
                    READ
                } else {
                    0
                }
        } else {
            READ
        };
        for path in walked {
            let in_the_way = if whole_path(need) {
                path.ancestors()
                    .skip(1)
                    .find_map(|dir| denied(dir, who, EXECUTE).map(|meta| (dir, meta, "pass")))
            } else {
                None
            };
            let in_the_way = in_the_way.or_else(|| {
                let meta = std::fs::metadata(path).ok()?;
                let (wanted, verb) = if meta.is_dir() {
                    (READ | EXECUTE, "list")
                } else if wanted & EXECUTE != 0 {
                    (wanted, "execute")
                } else {
                    (wanted, "read")
                };
                denied(path, who, wanted).map(|meta| (path, meta, verb))
            });
            if let Some((blocker, meta, verb)) = in_the_way {
                return Err(invalid(
                    need.why.key(),
                    format!(
                        "{} ({}) cannot be reached by {who}, which runs the agent: {} is mode {:o}, \
                         owned by uid {} gid {}, so {who} may not {verb} it; make it reachable for \
                         other users (e.g. chmod o+rx on the directories, o+r on the files) or \
                         install the agent where every user can read it",
                        need.why.describe(),
                        need.named.display(),
                        blocker.display(),
                        meta.mode() & 0o7777,
                        meta.uid(),
                        meta.gid()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The metadata of `path` if `who` lacks `wanted` on it (as its owner, group or other user);
/// `None` when allowed or when `path` cannot be inspected (what then fails says so itself).
fn denied(path: &Path, who: Who, wanted: u32) -> Option<Metadata> {
    let meta = std::fs::metadata(path).ok()?;
    let class = match who {
        Who::Uid(uid) if meta.uid() == uid => meta.mode() >> 6,
        Who::Uid(gid) if meta.gid() == gid => meta.mode() >> 3,
        Who::Uid(_) | Who::NewSessionUser => meta.mode(),
    };
    (class & wanted != wanted).then_some(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shebang_lines_are_split_as_the_kernel_splits_them() {
        let parsed = |head: &[u8]| parse_shebang(head).map(|(i, a)| (i.display().to_string(), a));
        assert_eq!(parsed(b"#!/bin/sh\necho"), Some(("/bin/sh".into(), None)));
        assert_eq!(
            parsed(b"#! /usr/bin/env  node \r\n"),
            Some(("/usr/bin/env".into(), Some("node".into())))
        );
        assert_eq!(
            parsed(b"#!/usr/bin/env -S node --flag\n"),
            Some(("/usr/bin/env".into(), Some("-S node --flag".into())))
        );
        assert_eq!(parsed(b"#!python3\n"), None, "relative");
        assert_eq!(parsed(b"\x7fELF"), None);
        assert_eq!(parsed(b""), None);
    }

    #[test]
    fn env_runs_the_first_word_that_is_no_option_nor_assignment() {
        assert_eq!(env_program("node"), Some("node"));
        assert_eq!(env_program("-S VAR=1 python3 -u"), Some("python3"));
        assert_eq!(env_program("-S"), None);
    }

    #[test]
    fn arguments_name_files_only_as_absolute_paths_to_host_files_outside_the_sandbox_paths() {
        // Not under /tmp, whose paths an argument means as the sandbox's own.
        let dir = tempfile::Builder::new().tempdir_in("/var/tmp").expect("tempdir");
        let script = dir.path().join("agent.py");
        std::fs::write(&script, "print()\n").expect("write");
        let args: Vec<String> = [
            "--flag",
            "agent.py",
            &script.display().to_string(),
            &dir.path().display().to_string(),
            "/workspace/agent.py",
            "/tmp",
            "/no/such/file",
        ]
        .map(str::to_owned)
        .to_vec();
        let found = argument_files(&args);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].named, script);
        assert_eq!(found[0].why, Why::Argument(3));
        assert_eq!(found[0].why.key(), ARGS_KEY);
    }

    #[test]
    fn a_package_root_is_a_virtual_environment_or_the_node_modules_a_package_is_in() {
        let dir = tempfile::Builder::new().tempdir_in("/var/tmp").expect("tempdir");
        let venv = dir.path().join("venv");
        std::fs::create_dir_all(venv.join("bin")).expect("mkdir");
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").expect("write");
        assert_eq!(package_roots(&venv.join("bin/python")), vec![venv.clone()]);
        let modules = dir.path().join("lib/node_modules");
        let package = modules.join("@scope/pkg");
        std::fs::create_dir_all(package.join("dist")).expect("mkdir");
        std::fs::write(package.join("package.json"), "{}").expect("write");
        assert_eq!(package_roots(&package.join("dist/index.js")), vec![modules]);
        let alone = dir.path().join("alone");
        std::fs::create_dir_all(alone.join("bin")).expect("mkdir");
        std::fs::write(alone.join("package.json"), "{}").expect("write");
        assert_eq!(package_roots(&alone.join("bin/agent.js")), vec![alone]);
        assert_eq!(package_roots(Path::new("/usr/bin/env")), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_root_that_does_not_exist_yet_is_resolved_as_far_as_it_exists() {
        let dir = tempfile::tempdir().expect("tempdir");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).expect("symlink");
        let real = std::fs::canonicalize(dir.path()).expect("real");
        assert_eq!(
            resolved_as_far_as_it_exists(&link.join("not/yet")),
            real.join("not/yet")
        );
    }
}
