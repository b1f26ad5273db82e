//! Tests of the local runtime's sandbox layer (`src/sandbox`): command lines, uid claims, storage
//! permissions, cgroups, and live sandboxes (bubblewrap and Landlock) run on this host.
//!
//! The module is compiled into this test crate (`#[path]`), so its crate-private items are
//! reachable and the `oab-landlock-exec` helper built by Cargo is known
//! (`CARGO_BIN_EXE_oab-landlock-exec`). Live tests check what this host offers first and assert
//! the documented behaviour either way: where bubblewrap, Landlock or cgroups are missing, the
//! sandbox must refuse with the right error instead.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use session_runtime::config::{NetworkMode, ReadonlyMount, ResourceLimits, SandboxMode};
use session_runtime::{Error, IsolationLevel, SessionId, SessionIdentity};

// `crate::RUNTIME`, as the sandbox module expects.
use runtime_local::RUNTIME;

// `crate::backend_error`, as the sandbox module expects.
#[path = "../src/errors.rs"]
mod errors;
use errors::backend_error;
#[allow(dead_code)]
#[path = "../src/layout.rs"]
mod layout;
#[allow(dead_code)]
#[path = "../src/process.rs"]
mod process;
#[allow(dead_code)]
#[path = "../src/sandbox/mod.rs"]
mod sandbox;

use layout::SessionDirs;
use sandbox::bwrap::bwrap_args;
use sandbox::cgroup::{cpu_quota_us, group_name, CgroupHost, CgroupV1, CgroupV2};
use sandbox::host::{HostLayout, SystemEntry};
use sandbox::landlock_exec::rules as landlock_rules_for;
use sandbox::landlock_rules::{
    kernel_abi as landlock_kernel_abi, parse as parse_landlock_args, Invocation as LandlockInvocation,
    Rules as LandlockRules,
};
use sandbox::storage::IdentityFiles;
use sandbox::uids::{allocate_in, release_in, HostIds};
use sandbox::{running_as_root, DetectOptions, LaunchSpec, Sandbox, SandboxKind, UID_RANGE};

const HELPER: &str = env!("CARGO_BIN_EXE_oab-landlock-exec");

fn id(thread: &str) -> SessionId {
    SessionIdentity::new("test", "agent", "discord", thread)
        .expect("valid identity")
        .id()
}

fn strings(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// A Debian-like host: merged /usr, root, setpriv available.
fn debian_layout(root: bool) -> HostLayout {
    let link = |path: &str, target: &str| SystemEntry::Symlink {
        path: path.into(),
        target: target.into(),
    };
    HostLayout {
        system: vec![
            SystemEntry::Dir("/usr".into()),
            link("/bin", "usr/bin"),
            link("/sbin", "usr/sbin"),
            link("/lib", "usr/lib"),
            link("/lib64", "usr/lib64"),
            SystemEntry::Dir("/etc".into()),
        ],
        etc_identity: true,
        resolv_conf: None,
        setpriv: Some("/usr/bin/setpriv".into()),
        root,
    }
}

fn skills() -> ReadonlyMount {
    ReadonlyMount::new("/opt/openab/skills", "/skills").expect("valid mount")
}

fn config_key(error: &Error) -> &str {
    match error {
        Error::InvalidConfig { key, .. } => key,
        other => panic!("expected an invalid-config error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Command lines
// ---------------------------------------------------------------------------------------------

#[test]
fn bubblewrap_argv_as_root_with_a_uid_and_no_network() {
    let id = id("argv-root");
    let dirs = SessionDirs::live(Path::new("/var/lib/openab/sessions"), &id);
    let args = vec!["--acp".to_owned(), "--verbose".to_owned()];
    let spec = LaunchSpec {
        id: &id,
        program: "agent",
        args: &args,
        dirs: &dirs,
        uid: Some(200_123),
        join_cgroups: None,
        needs: &[],
        pinned: &sandbox::needs::PinnedNeeds::default(),
        egress: None,
        working_dir: None,
    };
    let identity = IdentityFiles::at(&dirs.base);
    let argv = bwrap_args(
        &debian_layout(true),
        NetworkMode::None,
        &[skills()],
        &spec,
        Some(&identity),
        None,
    )
    .expect("argv");
    let base = format!("/var/lib/openab/sessions/{id}");
    let expected: Vec<String> = [
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-net",
        "--hostname",
        "openab",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/sbin",
        "/sbin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--ro-bind",
        "/etc",
        "/etc",
        "--ro-bind",
        &format!("{base}/sandbox-passwd"),
        "/etc/passwd",
        "--ro-bind",
        &format!("{base}/sandbox-group"),
        "/etc/group",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "0755",
        "--dir",
        "/home",
        "--bind",
        &format!("{base}/home"),
        "/home/agent",
        "--bind",
        &format!("{base}/workspace"),
        "/workspace",
        "--bind",
        &format!("{base}/tmp"),
        "/tmp",
        "--bind",
        &format!("{base}/state"),
        "/state",
        "--ro-bind",
        "/opt/openab/skills",
        "/skills",
        "--chdir",
        "/workspace",
        "--",
        "/usr/bin/setpriv",
        "--reuid=200123",
        "--regid=200123",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
        "agent",
        "--acp",
        "--verbose",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let argv: Vec<String> = argv.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    assert_eq!(argv, expected);
}

#[test]
fn bubblewrap_argv_without_a_uid_drops_every_capability() {
    let id = id("argv-user");
    let dirs = SessionDirs::live(Path::new("/srv/s"), &id);
    let spec = LaunchSpec {
        id: &id,
        program: "agent",
        args: &[],
        dirs: &dirs,
        uid: None,
        join_cgroups: None,
        needs: &[],
        pinned: &sandbox::needs::PinnedNeeds::default(),
        egress: None,
        working_dir: None,
    };
    let argv = bwrap_args(&debian_layout(false), NetworkMode::Host, &[], &spec, None, None).expect("argv");
    let base = format!("/srv/s/{id}");
    assert_eq!(
        &argv[..9],
        &strings(&[
            "--die-with-parent",
            "--new-session",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--hostname",
            "openab",
            "--cap-drop",
            "ALL",
        ])[..]
    );
    assert!(
        !argv.iter().any(|a| a == "--unshare-net"),
        "network = host keeps the network"
    );
    assert!(
        !argv.iter().any(|a| a == "/etc/passwd"),
        "no generated identity without a uid"
    );
    let expected_tail = strings(&[
        "--perms",
        "0755",
        "--dir",
        "/home",
        "--bind",
        &format!("{base}/home"),
        "/home/agent",
        "--bind",
        &format!("{base}/workspace"),
        "/workspace",
        "--bind",
        &format!("{base}/tmp"),
        "/tmp",
        "--bind",
        &format!("{base}/state"),
        "/state",
        "--chdir",
        "/workspace",
        "--",
        "agent",
    ]);
    assert_eq!(
        &argv[argv.len() - expected_tail.len()..],
        expected_tail.as_slice()
    );
}

#[test]
fn bubblewrap_refuses_a_uid_it_cannot_switch_to() {
    let id = id("argv-no-root");
    let dirs = SessionDirs::live(Path::new("/srv/s"), &id);
    let spec = LaunchSpec {
        id: &id,
        program: "agent",
        args: &[],
        dirs: &dirs,
        uid: Some(200_001),
        join_cgroups: None,
        needs: &[],
        pinned: &sandbox::needs::PinnedNeeds::default(),
        egress: None,
        working_dir: None,
    };
    let error =
        bwrap_args(&debian_layout(false), NetworkMode::Host, &[], &spec, None, None).expect_err("not root");
    assert!(
        matches!(error, Error::Backend { retryable: false, .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("not root"), "{error}");
}

#[test]
fn bubblewrap_binds_an_agent_that_lives_outside_the_system_directories() {
    let id = id("argv-program");
    let dirs = SessionDirs::live(Path::new("/srv/s"), &id);
    let under_target = tempfile::Builder::new()
        .prefix("agent-bin")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("tempdir");
    let under_tmp = tempfile::Builder::new()
        .prefix("agent-bin")
        .tempdir()
        .expect("tempdir");
    for dir in [under_target.path(), under_tmp.path()] {
        let program = dir.join("agent");
        fs::write(&program, "#!/bin/sh\n").expect("write");
        let real = fs::canonicalize(&program).expect("canonical");
        // The sandbox's /tmp is the session's own: a program from the host's /tmp is shown elsewhere.
        let shown = if real.starts_with("/tmp") {
            Path::new("/run/host").join(real.strip_prefix("/").expect("absolute"))
        } else {
            real.clone()
        };
        let spec = LaunchSpec {
            id: &id,
            program: program.to_str().expect("utf-8"),
            args: &[],
            dirs: &dirs,
            uid: None,
            join_cgroups: None,
            needs: &[],
            pinned: &sandbox::needs::PinnedNeeds::default(),
            egress: None,
            working_dir: None,
        };
        let argv =
            bwrap_args(&debian_layout(false), NetworkMode::Host, &[], &spec, None, None).expect("argv");
        let bind = vec![
            OsString::from("--ro-bind"),
            real.clone().into(),
            shown.clone().into(),
        ];
        assert!(argv.windows(3).any(|w| w == bind.as_slice()), "{argv:?}");
        assert_eq!(
            argv.last(),
            Some(&shown.into_os_string()),
            "the shown path is executed"
        );
    }

    // In-sandbox paths and PATH names are left alone.
    for program in ["/workspace/bin/agent", "/skills/agent", "node"] {
        let spec = LaunchSpec {
            id: &id,
            program,
            args: &[],
            dirs: &dirs,
            uid: None,
            join_cgroups: None,
            needs: &[],
            pinned: &sandbox::needs::PinnedNeeds::default(),
            egress: None,
            working_dir: None,
        };
        let argv = bwrap_args(
            &debian_layout(false),
            NetworkMode::Host,
            &[skills()],
            &spec,
            None,
            None,
        )
        .expect("argv");
        assert_eq!(
            argv.iter().filter(|a| *a == "--ro-bind").count(),
            3,
            "{program}: {argv:?}"
        );
        assert_eq!(argv.last(), Some(&OsString::from(program)));
    }
}

#[test]
fn landlock_rules_cover_system_paths_read_only_and_the_session_read_write() {
    let id = id("rules");
    let dirs = SessionDirs::live(Path::new("/srv/s"), &id);
    let args = vec!["-c".to_owned(), "true".to_owned()];
    let spec = LaunchSpec {
        id: &id,
        program: "sh",
        args: &args,
        dirs: &dirs,
        uid: Some(200_500),
        join_cgroups: None,
        needs: &[],
        pinned: &sandbox::needs::PinnedNeeds::default(),
        egress: None,
        working_dir: None,
    };
    let rules = landlock_rules_for(&debian_layout(true), &[skills()], &spec);
    for path in ["/usr", "/bin", "/etc", "/proc", "/opt/openab/skills"] {
        assert!(
            rules.read.contains(&PathBuf::from(path)),
            "{path} readable: {rules:?}"
        );
    }
    for dir in [&dirs.workspace, &dirs.home, &dirs.tmp, &dirs.state] {
        assert!(rules.write.contains(dir), "{} writable", dir.display());
        assert!(
            !rules.read.iter().any(|r| dir.starts_with(r)),
            "no broader read grant over the session"
        );
    }
    assert!(rules.write.contains(&PathBuf::from("/dev/null")));
    assert!(!rules
        .write
        .iter()
        .chain(&rules.read)
        .any(|p| p == Path::new("/srv/s") || p == &dirs.base));
    assert_eq!((rules.uid, rules.gid), (Some(200_500), Some(200_500)));

    // The helper reads back exactly what the library wrote.
    let argv = rules.to_args("sh".as_ref(), &strings(&["-c", "true"]));
    match parse_landlock_args(argv).expect("parses") {
        LandlockInvocation::Exec {
            rules: parsed,
            program,
            args,
        } => {
            assert_eq!(parsed, rules);
            assert_eq!(program, "sh");
            assert_eq!(args, strings(&["-c", "true"]));
        }
        other => panic!("expected exec, got {other:?}"),
    }
    assert_eq!(
        parse_landlock_args(strings(&["--probe"])).expect("probe"),
        LandlockInvocation::Probe
    );
    // What a bubblewrap sandbox on the host's network runs the agent through.
    assert_eq!(
        parse_landlock_args(strings(&["--scopes-only", "--", "agent", "--acp"])).expect("scopes"),
        LandlockInvocation::ScopesOnly {
            program: "agent".into(),
            args: strings(&["--acp"]),
        }
    );
    for bad in [
        &["--scopes-only"][..],
        &["--scopes-only", "agent"],
        &["--scopes-only", "--"],
        &["--read", "relative", "--", "x"],
        &["--uid", "-1", "--", "x"],
        &["--"],
        &["--bogus"],
        &["--read"],
    ] {
        assert!(
            parse_landlock_args(strings(bad)).is_err(),
            "{bad:?} must be rejected"
        );
    }
    assert_eq!(
        LandlockRules::default().to_args("x".as_ref(), &[]),
        strings(&["--", "x"])
    );
}

// ---------------------------------------------------------------------------------------------
// Detection
// ---------------------------------------------------------------------------------------------

#[test]
fn plain_mode_isolates_nothing_and_shows_host_paths() {
    let sandbox = Sandbox::detect(SandboxMode::None, NetworkMode::Host, &[]).expect("plain always works");
    assert_eq!(sandbox.kind(), SandboxKind::None);
    assert_eq!(sandbox.kind().to_string(), "none");
    assert_eq!(sandbox.isolation(), IsolationLevel::None);
    let dirs = SessionDirs::live(Path::new("/srv/s"), &id("plain"));
    let paths = sandbox.worker_paths(&dirs);
    assert_eq!(paths.workspace, dirs.workspace.display().to_string());
    assert_eq!(paths.home, dirs.home.display().to_string());
    let root = tempfile::tempdir().expect("tempdir");
    assert_eq!(
        sandbox.allocate_uid(root.path(), &id("plain")).expect("allocate"),
        None,
        "plain keeps the broker's user"
    );
}

#[test]
fn a_missing_sandbox_is_a_config_error_that_says_what_to_do() {
    let missing = DetectOptions {
        bwrap: Some("/nonexistent/bwrap".into()),
        landlock_helper: Some("/nonexistent/oab-landlock-exec".into()),
        network_is_default: false,
    };
    let error = Sandbox::detect_with(SandboxMode::Bubblewrap, NetworkMode::Host, &[], &missing)
        .expect_err("no bwrap");
    assert_eq!(config_key(&error), "session_runtime.local.sandbox");
    assert!(
        error.to_string().contains("apt-get install bubblewrap"),
        "{error}"
    );

    let error =
        Sandbox::detect_with(SandboxMode::Auto, NetworkMode::Host, &[], &missing).expect_err("nothing works");
    assert_eq!(config_key(&error), "session_runtime.local.sandbox");
    let text = error.to_string();
    for needle in [
        "apt-get install bubblewrap",
        "sandbox = \"none\"",
        "bubblewrap:",
        "landlock:",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }

    let error =
        Sandbox::detect_with(SandboxMode::Landlock, NetworkMode::Host, &[], &missing).expect_err("no helper");
    assert_eq!(config_key(&error), "session_runtime.local.sandbox");
}

#[test]
fn read_only_inputs_must_exist_and_stay_out_of_the_sandbox_own_paths() {
    let options = DetectOptions::default();
    let missing = ReadonlyMount::new("/nonexistent/skills", "/skills").expect("mount");
    let clash = ReadonlyMount::new("/usr/share", "/workspace/skills").expect("mount");
    let cover = ReadonlyMount::new("/usr/share", "/home").expect("mount");
    for mode in [SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        match Sandbox::detect_with(mode, NetworkMode::Host, &[], &options) {
            // This host lacks the mechanism: the mount checks are moot.
            Err(error) => assert_eq!(config_key(&error), "session_runtime.local.sandbox"),
            Ok(_) => {
                let error =
                    Sandbox::detect_with(mode, NetworkMode::Host, std::slice::from_ref(&missing), &options)
                        .expect_err("missing");
                assert_eq!(config_key(&error), "session_runtime.local.readonly", "{mode}");
            }
        }
    }
    if Sandbox::detect(SandboxMode::Bubblewrap, NetworkMode::Host, &[]).is_ok() {
        for mount in [clash, cover] {
            let error =
                Sandbox::detect(SandboxMode::Bubblewrap, NetworkMode::Host, &[mount]).expect_err("clash");
            assert_eq!(config_key(&error), "session_runtime.local.readonly");
        }
    }
}

#[test]
fn landlock_cannot_take_the_network_away() {
    let options = DetectOptions {
        bwrap: None,
        landlock_helper: Some(HELPER.into()),
        network_is_default: false,
    };
    let error =
        Sandbox::detect_with(SandboxMode::Landlock, NetworkMode::None, &[], &options).expect_err("refused");
    let key = config_key(&error);
    if landlock_kernel_abi().is_some() {
        assert_eq!(key, "session_runtime.local.network");
    } else {
        assert_eq!(key, "session_runtime.local.sandbox");
    }
}

// ---------------------------------------------------------------------------------------------
// Uids
// ---------------------------------------------------------------------------------------------

#[test]
fn uid_claims_are_distinct_stable_and_released() {
    let root = tempfile::tempdir().expect("tempdir");
    let host = HostIds::default();
    let (a, b, c) = (id("uid-a"), id("uid-b"), id("uid-c"));
    let range = 300_000..300_002;
    let ua = allocate_in(root.path(), &a, range.clone(), &host).expect("a");
    let ub = allocate_in(root.path(), &b, range.clone(), &host).expect("b");
    assert_ne!(ua, ub);
    assert!(range.contains(&ua) && range.contains(&ub));
    assert_eq!(
        allocate_in(root.path(), &a, range.clone(), &host).expect("a again"),
        ua,
        "same session, same uid"
    );
    assert_eq!(
        fs::read_to_string(root.path().join(".uids").join(ua.to_string())).expect("claim"),
        a.as_str()
    );
    assert_eq!(
        fs::metadata(root.path().join(".uids"))
            .expect("dir")
            .permissions()
            .mode()
            & 0o777,
        0o700
    );

    let error = allocate_in(root.path(), &c, range.clone(), &host).expect_err("range exhausted");
    assert!(matches!(error, Error::Backend { .. }), "{error:?}");
    release_in(root.path(), &a, || true).expect("release while a has storage");
    assert!(
        root.path().join(".uids").join(ua.to_string()).exists(),
        "a claim whose session has storage is kept"
    );
    release_in(root.path(), &a, || false).expect("release");
    release_in(root.path(), &a, || false).expect("release is idempotent");
    assert_eq!(
        allocate_in(root.path(), &c, range.clone(), &host).expect("c"),
        ua,
        "a's uid is free again"
    );
    let leftovers: Vec<_> = fs::read_dir(root.path().join(".uids"))
        .expect("read")
        .map(|e| e.expect("entry").file_name())
        .filter(|n| n.to_string_lossy().starts_with(".claim-"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "temporary claims are cleaned up: {leftovers:?}"
    );
}

#[test]
fn uid_claims_skip_ids_the_host_uses() {
    let root = tempfile::tempdir().expect("tempdir");
    let host = HostIds {
        ids: [400_000, 400_001].into_iter().collect(),
        ranges: vec![400_002..400_003, 400_003..400_004],
    };
    let uid = allocate_in(root.path(), &id("skip"), 400_000..400_005, &host).expect("free id");
    assert_eq!(uid, 400_004);
}

#[test]
fn concurrent_claims_from_eight_threads_never_share_a_uid() {
    let root = Arc::new(tempfile::tempdir().expect("tempdir"));
    let range = 500_000..500_032;
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let root = Arc::clone(&root);
            let range = range.clone();
            std::thread::spawn(move || {
                (0..4)
                    .map(|s| {
                        let id = id(&format!("race-{t}-{s}"));
                        let uid =
                            allocate_in(root.path(), &id, range.clone(), &HostIds::default()).expect("claim");
                        (id, uid)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let claims: Vec<(SessionId, u32)> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("thread"))
        .collect();
    let uids: HashSet<u32> = claims.iter().map(|(_, uid)| *uid).collect();
    assert_eq!(uids.len(), 32, "32 sessions, 32 distinct uids: {claims:?}");
    for (id, uid) in &claims {
        assert_eq!(
            allocate_in(root.path(), id, range.clone(), &HostIds::default()).expect("again"),
            *uid
        );
    }
}

#[test]
fn a_root_broker_allocates_from_the_documented_range() {
    let Ok(sandbox) = Sandbox::detect(SandboxMode::Auto, NetworkMode::Host, &[]) else {
        // No sandbox here: the refusal itself is tested above.
        return;
    };
    let root = tempfile::tempdir().expect("tempdir");
    let uid = sandbox.allocate_uid(root.path(), &id("range")).expect("allocate");
    if running_as_root() {
        let uid = uid.expect("root brokers give sessions a uid");
        assert!(UID_RANGE.contains(&uid), "{uid}");
        sandbox
            .release_uid(root.path(), &id("range"), || false)
            .expect("release");
    } else {
        assert_eq!(uid, None, "a broker that is not root runs agents as itself");
    }
}

// ---------------------------------------------------------------------------------------------
// Storage
// ---------------------------------------------------------------------------------------------

fn make_dirs(root: &Path, id: &SessionId) -> SessionDirs {
    let dirs = SessionDirs::live(root, id);
    for dir in [&dirs.base, &dirs.workspace, &dirs.home, &dirs.state, &dirs.tmp] {
        fs::create_dir_all(dir).expect("mkdir");
    }
    dirs
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path).expect("stat").permissions().mode() & 0o7777
}

#[test]
fn storage_is_made_private_to_the_session() {
    let root = tempfile::tempdir().expect("tempdir");
    let id = id("storage");
    let dirs = make_dirs(root.path(), &id);
    fs::create_dir_all(dirs.home.join(".config/agent")).expect("mkdir");
    fs::write(dirs.home.join(".config/agent/credentials"), "secret").expect("write");
    std::os::unix::fs::symlink("/etc/hostname", dirs.home.join("link")).expect("symlink");
    let sandbox = Sandbox::detect(SandboxMode::None, NetworkMode::Host, &[]).expect("plain");

    let uid = if running_as_root() { Some(300_777) } else { None };
    let root_mode = mode(root.path());
    sandbox.prepare_storage(&dirs, uid).expect("prepare");
    assert_eq!(mode(root.path()), root_mode, "the root is left as it was");
    for dir in [&dirs.workspace, &dirs.home, &dirs.state, &dirs.tmp] {
        assert_eq!(mode(dir), 0o700, "{}", dir.display());
    }
    match uid {
        Some(uid) => {
            assert_eq!(mode(&dirs.base), 0o710);
            assert_eq!(fs::metadata(&dirs.base).expect("stat").gid(), uid);
            for path in [
                dirs.home.clone(),
                dirs.home.join(".config/agent"),
                dirs.home.join(".config/agent/credentials"),
            ] {
                let meta = fs::symlink_metadata(&path).expect("stat");
                assert_eq!((meta.uid(), meta.gid()), (uid, uid), "{}", path.display());
            }
            assert_eq!(
                fs::symlink_metadata(dirs.home.join("link")).expect("lstat").uid(),
                uid,
                "the link itself"
            );
            assert_eq!(
                fs::metadata("/etc/hostname").expect("stat").uid(),
                0,
                "never what a link points to"
            );
        }
        None => assert_eq!(mode(&dirs.base), 0o700),
    }
}

// ---------------------------------------------------------------------------------------------
// Live sandboxes
// ---------------------------------------------------------------------------------------------

/// A session's storage, provisioned as the runtime does it.
struct Session {
    id: SessionId,
    dirs: SessionDirs,
    uid: Option<u32>,
}

fn provision(sandbox: &Sandbox, root: &Path, thread: &str) -> Session {
    let id = id(thread);
    let dirs = make_dirs(root, &id);
    let uid = sandbox.allocate_uid(root, &id).expect("allocate uid");
    sandbox.prepare_storage(&dirs, uid).expect("prepare storage");
    Session { id, dirs, uid }
}

struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Output {
    /// The value of a `key=value` line.
    fn get(&self, key: &str) -> &str {
        self.stdout
            .lines()
            .find_map(|line| line.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
            .unwrap_or_else(|| panic!("no {key}= in output:\n{}\nstderr:\n{}", self.stdout, self.stderr))
    }
}

async fn run(sandbox: &Sandbox, session: &Session, script: &str) -> Output {
    let args = vec!["-c".to_owned(), script.to_owned()];
    let spec = LaunchSpec {
        id: &session.id,
        program: "/bin/sh",
        args: &args,
        dirs: &session.dirs,
        uid: session.uid,
        join_cgroups: None,
        needs: &[],
        pinned: &sandbox::needs::PinnedNeeds::default(),
        egress: None,
        working_dir: None,
    };
    let paths = sandbox.worker_paths(&session.dirs);
    let mut command = sandbox.command(&spec).expect("command");
    command
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", &paths.home)
        .env("TMPDIR", &paths.tmp)
        .current_dir(&session.dirs.workspace)
        .stdin(Stdio::null())
        .process_group(0);
    let output = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("sandboxed shell finishes")
        .expect("sandboxed shell runs");
    Output {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Probes run inside each sandbox.
fn probe_script(other: &Session) -> String {
    format!(
        r#"echo uid=$(id -u)
echo gid=$(id -g)
echo user=$(id -un 2>/dev/null)
echo pwd=$(pwd)
echo home=$HOME
echo root=$(ls / | tr '\n' ' ')
if touch /usr/x 2>/dev/null; then echo usr=writable; else echo usr=denied; fi
echo other_base=$(ls {base} 2>&1)
echo other_workspace=$(cat {workspace}/sentinel 2>&1)
echo procs=$(ls /proc | grep -E '^[0-9]+$' | tr '\n' ' ')
echo caps=$(grep -E '^(CapEff|CapBnd)' /proc/self/status | tr -s '\t ' ' ' | tr '\n' ' ')
echo nnp=$(grep NoNewPrivs /proc/self/status | tr -d ' \t' | cut -d: -f2)
if echo made-inside > ./inside 2>/dev/null; then echo write=ok; else echo write=denied; fi
echo host=$(hostname)
echo net=$(cut -d: -f1 /proc/net/dev | tail -n +3 | tr -d ' ' | tr '\n' ' ')
"#,
        base = other.dirs.base.display(),
        workspace = other.dirs.workspace.display(),
    )
}

/// The live bubblewrap sandbox, or `None` (after checking the refusal) where this host has none.
fn bubblewrap(network: NetworkMode, readonly: &[ReadonlyMount]) -> Option<Sandbox> {
    match Sandbox::detect(SandboxMode::Bubblewrap, network, readonly) {
        Ok(sandbox) => Some(sandbox),
        Err(error) => {
            assert_eq!(config_key(&error), "session_runtime.local.sandbox");
            assert!(
                std::process::Command::new("bwrap")
                    .args([
                        "--ro-bind",
                        "/",
                        "/",
                        "--unshare-pid",
                        "--dev",
                        "/dev",
                        "--proc",
                        "/proc",
                        "true"
                    ])
                    .status()
                    .map_or(true, |s| !s.success()),
                "bwrap works here, yet detect refused: {error}"
            );
            None
        }
    }
}

#[tokio::test]
async fn bubblewrap_confines_a_shell_to_its_own_session() {
    let Some(sandbox) = bubblewrap(NetworkMode::Host, &[]) else {
        return;
    };
    assert_eq!(sandbox.kind(), SandboxKind::Bubblewrap);
    assert_eq!(sandbox.isolation(), IsolationLevel::Namespaces);
    let root = tempfile::tempdir().expect("tempdir");
    let a = provision(&sandbox, root.path(), "bwrap-a");
    let b = provision(&sandbox, root.path(), "bwrap-b");
    fs::write(b.dirs.workspace.join("sentinel"), "b's secret").expect("sentinel");

    let out = run(&sandbox, &a, &probe_script(&b)).await;
    assert_eq!(
        out.code,
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        out.stdout,
        out.stderr
    );
    assert_eq!(out.get("pwd"), "/workspace");
    assert_eq!(out.get("home"), "/home/agent");
    assert_eq!(out.get("usr"), "denied");
    assert_eq!(out.get("host"), "openab");
    assert!(
        out.get("other_base").contains("No such file or directory"),
        "{}",
        out.get("other_base")
    );
    assert!(
        out.get("other_workspace").contains("No such file or directory"),
        "{}",
        out.get("other_workspace")
    );
    let listing: HashSet<&str> = out.get("root").split_whitespace().collect();
    for expected in ["workspace", "home", "tmp", "state", "usr", "etc", "proc", "dev"] {
        assert!(listing.contains(expected), "/ lacks {expected}: {listing:?}");
    }
    assert!(
        !listing.contains("root") && !listing.contains("var"),
        "host directories are not shown: {listing:?}"
    );
    // The pid namespace: a handful of processes, pid 1 being the sandbox's own init.
    let pids: Vec<u32> = out
        .get("procs")
        .split_whitespace()
        .map(|p| p.parse().expect("pid"))
        .collect();
    assert!(
        pids.contains(&1) && pids.len() <= 6 && pids.iter().all(|p| *p < 100),
        "{pids:?}"
    );
    assert!(
        !pids.contains(&std::process::id()),
        "the broker's pid is invisible"
    );
    assert_eq!(out.get("write"), "ok");
    assert_eq!(
        fs::read_to_string(a.dirs.workspace.join("inside")).expect("host sees it"),
        "made-inside\n"
    );

    match a.uid {
        Some(uid) => {
            assert_ne!(uid, 0);
            assert_eq!(out.get("uid"), uid.to_string());
            assert_eq!(out.get("gid"), uid.to_string());
            assert_eq!(
                out.get("user"),
                "agent",
                "the generated /etc/passwd names the uid"
            );
            assert_eq!(
                out.get("caps"),
                "CapEff: 0000000000000000 CapBnd: 0000000000000000"
            );
            assert_eq!(out.get("nnp"), "1");
            assert_eq!(
                fs::metadata(a.dirs.workspace.join("inside")).expect("stat").uid(),
                uid
            );
            assert_ne!(a.uid, b.uid, "each session has its own uid");
        }
        None => assert!(
            out.get("caps").starts_with("CapEff: 0000000000000000"),
            "{}",
            out.get("caps")
        ),
    }
}

#[tokio::test]
async fn bubblewrap_without_a_uid_runs_with_no_capabilities() {
    let Some(sandbox) = bubblewrap(NetworkMode::Host, &[]) else {
        return;
    };
    let root = tempfile::tempdir().expect("tempdir");
    // The storage of a session without a uid belongs to the broker's user.
    let id = id("bwrap-nouid");
    let dirs = make_dirs(root.path(), &id);
    sandbox.prepare_storage(&dirs, None).expect("prepare");
    let a = Session { id, dirs, uid: None };
    let out = run(
        &sandbox,
        &a,
        "echo caps=$(grep CapEff /proc/self/status | tr -s '\\t ' ' '); echo uid=$(id -u)",
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(out.get("caps"), "CapEff: 0000000000000000");
    assert_eq!(out.get("uid"), rustix::process::geteuid().as_raw().to_string());
}

#[tokio::test]
async fn bubblewrap_runs_an_agent_from_the_hosts_tmp() {
    let Some(sandbox) = bubblewrap(NetworkMode::Host, &[]) else {
        return;
    };
    let bin = tempfile::Builder::new()
        .prefix("agent-bin")
        .tempdir()
        .expect("tempdir");
    fs::set_permissions(bin.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let program = bin.path().join("agent-sh");
    fs::copy(fs::canonicalize("/bin/sh").expect("sh"), &program).expect("copy");
    let root = tempfile::tempdir().expect("tempdir");
    let a = provision(&sandbox, root.path(), "bwrap-tmp-agent");
    let args = vec!["-c".to_owned(), "echo self=$0".to_owned()];
    let spec = LaunchSpec {
        id: &a.id,
        program: program.to_str().expect("utf-8"),
        args: &args,
        dirs: &a.dirs,
        uid: a.uid,
        join_cgroups: None,
        needs: &[],
        pinned: &sandbox::needs::PinnedNeeds::default(),
        egress: None,
        working_dir: None,
    };
    let mut command = sandbox.command(&spec).expect("command");
    command
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null());
    let output = command.output().await.expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.trim().starts_with("self=/run/host/"), "{stdout}");
}

#[tokio::test]
async fn bubblewrap_with_network_none_has_only_loopback() {
    let Some(sandbox) = bubblewrap(NetworkMode::None, &[]) else {
        return;
    };
    let root = tempfile::tempdir().expect("tempdir");
    let a = provision(&sandbox, root.path(), "bwrap-net");
    let b = provision(&sandbox, root.path(), "bwrap-net-other");
    let out = run(&sandbox, &a, &probe_script(&b)).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(out.get("net").trim(), "lo");
}

#[tokio::test]
async fn bubblewrap_shows_read_only_inputs_read_only() {
    let input = tempfile::Builder::new()
        .prefix("skills")
        .tempdir()
        .expect("tempdir");
    fs::write(input.path().join("SKILL.md"), "use the force").expect("write");
    fs::set_permissions(input.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let mount = ReadonlyMount::new(input.path(), "/skills").expect("mount");
    let Some(sandbox) = bubblewrap(NetworkMode::Host, &[mount]) else {
        return;
    };
    let root = tempfile::tempdir().expect("tempdir");
    let a = provision(&sandbox, root.path(), "bwrap-ro");
    let out = run(
        &sandbox,
        &a,
        "echo read=$(cat /skills/SKILL.md); if touch /skills/new 2>/dev/null; then echo write=ok; else echo write=denied; fi",
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(out.get("read"), "use the force");
    assert_eq!(out.get("write"), "denied");
    assert!(!input.path().join("new").exists());
}

#[tokio::test]
async fn landlock_confines_a_shell_to_its_own_session() {
    let options = DetectOptions {
        bwrap: None,
        landlock_helper: Some(HELPER.into()),
        network_is_default: false,
    };
    let sandbox = match Sandbox::detect_with(SandboxMode::Landlock, NetworkMode::Host, &[], &options) {
        Ok(sandbox) => sandbox,
        Err(error) => {
            assert!(
                landlock_kernel_abi().is_none(),
                "landlock works here, yet detect refused: {error}"
            );
            assert_eq!(config_key(&error), "session_runtime.local.sandbox");
            return;
        }
    };
    assert_eq!(sandbox.kind(), SandboxKind::Landlock);
    let root = tempfile::tempdir().expect("tempdir");
    let a = provision(&sandbox, root.path(), "landlock-a");
    let b = provision(&sandbox, root.path(), "landlock-b");
    fs::write(b.dirs.workspace.join("sentinel"), "b's secret").expect("sentinel");
    fs::write(a.dirs.home.join("mine"), "a's own").expect("own file");
    if let Some(uid) = a.uid {
        std::os::unix::fs::chown(a.dirs.home.join("mine"), Some(uid), Some(uid)).expect("chown");
    }
    let script = format!(
        r#"{probes}echo own=$(cat $HOME/mine 2>&1)
echo tmp_write=$(echo x > $TMPDIR/t && echo ok || echo denied)
echo host_tmp=$(ls /tmp 2>&1 | head -c 200)
echo root_dir=$(ls {root} 2>&1)
echo etc=$(head -c 5 /etc/hostname >/dev/null 2>&1 && echo readable || echo denied)
echo sh=$(sh -c 'echo nested')
"#,
        probes = probe_script(&b),
        root = root.path().display(),
    );
    let out = run(&sandbox, &a, &script).await;
    assert_eq!(
        out.code,
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        out.stdout,
        out.stderr
    );
    assert_eq!(
        out.get("pwd"),
        a.dirs.workspace.display().to_string(),
        "landlock shows host paths"
    );
    assert_eq!(out.get("home"), a.dirs.home.display().to_string());
    assert_eq!(out.get("usr"), "denied");
    assert_eq!(out.get("own"), "a's own");
    assert_eq!(out.get("write"), "ok");
    assert_eq!(out.get("tmp_write"), "ok");
    assert_eq!(out.get("etc"), "readable");
    assert_eq!(out.get("sh"), "nested");
    for key in ["other_base", "other_workspace", "host_tmp", "root_dir"] {
        assert!(
            out.get(key).contains("Permission denied"),
            "{key}: {}",
            out.get(key)
        );
    }
    assert!(b.dirs.workspace.join("sentinel").exists());
    match a.uid {
        Some(uid) => {
            assert_eq!(out.get("uid"), uid.to_string());
            assert_eq!(out.get("nnp"), "1");
            assert!(
                out.get("caps").starts_with("CapEff: 0000000000000000"),
                "{}",
                out.get("caps")
            );
        }
        None => assert_eq!(out.get("uid"), rustix::process::geteuid().as_raw().to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// Cgroups
// ---------------------------------------------------------------------------------------------

fn limits(memory: Option<u64>, pids: Option<u32>, cpu: Option<f64>) -> ResourceLimits {
    let mut limits = ResourceLimits::default();
    limits.memory = memory;
    limits.pids = pids;
    limits.cpu = cpu;
    limits
}

fn read(path: &Path) -> String {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_owned()
}

#[test]
fn cgroup_hierarchies_are_read_from_mountinfo() {
    // A hybrid host (this project's CI machines): v1 controllers plus an almost empty unified hierarchy.
    let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
32 30 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
33 30 0:29 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
34 30 0:30 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
35 30 0:31 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
";
    let cgroups = "8:pids:/\n4:memory:/svc/broker\n1:cpu:/\n0::/\n";
    let host = CgroupHost::parse(mountinfo, cgroups);
    assert_eq!(
        host.v2,
        Some(CgroupV2 {
            parent: "/sys/fs/cgroup/unified".into()
        })
    );
    assert_eq!(
        host.v1,
        vec![
            CgroupV1 {
                controllers: vec!["cpu".into()],
                parent: "/sys/fs/cgroup/cpu".into()
            },
            CgroupV1 {
                controllers: vec!["memory".into()],
                parent: "/sys/fs/cgroup/memory/svc/broker".into()
            },
            CgroupV1 {
                controllers: vec!["pids".into()],
                parent: "/sys/fs/cgroup/pids".into()
            },
        ]
    );

    // A pure v2 host with the broker in a systemd service, already moved into its leaf; the mount
    // is a namespaced view rooted at the service.
    let mountinfo = "40 25 0:40 /system.slice /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
    let host = CgroupHost::parse(mountinfo, "0::/system.slice/openab.service/openab-broker\n");
    assert_eq!(
        host.v2,
        Some(CgroupV2 {
            parent: "/sys/fs/cgroup/openab.service".into()
        })
    );
    assert!(host.v1.is_empty());
}

#[test]
fn cgroup_v2_limits_are_written_where_delegated() {
    let fake = tempfile::tempdir().expect("tempdir");
    let parent = fake.path().join("broker");
    fs::create_dir(&parent).expect("mkdir");
    fs::write(parent.join("cgroup.controllers"), "cpuset cpu io memory pids\n").expect("write");
    fs::write(parent.join("cgroup.subtree_control"), "").expect("write");
    let host = CgroupHost {
        v2: Some(CgroupV2 {
            parent: parent.clone(),
        }),
        v1: Vec::new(),
    };
    let id = id("cg-v2");
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("sleep");
    let handle = host
        .apply(
            &group_name(&id, "test"),
            &limits(Some(64 << 20), Some(16), Some(0.5)),
            child.id(),
        )
        .expect("apply");
    let dir = parent.join(group_name(&id, "test"));
    assert_eq!(handle.paths(), vec![dir.as_path()]);
    assert_eq!(read(&parent.join("cgroup.subtree_control")), "+memory +pids +cpu");
    assert_eq!(read(&dir.join("memory.max")), (64u64 << 20).to_string());
    assert_eq!(read(&dir.join("pids.max")), "16");
    assert_eq!(read(&dir.join("cpu.max")), "50000 100000");
    assert_eq!(read(&dir.join("cgroup.procs")), child.id().to_string());
    child.kill().expect("kill");
    child.wait().expect("reap");
    assert_eq!(cpu_quota_us(0.001), 1000, "the kernel's minimum quota");
    assert_eq!(cpu_quota_us(2.0), 200_000);
    assert_eq!(
        cpu_quota_us(1e308),
        (1 << 44) - 1,
        "a huge limit never becomes the minimum"
    );
}

#[test]
fn limits_without_a_controller_are_a_config_error() {
    let host = CgroupHost {
        v2: None,
        v1: Vec::new(),
    };
    let error = host
        .apply(
            &group_name(&id("cg-none"), "test"),
            &limits(Some(1 << 30), None, None),
            1,
        )
        .expect_err("no memory controller");
    assert_eq!(config_key(&error), "session_runtime.local.limits");
    assert!(error.to_string().contains("memory"), "{error}");
}

/// Removes a session's cgroups when a test ends, even by a failed assertion.
struct RemoveOnDrop<'a>(&'a sandbox::LimitsHandle);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.remove();
    }
}

/// This host's cgroups, or `None` after checking that limits are refused with the right error.
fn live_cgroups(sandbox: &Sandbox, wanted: &ResourceLimits) -> Option<()> {
    match sandbox.check_limits(wanted) {
        Ok(()) => Some(()),
        Err(error) => {
            assert!(
                !running_as_root(),
                "a root broker can manage cgroups here, yet: {error}"
            );
            assert_eq!(config_key(&error), "session_runtime.local.limits");
            None
        }
    }
}

#[test]
fn cgroup_limits_on_this_host() {
    let fs_type = std::process::Command::new("stat")
        .args(["-fc", "%T", "/sys/fs/cgroup"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let sandbox = Sandbox::detect(SandboxMode::None, NetworkMode::Host, &[]).expect("plain");
    let wanted = limits(Some(64 << 20), Some(16), Some(0.5));
    if live_cgroups(&sandbox, &wanted).is_none() {
        return;
    }
    let id = id(&format!("cg-live-{}", std::process::id()));
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("sleep");
    let handle = sandbox
        .apply_limits(&group_name(&id, "test"), &wanted, child.id())
        .expect("apply");
    let _cleanup = RemoveOnDrop(&handle);
    let paths: Vec<PathBuf> = handle.paths().into_iter().map(Path::to_path_buf).collect();
    eprintln!("/sys/fs/cgroup is {fs_type}; session cgroups: {paths:?}");
    let (mut memory, mut pids, mut cpu) = (false, false, false);
    for dir in &paths {
        assert!(
            read(&dir.join("cgroup.procs"))
                .lines()
                .any(|p| p == child.id().to_string()),
            "{}",
            dir.display()
        );
        if dir.join("memory.max").exists() {
            assert_eq!(read(&dir.join("memory.max")), (64u64 << 20).to_string());
            memory = true;
        } else if dir.join("memory.limit_in_bytes").exists() {
            assert_eq!(
                read(&dir.join("memory.limit_in_bytes")),
                (64u64 << 20).to_string()
            );
            memory = true;
        }
        if dir.join("pids.max").exists() {
            assert_eq!(read(&dir.join("pids.max")), "16");
            pids = true;
        }
        if dir.join("cpu.max").exists() {
            assert_eq!(read(&dir.join("cpu.max")), "50000 100000");
            cpu = true;
        } else if dir.join("cpu.cfs_quota_us").exists() {
            assert_eq!(read(&dir.join("cpu.cfs_quota_us")), "50000");
            assert_eq!(read(&dir.join("cpu.cfs_period_us")), "100000");
            cpu = true;
        }
    }
    assert!(
        memory && pids && cpu,
        "every limit written: memory {memory}, pids {pids}, cpu {cpu}"
    );
    let usage = handle.usage();
    assert_eq!(usage.pids, Some(1), "{usage:?}");
    assert!(usage.memory_bytes.is_some(), "{usage:?}");
    assert_eq!(usage.oom_kills, Some(0), "{usage:?}");
    let mut found: Vec<PathBuf> = sandbox
        .existing_limits(&group_name(&id, "test"))
        .expect("found again")
        .paths()
        .into_iter()
        .map(Path::to_path_buf)
        .collect();
    let mut expected = paths.clone();
    found.sort();
    expected.sort();
    assert_eq!(found, expected, "reconcile finds the same cgroups");

    // Removing kills what is still inside, then removes the cgroups.
    handle.remove().expect("remove");
    let status = child.wait().expect("reap");
    assert!(!status.success(), "killed by remove");
    for dir in &paths {
        assert!(!dir.exists(), "{} removed", dir.display());
    }
    handle.remove().expect("remove is idempotent");
    assert_eq!(sandbox.existing_limits(&group_name(&id, "test")), None);
}

#[tokio::test]
async fn cgroup_limits_hold_a_whole_bubblewrap_sandbox() {
    let Some(sandbox) = bubblewrap(NetworkMode::Host, &[]) else {
        return;
    };
    let wanted = limits(None, Some(6), None);
    if live_cgroups(&sandbox, &wanted).is_none() {
        return;
    }
    let root = tempfile::tempdir().expect("tempdir");
    let a = provision(&sandbox, root.path(), &format!("cg-bwrap-{}", std::process::id()));
    let args = vec![
        "-c".to_owned(),
        "sleep 1; for i in 1 2 3 4 5 6 7 8 9 10; do sleep 5 & done; wait; echo done".to_owned(),
    ];
    let spec = LaunchSpec {
        id: &a.id,
        program: "/bin/sh",
        args: &args,
        dirs: &a.dirs,
        uid: a.uid,
        join_cgroups: None,
        needs: &[],
        pinned: &sandbox::needs::PinnedNeeds::default(),
        egress: None,
        working_dir: None,
    };
    let mut command = sandbox.command(&spec).expect("command");
    command
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let child = command.spawn().expect("spawn");
    let pid = child.id().expect("pid");
    let handle = sandbox
        .apply_limits(&group_name(&a.id, "test"), &wanted, pid)
        .expect("apply");
    let _cleanup = RemoveOnDrop(&handle);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // bwrap, the sandbox's init and the shell are all inside.
    let inside = handle.usage().pids.expect("pids usage");
    assert!(inside >= 3, "the whole sandbox is in the cgroup: {inside}");
    let output = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("finishes")
        .expect("output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("fork") || stderr.contains("Resource temporarily unavailable"),
        "the pids limit stopped the fork storm: {stderr}"
    );
    assert!(handle.usage().oom_kills.is_none_or(|n| n == 0));
    handle.remove().expect("remove");
}
