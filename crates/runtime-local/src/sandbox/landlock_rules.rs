//! The command line of the `oab-landlock-exec` helper and the Landlock ruleset it applies.
//!
//! This file is compiled twice: into the runtime library, which writes the helper's command line
//! ([`Rules::to_args`]), and into the helper binary, which reads it back ([`parse`]) and applies it
//! ([`restrict_self`]) before it executes the agent. Both sides therefore always agree on the
//! format.
//!
//! ```text
//! oab-landlock-exec [--uid N] [--gid N] [--read PATH]... [--write PATH]... -- PROGRAM [ARG]...
//! oab-landlock-exec --probe
//! oab-landlock-exec --scopes-only -- PROGRAM [ARG]...
//! ```
//!
//! - `--read PATH`: read, list and execute beneath `PATH` (or the file `PATH`);
//! - `--write PATH`: every filesystem right beneath `PATH` (or the file `PATH`);
//! - `--uid N` / `--gid N`: after restricting itself, the helper switches to this user and group
//!   (dropping supplementary groups) as it executes `PROGRAM`, so it can start as the broker's user
//!   (root) and no file of the helper needs to be readable by the session's uid;
//! - `--probe`: restrict itself with an empty ruleset and exit 0 if Landlock is enforced.
//! - `--scopes-only`: apply only the scopes (no filesystem rule), then execute `PROGRAM`: how a
//!   bubblewrap sandbox that shares the host's network namespace keeps its sessions' abstract
//!   UNIX sockets apart ([`restrict_scopes`]).
//!
//! Everything not granted is denied: the ruleset handles every filesystem right of
//! [`VETTED_ABI`], plus its scopes (signals to, and abstract UNIX sockets of, processes outside
//! the sandbox). On older kernels the rights they lack are left out (Landlock's best effort); a
//! kernel without Landlock fails the helper instead of running the agent unrestricted.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

use landlock::{
    Access, AccessFs, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, Scope, ABI,
};

/// The newest Landlock ABI whose access rights this code handles (filesystem rights up to
/// `IoctlDev`, and the signal and abstract-socket scopes). Newer rights are not requested, so a
/// newer kernel never denies something this code does not know about.
pub(crate) const VETTED_ABI: ABI = ABI::V6;

/// The helper's exit code when it cannot restrict itself or execute the program (as a shell's).
pub(crate) const EXIT_CANNOT_RUN: i32 = 126;

/// The helper's exit code when the program does not exist (as a shell's).
pub(crate) const EXIT_NOT_FOUND: i32 = 127;

/// What the sandboxed program may touch, and as whom it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Rules {
    /// The user the program runs as; `None`: the helper's own.
    pub(crate) uid: Option<u32>,
    /// The group the program runs as; `None`: the helper's own.
    pub(crate) gid: Option<u32>,
    /// Paths (directories or files) that may be read, listed and executed.
    pub(crate) read: Vec<PathBuf>,
    /// Paths (directories or files) with every filesystem right.
    pub(crate) write: Vec<PathBuf>,
}

/// One parsed command line of the helper.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Invocation {
    /// `--probe`: check that Landlock is enforced, run nothing.
    Probe,
    /// `--scopes-only`: apply the scopes only ([`restrict_scopes`]), then execute `program`.
    ScopesOnly {
        /// The program, looked up on `PATH` if it has no `/`.
        program: OsString,
        /// Its arguments.
        args: Vec<OsString>,
    },
    /// Restrict, then execute `program` with `args`.
    Exec {
        /// The restrictions.
        rules: Rules,
        /// The program, looked up on `PATH` if it has no `/`.
        program: OsString,
        /// Its arguments.
        args: Vec<OsString>,
    },
}

impl Rules {
    /// The helper's arguments (without the helper itself) that apply these rules and execute
    /// `program` with `args`.
    pub(crate) fn to_args(&self, program: &OsStr, args: &[OsString]) -> Vec<OsString> {
        let mut out: Vec<OsString> = Vec::new();
        if let Some(uid) = self.uid {
            out.extend(["--uid".into(), uid.to_string().into()]);
        }
        if let Some(gid) = self.gid {
            out.extend(["--gid".into(), gid.to_string().into()]);
        }
        for path in &self.read {
            out.extend(["--read".into(), path.clone().into_os_string()]);
        }
        for path in &self.write {
            out.extend(["--write".into(), path.clone().into_os_string()]);
        }
        out.push("--".into());
        out.push(program.to_owned());
        out.extend(args.iter().cloned());
        out
    }
}

/// Reads the helper's arguments (without the helper itself).
///
/// # Errors
///
/// A description of the first problem: an unknown option, a missing or malformed value, a
/// relative path, or no program.
pub(crate) fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Invocation, String> {
    let mut args = args.into_iter();
    let mut rules = Rules::default();
    let mut first = true;
    loop {
        let Some(arg) = args.next() else {
            return Err("no program: expected `-- PROGRAM [ARG]...`".to_owned());
        };
        if first && arg == "--probe" {
            return match args.next() {
                None => Ok(Invocation::Probe),
                Some(extra) => Err(format!("--probe takes no arguments, found {extra:?}")),
            };
        }
        if first && arg == "--scopes-only" {
            if args.next().is_none_or(|separator| separator != "--") {
                return Err("--scopes-only takes `-- PROGRAM [ARG]...`".to_owned());
            }
            let program = args.next().ok_or_else(|| "no program after `--`".to_owned())?;
            return Ok(Invocation::ScopesOnly {
                program,
                args: args.collect(),
            });
        }
        first = false;
        match arg.to_str() {
            Some("--") => break,
            Some(option @ ("--uid" | "--gid")) => {
                let value = args.next().ok_or_else(|| format!("{option} needs a number"))?;
                let id = value
                    .to_str()
                    .and_then(|v| v.parse::<u32>().ok())
                    .filter(|id| *id != u32::MAX)
                    .ok_or_else(|| format!("{option} needs a number, found {value:?}"))?;
                if option == "--uid" {
                    rules.uid = Some(id);
                } else {
                    rules.gid = Some(id);
                }
            }
            Some(option @ ("--read" | "--write")) => {
                let path = PathBuf::from(args.next().ok_or_else(|| format!("{option} needs a path"))?);
                if !path.is_absolute() {
                    return Err(format!("{option} needs an absolute path, found {path:?}"));
                }
                if option == "--read" {
                    rules.read.push(path);
                } else {
                    rules.write.push(path);
                }
            }
            _ => return Err(format!("unknown option {arg:?}")),
        }
    }
    let program = args.next().ok_or_else(|| "no program after `--`".to_owned())?;
    Ok(Invocation::Exec {
        rules,
        program,
        args: args.collect(),
    })
}

/// Restricts the calling thread (and everything it executes) to `rules` (the uid and gid aside).
///
/// # Errors
///
/// A description of what failed; in particular, a kernel that does not enforce Landlock at all.
pub(crate) fn restrict_self(rules: &Rules) -> Result<(), String> {
    let abi = VETTED_ABI;
    let mut ruleset = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.scope(Scope::from_all(abi)))
        .and_then(|r| r.create())
        .map_err(|e| format!("creating the landlock ruleset: {e}"))?;
    let grants = rules
        .read
        .iter()
        .map(|path| (path, AccessFs::from_read(abi)))
        .chain(rules.write.iter().map(|path| (path, AccessFs::from_all(abi))));
    for (path, access) in grants {
        let fd = PathFd::new(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, access))
            .map_err(|e| format!("allowing {}: {e}", path.display()))?;
    }
    let status = ruleset
        .restrict_self()
        .map_err(|e| format!("enforcing the landlock ruleset: {e}"))?;
    if status.ruleset == RulesetStatus::NotEnforced {
        return Err(
            "this kernel does not enforce landlock (not built in, or not enabled at boot: \
                    add `landlock` to the `lsm=` kernel parameter)"
                .to_owned(),
        );
    }
    Ok(())
}

/// Restricts the calling thread (and everything it executes) with Landlock's scopes only: it can
/// no longer connect to an abstract UNIX socket, nor signal a process, outside its own Landlock
/// domain. Files are not restricted. Two sessions restricted this way each get a domain of their
/// own, so neither reaches the other's abstract sockets even in one network namespace.
///
/// # Errors
///
/// A description of what failed; in particular, a kernel without the scopes (Linux 6.12 and
/// later have them), where nothing would be restricted.
pub(crate) fn restrict_scopes() -> Result<(), String> {
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .scope(Scope::from_all(ABI::V6))
        .and_then(|r| r.create())
        .map_err(|e| format!("creating the landlock scopes: {e}"))?
        .restrict_self()
        .map_err(|e| format!("enforcing the landlock scopes: {e}"))?;
    if status.ruleset != RulesetStatus::FullyEnforced {
        return Err(
            "this kernel does not enforce landlock's scopes (they need Linux 6.12 or later)".to_owned(),
        );
    }
    Ok(())
}

/// Whether this kernel enforces Landlock's scopes of abstract UNIX sockets and signals (ABI 6,
/// Linux 6.12 and later), which [`restrict_scopes`] needs. Creates (and drops) a ruleset.
pub(crate) fn kernel_scopes() -> bool {
    Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .scope(Scope::from_all(ABI::V6))
        .and_then(|r| r.create())
        .is_ok()
}

/// The newest Landlock ABI up to [`VETTED_ABI`] that this kernel fully supports, or `None` if it
/// does not enforce Landlock at all. Creates (and drops) rulesets; restricts nothing.
pub(crate) fn kernel_abi() -> Option<ABI> {
    [ABI::V6, ABI::V5, ABI::V4, ABI::V3, ABI::V2, ABI::V1]
        .into_iter()
        .find(|abi| {
            let ruleset = Ruleset::default()
                .set_compatibility(CompatLevel::HardRequirement)
                .handle_access(AccessFs::from_all(*abi));
            let ruleset = if Scope::from_all(*abi).is_empty() {
                ruleset
            } else {
                ruleset.and_then(|r| r.scope(Scope::from_all(*abi)))
            };
            ruleset.and_then(|r| r.create()).is_ok()
        })
}
