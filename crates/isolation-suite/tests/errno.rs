//! Reading the errno from what real tools print on standard error.

use isolation_suite::Errno;

#[test]
fn enoent_in_every_wording() {
    for stderr in [
        // coreutils
        "cat: /workspace/oab-sentinel-1-workspace: No such file or directory",
        "stat: cannot statx '/home/agent/x': No such file or directory",
        "ls: cannot access '/x': No such file or directory",
        "rm: cannot remove '/x': No such file or directory",
        "sha256sum: /x: No such file or directory",
        // busybox
        "cat: can't open '/x': No such file or directory",
        "stat: can't stat '/x': No such file or directory",
        "rm: can't remove '/x': No such file or directory",
        // git
        "fatal: cannot change to '/workspace/oab-sentinel-1-repo': No such file or directory",
        // shells redirecting into a missing directory: bash, dash, busybox ash
        "bash: line 1: /srv/s1/workspace/x: No such file or directory",
        "/bin/sh: 1: cannot create /srv/s1/workspace/x: Directory nonexistent",
        "sh: can't create /srv/s1/workspace/x: nonexistent directory",
    ] {
        assert_eq!(Errno::from_stderr(stderr), Some(Errno::ENOENT), "{stderr}");
    }
}

#[test]
fn eacces_erofs_eperm() {
    assert_eq!(
        Errno::from_stderr("cat: /srv/s1/home/x: Permission denied"),
        Some(Errno::EACCES)
    );
    assert_eq!(
        Errno::from_stderr("/bin/sh: 1: cannot create /srv/x: Permission denied"),
        Some(Errno::EACCES)
    );
    assert_eq!(
        Errno::from_stderr("fatal: cannot change to '/srv/s1/repo': PERMISSION DENIED"),
        Some(Errno::EACCES)
    );
    assert_eq!(
        Errno::from_stderr("/bin/sh: 1: cannot create /skills/x: Read-only file system"),
        Some(Errno::EROFS)
    );
    assert_eq!(
        Errno::from_stderr("sh: can't create /skills/x: Read-only file system"),
        Some(Errno::EROFS)
    );
    assert_eq!(
        Errno::from_stderr("rm: cannot remove '/x': Operation not permitted"),
        Some(Errno::EPERM)
    );
}

#[test]
fn the_first_line_with_a_known_message_decides() {
    let stderr = "warning: something harmless\nrm: cannot remove '/a': Permission denied\nrm: cannot remove '/b': No such file or directory\n";
    assert_eq!(Errno::from_stderr(stderr), Some(Errno::EACCES));
}

#[test]
fn other_errors_are_named_or_quoted() {
    assert_eq!(
        Errno::from_stderr("cat: /x/y: Not a directory"),
        Some(Errno::Other("ENOTDIR".into()))
    );
    assert_eq!(
        Errno::from_stderr("cat: /x: Is a directory"),
        Some(Errno::Other("EISDIR".into()))
    );
    assert_eq!(
        Errno::from_stderr("\n  fatal: not a git repository (or any of the parent directories): .git\n"),
        Some(Errno::Other(
            "fatal: not a git repository (or any of the parent directories): .git".into()
        ))
    );
    let long = "x".repeat(500);
    match Errno::from_stderr(&long) {
        Some(Errno::Other(text)) => assert_eq!(text.len(), 200),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(Errno::from_stderr(""), None);
    assert_eq!(Errno::from_stderr(" \n\n"), None);
}

#[test]
fn which_errors_refuse() {
    assert!(Errno::ENOENT.is_refusal());
    assert!(Errno::EACCES.is_refusal());
    assert!(Errno::EPERM.is_refusal());
    assert!(!Errno::EROFS.is_refusal());
    assert!(Errno::EROFS.is_write_refusal());
    assert!(!Errno::Other("ENOTDIR".into()).is_refusal());
    assert!(!Errno::Other("ENOTDIR".into()).is_write_refusal());
    // The shared read-only input (the RFC's step 7): EROFS or EACCES only.
    assert!(Errno::EROFS.is_shared_write_refusal());
    assert!(Errno::EACCES.is_shared_write_refusal());
    assert!(!Errno::EPERM.is_shared_write_refusal());
    assert!(!Errno::ENOENT.is_shared_write_refusal());
    assert_eq!(Errno::EROFS.to_string(), "EROFS");
    assert_eq!(Errno::Other("ELOOP".into()).to_string(), "ELOOP");
}
