//! The seven steps of the RFC's acceptance test.

use std::future::Future;
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime};
use sha2::{Digest, Sha256};

use crate::host::{self, Expect};
use crate::mounts::writable_mounts;
use crate::shell::{first_line, join, quote, Channel, Connected, Output, Worker};
use crate::{
    Action, Errno, GitSentinel, IsolationReport, Probe, Sentinel, SentinelKind, SessionSummary, Side,
    Skipped, SuiteError, SuiteOptions, Verdict,
};

/// At most this many found paths are quoted as a scan's evidence.
const EVIDENCE_PATHS: usize = 10;

/// A fixed identity for the sentinel commit, and no signing (whatever the worker's git config says).
const GIT_COMMIT_FLAGS: &str =
    "-c user.name=oab-isolation-suite -c user.email=isolation-suite@openab.invalid -c commit.gpgsign=false";

/// The step numbers one pass (owner's set-up, attacker's attempts, owner's verification) is
/// reported under.
#[derive(Debug, Clone, Copy)]
struct Steps {
    sentinels: u8,
    git: u8,
    attack: u8,
    verify: u8,
}

/// Steps 2 to 5: A owns, B attacks.
const FORWARD: Steps = Steps {
    sentinels: 2,
    git: 3,
    attack: 4,
    verify: 5,
};

/// Step 6: the same with the roles reversed.
const REVERSED: Steps = Steps {
    sentinels: 6,
    git: 6,
    attack: 6,
    verify: 6,
};

/// The shared-input step.
const SHARED_STEP: u8 = 7;

/// The channels step: abstract UNIX sockets and loopback ports, in both directions.
const CHANNELS_STEP: u8 = 8;

/// How long a connect probe waits for the listener's reply.
const CONNECT_TIME: Duration = Duration::from_secs(5);

/// What an owner planted in one pass.
#[derive(Debug, Default)]
struct Planted {
    token: String,
    home: Option<String>,
    /// Markers in the sentinels' content: seeing one in the attacker's output is a leak.
    secrets: Vec<String>,
    sentinels: Vec<Sentinel>,
    git: Option<GitSentinel>,
    /// Every path the owner tried to create, for the clean-up.
    attempted_files: Vec<String>,
    attempted_repo: Option<String>,
}

/// Runs the suite; see the crate documentation.
pub(crate) async fn run(
    runtime: Arc<dyn SessionRuntime>,
    options: &SuiteOptions,
) -> Result<IsolationReport, SuiteError> {
    validate(options)?;
    let run_token = random_hex(8);
    let identities = [
        identity(options, &run_token, Side::A)?,
        identity(options, &run_token, Side::B)?,
    ];
    let mut suite = Suite {
        runtime: Arc::clone(&runtime),
        options,
        probes: Vec::new(),
        skipped: Vec::new(),
        cleanup_problems: Vec::new(),
    };
    let result = suite.run(&identities).await;

    // Close both sessions whatever happened; closing one that was never created is a no-op.
    let mut problems = Vec::new();
    for (identity, side) in identities.iter().zip([Side::A, Side::B]) {
        let id = identity.id();
        let close = runtime.close(&id, CloseReason::Ended);
        match tokio::time::timeout(options.lifecycle_timeout, close).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => problems.push(format!("closing session {side} ({id}): {e}")),
            Err(_) => problems.push(format!(
                "closing session {side} ({id}) did not finish within {:?}",
                options.lifecycle_timeout
            )),
        }
    }
    result.map(|mut report| {
        report.cleanup_problems.extend(problems);
        report
    })
}

fn validate(options: &SuiteOptions) -> Result<(), SuiteError> {
    let invalid = |why: String| Err(SuiteError::InvalidOptions(why));
    if let Some(shared) = &options.shared_input {
        if !shared.file.starts_with('/') || shared.file.ends_with('/') {
            return invalid(format!(
                "the shared input must be an absolute path of a file, got {:?}",
                shared.file
            ));
        }
        if let Some(sha) = &shared.expected_sha256 {
            if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
                return invalid(format!(
                    "the shared input's expected sha256 must be 64 hex digits, got {sha:?}"
                ));
            }
        }
    }
    if let Some(path) = options.extra_scan_paths.iter().find(|p| !p.starts_with('/')) {
        return invalid(format!("extra scan paths must be absolute, got {path:?}"));
    }
    for (name, limit) in [
        ("scan_timeout", options.scan_timeout),
        ("command_timeout", options.command_timeout),
        ("lifecycle_timeout", options.lifecycle_timeout),
    ] {
        if limit.is_zero() {
            return invalid(format!("{name} must not be zero"));
        }
    }
    Ok(())
}

fn identity(options: &SuiteOptions, run_token: &str, side: Side) -> Result<SessionIdentity, SuiteError> {
    let thread = format!("isolation-suite/{run_token}/{}", side.lower());
    SessionIdentity::new(
        options.installation.as_str(),
        options.agent.as_str(),
        options.platform.as_str(),
        thread,
    )
    .map_err(|e| SuiteError::InvalidOptions(e.to_string()))
}

/// `2 * bytes` random lower-case hex digits: from `/dev/urandom`, mixed with the time, the
/// process id and a counter so they stay unique where `/dev/urandom` cannot be read.
pub(crate) fn random_hex(bytes: usize) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut seed = [0u8; 32];
    let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut seed));
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let mut hasher = Sha256::new();
    hasher.update(seed);
    hasher.update(nanos.to_le_bytes());
    hasher.update(std::process::id().to_le_bytes());
    hasher.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let digest = hasher.finalize();
    host::hex(&digest[..bytes.min(digest.len())])
}

/// Waits for a runtime call, bounded.
async fn within<T>(
    side: Side,
    operation: &'static str,
    limit: Duration,
    call: impl Future<Output = session_runtime::Result<T>> + Send,
) -> Result<T, SuiteError> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(SuiteError::Runtime {
            side,
            operation,
            source,
        }),
        Err(_) => Err(SuiteError::Timeout {
            side,
            operation,
            limit,
        }),
    }
}

/// The lower-case SHA-256 at the start of `sha256sum`'s output.
fn parse_sha256(stdout: &str) -> Option<String> {
    let word = stdout.split_whitespace().next()?;
    (word.len() == 64 && word.bytes().all(|b| b.is_ascii_hexdigit())).then(|| word.to_ascii_lowercase())
}

/// A commit id on the last line of `stdout`.
fn parse_commit(stdout: &str) -> Option<String> {
    let word = stdout.lines().map(str::trim).rfind(|l| !l.is_empty())?;
    (matches!(word.len(), 40 | 64) && word.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| word.to_ascii_lowercase())
}

/// Where a probe belongs: its step, the session that ran it, and what it did.
struct At(u8, Side, Action);

struct Suite<'a> {
    runtime: Arc<dyn SessionRuntime>,
    options: &'a SuiteOptions,
    probes: Vec<Probe>,
    skipped: Vec<Skipped>,
    cleanup_problems: Vec<String>,
}

/// The verdict on an attempt to reach the other session's path: a success is a leak (with the
/// evidence `leak` makes of it), an error that `refused` accepts is a denial, anything else is
/// inconclusive.
fn judge(
    outcome: &Result<Output, String>,
    refused: fn(&Errno) -> bool,
    leak: impl FnOnce(&Output) -> String,
) -> Verdict {
    let out = match outcome {
        Ok(out) => out,
        Err(why) => return Verdict::Inconclusive { why: why.clone() },
    };
    if out.success() {
        return Verdict::Leaked { evidence: leak(out) };
    }
    if let Some(why) = out.abnormal() {
        return Verdict::Inconclusive { why };
    }
    match out.errno() {
        Some(errno) if refused(&errno) => Verdict::Denied,
        _ => Verdict::Inconclusive {
            why: format!("not a refusal: {}", out.describe()),
        },
    }
}

fn held(detail: impl Into<String>) -> Verdict {
    Verdict::Held {
        detail: detail.into(),
    }
}

/// What went wrong with a command, in one line.
fn failure(outcome: &Result<Output, String>) -> String {
    match outcome {
        Ok(out) => out.describe(),
        Err(why) => why.clone(),
    }
}

fn inconclusive(outcome: &Result<Output, String>) -> Verdict {
    Verdict::Inconclusive {
        why: failure(outcome),
    }
}

impl Suite<'_> {
    fn record(
        &mut self,
        At(step, from, action): At,
        target: &str,
        command: &str,
        outcome: Option<&Result<Output, String>>,
        verdict: Verdict,
    ) {
        let out = outcome.and_then(|o| o.as_ref().ok());
        self.probes.push(Probe {
            step,
            from,
            target: target.to_owned(),
            action,
            command: command.to_owned(),
            exit_code: out.and_then(|o| o.exit_code),
            errno: out.and_then(|o| if o.success() { None } else { o.errno() }),
            verdict,
        });
    }

    async fn run(&mut self, identities: &[SessionIdentity; 2]) -> Result<IsolationReport, SuiteError> {
        let a = self.open(Side::A, &identities[0]).await?;
        let b = self.open(Side::B, &identities[1]).await?;
        let limit = self.options.lifecycle_timeout;
        let status_a = within(Side::A, "status", limit, self.runtime.status(&a.id)).await?;
        let status_b = within(Side::B, "status", limit, self.runtime.status(&b.id)).await?;

        // Step 1: two sessions, two workers.
        let worker_a = a.client.control().worker_id().to_owned();
        let worker_b = b.client.control().worker_id().to_owned();
        let command =
            "compare the workers' ids: attach(A).control().worker_id() and attach(B).control().worker_id()";
        let verdict = if worker_a == worker_b {
            Verdict::Failed {
                why: format!("both sessions are served by worker {worker_a}"),
            }
        } else {
            held(format!("A is {worker_a}, B is {worker_b}"))
        };
        self.record(
            At(1, Side::A, Action::DistinctWorkers),
            "A and B",
            command,
            None,
            verdict,
        );

        let planted_a = self.pass(&a, &status_a.storage_refs, &b, FORWARD).await;
        let planted_b = self.pass(&b, &status_b.storage_refs, &a, REVERSED).await;
        let shared_files = self.shared(&a, &b).await;
        if let Some(why) = &self.options.skip_channels {
            self.skipped.push(Skipped {
                step: CHANNELS_STEP,
                reason: why.clone(),
            });
        } else {
            self.channels(&a, &b).await;
            self.channels(&b, &a).await;
        }

        self.cleanup(&a, &planted_a, &shared_files).await;
        self.cleanup(&b, &planted_b, &shared_files).await;

        let summary = |worker: &Worker, storage_refs: Vec<String>, worker_id: String, planted: Planted| {
            SessionSummary {
                side: worker.side,
                id: worker.id,
                worker_id,
                working_dir: worker.client.working_dir().to_owned(),
                home: planted.home,
                storage_refs,
                token: planted.token,
                sentinels: planted.sentinels,
                git: planted.git,
            }
        };
        Ok(IsolationReport {
            runtime: self.runtime.name().to_owned(),
            declared_isolation: self.runtime.capabilities().isolation,
            sessions: [
                summary(&a, status_a.storage_refs, worker_a, planted_a),
                summary(&b, status_b.storage_refs, worker_b, planted_b),
            ],
            probes: std::mem::take(&mut self.probes),
            skipped: std::mem::take(&mut self.skipped),
            cleanup_problems: std::mem::take(&mut self.cleanup_problems),
        })
    }

    /// Creates and attaches one session, and initializes its agent.
    async fn open(&self, side: Side, identity: &SessionIdentity) -> Result<Worker, SuiteError> {
        let limit = self.options.lifecycle_timeout;
        let id = identity.id();
        within(
            side,
            "create",
            limit,
            self.runtime.create(identity, &CreateOptions::new()),
        )
        .await?;
        let attachment = within(side, "attach", limit, self.runtime.attach(&id)).await?;
        let client = AcpClient::new(attachment);
        match tokio::time::timeout(limit, client.initialize()).await {
            Ok(Ok(_)) => Ok(Worker { side, id, client }),
            Ok(Err(source)) => Err(SuiteError::Agent {
                side,
                operation: "initialize",
                source,
            }),
            Err(_) => Err(SuiteError::Timeout {
                side,
                operation: "initialize",
                limit,
            }),
        }
    }

    /// One pass: `owner` plants sentinels, `attacker` tries to reach them, `owner` verifies them.
    async fn pass(
        &mut self,
        owner: &Worker,
        storage_refs: &[String],
        attacker: &Worker,
        steps: Steps,
    ) -> Planted {
        let mut planted = Planted {
            token: random_hex(8),
            ..Planted::default()
        };
        self.plant_files(owner, storage_refs, &mut planted, steps.sentinels)
            .await;
        self.plant_git(owner, storage_refs, &mut planted, steps.git).await;
        self.attack(attacker, &planted, steps.attack).await;
        self.verify(owner, &planted, steps.verify).await;
        planted
    }

    async fn plant_files(
        &mut self,
        owner: &Worker,
        storage_refs: &[String],
        planted: &mut Planted,
        step: u8,
    ) {
        let timeout = self.options.command_timeout;
        let home_command = "printf '%s' \"$HOME\"";
        let home = owner.sh(home_command, timeout).await;
        planted.home = match &home {
            Ok(out) if out.success() && out.stdout.starts_with('/') => Some(out.stdout.clone()),
            _ => None,
        };
        let workspace = owner.client.working_dir().to_owned();
        let mut places = vec![(SentinelKind::Workspace, Some(workspace))];
        places.push((SentinelKind::Home, planted.home.clone()));
        for (kind, dir) in places {
            let Some(dir) = dir else {
                let why = match &home {
                    Ok(out) if out.success() => {
                        "HOME is not set to an absolute path in the worker".to_owned()
                    }
                    other => format!("cannot read HOME: {}", failure(other)),
                };
                let verdict = Verdict::Inconclusive { why };
                self.record(
                    At(step, owner.side, Action::CreateSentinel),
                    "$HOME",
                    home_command,
                    Some(&home),
                    verdict,
                );
                continue;
            };
            let name = format!("oab-sentinel-{}-{kind}", planted.token);
            let path = join(&dir, &name);
            let secret = random_hex(16);
            let content = format!("oab isolation sentinel {} {kind} {secret}", planted.token);
            let expected = host::sha256_hex(format!("{content}\n").as_bytes());
            let quoted = quote(&path);
            let command = format!(
                "printf '%s\\n' {} > {quoted} && sha256sum -- {quoted}",
                quote(&content)
            );
            planted.attempted_files.push(path.clone());
            let outcome = owner.sh(&command, timeout).await;
            let verdict = match &outcome {
                Ok(out) if out.success() => match parse_sha256(&out.stdout) {
                    Some(sha) if sha == expected => held(format!("written; sha256 {sha}")),
                    other => Verdict::Inconclusive {
                        why: format!("sha256sum printed {other:?}, expected {expected}"),
                    },
                },
                other => inconclusive(other),
            };
            if verdict.is_pass() {
                planted.secrets.push(secret);
                let host_path = locate(storage_refs, &path, &name, Expect::File(expected.clone())).await;
                planted.sentinels.push(Sentinel {
                    kind,
                    path: path.clone(),
                    host_path,
                    sha256: expected,
                });
            }
            self.record(
                At(step, owner.side, Action::CreateSentinel),
                &path,
                &command,
                Some(&outcome),
                verdict,
            );
        }
    }

    async fn plant_git(&mut self, owner: &Worker, storage_refs: &[String], planted: &mut Planted, step: u8) {
        let name = format!("oab-sentinel-{}-repo", planted.token);
        let repo = join(owner.client.working_dir(), &name);
        let reference = format!("refs/heads/oab-sentinel-{}", planted.token);
        let r = quote(&repo);
        let content = format!("oab isolation sentinel {} git {}", planted.token, random_hex(16));
        let command = format!(
            "command -v git >/dev/null 2>&1 || {{ echo 'git: not found' >&2; exit 127; }}; \
             git -c init.defaultBranch=main init -q {r} && cd {r} && printf '%s\\n' {} > sentinel.txt \
             && git add sentinel.txt && git {GIT_COMMIT_FLAGS} commit -q -m 'oab isolation sentinel' \
             && git update-ref {reference} HEAD && git rev-parse --verify {reference}",
            quote(&content)
        );
        planted.attempted_repo = Some(repo.clone());
        let outcome = owner.sh(&command, self.options.command_timeout).await;
        let verdict = match &outcome {
            Ok(out) if out.exit_code == Some(127) => Verdict::Inconclusive {
                why: format!(
                    "git is not available in session {}'s worker, so its local-only ref cannot be made or probed ({})",
                    owner.side,
                    first_line(&out.stderr)
                ),
            },
            Ok(out) if out.success() => match parse_commit(&out.stdout) {
                Some(commit) => {
                    let host_repo = locate(storage_refs, &repo, &name, Expect::Dir).await;
                    planted.secrets.push(commit.clone());
                    planted.git = Some(GitSentinel {
                        repo: repo.clone(),
                        host_repo,
                        reference: reference.clone(),
                        commit: commit.clone(),
                    });
                    held(format!("{reference} -> {commit}"))
                }
                None => Verdict::Inconclusive {
                    why: format!("git printed no commit id: {:?}", first_line(&out.stdout)),
                },
            },
            other => inconclusive(other),
        };
        self.record(
            At(step, owner.side, Action::CreateRef),
            &repo,
            &command,
            Some(&outcome),
            verdict,
        );
    }

    /// Step 4 (or 6): everything the attacker tries against the owner's sentinels.
    async fn attack(&mut self, attacker: &Worker, planted: &Planted, step: u8) {
        let from = attacker.side;
        let timeout = self.options.command_timeout;

        // (a) Discovery by scanning every writable mount, and the extra paths.
        let roots = self.scan_roots(attacker, step).await;
        let scan_secs = self
            .options
            .scan_timeout
            .min(crate::options::MAX_COMMAND_TIME)
            .as_secs()
            .max(1);
        for root in roots {
            let command = format!(
                "T=; if command -v timeout >/dev/null 2>&1; then T='timeout {scan_secs}'; fi; \
                 $T find {} -xdev -name '*{}*' -exec printf '%s\\n' {{}} \\; 2>/dev/null",
                quote(&root),
                planted.token
            );
            // Two seconds more for the agent's own limit, so `timeout` ends `find` first.
            let outcome = attacker
                .sh(&command, self.options.scan_timeout + Duration::from_secs(2))
                .await;
            let verdict = match &outcome {
                Ok(out) => {
                    let hits: Vec<&str> = out.stdout.lines().filter(|l| !l.trim().is_empty()).collect();
                    if !hits.is_empty() {
                        let mut evidence =
                            format!("found {}", hits[..hits.len().min(EVIDENCE_PATHS)].join(", "));
                        if hits.len() > EVIDENCE_PATHS {
                            evidence.push_str(&format!(" and {} more", hits.len() - EVIDENCE_PATHS));
                        }
                        Verdict::Leaked { evidence }
                    } else if let Some(why) = out.abnormal() {
                        Verdict::Inconclusive { why }
                    } else if matches!(out.exit_code, Some(0 | 1)) {
                        // `find` exits 1 when some directories could not be read: the scan
                        // still covered everything the attacker can reach.
                        Verdict::Denied
                    } else {
                        Verdict::Inconclusive {
                            why: format!(
                                "the scan did not complete (exit {}; `timeout` ends it with 124 or 143 after {scan_secs} s)",
                                out.exit_code.unwrap_or_default()
                            ),
                        }
                    }
                }
                Err(why) => Verdict::Inconclusive { why: why.clone() },
            };
            self.record(
                At(step, from, Action::Scan),
                &root,
                &command,
                Some(&outcome),
                verdict,
            );
        }

        // (b) stat and cat of every recorded path, in-worker and host.
        let files = targets(
            planted
                .sentinels
                .iter()
                .map(|s| (s.path.as_str(), s.host_path.as_ref())),
        );
        for path in &files {
            let command = format!("stat -- {}", quote(path));
            let outcome = attacker.sh(&command, timeout).await;
            let verdict = judge(&outcome, Errno::is_refusal, |out| {
                format!("stat succeeded: {}", first_line(&out.stdout))
            });
            self.record(
                At(step, from, Action::Stat),
                path,
                &command,
                Some(&outcome),
                verdict,
            );

            let command = format!("cat -- {}", quote(path));
            let outcome = attacker.sh(&command, timeout).await;
            let seen = outcome
                .as_ref()
                .ok()
                .filter(|out| planted.secrets.iter().any(|s| out.stdout.contains(s.as_str())));
            let verdict = match seen {
                Some(out) => Verdict::Leaked {
                    evidence: format!("read the sentinel's content: {}", first_line(&out.stdout)),
                },
                None => judge(&outcome, Errno::is_refusal, |out| {
                    format!(
                        "cat succeeded ({} bytes) on a path only the other session created",
                        out.stdout.len()
                    )
                }),
            };
            self.record(
                At(step, from, Action::Read),
                path,
                &command,
                Some(&outcome),
                verdict,
            );
        }

        // (d, discovery) the local-only ref, by listing the repository's refs.
        let repos = targets(
            planted
                .git
                .iter()
                .map(|g| (g.repo.as_str(), g.host_repo.as_ref())),
        );
        for repo in &repos {
            let command = format!(
                "git -c safe.directory='*' -C {} for-each-ref --format='%(refname) %(objectname)'",
                quote(repo)
            );
            let outcome = attacker.sh(&command, timeout).await;
            let revealing = |line: &&str| {
                line.contains(planted.token.as_str())
                    || planted.secrets.iter().any(|s| line.contains(s.as_str()))
            };
            let seen: Vec<&str> = match &outcome {
                Ok(out) => out.stdout.lines().filter(revealing).collect(),
                Err(_) => Vec::new(),
            };
            let verdict = match &outcome {
                _ if !seen.is_empty() => Verdict::Leaked {
                    evidence: format!("listed the other session's refs: {}", seen.join("; ")),
                },
                Ok(out) if out.success() => Verdict::Inconclusive {
                    why: "a repository answered at this path, without the other session's ref".to_owned(),
                },
                _ => judge(&outcome, Errno::is_refusal, |_| String::new()),
            };
            self.record(
                At(step, from, Action::ListRef),
                repo,
                &command,
                Some(&outcome),
                verdict,
            );
        }

        // (c) overwrite, then delete, every recorded path. The overwrite only writes to a path the
        // attacker can see (`ls -d` first): a redirection would otherwise create a new file of
        // the attacker's own where the path's directory exists in its worker too (the same
        // `/workspace` in two sandboxes), which is not a write to the owner's file.
        for path in &files {
            let q = quote(path);
            let command =
                format!("ls -d -- {q} >/dev/null && printf 'overwritten by session {from}\\n' > {q}");
            let outcome = attacker.sh(&command, timeout).await;
            let verdict = judge(&outcome, Errno::is_write_refusal, |_| {
                "overwrote the other session's file".to_owned()
            });
            self.record(
                At(step, from, Action::Overwrite),
                path,
                &command,
                Some(&outcome),
                verdict,
            );
        }
        for path in &files {
            let command = format!("rm -- {}", quote(path));
            let outcome = attacker.sh(&command, timeout).await;
            let verdict = judge(&outcome, Errno::is_write_refusal, |_| {
                "deleted the other session's file".to_owned()
            });
            self.record(
                At(step, from, Action::Delete),
                path,
                &command,
                Some(&outcome),
                verdict,
            );
        }
        if let Some(git) = &planted.git {
            for repo in &repos {
                let command = format!(
                    "git -c safe.directory='*' -C {} update-ref -d {} {}",
                    quote(repo),
                    git.reference,
                    git.commit
                );
                let outcome = attacker.sh(&command, timeout).await;
                let verdict = judge(&outcome, Errno::is_write_refusal, |_| {
                    format!("deleted the other session's ref {}", git.reference)
                });
                self.record(
                    At(step, from, Action::UpdateRef),
                    repo,
                    &command,
                    Some(&outcome),
                    verdict,
                );
            }
        }
    }

    /// The attacker's writable mounts (read from its own `/proc/self/mounts`) and the extra scan
    /// paths. Records an inconclusive probe when the mounts cannot be read.
    async fn scan_roots(&mut self, attacker: &Worker, step: u8) -> Vec<String> {
        let command = "cat /proc/self/mounts";
        let outcome = attacker.sh(command, self.options.command_timeout).await;
        let mut roots = match &outcome {
            Ok(out) if out.success() => writable_mounts(&out.stdout),
            _ => Vec::new(),
        };
        if roots.is_empty() {
            let why = match &outcome {
                Ok(out) if out.success() => "no writable mount found in /proc/self/mounts".to_owned(),
                other => format!("cannot read the mount table: {}", failure(other)),
            };
            let verdict = Verdict::Inconclusive { why };
            self.record(
                At(step, attacker.side, Action::Scan),
                "/proc/self/mounts",
                command,
                Some(&outcome),
                verdict,
            );
        }
        for extra in &self.options.extra_scan_paths {
            if !roots.contains(extra) {
                roots.push(extra.clone());
            }
        }
        roots
    }

    /// Step 5 (or 6): the owner re-hashes its sentinels and re-reads its ref.
    async fn verify(&mut self, owner: &Worker, planted: &Planted, step: u8) {
        let timeout = self.options.command_timeout;
        for sentinel in &planted.sentinels {
            let command = format!("sha256sum -- {}", quote(&sentinel.path));
            let outcome = owner.sh(&command, timeout).await;
            let mut verdict = match &outcome {
                Ok(out) if out.success() => match parse_sha256(&out.stdout) {
                    Some(sha) if sha == sentinel.sha256 => held("sha256 unchanged in the worker"),
                    Some(sha) => Verdict::Leaked {
                        evidence: format!("the content changed: sha256 was {}, is {sha}", sentinel.sha256),
                    },
                    None => inconclusive(&outcome),
                },
                Ok(out) if out.abnormal().is_none() && out.errno() == Some(Errno::ENOENT) => {
                    Verdict::Leaked {
                        evidence: "the sentinel is gone".to_owned(),
                    }
                }
                other => inconclusive(other),
            };
            if let (Some(host_path), true) = (&sentinel.host_path, verdict.is_pass()) {
                let path = host_path.clone();
                let on_host = tokio::task::spawn_blocking(move || host::file_sha256(&path))
                    .await
                    .ok()
                    .flatten();
                verdict = match on_host {
                    Some(sha) if sha == sentinel.sha256 => {
                        held("sha256 unchanged in the worker and on the host")
                    }
                    Some(sha) => Verdict::Leaked {
                        evidence: format!(
                            "the host copy {} changed: sha256 was {}, is {sha}",
                            host_path.display(),
                            sentinel.sha256
                        ),
                    },
                    None => Verdict::Leaked {
                        evidence: format!("the host copy {} is gone", host_path.display()),
                    },
                };
            }
            self.record(
                At(step, owner.side, Action::VerifyHash),
                &sentinel.path,
                &command,
                Some(&outcome),
                verdict,
            );
        }
        if let Some(git) = &planted.git {
            let command = format!(
                "git -C {} rev-parse --verify -q {}",
                quote(&git.repo),
                git.reference
            );
            let outcome = owner.sh(&command, timeout).await;
            let verdict = match &outcome {
                Ok(out) if out.success() => match parse_commit(&out.stdout) {
                    Some(commit) if commit == git.commit => {
                        held(format!("{} still points to {commit}", git.reference))
                    }
                    Some(commit) => Verdict::Leaked {
                        evidence: format!("{} moved from {} to {commit}", git.reference, git.commit),
                    },
                    None => inconclusive(&outcome),
                },
                Ok(out) if out.exit_code == Some(1) && out.stderr.trim().is_empty() => Verdict::Leaked {
                    evidence: format!("{} is gone", git.reference),
                },
                Ok(out) if out.abnormal().is_none() && out.errno() == Some(Errno::ENOENT) => {
                    Verdict::Leaked {
                        evidence: "the repository is gone".to_owned(),
                    }
                }
                other => inconclusive(other),
            };
            self.record(
                At(step, owner.side, Action::VerifyRef),
                &git.reference,
                &command,
                Some(&outcome),
                verdict,
            );
        }
    }

    /// Step 7: both sessions read the shared input and try to write to it. Returns the files a
    /// session managed to create there, for the clean-up.
    async fn shared(&mut self, a: &Worker, b: &Worker) -> Vec<(Side, String)> {
        let Some(shared) = self.options.shared_input.clone() else {
            self.skipped.push(Skipped {
                step: SHARED_STEP,
                reason: "no shared read-only input is configured (SuiteOptions::shared_input)".to_owned(),
            });
            return Vec::new();
        };
        let timeout = self.options.command_timeout;
        let file = shared.file.as_str();
        let dir = match file.rfind('/') {
            Some(0) | None => "/",
            Some(cut) => &file[..cut],
        };
        let read_command = format!("sha256sum -- {}", quote(file));
        let mut first_read: Option<String> = None;
        for worker in [a, b] {
            let outcome = worker.sh(&read_command, timeout).await;
            let sha = outcome
                .as_ref()
                .ok()
                .filter(|o| o.success())
                .and_then(|o| parse_sha256(&o.stdout));
            let verdict = match (&sha, &shared.expected_sha256, &first_read) {
                (None, _, _) => Verdict::Failed {
                    why: format!("cannot read the shared input: {}", failure(&outcome)),
                },
                (Some(sha), Some(expected), _) if sha != expected => Verdict::Failed {
                    why: format!("read sha256 {sha}, expected {expected}"),
                },
                (Some(sha), _, Some(other)) if sha != other => Verdict::Failed {
                    why: format!(
                        "read sha256 {sha}, session A read {other}: the sessions see different versions"
                    ),
                },
                (Some(sha), _, _) => held(format!("read sha256 {sha}")),
            };
            if first_read.is_none() {
                first_read.clone_from(&sha);
            }
            self.record(
                At(SHARED_STEP, worker.side, Action::ReadShared),
                file,
                &read_command,
                Some(&outcome),
                verdict,
            );
        }

        let token = random_hex(8);
        let mut created = Vec::new();
        for worker in [a, b] {
            let new_file = join(
                dir,
                &format!("oab-sentinel-{token}-shared-{}", worker.side.lower()),
            );
            let command = format!(
                "printf 'written by session {}\\n' > {}",
                worker.side,
                quote(&new_file)
            );
            let outcome = worker.sh(&command, timeout).await;
            let verdict = judge(&outcome, Errno::is_shared_write_refusal, |_| {
                format!("created {new_file} in the shared input")
            });
            if verdict.is_leak() {
                created.push((worker.side, new_file.clone()));
            }
            self.record(
                At(SHARED_STEP, worker.side, Action::WriteShared),
                &new_file,
                &command,
                Some(&outcome),
                verdict,
            );

            // `>>` opens the file for writing without truncating it, and `:` writes nothing, so
            // a writable shared input is detected without damaging it.
            let command = format!(": >> {}", quote(file));
            let outcome = worker.sh(&command, timeout).await;
            let verdict = judge(&outcome, Errno::is_shared_write_refusal, |_| {
                "opened the shared input's file for writing".to_owned()
            });
            self.record(
                At(SHARED_STEP, worker.side, Action::OverwriteShared),
                file,
                &command,
                Some(&outcome),
                verdict,
            );
        }

        if let Some(before) = first_read {
            let outcome = a.sh(&read_command, timeout).await;
            let verdict = match outcome
                .as_ref()
                .ok()
                .filter(|o| o.success())
                .and_then(|o| parse_sha256(&o.stdout))
            {
                Some(sha) if sha == before => held("sha256 unchanged after the write attempts"),
                Some(sha) => Verdict::Leaked {
                    evidence: format!("the shared input changed: sha256 was {before}, is {sha}"),
                },
                None => inconclusive(&outcome),
            };
            self.record(
                At(SHARED_STEP, Side::A, Action::VerifyHash),
                file,
                &read_command,
                Some(&outcome),
                verdict,
            );
        }
        created
    }

    /// Step 8, one direction: `owner` listens on an abstract UNIX socket and a loopback TCP port,
    /// each answering with a secret, and must reach both itself (the positive control: a
    /// listener that cannot be reached from its own session proves nothing about the other);
    /// then `attacker` connects to both. Receiving the secret is a leak; a refusal
    /// (`ECONNREFUSED`, `EPERM`, `EACCES`, `ENETUNREACH`) is a denial. The listeners live until
    /// the owner's worker ends.
    async fn channels(&mut self, owner: &Worker, attacker: &Worker) {
        let token = random_hex(8);
        let secret = format!("oab-sentinel-{token}-secret-of-session-{}", owner.side);
        let probes = [
            (
                Channel::Abstract,
                format!("oab-sentinel-{token}-{}", owner.side.lower()),
                Action::ConnectAbstract,
            ),
            (
                Channel::Loopback,
                "127.0.0.1:0".to_owned(),
                Action::ConnectLoopback,
            ),
        ];
        for (channel, asked, action) in probes {
            let listen = format!(
                "{} kind={} address={asked} in {owner_side}, then {} to it from {owner_side}",
                crate::shell::LISTEN_METHOD,
                channel.kind(),
                crate::shell::CONNECT_METHOD,
                owner_side = owner.side
            );
            let listened = owner.listen(channel, &asked, &secret).await;
            let control = match &listened {
                Ok(address) => owner.connect(channel, address, CONNECT_TIME).await,
                Err(why) => Err(why.clone()),
            };
            let (target, control_verdict) = match (&listened, &control) {
                (Ok(address), Ok(Connected::Received(text))) if *text == secret => (
                    channel.display(address),
                    held(format!("{} reached its own listener", owner.side)),
                ),
                (Ok(address), Ok(other)) => (
                    channel.display(address),
                    Verdict::Inconclusive {
                        why: format!("the owner could not reach its own listener: {other:?}"),
                    },
                ),
                (Ok(address), Err(why)) => (
                    channel.display(address),
                    Verdict::Inconclusive { why: why.clone() },
                ),
                (Err(why), _) => (
                    channel.display(&asked),
                    Verdict::Inconclusive { why: why.clone() },
                ),
            };
            let control_passed = control_verdict.is_pass();
            self.record(
                At(CHANNELS_STEP, owner.side, Action::Listen),
                &target,
                &listen,
                None,
                control_verdict,
            );
            let address = match (&listened, control_passed) {
                (Ok(address), true) => address.clone(),
                _ => {
                    let why =
                        "the positive control failed: the owner's listener is not known to work".to_owned();
                    self.record(
                        At(CHANNELS_STEP, attacker.side, action),
                        &target,
                        "(not run)",
                        None,
                        Verdict::Inconclusive { why },
                    );
                    continue;
                }
            };
            let command = format!(
                "{} kind={} address={address} from {}",
                crate::shell::CONNECT_METHOD,
                channel.kind(),
                attacker.side
            );
            let (verdict, errno) = match attacker.connect(channel, &address, CONNECT_TIME).await {
                Ok(Connected::Received(text)) if text.contains(&secret) => (
                    Verdict::Leaked {
                        evidence: format!("received {}'s secret from {target}", owner.side),
                    },
                    None,
                ),
                Ok(Connected::Received(text)) => (
                    Verdict::Inconclusive {
                        why: format!(
                            "connected to {target}, but something else answered: {:?}",
                            first_line(&text)
                        ),
                    },
                    None,
                ),
                Ok(Connected::Refused { error, errno }) => connect_refusal(&error, errno),
                Err(why) => (Verdict::Inconclusive { why }, None),
            };
            self.probes.push(Probe {
                step: CHANNELS_STEP,
                from: attacker.side,
                target,
                action,
                command,
                exit_code: None,
                errno,
                verdict,
            });
        }
    }

    /// Removes, inside the session that made them, every file and repository the suite created
    /// there (best effort; problems are noted in the report).
    async fn cleanup(&mut self, owner: &Worker, planted: &Planted, shared_files: &[(Side, String)]) {
        let mut files: Vec<String> = planted.attempted_files.iter().map(|p| quote(p)).collect();
        files.extend(
            shared_files
                .iter()
                .filter(|(side, _)| *side == owner.side)
                .map(|(_, path)| quote(path)),
        );
        let mut commands = Vec::new();
        if !files.is_empty() {
            commands.push(format!("rm -f -- {}", files.join(" ")));
        }
        if let Some(repo) = &planted.attempted_repo {
            commands.push(format!("rm -rf -- {}", quote(repo)));
        }
        if commands.is_empty() {
            return;
        }
        let command = commands.join("; ");
        match owner.sh(&command, self.options.command_timeout).await {
            Ok(out) if out.success() => {}
            Ok(out) => {
                self.cleanup_problems
                    .push(format!("session {}: `{command}`: {}", owner.side, out.describe()))
            }
            Err(why) => self
                .cleanup_problems
                .push(format!("session {}: {why}", owner.side)),
        }
    }
}

/// The verdict on a refused connection: `ECONNREFUSED` (nothing listens there: another network
/// namespace), `EPERM` (Landlock's scope), `EACCES` or `ENETUNREACH` are denials; anything
/// else is inconclusive.
fn connect_refusal(error: &str, errno: Option<i32>) -> (Verdict, Option<Errno>) {
    const EPERM: i32 = 1;
    const EACCES: i32 = 13;
    const ENETUNREACH: i32 = 101;
    const ECONNREFUSED: i32 = 111;
    let named = match errno {
        Some(EPERM) => Some(Errno::EPERM),
        Some(EACCES) => Some(Errno::EACCES),
        Some(ENETUNREACH) => Some(Errno::Other("ENETUNREACH".to_owned())),
        Some(ECONNREFUSED) => Some(Errno::Other("ECONNREFUSED".to_owned())),
        _ => Errno::from_stderr(error),
    };
    let verdict = match errno {
        Some(EPERM | EACCES | ENETUNREACH | ECONNREFUSED) => Verdict::Denied,
        _ => Verdict::Inconclusive {
            why: format!("not a refusal: {error}"),
        },
    };
    (verdict, named)
}

/// Each in-worker path, then its host path where that differs.
fn targets<'a>(items: impl Iterator<Item = (&'a str, Option<&'a std::path::PathBuf>)>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (in_worker, host) in items {
        let host = host.map(|h| h.to_string_lossy().into_owned());
        for path in std::iter::once(in_worker.to_owned()).chain(host) {
            if !out.contains(&path) {
                out.push(path);
            }
        }
    }
    out
}

/// [`host::locate`] off the async threads.
async fn locate(
    storage_refs: &[String],
    in_worker: &str,
    name: &str,
    expect: Expect,
) -> Option<std::path::PathBuf> {
    let refs = storage_refs.to_vec();
    let in_worker = in_worker.to_owned();
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || host::locate(&refs, &in_worker, &name, &expect))
        .await
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_and_commit_parsing() {
        let sha = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(parse_sha256(&format!("{sha}  /w/f\n")), Some(sha.to_owned()));
        assert_eq!(parse_sha256("sha256sum: /w/f: No such file or directory"), None);
        let commit = "0123456789abcdef0123456789abcdef01234567";
        assert_eq!(
            parse_commit(&format!("noise\n{commit}\n\n")),
            Some(commit.to_owned())
        );
        assert_eq!(parse_commit("main"), None);
    }

    #[test]
    fn refused_connections_are_denials_and_other_errors_are_not() {
        for (errno, named) in [
            (111, Errno::Other("ECONNREFUSED".to_owned())),
            (1, Errno::EPERM),
            (13, Errno::EACCES),
            (101, Errno::Other("ENETUNREACH".to_owned())),
        ] {
            assert_eq!(
                connect_refusal("refused", Some(errno)),
                (Verdict::Denied, Some(named))
            );
        }
        // A timeout says nothing about isolation: someone may listen there.
        let (verdict, _) = connect_refusal("Connection timed out (os error 110)", Some(110));
        assert!(matches!(verdict, Verdict::Inconclusive { .. }), "{verdict:?}");
        let (verdict, _) = connect_refusal("no errno", None);
        assert!(matches!(verdict, Verdict::Inconclusive { .. }), "{verdict:?}");
    }

    #[test]
    fn random_tokens_differ() {
        let a = random_hex(8);
        let b = random_hex(8);
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn targets_deduplicate_host_paths() {
        let same = std::path::PathBuf::from("/w/a");
        let other = std::path::PathBuf::from("/srv/s1/w/b");
        let list = targets([("/w/a", Some(&same)), ("/w/b", Some(&other)), ("/w/c", None)].into_iter());
        assert_eq!(list, vec!["/w/a", "/w/b", "/srv/s1/w/b", "/w/c"]);
    }
}
