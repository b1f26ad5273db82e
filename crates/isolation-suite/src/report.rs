//! What the suite found: [`IsolationReport`] and its parts.

use std::fmt;
use std::path::PathBuf;

use session_runtime::{IsolationLevel, SessionId};

use crate::Errno;

/// One of the two sessions of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The first session: the owner of the sentinels in steps 2 to 5, the attacker in step 6.
    A,
    /// The second session: the attacker in steps 4 and 5, the owner of the sentinels in step 6.
    B,
}

impl Side {
    /// The other session.
    pub fn other(self) -> Self {
        match self {
            Self::A => Self::B,
            Self::B => Self::A,
        }
    }

    /// `a` or `b`, for names.
    pub(crate) fn lower(self) -> &'static str {
        match self {
            Self::A => "a",
            Self::B => "b",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::A => "A",
            Self::B => "B",
        })
    }
}

/// What a probe did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Action {
    /// Step 1: the runtime gave the two sessions different workers.
    DistinctWorkers,
    /// Steps 2 and 6: the owner wrote a sentinel file and hashed it.
    CreateSentinel,
    /// Steps 3 and 6: the owner made a local-only git branch.
    CreateRef,
    /// The attacker searched a writable mount (or an extra path) for the owner's token.
    Scan,
    /// The attacker ran `stat` on one of the owner's paths.
    Stat,
    /// The attacker ran `cat` on one of the owner's paths.
    Read,
    /// The attacker listed the refs of the owner's repository.
    ListRef,
    /// The attacker tried to overwrite one of the owner's files.
    Overwrite,
    /// The attacker tried to delete one of the owner's files.
    Delete,
    /// The attacker tried to delete the owner's local-only ref.
    UpdateRef,
    /// The owner re-hashed a sentinel after the attacks (and the suite re-hashed its host copy).
    VerifyHash,
    /// The owner re-read its local-only ref after the attacks.
    VerifyRef,
    /// Step 7: a session read the shared read-only input.
    ReadShared,
    /// Step 7: a session tried to create a file in the shared read-only input.
    WriteShared,
    /// Step 7: a session tried to open the shared input's file for writing.
    OverwriteShared,
    /// Step 8, the positive control of the channel probes: the owner listened on an abstract
    /// UNIX socket and a loopback TCP port and reached both itself.
    Listen,
    /// Step 8: the attacker tried to connect to the owner's abstract UNIX socket.
    ConnectAbstract,
    /// Step 8: the attacker tried to connect to the owner's TCP port on the loopback address.
    ConnectLoopback,
}

impl Action {
    /// A short lower-case name for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DistinctWorkers => "workers",
            Self::CreateSentinel => "create",
            Self::CreateRef => "create-ref",
            Self::Scan => "scan",
            Self::Stat => "stat",
            Self::Read => "read",
            Self::ListRef => "list-ref",
            Self::Overwrite => "overwrite",
            Self::Delete => "delete",
            Self::UpdateRef => "update-ref",
            Self::VerifyHash => "verify-hash",
            Self::VerifyRef => "verify-ref",
            Self::ReadShared => "read-shared",
            Self::WriteShared => "write-shared",
            Self::OverwriteShared => "overwrite-shared",
            Self::Listen => "listen",
            Self::ConnectAbstract => "connect-abstract",
            Self::ConnectLoopback => "connect-loopback",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a probe showed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The attempt was refused (`ENOENT`, `EACCES`, `EPERM`, or `EROFS` for writes), or a scan
    /// found nothing: isolation held.
    Denied,
    /// A check came out as required (a sentinel was written, a hash is unchanged, the shared input
    /// reads the same in both sessions, ...).
    Held {
        /// What was seen.
        detail: String,
    },
    /// One session reached the other's data: saw it, read it, changed or deleted it.
    Leaked {
        /// What shows it (the found path, the content read, the changed hash, ...).
        evidence: String,
    },
    /// A requirement other than confidentiality failed (the same worker for both sessions, a
    /// shared input that differs between them or cannot be read).
    Failed {
        /// What went wrong.
        why: String,
    },
    /// The probe could not decide: the command could not run, timed out, or failed in a way that
    /// is not a refusal.
    Inconclusive {
        /// Why.
        why: String,
    },
}

impl Verdict {
    /// Whether the probe passed: [`Denied`](Self::Denied) or [`Held`](Self::Held).
    pub fn is_pass(&self) -> bool {
        matches!(self, Self::Denied | Self::Held { .. })
    }

    /// Whether the probe shows a leak.
    pub fn is_leak(&self) -> bool {
        matches!(self, Self::Leaked { .. })
    }

    fn word(&self) -> &'static str {
        match self {
            Self::Denied => "denied",
            Self::Held { .. } => "held",
            Self::Leaked { .. } => "LEAKED",
            Self::Failed { .. } => "FAILED",
            Self::Inconclusive { .. } => "INCONCLUSIVE",
        }
    }

    fn text(&self) -> Option<&str> {
        match self {
            Self::Denied => None,
            Self::Held { detail } => Some(detail),
            Self::Leaked { evidence } => Some(evidence),
            Self::Failed { why } | Self::Inconclusive { why } => Some(why),
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.word())?;
        match self.text() {
            Some(text) => write!(f, ": {text}"),
            None => Ok(()),
        }
    }
}

/// One thing the suite tried, where, how, and what came of it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Probe {
    /// The step of the RFC's acceptance test (1 to 7).
    pub step: u8,
    /// The session whose shell ran the command.
    pub from: Side,
    /// The path, ref or mount the probe aimed at.
    pub target: String,
    /// What it did.
    pub action: Action,
    /// The exact shell command, as run with `/bin/sh -c` in `from`'s worker (or a description of
    /// a runtime call for step 1).
    pub command: String,
    /// The command's exit code, if it ran and exited.
    pub exit_code: Option<i32>,
    /// The error the command met, read from its standard error (see [`Errno::from_stderr`]).
    pub errno: Option<Errno>,
    /// The outcome.
    pub verdict: Verdict,
}

/// Where a sentinel file lives in its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SentinelKind {
    /// In the workspace (the attachment's working directory).
    Workspace,
    /// In `$HOME` as the session sees it.
    Home,
}

impl fmt::Display for SentinelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Workspace => "workspace",
            Self::Home => "home",
        })
    }
}

/// An uncommitted sentinel file one session wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sentinel {
    /// Workspace or HOME.
    pub kind: SentinelKind,
    /// Its absolute path inside the owner's worker, as the owner sees it.
    pub path: String,
    /// Its path on the suite's host, when the suite found it there (under the owner's
    /// `storage_refs`, or at `path` itself) with the same content; `None` when it did not.
    pub host_path: Option<PathBuf>,
    /// The lower-case hex SHA-256 of its content, computed inside the owner's worker.
    pub sha256: String,
}

/// A local-only git branch one session made.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GitSentinel {
    /// The repository's absolute path inside the owner's worker.
    pub repo: String,
    /// The repository's path on the suite's host, when found there.
    pub host_repo: Option<PathBuf>,
    /// The full ref name, `refs/heads/oab-sentinel-<token>`.
    pub reference: String,
    /// The commit it points to.
    pub commit: String,
}

/// One session of the run and what it was given to protect.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SessionSummary {
    /// A or B.
    pub side: Side,
    /// The session's id.
    pub id: SessionId,
    /// Its worker, as the attachment's control handle names it.
    pub worker_id: String,
    /// The attachment's in-worker working directory (the workspace).
    pub working_dir: String,
    /// `$HOME` as the session's shell sees it, if set.
    pub home: Option<String>,
    /// The storage references the runtime reported in the session's status.
    pub storage_refs: Vec<String>,
    /// The random token in the names of this session's sentinels.
    pub token: String,
    /// Its sentinel files (those that could be written).
    pub sentinels: Vec<Sentinel>,
    /// Its local-only git branch, if git was available.
    pub git: Option<GitSentinel>,
}

/// A step that was not run, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Skipped {
    /// The step.
    pub step: u8,
    /// Why it was not run.
    pub reason: String,
}

/// Everything one run of the suite found.
///
/// `Display` renders a readable multi-line report for operators; the alternate form (`{:#}`)
/// also shows the command of every probe (the plain form shows commands only for probes that
/// did not pass).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IsolationReport {
    /// The runtime's name.
    pub runtime: String,
    /// The isolation level the runtime declares in its capabilities.
    pub declared_isolation: IsolationLevel,
    /// Session A and session B.
    pub sessions: [SessionSummary; 2],
    /// Every probe, in the order run.
    pub probes: Vec<Probe>,
    /// Steps that were not run: step 7 when no shared input is configured, step 8 when
    /// [`SuiteOptions::without_channel_probes`](crate::SuiteOptions::without_channel_probes)
    /// says why.
    pub skipped: Vec<Skipped>,
    /// Problems removing the suite's own files at the end (they do not affect the verdict).
    pub cleanup_problems: Vec<String>,
}

impl IsolationReport {
    /// Whether isolation held: every probe is [`Denied`](Verdict::Denied) or
    /// [`Held`](Verdict::Held), so none leaked, failed or was inconclusive. A skipped step 7 is
    /// allowed (and shown in the report).
    pub fn passed(&self) -> bool {
        !self.probes.is_empty() && self.probes.iter().all(|probe| probe.verdict.is_pass())
    }

    /// The probes that show a leak.
    pub fn leaks(&self) -> impl Iterator<Item = &Probe> {
        self.probes.iter().filter(|probe| probe.verdict.is_leak())
    }

    /// The probes that did not pass: leaked, failed or inconclusive.
    pub fn problems(&self) -> impl Iterator<Item = &Probe> {
        self.probes.iter().filter(|probe| !probe.verdict.is_pass())
    }

    /// The summary of one side.
    pub fn session(&self, side: Side) -> &SessionSummary {
        match side {
            Side::A => &self.sessions[0],
            Side::B => &self.sessions[1],
        }
    }
}

/// At most this many characters of a target are shown in the probe table.
const TARGET_COLUMN: usize = 56;

fn count(probes: &[Probe], pick: impl Fn(&Verdict) -> bool) -> usize {
    probes.iter().filter(|probe| pick(&probe.verdict)).count()
}

fn host_text(host: Option<&PathBuf>, in_worker: &str) -> String {
    match host {
        Some(path) if path.to_string_lossy() == in_worker => "host: same path".to_owned(),
        Some(path) => format!("host: {}", path.display()),
        None => "host: not found".to_owned(),
    }
}

impl fmt::Display for SessionSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  {}  session {}  worker {}  token {}",
            self.side, self.id, self.worker_id, self.token
        )?;
        writeln!(
            f,
            "     workspace {}  HOME {}",
            self.working_dir,
            self.home.as_deref().unwrap_or("(unset)")
        )?;
        if !self.storage_refs.is_empty() {
            writeln!(f, "     storage {}", self.storage_refs.join(", "))?;
        }
        for sentinel in &self.sentinels {
            writeln!(
                f,
                "     sentinel {:<9} {}  ({})  sha256 {}",
                sentinel.kind.to_string(),
                sentinel.path,
                host_text(sentinel.host_path.as_ref(), &sentinel.path),
                sentinel.sha256
            )?;
        }
        if let Some(git) = &self.git {
            writeln!(
                f,
                "     git ref  {} -> {} in {}  ({})",
                git.reference,
                git.commit,
                git.repo,
                host_text(git.host_repo.as_ref(), &git.repo)
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for IsolationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let all_commands = f.alternate();
        let outcome = if self.passed() { "PASSED" } else { "FAILED" };
        writeln!(
            f,
            "isolation acceptance suite: {outcome} (runtime {}, declared isolation: {})",
            self.runtime, self.declared_isolation
        )?;
        let probes = &self.probes;
        writeln!(
            f,
            "  {} probes: {} denied, {} held, {} leaked, {} failed, {} inconclusive",
            probes.len(),
            count(probes, |v| matches!(v, Verdict::Denied)),
            count(probes, |v| matches!(v, Verdict::Held { .. })),
            count(probes, Verdict::is_leak),
            count(probes, |v| matches!(v, Verdict::Failed { .. })),
            count(probes, |v| matches!(v, Verdict::Inconclusive { .. })),
        )?;
        if self.declared_isolation == IsolationLevel::None {
            writeln!(
                f,
                "  note: this runtime declares that it isolates nothing; leaks are expected"
            )?;
        }
        writeln!(f)?;
        writeln!(f, "sessions")?;
        for session in &self.sessions {
            write!(f, "{session}")?;
        }
        writeln!(f)?;
        writeln!(f, "probes")?;
        for probe in probes {
            let target: String = if probe.target.chars().count() > TARGET_COLUMN {
                let tail: Vec<char> = probe.target.chars().rev().take(TARGET_COLUMN - 3).collect();
                format!("...{}", tail.into_iter().rev().collect::<String>())
            } else {
                probe.target.clone()
            };
            let errno = probe
                .errno
                .as_ref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default();
            writeln!(
                f,
                "  step {}  {}  {:<16} {:<width$}  {}{errno}",
                probe.step,
                probe.from,
                probe.action.as_str(),
                target,
                probe.verdict.word(),
                width = TARGET_COLUMN,
            )?;
            if let Some(text) = probe.verdict.text() {
                for line in text.lines() {
                    writeln!(f, "                {line}")?;
                }
            }
            if all_commands || !probe.verdict.is_pass() {
                let exit = match probe.exit_code {
                    Some(code) => format!("  [exit {code}]"),
                    None => String::new(),
                };
                writeln!(
                    f,
                    "                $ {}{exit}",
                    probe.command.replace('\n', "\n                  ")
                )?;
            }
        }
        if !self.skipped.is_empty() {
            writeln!(f)?;
            writeln!(f, "skipped")?;
            for skipped in &self.skipped {
                writeln!(f, "  step {}: {}", skipped.step, skipped.reason)?;
            }
        }
        if !self.cleanup_problems.is_empty() {
            writeln!(f)?;
            writeln!(f, "cleanup")?;
            for problem in &self.cleanup_problems {
                writeln!(f, "  {problem}")?;
            }
        }
        let leaks = self.leaks().count();
        let problems = self.problems().count();
        writeln!(f)?;
        if self.passed() {
            write!(
                f,
                "result: PASSED: every attempt was refused and every hash is unchanged"
            )
        } else {
            write!(
                f,
                "result: FAILED: {leaks} probe(s) leaked, {} other probe(s) failed or were inconclusive",
                problems - leaks
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use session_runtime::SessionIdentity;

    use super::*;

    fn summary(side: Side) -> SessionSummary {
        let id = SessionIdentity::new("verify", "isolation-suite", "verify", format!("t/{side}"))
            .expect("identity")
            .id();
        SessionSummary {
            side,
            id,
            worker_id: format!("worker-{side}"),
            working_dir: "/workspace".into(),
            home: Some("/home/agent".into()),
            storage_refs: vec![format!("/srv/sessions/{id}")],
            token: format!("token{side}"),
            sentinels: vec![Sentinel {
                kind: SentinelKind::Workspace,
                path: format!("/workspace/oab-sentinel-token{side}-workspace"),
                host_path: Some(PathBuf::from(format!(
                    "/srv/sessions/{id}/workspace/oab-sentinel-token{side}-workspace"
                ))),
                sha256: "ab".repeat(32),
            }],
            git: None,
        }
    }

    fn probe(step: u8, action: Action, target: &str, errno: Option<Errno>, verdict: Verdict) -> Probe {
        Probe {
            step,
            from: Side::B,
            target: target.into(),
            action,
            command: format!("{action} -- '{target}'"),
            exit_code: Some(if verdict.is_leak() { 0 } else { 1 }),
            errno,
            verdict,
        }
    }

    fn report(probes: Vec<Probe>, skipped: Vec<Skipped>) -> IsolationReport {
        IsolationReport {
            runtime: "local".into(),
            declared_isolation: IsolationLevel::Namespaces,
            sessions: [summary(Side::A), summary(Side::B)],
            probes,
            skipped,
            cleanup_problems: Vec::new(),
        }
    }

    #[test]
    fn a_passing_report_shows_commands_only_when_asked() {
        let report = report(
            vec![
                probe(
                    4,
                    Action::Stat,
                    "/workspace/oab-sentinel-tokenA-workspace",
                    Some(Errno::ENOENT),
                    Verdict::Denied,
                ),
                probe(
                    5,
                    Action::VerifyHash,
                    "/workspace/oab-sentinel-tokenA-workspace",
                    None,
                    Verdict::Held {
                        detail: "sha256 unchanged in the worker".into(),
                    },
                ),
            ],
            vec![Skipped {
                step: 7,
                reason: "no shared read-only input is configured".into(),
            }],
        );
        assert!(report.passed());
        assert_eq!(report.leaks().count(), 0);
        let text = report.to_string();
        assert!(
            text.starts_with(
                "isolation acceptance suite: PASSED (runtime local, declared isolation: namespaces)"
            ),
            "{text}"
        );
        assert!(
            text.contains("2 probes: 1 denied, 1 held, 0 leaked, 0 failed, 0 inconclusive"),
            "{text}"
        );
        assert!(text.contains("step 4  B  stat "), "{text}");
        assert!(text.contains("denied (ENOENT)"), "{text}");
        assert!(text.contains("sha256 unchanged in the worker"), "{text}");
        assert!(
            text.contains("skipped\n  step 7: no shared read-only input is configured"),
            "{text}"
        );
        assert!(text.contains("/srv/sessions/"), "host paths are shown: {text}");
        assert!(
            !text.contains("$ stat"),
            "passing probes hide their commands: {text}"
        );
        assert!(
            text.ends_with("result: PASSED: every attempt was refused and every hash is unchanged"),
            "{text}"
        );
        let verbose = format!("{report:#}");
        assert!(
            verbose.contains("$ stat -- '/workspace/oab-sentinel-tokenA-workspace'  [exit 1]"),
            "{verbose}"
        );
    }

    #[test]
    fn a_failing_report_names_the_leak_and_its_command() {
        let long = format!(
            "/srv/sessions/{}/workspace/oab-sentinel-tokenA-workspace",
            "x".repeat(60)
        );
        let report = report(
            vec![
                probe(
                    4,
                    Action::Read,
                    &long,
                    None,
                    Verdict::Leaked {
                        evidence: "read the sentinel's content: oab isolation sentinel tokenA".into(),
                    },
                ),
                probe(
                    4,
                    Action::Scan,
                    "/",
                    None,
                    Verdict::Inconclusive {
                        why: "the scan did not finish within 20 s".into(),
                    },
                ),
                probe(
                    4,
                    Action::Stat,
                    "/workspace/x",
                    Some(Errno::ENOENT),
                    Verdict::Denied,
                ),
            ],
            Vec::new(),
        );
        assert!(!report.passed());
        assert_eq!(report.leaks().count(), 1);
        assert_eq!(report.problems().count(), 2);
        let text = report.to_string();
        assert!(text.starts_with("isolation acceptance suite: FAILED"), "{text}");
        assert!(text.contains("LEAKED"), "{text}");
        assert!(text.contains("read the sentinel's content"), "{text}");
        assert!(text.contains(&format!("$ read -- '{long}'  [exit 0]")), "{text}");
        assert!(text.contains("INCONCLUSIVE"), "{text}");
        // Long targets keep their distinctive end.
        assert!(
            text.contains("...") && text.contains("oab-sentinel-tokenA-workspace  LEAKED"),
            "{text}"
        );
        assert!(
            text.ends_with("result: FAILED: 1 probe(s) leaked, 1 other probe(s) failed or were inconclusive"),
            "{text}"
        );
    }

    #[test]
    fn an_empty_report_does_not_pass() {
        assert!(!report(Vec::new(), Vec::new()).passed());
    }

    #[test]
    fn no_isolation_is_called_out() {
        let mut report = report(Vec::new(), Vec::new());
        report.declared_isolation = IsolationLevel::None;
        assert!(report.to_string().contains("declares that it isolates nothing"));
    }
}
