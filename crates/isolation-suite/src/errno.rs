//! [`Errno`]: which error a shell command met, read from its standard error.

use std::fmt;

/// The error a probe's command met, as far as its standard error tells.
///
/// Commands run in the worker's own shell, so the suite cannot see the `errno` a system call
/// returned; it reads the message the command printed instead (see [`Errno::from_stderr`]).
#[allow(
    clippy::upper_case_acronyms,
    reason = "errno names are spelled as in errno(3), as in libc and nix"
)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Errno {
    /// `ENOENT`: no such file or directory.
    ENOENT,
    /// `EACCES`: permission denied.
    EACCES,
    /// `EROFS`: read-only file system.
    EROFS,
    /// `EPERM`: operation not permitted.
    EPERM,
    /// Anything else: the errno name where the message is a known one (`ENOTDIR`, `EISDIR`, ...),
    /// else the first line of standard error (at most 200 characters).
    Other(String),
}

/// Messages of the errors the suite decides on, lower-cased, with the errno they stand for.
///
/// - glibc's `strerror` text, which coreutils, busybox, git and bash print after the path:
///   `cat: /x: No such file or directory`, `cat: can't open '/x': No such file or directory`,
///   `fatal: cannot change to '/x': Permission denied`;
/// - dash's own wording for a redirection into a missing directory:
///   `cannot create /x/y: Directory nonexistent`;
/// - busybox ash's wording for the same: `can't create /x/y: nonexistent directory`.
const DECIDING: &[(&str, Errno)] = &[
    ("no such file or directory", Errno::ENOENT),
    ("directory nonexistent", Errno::ENOENT),
    ("nonexistent directory", Errno::ENOENT),
    ("permission denied", Errno::EACCES),
    ("read-only file system", Errno::EROFS),
    ("operation not permitted", Errno::EPERM),
];

/// Other `strerror` texts worth naming in a report; they never count as a denial.
const NAMED: &[(&str, &str)] = &[
    ("not a directory", "ENOTDIR"),
    ("is a directory", "EISDIR"),
    ("too many levels of symbolic links", "ELOOP"),
    ("input/output error", "EIO"),
    ("stale file handle", "ESTALE"),
    ("no space left on device", "ENOSPC"),
    ("disk quota exceeded", "EDQUOT"),
    ("file exists", "EEXIST"),
    ("device or resource busy", "EBUSY"),
    ("text file busy", "ETXTBSY"),
    ("file name too long", "ENAMETOOLONG"),
];

/// How much of an unrecognised message [`Errno::Other`] keeps.
const OTHER_CHARS: usize = 200;

impl Errno {
    /// Reads the errno a command met from its standard error.
    ///
    /// Lines are examined in order and the first line that carries a known message decides; the
    /// match is case-insensitive and ignores where in the line the message appears, so the
    /// wording of coreutils, busybox, git, bash, dash and busybox ash are all understood (see the
    /// module source for the exact list). A standard error with text but no known message gives
    /// [`Errno::Other`] with its first non-empty line; an empty one gives `None`.
    ///
    /// ```
    /// use isolation_suite::Errno;
    ///
    /// assert_eq!(Errno::from_stderr("cat: /w/x: No such file or directory\n"), Some(Errno::ENOENT));
    /// assert_eq!(Errno::from_stderr("sh: 1: cannot create /w/x: Directory nonexistent"), Some(Errno::ENOENT));
    /// assert_eq!(Errno::from_stderr("sh: can't create /skills/x: Read-only file system"), Some(Errno::EROFS));
    /// assert_eq!(Errno::from_stderr(""), None);
    /// ```
    pub fn from_stderr(stderr: &str) -> Option<Self> {
        for line in stderr.lines() {
            let lower = line.to_lowercase();
            if let Some((_, errno)) = DECIDING.iter().find(|(text, _)| lower.contains(text)) {
                return Some(errno.clone());
            }
            if let Some((_, name)) = NAMED.iter().find(|(text, _)| lower.contains(text)) {
                return Some(Self::Other((*name).to_owned()));
            }
        }
        let first = stderr.lines().map(str::trim).find(|line| !line.is_empty())?;
        Some(Self::Other(first.chars().take(OTHER_CHARS).collect()))
    }

    /// Whether this error means the access was refused: `ENOENT`, `EACCES` or `EPERM`.
    ///
    /// `EPERM` counts because a seccomp filter, an LSM or the sticky bit refuse with it where a
    /// permission bit would give `EACCES`; either way the other session's file was not reached.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::ENOENT | Self::EACCES | Self::EPERM)
    }

    /// Whether this error refuses a write: a refusal ([`is_refusal`](Self::is_refusal)) or `EROFS`.
    pub fn is_write_refusal(&self) -> bool {
        self.is_refusal() || matches!(self, Self::EROFS)
    }

    /// Whether this error refuses a write to the shared read-only input as the RFC's step 7
    /// requires: `EROFS` or `EACCES`, nothing else (the input exists, so `ENOENT` would mean the
    /// probe wrote somewhere else).
    pub fn is_shared_write_refusal(&self) -> bool {
        matches!(self, Self::EROFS | Self::EACCES)
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ENOENT => f.write_str("ENOENT"),
            Self::EACCES => f.write_str("EACCES"),
            Self::EROFS => f.write_str("EROFS"),
            Self::EPERM => f.write_str("EPERM"),
            Self::Other(text) => f.write_str(text),
        }
    }
}
