//! The suite against `FakeRuntime`, which isolates nothing: every session shares the test
//! process's filesystem, uid and HOME. The suite must fail, and name the probes that leaked.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use isolation_suite::{
    Action, IsolationReport, Probe, SentinelKind, SharedInput, Side, SuiteError, SuiteOptions,
};
use session_runtime::testing::FakeRuntime;
use session_runtime::{SessionRuntime, SessionState};

const INSTALLATION: &str = "isolation";

fn fake() -> (Arc<FakeRuntime>, Arc<dyn SessionRuntime>) {
    let fake = Arc::new(
        FakeRuntime::builder()
            .installation(INSTALLATION)
            .build()
            .expect("fake runtime"),
    );
    let runtime: Arc<dyn SessionRuntime> = Arc::<FakeRuntime>::clone(&fake);
    (fake, runtime)
}

/// The single probe of `step`, `from`, `action` aimed at `target`.
fn probe<'a>(report: &'a IsolationReport, step: u8, from: Side, action: Action, target: &str) -> &'a Probe {
    let found: Vec<&Probe> = report
        .probes
        .iter()
        .filter(|p| p.step == step && p.from == from && p.action == action && p.target == target)
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
        isolation_suite::Verdict::Leaked { evidence } => assert!(
            evidence.contains(evidence_contains),
            "{} {}: evidence {evidence:?} should mention {evidence_contains:?}",
            probe.action,
            probe.target
        ),
        other => panic!(
            "{} {} should have leaked, got {other}",
            probe.action, probe.target
        ),
    }
}

fn sentinel_path(report: &IsolationReport, side: Side, kind: SentinelKind) -> String {
    report
        .session(side)
        .sentinels
        .iter()
        .find(|s| s.kind == kind)
        .unwrap_or_else(|| panic!("session {side} has a {kind} sentinel:\n{report:#}"))
        .path
        .clone()
}

/// Nothing the suite created is left: not the sentinels, not the repositories, not a file with
/// either token in HOME.
fn assert_cleaned_up(report: &IsolationReport) {
    for side in [Side::A, Side::B] {
        let session = report.session(side);
        for sentinel in &session.sentinels {
            assert!(
                !Path::new(&sentinel.path).exists(),
                "{} was left behind",
                sentinel.path
            );
        }
        if let Some(git) = &session.git {
            assert!(!Path::new(&git.repo).exists(), "{} was left behind", git.repo);
        }
        if let Some(home) = &session.home {
            let leftovers: Vec<PathBuf> = std::fs::read_dir(home)
                .expect("HOME is readable")
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    let name = p.file_name().unwrap_or_default().to_string_lossy();
                    report.sessions.iter().any(|s| name.contains(&s.token))
                })
                .collect();
            assert!(leftovers.is_empty(), "left in HOME: {leftovers:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detects_every_kind_of_leak_on_a_runtime_that_isolates_nothing() {
    let (fake, runtime) = fake();
    // The fake keeps its sessions under the temporary directory, on the host's root file system,
    // whose whole scan may outlast the scan timeout on a machine full of build caches: name the
    // storage root, as `verify` names the local runtime's, so the scan that must find A's
    // files is one that completes.
    let options = SuiteOptions::new(INSTALLATION).with_extra_scan_path(
        std::env::temp_dir()
            .to_str()
            .expect("a UTF-8 temporary directory"),
    );
    let report = isolation_suite::run(runtime, &options)
        .await
        .expect("the suite runs to a report");
    println!("{report}");

    assert!(!report.passed(), "the fake isolates nothing:\n{report:#}");
    assert!(report.leaks().count() > 10, "{report:#}");

    // Step 1: two sessions, two workers.
    assert!(probe(&report, 1, Side::A, Action::DistinctWorkers, "A and B")
        .verdict
        .is_pass());

    // Steps 2 and 3: A's sentinels and ref were made, and found on the host (it is the same one).
    let a = report.session(Side::A);
    assert_eq!(a.sentinels.len(), 2, "{report:#}");
    assert!(a.sentinels.iter().all(|s| s.host_path.is_some()), "{report:#}");
    let git = a.git.as_ref().expect("git is installed where the tests run");
    let a_workspace = sentinel_path(&report, Side::A, SentinelKind::Workspace);
    let a_home = sentinel_path(&report, Side::A, SentinelKind::Home);
    assert!(a_workspace.starts_with(&a.working_dir));

    // Step 4: B finds, reads, overwrites and deletes A's files, and lists and deletes A's ref.
    let found = report
        .probes
        .iter()
        .filter(|p| p.step == 4 && p.from == Side::B && p.action == Action::Scan)
        .find(|p| matches!(&p.verdict, isolation_suite::Verdict::Leaked { evidence } if evidence.contains(&a_workspace)));
    assert!(
        found.is_some(),
        "the mount scan must find A's workspace sentinel:\n{report:#}"
    );
    for path in [&a_workspace, &a_home] {
        assert_leaked(probe(&report, 4, Side::B, Action::Stat, path), "stat succeeded");
        assert_leaked(probe(&report, 4, Side::B, Action::Read, path), &a.token);
        assert_leaked(probe(&report, 4, Side::B, Action::Overwrite, path), "overwrote");
        assert_leaked(probe(&report, 4, Side::B, Action::Delete, path), "deleted");
        // Step 5: A sees its sentinel is gone, even had B's commands claimed to fail.
        assert_leaked(probe(&report, 5, Side::A, Action::VerifyHash, path), "gone");
    }
    assert_leaked(probe(&report, 4, Side::B, Action::ListRef, &git.repo), &a.token);
    assert_leaked(
        probe(&report, 4, Side::B, Action::UpdateRef, &git.repo),
        &git.reference,
    );
    assert_leaked(
        probe(&report, 5, Side::A, Action::VerifyRef, &git.reference),
        "gone",
    );

    // Step 6: the same, reversed.
    let b = report.session(Side::B);
    assert_ne!(a.token, b.token);
    let b_workspace = sentinel_path(&report, Side::B, SentinelKind::Workspace);
    assert_leaked(probe(&report, 6, Side::A, Action::Read, &b_workspace), &b.token);
    assert_leaked(
        probe(&report, 6, Side::B, Action::VerifyHash, &b_workspace),
        "gone",
    );

    // Step 7 is skipped, and says so.
    assert_eq!(report.skipped.len(), 1);
    assert_eq!(report.skipped[0].step, 7);

    // Step 8: one network namespace, nothing scoped: each session's abstract socket and loopback
    // port answer the other with their secret, after the owner's own positive control held.
    for (owner, attacker) in [(Side::A, Side::B), (Side::B, Side::A)] {
        let controls: Vec<&Probe> = report
            .probes
            .iter()
            .filter(|p| p.step == 8 && p.from == owner && p.action == Action::Listen)
            .collect();
        assert_eq!(controls.len(), 2, "{report:#}");
        assert!(controls.iter().all(|p| p.verdict.is_pass()), "{report:#}");
        for action in [Action::ConnectAbstract, Action::ConnectLoopback] {
            let found: Vec<&Probe> = report
                .probes
                .iter()
                .filter(|p| p.step == 8 && p.from == attacker && p.action == action)
                .collect();
            assert_eq!(found.len(), 1, "{action} from {attacker}:\n{report:#}");
            assert_leaked(found[0], &format!("{owner}'s secret"));
        }
    }

    // The report names what leaked.
    let text = report.to_string();
    assert!(text.contains("FAILED"), "{text}");
    assert!(text.contains("declared isolation: none"), "{text}");
    assert!(text.contains(&format!("cat -- '{a_workspace}'")), "{text}");

    // Both sessions were closed, and nothing was left in HOME or the workspaces.
    for session in &report.sessions {
        let status = fake.status(&session.id).await.expect("status");
        assert_eq!(status.state, SessionState::Closed);
    }
    assert!(
        report.cleanup_problems.is_empty(),
        "{:?}",
        report.cleanup_problems
    );
    assert_cleaned_up(&report);
}

/// A shared input that is writable (the fake has no read-only mounts): both sessions read the
/// same version, and every write attempt is reported as a leak, without damaging the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_shared_input_is_reported_and_left_intact() {
    let (_fake, runtime) = fake();
    let dir = std::env::temp_dir().join(format!("isolation-suite-shared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("shared dir");
    let file = dir.join("SKILL.md");
    std::fs::write(&file, "shared skill v1\n").expect("shared file");
    let shared = SharedInput::new(file.to_string_lossy())
        .with_expected_sha256("7403CA5B9B78DC58CA5AF0F99505768DFE4DABAEE9C7BB4AE4B35F4E1841AE2E");

    let options = SuiteOptions::new(INSTALLATION).with_shared_input(shared);
    let report = isolation_suite::run(runtime, &options).await.expect("report");
    let file_name = file.to_string_lossy().into_owned();

    assert!(report.skipped.is_empty(), "{report:#}");
    for side in [Side::A, Side::B] {
        let read = probe(&report, 7, side, Action::ReadShared, &file_name);
        assert!(read.verdict.is_pass(), "{report:#}");
        assert_leaked(
            probe(&report, 7, side, Action::OverwriteShared, &file_name),
            "for writing",
        );
        let created: Vec<&Probe> = report
            .probes
            .iter()
            .filter(|p| p.step == 7 && p.from == side && p.action == Action::WriteShared)
            .collect();
        assert_eq!(created.len(), 1);
        assert_leaked(created[0], "created");
    }
    assert!(probe(&report, 7, Side::A, Action::VerifyHash, &file_name)
        .verdict
        .is_pass());

    // The shared file is untouched and the files the sessions created there are gone.
    assert_eq!(
        std::fs::read_to_string(&file).expect("shared file"),
        "shared skill v1\n"
    );
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("SKILL.md")]);
    std::fs::remove_dir_all(&dir).expect("remove shared dir");
    assert_cleaned_up(&report);
}

#[tokio::test]
async fn bad_options_and_a_foreign_installation_are_errors() {
    let (fake, runtime) = fake();
    let bad_label = SuiteOptions::new("Not A Label");
    let error = isolation_suite::run(Arc::clone(&runtime), &bad_label)
        .await
        .unwrap_err();
    assert!(matches!(error, SuiteError::InvalidOptions(_)), "{error}");

    let relative = SuiteOptions::new(INSTALLATION).with_extra_scan_path("srv/sessions");
    let error = isolation_suite::run(Arc::clone(&runtime), &relative)
        .await
        .unwrap_err();
    assert!(matches!(error, SuiteError::InvalidOptions(_)), "{error}");

    let relative_shared = SuiteOptions::new(INSTALLATION).with_shared_input(SharedInput::new("skills/x"));
    let error = isolation_suite::run(Arc::clone(&runtime), &relative_shared)
        .await
        .unwrap_err();
    assert!(matches!(error, SuiteError::InvalidOptions(_)), "{error}");

    // The runtime refuses identities of another installation: no report, and nothing left open.
    let foreign = SuiteOptions::new("someone-else");
    let error = isolation_suite::run(runtime, &foreign).await.unwrap_err();
    assert!(
        matches!(
            error,
            SuiteError::Runtime {
                side: Side::A,
                operation: "create",
                ..
            }
        ),
        "{error}"
    );
    assert!(fake.list().await.expect("list").is_empty());
}
