//! The isolation acceptance suite (`isolation-suite`) against the local runtime, in every mode:
//!
//! - bubblewrap, with a shared read-only input mounted at `/skills`: must pass, step 7 included;
//! - Landlock, with a uid per session (the tests run as root, so the broker allocates them): must
//!   pass, step 7 included (Landlock cannot move a mount, so the input is read at its host path);
//! - plain (`sandbox = "none"`): isolates nothing, so the suite must fail, and this test names
//!   the leaks it must have found.
//!
//! Every mode also scans the runtime's root from inside the sessions (`extra_scan_paths`), so a
//! sandbox that exposed the storage root read-only would be caught too.
//!
//! A mode this machine cannot run (no bubblewrap, a kernel without Landlock, not root) is checked
//! to be refused by the builder with a configuration error instead, and the test returns early.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use isolation_suite::{
    Action, IsolationReport, Probe, SentinelKind, SharedInput, Side, SuiteOptions, Verdict,
};
use runtime_local::LocalRuntime;
use session_runtime::config::{ReadonlyMount, SandboxMode};
use session_runtime::testing::CapturedLogs;
use session_runtime::{Error, IsolationLevel, SessionRuntime, SessionState};

const INSTALLATION: &str = "isolation";
const SKILL: &str = "# shared skill\nread-only for every session\n";

/// A directory of shared skills, readable (not writable) by every uid, with `SKILL.md`.
fn skills_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("oab-isolation-skills-")
        .tempdir()
        .expect("skills dir");
    std::fs::write(dir.path().join("SKILL.md"), SKILL).expect("SKILL.md");
    // Sessions run as their own unprivileged uids: they must be able to read the input.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(
        dir.path().join("SKILL.md"),
        std::fs::Permissions::from_mode(0o644),
    )
    .expect("chmod");
    dir
}

fn sha256_hex(bytes: &[u8]) -> String {
    let out = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(bytes)?;
            child.wait_with_output()
        })
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("a digest")
        .to_owned()
}

/// Builds the runtime, or `None` if this machine cannot run `mode` (after checking that the
/// refusal is the documented configuration error).
fn build(mode: SandboxMode, root: &Path, readonly: Vec<ReadonlyMount>) -> Option<Arc<LocalRuntime>> {
    common::build_if_supported(common::builder(root, INSTALLATION, mode).readonly(readonly), mode)
}

async fn run_suite(runtime: &Arc<LocalRuntime>, options: &SuiteOptions) -> IsolationReport {
    let dynamic: Arc<dyn SessionRuntime> = Arc::<LocalRuntime>::clone(runtime);
    let report = isolation_suite::run(dynamic, options)
        .await
        .expect("the suite runs to a report");
    println!("{report}");
    report
}

/// Both sessions are closed, and (default retention: delete) their storage is gone.
async fn assert_closed_and_gone(runtime: &LocalRuntime, report: &IsolationReport, root: &Path) {
    for session in &report.sessions {
        match runtime.status(&session.id).await {
            Ok(status) => assert_eq!(status.state, SessionState::Closed, "{report:#}"),
            Err(Error::NotFound { .. }) => {}
            Err(error) => panic!("status of {}: {error}", session.id),
        }
        assert!(
            !root.join(session.id.as_str()).exists(),
            "session {} storage must be deleted at close",
            session.id
        );
    }
}

/// Every probe of `step` from `from` doing `action` (there may be one per path).
fn probes(report: &IsolationReport, step: u8, from: Side, action: Action) -> Vec<&Probe> {
    report
        .probes
        .iter()
        .filter(|p| p.step == step && p.from == from && p.action == action)
        .collect()
}

fn the_probe<'a>(
    report: &'a IsolationReport,
    step: u8,
    from: Side,
    action: Action,
    target: &str,
) -> &'a Probe {
    let found: Vec<&Probe> = probes(report, step, from, action)
        .into_iter()
        .filter(|p| p.target == target)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {action} probe from {from} in step {step} on {target}:\n{report:#}"
    );
    found[0]
}

fn assert_leaked(probe: &Probe, evidence_contains: &str) {
    match &probe.verdict {
        Verdict::Leaked { evidence } => assert!(
            evidence.contains(evidence_contains),
            "{} {}: evidence {evidence:?} should mention {evidence_contains:?}",
            probe.action,
            probe.target
        ),
        other => panic!(
            "{} {} from {} should have leaked, got {other}",
            probe.action, probe.target, probe.from
        ),
    }
}

/// The shape every passing report must have: nothing skipped (step 7 ran), every attack of
/// steps 4 and 6 denied, the shared input written by neither session, and neither session
/// reached the other's abstract socket or loopback port (step 8).
fn assert_full_pass(report: &IsolationReport, declared: IsolationLevel) {
    assert!(report.passed(), "{report:#}");
    assert_files_isolated(report, declared);
    assert_channels(report, Verdict::Denied, Verdict::Denied);
}

/// Steps 1 to 7 of [`assert_full_pass`]: no session reached the other's files.
fn assert_files_isolated(report: &IsolationReport, declared: IsolationLevel) {
    assert!(report.skipped.is_empty(), "step 7 must run:\n{report:#}");
    assert_eq!(
        report.declared_isolation, declared,
        "each mode names its isolation truthfully"
    );
    for (step, attacker) in [(4, Side::B), (6, Side::A)] {
        for action in [
            Action::Scan,
            Action::Stat,
            Action::Read,
            Action::Overwrite,
            Action::Delete,
        ] {
            let found = probes(report, step, attacker, action);
            assert!(!found.is_empty(), "no {action} probe in step {step}:\n{report:#}");
            assert!(
                found.iter().all(|p| p.verdict == Verdict::Denied),
                "{action} in step {step}:\n{report:#}"
            );
        }
    }
    for side in [Side::A, Side::B] {
        for action in [Action::WriteShared, Action::OverwriteShared] {
            let found = probes(report, 7, side, action);
            assert_eq!(found.len(), 1, "{action} from {side}:\n{report:#}");
            assert_eq!(found[0].verdict, Verdict::Denied, "{report:#}");
        }
        assert!(
            probes(report, 7, side, Action::ReadShared)
                .iter()
                .all(|p| p.verdict.is_pass()),
            "{report:#}"
        );
    }
    assert!(
        report.cleanup_problems.is_empty(),
        "{:?}",
        report.cleanup_problems
    );
}

/// Step 8 in both directions: each owner reached its own abstract socket and loopback port (the
/// positive controls held), and the other session's attempts on them got `abstract_socket` and
/// `loopback` (a denial, or a leak whose evidence names the owner's secret).
fn assert_channels(report: &IsolationReport, abstract_socket: Verdict, loopback: Verdict) {
    for (owner, attacker) in [(Side::A, Side::B), (Side::B, Side::A)] {
        let controls = probes(report, 8, owner, Action::Listen);
        assert_eq!(
            controls.len(),
            2,
            "two listeners in {owner}:
{report:#}"
        );
        assert!(
            controls.iter().all(|p| p.verdict.is_pass()),
            "the positive controls must hold:
{report:#}"
        );
        for (action, expected) in [
            (Action::ConnectAbstract, &abstract_socket),
            (Action::ConnectLoopback, &loopback),
        ] {
            let found = probes(report, 8, attacker, action);
            assert_eq!(
                found.len(),
                1,
                "{action} from {attacker}:
{report:#}"
            );
            match expected {
                Verdict::Leaked { .. } => assert_leaked(found[0], &format!("{owner}'s secret")),
                _ => assert_eq!(
                    &found[0].verdict, expected,
                    "{action} from {attacker}:
{report:#}"
                ),
            }
        }
    }
}

/// A leak, for [`assert_channels`].
fn leaked() -> Verdict {
    Verdict::Leaked {
        evidence: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bubblewrap_sessions_are_isolated_and_share_a_read_only_input() {
    let root = tempfile::tempdir().expect("root");
    let skills = skills_dir();
    let mount = ReadonlyMount::new(skills.path(), "/skills").expect("mount");
    let Some(runtime) = build(SandboxMode::Bubblewrap, root.path(), vec![mount]) else {
        return;
    };
    let options = SuiteOptions::new(INSTALLATION)
        .with_shared_input(
            SharedInput::new("/skills/SKILL.md").with_expected_sha256(sha256_hex(SKILL.as_bytes())),
        )
        .with_extra_scan_path(root.path().display().to_string());
    let report = run_suite(&runtime, &options).await;
    assert_full_pass(&report, IsolationLevel::Namespaces);
    // Each session sees its own storage at the fixed in-sandbox paths, never a host path.
    for side in [Side::A, Side::B] {
        let session = report.session(side);
        assert_eq!(session.working_dir, "/workspace");
        assert_eq!(session.home.as_deref(), Some("/home/agent"));
    }
    assert_eq!(
        std::fs::read_to_string(skills.path().join("SKILL.md")).expect("skill"),
        SKILL
    );
    assert_closed_and_gone(&runtime, &report, root.path()).await;
}

/// `network = "host"`, chosen explicitly: the sessions share the host's network namespace, so
/// each reaches the other's loopback ports (the suite says so, and fails); their abstract
/// sockets are scoped by Landlock inside bubblewrap where the kernel offers it, and shared
/// otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bubblewrap_with_the_host_network_shares_loopback_and_says_so() {
    common::use_built_landlock_helper();
    let root = tempfile::tempdir().expect("root");
    let builder = common::builder(root.path(), INSTALLATION, SandboxMode::Bubblewrap)
        .network(session_runtime::config::NetworkMode::Host);
    // The choice is said at startup: what the sessions share. (One capture for the whole test
    // binary, read by this runtime's root: a subscriber scoped to this thread missed the line
    // now and then while other tests ran.)
    CapturedLogs::global();
    let Some(runtime) = common::build_if_supported(builder, SandboxMode::Bubblewrap) else {
        return;
    };
    let startup = CapturedLogs::global()
        .lines_with(&root.path().display().to_string())
        .join("\n");
    assert!(
        startup.contains("WARN") && startup.contains("sessions share the host's network namespace"),
        "{startup}"
    );
    let options = SuiteOptions::new(INSTALLATION).with_extra_scan_path(root.path().display().to_string());
    let report = run_suite(&runtime, &options).await;
    assert!(
        !report.passed(),
        "a shared loopback is a leak:
{report:#}"
    );
    let abstract_socket = if scopes_available() {
        Verdict::Denied
    } else {
        leaked()
    };
    assert_channels(&report, abstract_socket, leaked());
    let others: Vec<&Probe> = report.problems().filter(|p| p.step != 8).collect();
    assert!(
        others.is_empty(),
        "only the network is shared:
{report:#}"
    );
    assert_closed_and_gone(&runtime, &report, root.path()).await;
}

/// `network = "allowlist"` (here selected by `egress` alone): each session has a network
/// namespace of its own behind its proxy, so neither reaches the other's abstract socket or
/// loopback port, though a loopback port of the host is forwarded into both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bubblewrap_with_an_allowlist_shares_no_network() {
    common::use_built_egress_forwarder();
    let root = tempfile::tempdir().expect("root");
    let model = std::net::TcpListener::bind("127.0.0.1:0").expect("a host port to forward");
    let entry =
        session_runtime::config::EgressTarget::parse(&model.local_addr().expect("address").to_string())
            .expect("an egress entry");
    let builder = common::builder(root.path(), INSTALLATION, SandboxMode::Bubblewrap).egress(vec![entry]);
    let Some(runtime) = common::build_if_supported(builder, SandboxMode::Bubblewrap) else {
        return;
    };
    let options = SuiteOptions::new(INSTALLATION).with_extra_scan_path(root.path().display().to_string());
    let report = run_suite(&runtime, &options).await;
    assert_channels(&report, Verdict::Denied, Verdict::Denied);
    assert!(report.passed(), "{report:#}");
    assert_closed_and_gone(&runtime, &report, root.path()).await;
}

/// With `network` unset, a bubblewrap runtime says at startup that sessions have a network of
/// their own, and the one setting that reaches a model (a user upgrading from `host` finds it).
#[test]
fn the_default_network_says_how_to_reach_a_model() {
    let root = tempfile::tempdir().expect("root");
    CapturedLogs::global();
    let built = common::build_if_supported(
        common::builder(root.path(), INSTALLATION, SandboxMode::Bubblewrap),
        SandboxMode::Bubblewrap,
    );
    if built.is_none() {
        return;
    }
    let startup = CapturedLogs::global()
        .lines_with(&root.path().display().to_string())
        .join("\n");
    assert!(
        startup.contains("network namespace of its own") && startup.contains("egress = ["),
        "{startup}"
    );
    assert!(
        !startup.contains("share the host's network namespace"),
        "{startup}"
    );
}

/// Whether this kernel enforces Landlock's scopes (ABI 6): a ruleset with them can be created.
fn scopes_available() -> bool {
    use landlock::{Access, CompatLevel, Compatible, Ruleset, RulesetAttr, Scope, ABI};
    Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .scope(Scope::from_all(ABI::V6))
        .and_then(|r| r.create())
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landlock_sessions_with_their_own_uids_are_isolated() {
    if !rustix::process::geteuid().is_root() {
        // Without root the broker cannot give sessions their own uids, and Landlock alone lets
        // `stat` reveal that another session's path exists (documented in the crate).
        eprintln!("skipping: Landlock isolation needs a root broker for per-session uids");
        return;
    }
    // The runtime finds the helper one directory above the test binary (`target/<profile>/`),
    // where Cargo builds it; should a target layout differ, it is named explicitly.
    let helper = Path::new(env!("CARGO_BIN_EXE_oab-landlock-exec"));
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("oab-landlock-exec")));
    if beside.as_deref() != Some(helper) {
        std::env::set_var("OAB_LANDLOCK_EXEC", helper);
    }
    let root = tempfile::tempdir().expect("root");
    let skills = skills_dir();
    let skill_file = skills.path().join("SKILL.md");
    // Landlock cannot move a mount: the input keeps its host path inside the session.
    let mount = ReadonlyMount::new(skills.path(), skills.path()).expect("mount");
    let Some(runtime) = build(SandboxMode::Landlock, root.path(), vec![mount]) else {
        return;
    };
    let options = SuiteOptions::new(INSTALLATION)
        .with_shared_input(
            SharedInput::new(skill_file.display().to_string())
                .with_expected_sha256(sha256_hex(SKILL.as_bytes())),
        )
        .with_extra_scan_path(root.path().display().to_string());
    let report = run_suite(&runtime, &options).await;
    // Landlock gives a session no network namespace of its own, so with the default network it
    // shares the host's: its loopback ports are open to the other session (which `verify`
    // reports as a leak), while its abstract sockets are scoped (`EPERM`). Everything else holds.
    assert_files_isolated(&report, IsolationLevel::AccessControl);
    assert_channels(&report, Verdict::Denied, leaked());
    for probe in probes(&report, 8, Side::A, Action::ConnectAbstract) {
        assert_eq!(probe.errno, Some(isolation_suite::Errno::EPERM), "{probe:?}");
    }
    let others: Vec<&Probe> = report
        .problems()
        .filter(|p| p.action != Action::ConnectLoopback)
        .collect();
    assert!(
        others.is_empty(),
        "only loopback is shared:
{report:#}"
    );
    // Landlock shows host paths: each session works in its own directory under the root.
    for side in [Side::A, Side::B] {
        let session = report.session(side);
        let base = root.path().join(session.id.as_str());
        assert_eq!(session.working_dir, base.join("workspace").display().to_string());
        assert_eq!(
            session.home.as_deref(),
            Some(base.join("home").display().to_string().as_str())
        );
    }
    // The stat probes of the other session's host paths were refused (with distinct uids and
    // private directories, existence is hidden too): the probe saw EACCES, never a result.
    for (step, attacker) in [(4, Side::B), (6, Side::A)] {
        for probe in probes(&report, step, attacker, Action::Stat) {
            assert_eq!(probe.errno, Some(isolation_suite::Errno::EACCES), "{probe:?}");
        }
    }
    assert_eq!(std::fs::read_to_string(&skill_file).expect("skill"), SKILL);
    assert_closed_and_gone(&runtime, &report, root.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_mode_fails_the_suite_and_names_the_leaks() {
    let root = tempfile::tempdir().expect("root");
    let runtime = build(SandboxMode::None, root.path(), Vec::new()).expect("plain mode always builds");
    let options = SuiteOptions::new(INSTALLATION).with_extra_scan_path(root.path().display().to_string());
    let report = run_suite(&runtime, &options).await;

    assert!(!report.passed(), "plain mode isolates nothing:\n{report:#}");
    assert_eq!(report.declared_isolation, IsolationLevel::None);
    // Plain mode cannot mount a shared input, so step 7 is skipped, and says so.
    assert_eq!(report.skipped.len(), 1, "{report:#}");
    assert_eq!(report.skipped[0].step, 7);

    let a = report.session(Side::A);
    let b = report.session(Side::B);
    // Two workers, each with its own workspace and HOME under the root (host paths).
    assert!(the_probe(&report, 1, Side::A, Action::DistinctWorkers, "A and B")
        .verdict
        .is_pass());
    assert!(a
        .working_dir
        .starts_with(&root.path().join(a.id.as_str()).display().to_string()));
    assert_ne!(a.working_dir, b.working_dir);

    let path_of = |side: Side, kind: SentinelKind| -> String {
        report
            .session(side)
            .sentinels
            .iter()
            .find(|s| s.kind == kind)
            .unwrap_or_else(|| panic!("session {side} has a {kind} sentinel:\n{report:#}"))
            .path
            .clone()
    };
    // From B, every attack on A's workspace and HOME sentinels succeeds; A then finds them gone.
    for kind in [SentinelKind::Workspace, SentinelKind::Home] {
        let path = path_of(Side::A, kind);
        assert_leaked(
            the_probe(&report, 4, Side::B, Action::Stat, &path),
            "stat succeeded",
        );
        assert_leaked(the_probe(&report, 4, Side::B, Action::Read, &path), &a.token);
        assert_leaked(
            the_probe(&report, 4, Side::B, Action::Overwrite, &path),
            "overwrote",
        );
        assert_leaked(the_probe(&report, 4, Side::B, Action::Delete, &path), "deleted");
        assert_leaked(the_probe(&report, 5, Side::A, Action::VerifyHash, &path), "gone");
    }
    // The scan of the root finds A's files by name.
    let a_workspace = path_of(Side::A, SentinelKind::Workspace);
    let root_scan = the_probe(
        &report,
        4,
        Side::B,
        Action::Scan,
        &root.path().display().to_string(),
    );
    assert_leaked(root_scan, &a_workspace);
    // A's local-only ref is listed and deleted by B.
    if let Some(git) = &a.git {
        assert_leaked(
            the_probe(&report, 4, Side::B, Action::ListRef, &git.repo),
            &a.token,
        );
        assert_leaked(
            the_probe(&report, 4, Side::B, Action::UpdateRef, &git.repo),
            &git.reference,
        );
        assert_leaked(
            the_probe(&report, 5, Side::A, Action::VerifyRef, &git.reference),
            "gone",
        );
    }
    // Reversed: A reads B's workspace sentinel.
    let b_workspace = path_of(Side::B, SentinelKind::Workspace);
    assert_leaked(
        the_probe(&report, 6, Side::A, Action::Read, &b_workspace),
        &b.token,
    );
    // One network namespace, nothing scoped: each session reaches the other's abstract socket
    // and loopback port.
    assert_channels(&report, leaked(), leaked());
    // The report names the leaking command.
    let text = report.to_string();
    assert!(text.contains(&format!("cat -- '{a_workspace}'")), "{text}");
    assert_closed_and_gone(&runtime, &report, root.path()).await;
}
