//! The seccomp filters of `oab-storage-rules`: the calls AgentCore's session storage is
//! reported to refuse, refused for the whole worker (the relay and the agent under it).
//!
//! | call | answer |
//! |---|---|
//! | `link`, `linkat` (hard links) | `EPERM` |
//! | `mknod`, `mknodat` of a FIFO or a socket | `EPERM` |
//! | `socket(AF_UNIX, …)` | `EPERM` |
//! | `setxattr`, `lsetxattr`, `fsetxattr`, `setxattrat`, `removexattr` and its variants | `EOPNOTSUPP` |
//! | `fallocate` | `EOPNOTSUPP` |
//!
//! A filter sees numbers, never paths: it refuses these calls everywhere the worker makes them,
//! not only on the storage (in the emulator the worker's other writable directories, HOME and
//! `/tmp`, are session storage of the local backend anyway). A UNIX socket is refused when it is
//! made, since `bind`'s address is out of a filter's reach; that also refuses abstract and
//! unnamed UNIX sockets, which the storage would not. Everything else is allowed.

use std::collections::BTreeMap;

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

/// The two filters (one per answer), compiled for this architecture.
///
/// # Errors
/// A message if this architecture has no seccomp support in `seccompiler` or a rule is invalid.
pub fn filters() -> Result<Vec<BpfProgram>, String> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())?;
    let mut not_permitted: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    not_permitted.insert(libc::SYS_linkat, Vec::new());
    let mknodat = vec![file_kind(2, libc::S_IFIFO)?, file_kind(2, libc::S_IFSOCK)?];
    not_permitted.insert(libc::SYS_mknodat, mknodat);
    #[cfg(target_arch = "x86_64")]
    {
        not_permitted.insert(libc::SYS_link, Vec::new());
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
        let filters = super::filters().expect("filters");
        assert_eq!(filters.len(), 2);
        assert!(filters.iter().all(|program| !program.is_empty()));
    }
}
