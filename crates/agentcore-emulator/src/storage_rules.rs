//! What `oab-storage-rules` enforces before it executes the worker: the calls AgentCore's
//! session storage is reported to refuse, refused for the worker (the relay and the agent
//! under it), as precisely as the kernel allows.
//!
//! | call | where | answer | mechanism |
//! |---|---|---|---|
//! | making a UNIX socket (`bind`) or a FIFO (`mknod`) | on the storage (the worker's working directory when it starts) | `EACCES` | Landlock (`MAKE_SOCK`, `MAKE_FIFO`) |
//! | `link`, `linkat` (hard links) | everywhere | `EPERM` | seccomp |
//! | `setxattr`, `lsetxattr`, `fsetxattr`, `setxattrat`, `removexattr` and its variants | everywhere | `EOPNOTSUPP` | seccomp |
//! | `fallocate` | everywhere | `EOPNOTSUPP` | seccomp |
//!
//! Landlock is path-aware: the ruleset grants making sockets and FIFOs beneath every directory
//! beside the way from `/` to the storage, which leaves out exactly the storage (and the
//! directories on the way themselves, where nothing is made in practice). A directory on the way
//! that the worker cannot list (under the local backend's Landlock mode, its ancestors) grants
//! nothing beside it: sockets and FIFOs are then refused there too. A seccomp filter sees
//! call numbers, not paths, so hard links, xattrs and `fallocate` are refused in every directory
//! of the worker (its HOME and `/tmp` too, which in the emulator are local session storage as
//! well): stricter than the service, never looser. On a kernel without Landlock, sockets and
//! FIFOs fall back to seccomp as well: `socket(AF_UNIX, …)` and `mknod`/`mknodat` of a FIFO or
//! socket get `EPERM` everywhere (a filter cannot see `bind`'s address, so every UNIX socket is
//! refused when it is made, abstract ones included).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use landlock::{
    AccessFs, BitFlags, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus,
};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

/// `setxattrat` and `removexattrat` (Linux 6.13; one number on every architecture).
const SYS_SETXATTRAT: i64 = 463;
const SYS_REMOVEXATTRAT: i64 = 466;

/// `mode & S_IFMT == kind` on argument `arg`.
fn file_kind(arg: u8, kind: libc::mode_t) -> Result<SeccompRule, String> {
    let condition = SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(u64::from(libc::S_IFMT)),
        u64::from(kind),
    )
    .map_err(|e| e.to_string())?;
    SeccompRule::new(vec![condition]).map_err(|e| e.to_string())
}

/// Refuses making UNIX sockets and FIFOs beneath each of `storage` (the storage, by each path it
/// may be reached), and nowhere else, with Landlock. `Ok(false)`: this kernel does not enforce
/// Landlock (nothing changed).
///
/// # Errors
/// A message if a ruleset could not be made or enforced.
pub fn refuse_special_files_beneath(storage: &[PathBuf]) -> Result<bool, String> {
    let access: BitFlags<AccessFs> = AccessFs::MakeSock | AccessFs::MakeFifo;
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(access)
        .and_then(|ruleset| ruleset.create())
        .map_err(|e| format!("creating the landlock ruleset: {e}"))?;
    for dir in beside_the_way(storage) {
        // A directory this process cannot open is not one it can make anything in either.
        let Ok(fd) = PathFd::new(&dir) else { continue };
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, access))
            .map_err(|e| format!("allowing {}: {e}", dir.display()))?;
    }
    let status = ruleset
        .restrict_self()
        .map_err(|e| format!("enforcing the landlock ruleset: {e}"))?;
    Ok(status.ruleset != RulesetStatus::NotEnforced)
}

/// Every directory beside the ways from `/` to the `protected` paths (absolute): the children
/// of each directory on a way that are on no way themselves. Granting them all leaves out
/// exactly the protected paths (and the directories on the ways, where nothing is made in
/// practice).
fn beside_the_way(protected: &[PathBuf]) -> Vec<PathBuf> {
    let on_a_way: BTreeSet<&Path> = protected.iter().flat_map(|path| path.ancestors()).collect();
    let mut beside = BTreeSet::new();
    for dir in on_a_way.iter().filter(|dir| !protected.iter().any(|p| p == *dir)) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let is_dir = entry.file_type().is_ok_and(|kind| kind.is_dir());
            if is_dir && !on_a_way.contains(path.as_path()) {
                beside.insert(path);
            }
        }
    }
    beside.into_iter().collect()
}

/// The two filters (one per answer), compiled for this architecture. With `sockets_and_fifos`,
/// they also refuse every UNIX socket and FIFO (when Landlock could not refuse them on the
/// storage alone).
///
/// # Errors
/// A message if this architecture has no seccomp support in `seccompiler` or a rule is invalid.
pub fn filters(sockets_and_fifos: bool) -> Result<Vec<BpfProgram>, String> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())?;
    let mut not_permitted: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    not_permitted.insert(libc::SYS_linkat, Vec::new());
    #[cfg(target_arch = "x86_64")]
    not_permitted.insert(libc::SYS_link, Vec::new());
    if sockets_and_fifos {
        let mknodat = vec![file_kind(2, libc::S_IFIFO)?, file_kind(2, libc::S_IFSOCK)?];
        not_permitted.insert(libc::SYS_mknodat, mknodat);
        #[cfg(target_arch = "x86_64")]
        {
            let mknod = vec![file_kind(1, libc::S_IFIFO)?, file_kind(1, libc::S_IFSOCK)?];
            not_permitted.insert(libc::SYS_mknod, mknod);
        }
        let unix = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            u64::try_from(libc::AF_UNIX).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
        not_permitted.insert(
            libc::SYS_socket,
            vec![SeccompRule::new(vec![unix]).map_err(|e| e.to_string())?],
        );
    }
    let mut unsupported: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for call in [
        libc::SYS_setxattr,
        libc::SYS_lsetxattr,
        libc::SYS_fsetxattr,
        SYS_SETXATTRAT,
        libc::SYS_removexattr,
        libc::SYS_lremovexattr,
        libc::SYS_fremovexattr,
        SYS_REMOVEXATTRAT,
        libc::SYS_fallocate,
    ] {
        unsupported.insert(call, Vec::new());
    }
    let errno = |code: i32| SeccompAction::Errno(u32::try_from(code).unwrap_or(1));
    [(not_permitted, libc::EPERM), (unsupported, libc::EOPNOTSUPP)]
        .into_iter()
        .map(|(rules, code)| {
            let filter = SeccompFilter::new(rules, SeccompAction::Allow, errno(code), arch)
                .map_err(|e| e.to_string())?;
            BpfProgram::try_from(filter).map_err(|e| e.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_filters_compile_for_this_architecture() {
        for sockets_and_fifos in [true, false] {
            let filters = super::filters(sockets_and_fifos).expect("filters");
            assert_eq!(filters.len(), 2);
            assert!(filters.iter().all(|program| !program.is_empty()));
        }
    }

    #[test]
    fn everything_beside_the_way_to_the_storage_is_granted_and_nothing_on_it() {
        let dir = tempfile::tempdir().expect("dir");
        for name in ["storage", "home", "tmp"] {
            std::fs::create_dir(dir.path().join(name)).expect("mkdir");
        }
        std::fs::write(dir.path().join("file"), "").expect("a file");
        let storage = dir.path().join("storage");
        let beside = super::beside_the_way(std::slice::from_ref(&storage));
        assert!(beside.contains(&dir.path().join("home")), "{beside:?}");
        assert!(beside.contains(&dir.path().join("tmp")), "{beside:?}");
        assert!(
            !beside.contains(&dir.path().join("file")),
            "only directories: {beside:?}"
        );
        for ancestor in storage.ancestors() {
            assert!(
                !beside.iter().any(|granted| granted == ancestor),
                "{} granted",
                ancestor.display()
            );
        }
        // A second path to the storage is left out too.
        let both = super::beside_the_way(&[storage.clone(), dir.path().join("home")]);
        assert!(!both.contains(&dir.path().join("home")), "{both:?}");
        assert!(both.contains(&dir.path().join("tmp")), "{both:?}");
    }
}
