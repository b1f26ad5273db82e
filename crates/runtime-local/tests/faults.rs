//! Fault injection: the broker side killed with SIGKILL during `create`, during `attach` and
//! during `close`, at random points, then recovered by `reconcile` in a new runtime on the same
//! root.
//!
//! The broker is `oab-fault-harness` (a binary of this crate, feature `testing`): it runs the
//! local runtime on a root and loops over a pool of four sessions (create; attach, `initialize`
//! and an exec that leaves a background grandchild; sometimes suspend and resume or re-attach;
//! usually close with `Reset`, which deletes storage, or `Ended`, which retains it), reporting
//! each step on stdout. Before each operation of the phase under test it waits for a byte from
//! this test; the test sends it, sleeps a random time up to about the operation's measured
//! duration, and kills the harness. Only kills that land while that operation is running count
//! towards the [`KILLS`] per phase; the others are checked just the same.
//!
//! After every kill the test checks, with a fresh runtime on the same root:
//! 1. before any repair, no session has workers of two generations alive;
//! 2. `reconcile` reports no error, and afterwards no process of this root's workers is left
//!    (the environment marker `OPENAB_SESSION_WORKER=<scope>:...` is found in no process), and
//!    a second pass has nothing to do;
//! 3. storage matches what the operations the harness finished (or started: an interrupted one
//!    either took effect or did not) say: every open session's directory, with the token file
//!    the harness wrote in it; every `Ended` session's storage retained with its token; no
//!    `Reset` session's token anywhere; nothing in `.trash`; no uid claim without storage;
//! 4. records are consistent: `list` names exactly the open sessions, `status` of each parses
//!    and says `Created` or `Suspended` with no worker, closed sessions with retained storage
//!    read as `Closed`/retained, every retained record parses and names its session, and an
//!    interrupted `create` is completed by calling `create` again;
//! 5. the sessions are usable: one open session is attached (exactly one worker runs, of the new
//!    generation), initialized, and suspended again (its worker is gone).
//!
//! Iterations: [`KILLS`] in plain mode per phase, [`BUBBLEWRAP_KILLS`] per phase in bubblewrap
//! mode (workers mostly die with the broker by `--die-with-parent`, but not if the kill comes
//! before bubblewrap has armed it, so `reconcile` still has orphans to find), and
//! [`LIMITS_KILLS`] during attach with per-session cgroups (a pids limit), where additionally no
//! session cgroup may be left once no worker runs. Each test has an installation of its own,
//! so session ids and cgroup names differ between tests running at once. The seed is printed;
//! set `OAB_FAULT_SEED` to replay a sequence of choices (the kill timing itself is not
//! reproducible). `MAX_ATTEMPTS_PER_KILL` bounds the attempts (kills that land outside the
//! operation), so a machine where the timing never hits fails loudly instead of looping.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use runtime_local::LocalRuntime;
use session_runtime::config::{ResourceLimits, SandboxMode};
use session_runtime::testing::{acp_test_agent_binary, AcpClient};
use session_runtime::{
    AgentCommand, CloseReason, CreateOptions, Error, Retention, RetentionPolicy, SessionId, SessionIdentity,
    SessionRuntime, SessionState, StorageState, SuspendReason,
};

/// Kills that land inside the operation under test, per phase, in plain mode (the 50).
const KILLS: usize = 50;
/// The same in bubblewrap mode.
const BUBBLEWRAP_KILLS: usize = 10;
/// The same with per-session cgroup limits.
const LIMITS_KILLS: usize = 10;
/// At most this many attempts per counted kill before the test gives up.
const MAX_ATTEMPTS_PER_KILL: usize = 4;
/// The harness's session pool (see `src/bin/oab-fault-harness.rs`).
const THREADS: u64 = 4;
/// The marker every worker carries in its environment.
const MARKER: &str = "OPENAB_SESSION_WORKER=";
/// Bounds on waiting (never asserted as durations; only a hang fails).
const LINE_TIMEOUT: Duration = Duration::from_secs(60);
const GONE_TIMEOUT: Duration = Duration::from_secs(20);

const HARNESS: &str = env!("CARGO_BIN_EXE_oab-fault-harness");

fn seed(phase: &str, mode: SandboxMode) -> u64 {
    let base = std::env::var("OAB_FAULT_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0x0ab_fa17);
    // A different sequence per test, reproducible from the one seed.
    let salt = phase
        .bytes()
        .chain(mode.to_string().bytes())
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    base ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn agent_path() -> String {
    acp_test_agent_binary()
        .expect("acp-test-agent")
        .display()
        .to_string()
}

fn retention() -> RetentionPolicy {
    let mut retention = RetentionPolicy::default();
    retention.reset = Retention::Delete;
    retention.ended = Retention::Retain;
    retention
}

/// What one fault test runs: the harness's root, sandbox, installation and limits.
#[derive(Debug, Clone)]
struct Setup {
    root: PathBuf,
    mode: SandboxMode,
    /// Each test its own, so that session ids (and cgroup names) differ between tests.
    installation: String,
    pids_limit: Option<u32>,
}

impl Setup {
    fn identity(&self, thread: u64) -> SessionIdentity {
        SessionIdentity::new(
            self.installation.as_str(),
            "agent",
            "faults",
            format!("t{thread}"),
        )
        .expect("valid identity")
    }

    /// A runtime configured as the harness configures its own.
    fn runtime(&self) -> LocalRuntime {
        let mut builder = LocalRuntime::builder(AgentCommand::new(agent_path()).args(["--ignore-stdin-eof"]))
            .root(&self.root)
            .installation(self.installation.as_str())
            .sandbox(self.mode)
            .retention(retention())
            .idle_ttl(None)
            .terminate_grace(Duration::from_millis(500));
        if let Some(pids) = self.pids_limit {
            let mut limits = ResourceLimits::default();
            limits.pids = Some(pids);
            builder = builder.limits(limits);
        }
        builder.build().expect("runtime")
    }

    /// The scope the runtime puts in its workers' marker: `<installation>@<root dev>.<root ino>`.
    fn scope(&self) -> String {
        let meta = std::fs::metadata(&self.root).expect("root");
        format!("{}@{}.{}", self.installation, meta.dev(), meta.ino())
    }
}

/// Cgroups named after a session of the pool, anywhere under `/sys/fs/cgroup`
/// (`openab-<id>-<root tag>`).
fn session_cgroups(setup: &Setup) -> Vec<PathBuf> {
    let prefixes: Vec<String> = (0..THREADS)
        .map(|t| format!("openab-{}-", setup.identity(t).id()))
        .collect();
    let mut found = Vec::new();
    let mut queue = vec![(PathBuf::from("/sys/fs/cgroup"), 0)];
    while let Some((dir, depth)) = queue.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            if prefixes.iter().any(|prefix| name.starts_with(prefix)) {
                found.push(entry.path());
            } else if depth < 4 {
                queue.push((entry.path(), depth + 1));
            }
        }
    }
    found
}

/// Live processes carrying this root's worker marker: (pid, session id, generation).
fn workers(scope: &str) -> Vec<(u32, String, u64)> {
    let prefix = format!("{MARKER}{scope}:");
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // Zombies have an empty environment; exited processes have none.
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let Some(value) = environ
            .split(|b| *b == 0)
            .find_map(|e| e.strip_prefix(prefix.as_bytes()))
        else {
            continue;
        };
        let value = String::from_utf8_lossy(value);
        if let Some((id, generation)) = value.split_once(':') {
            if let Ok(generation) = generation.parse() {
                found.push((pid, id.to_owned(), generation));
            }
        }
    }
    found
}

/// Waits (bounded) until no worker process of `scope` (and of `id`, if given) is left; returns
/// what is left when the bound is reached.
fn wait_workers_gone(scope: &str, id: Option<&SessionId>) -> Vec<(u32, String, u64)> {
    let deadline = Instant::now() + GONE_TIMEOUT;
    loop {
        let left: Vec<_> = workers(scope)
            .into_iter()
            .filter(|(_, found, _)| id.is_none_or(|id| found == id.as_str()))
            .collect();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the test knows about one session of the pool, from the harness's reports.
#[derive(Debug, Default, Clone)]
struct Known {
    /// Created and not closed: its live storage must exist.
    open: bool,
    /// The token in its live workspace, if the harness wrote one.
    keep: Option<String>,
    /// A token the harness started to write and did not report written.
    pending_keep: Option<String>,
    /// Closed with `Ended` at least once: some retained storage of it exists.
    retained: bool,
    /// A `create` was started and not reported done.
    pending_create: bool,
    /// A `close` with this reason was started and not reported done.
    pending_close: Option<CloseReason>,
}

/// The model of the whole root.
#[derive(Debug, Default)]
struct Model {
    sessions: BTreeMap<u64, Known>,
    /// Tokens of storage retained by an `Ended` close: must exist, under `.retained`.
    retained: BTreeSet<String>,
    /// Tokens of storage deleted by a `Reset` close: must exist nowhere.
    deleted: BTreeSet<String>,
}

impl Model {
    fn session(&mut self, thread: u64) -> &mut Known {
        self.sessions.entry(thread).or_default()
    }

    fn finish_close(&mut self, thread: u64, reason: CloseReason) {
        let known = self.session(thread);
        let keep = known.keep.take();
        known.open = false;
        known.pending_close = None;
        if reason == CloseReason::Ended {
            known.retained = true;
        }
        if let Some(token) = keep {
            if reason == CloseReason::Ended {
                self.retained.insert(token);
            } else {
                self.deleted.insert(token);
            }
        }
    }

    /// Applies one line of the harness's report.
    fn apply(&mut self, line: &str) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let thread = |w: &str| w.strip_prefix('t').and_then(|t| t.parse::<u64>().ok());
        match words.as_slice() {
            ["create", "start", t] => self.session(thread(t).expect("thread")).pending_create = true,
            ["create", "done", t, _, fresh] => {
                let known = self.session(thread(t).expect("thread"));
                known.pending_create = false;
                if *fresh == "fresh" {
                    known.keep = None;
                }
                known.open = true;
            }
            ["keep", t, token] => {
                self.session(thread(t).expect("thread")).pending_keep = Some((*token).to_owned())
            }
            ["kept", t] => {
                let known = self.session(thread(t).expect("thread"));
                known.keep = known.pending_keep.take();
            }
            ["close", "start", t, reason] => {
                let reason = match *reason {
                    "reset" => CloseReason::Reset,
                    "ended" => CloseReason::Ended,
                    other => panic!("unexpected close reason {other}"),
                };
                self.session(thread(t).expect("thread")).pending_close = Some(reason);
            }
            ["close", "done", t, ..] => {
                let thread = thread(t).expect("thread");
                let reason = self.session(thread).pending_close.expect("a close was started");
                self.finish_close(thread, reason);
            }
            _ => {}
        }
    }
}

/// Measured durations of the operation under test, for choosing kill delays. For `create`,
/// only creates that provision a new session count (the others return at once, and are not
/// where the test kills).
#[derive(Debug, Default)]
struct Durations(Vec<u64>);

impl Durations {
    fn typical_micros(&self) -> u64 {
        if self.0.is_empty() {
            return 20_000;
        }
        let mut sorted = self.0.clone();
        sorted.sort_unstable();
        sorted[sorted.len() / 2]
    }
}

/// Counters for the closing report.
#[derive(Debug, Default)]
struct Stats {
    attempts: usize,
    inside: usize,
    orphans_before_reconcile: usize,
    killed_by_reconcile: usize,
    finished_closes: usize,
    completed_creates: usize,
}

struct Harness {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
}

impl Harness {
    fn start(setup: &Setup, phase: &str, seed: u64) -> Self {
        let mode = match setup.mode {
            SandboxMode::None => "none",
            SandboxMode::Bubblewrap => "bubblewrap",
            other => panic!("the harness does not run {other}"),
        };
        let mut command = Command::new(HARNESS);
        command.env("OAB_FAULT_INSTALLATION", &setup.installation);
        if let Some(pids) = setup.pids_limit {
            command.env("OAB_FAULT_PIDS_LIMIT", pids.to_string());
        }
        let mut child = command
            .arg(&setup.root)
            .args([
                mode,
                phase,
                &seed.to_string(),
                &agent_path(),
                "--ignore-stdin-eof",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the harness");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            stdin: child.stdin.take(),
            child,
            lines,
            log: Vec::new(),
        }
    }

    fn context(&self) -> String {
        let tail = self.log.len().saturating_sub(25);
        self.log[tail..].join("\n")
    }

    /// The next line, failing the test on a hang, an early exit or a reported failure.
    fn next_line(&mut self) -> String {
        let line = match self.lines.recv_timeout(LINE_TIMEOUT) {
            Ok(line) => line,
            Err(error) => panic!(
                "the harness stopped reporting ({error}; exit {:?}):\n{}",
                self.child.try_wait(),
                self.context()
            ),
        };
        self.log.push(line.clone());
        assert!(
            !line.starts_with("failed"),
            "the harness failed: {line}\n{}",
            self.context()
        );
        line
    }

    fn go(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin");
        stdin
            .write_all(b"g")
            .and_then(|()| stdin.flush())
            .expect("go-ahead");
    }

    /// SIGKILL, then every line it wrote before dying.
    fn kill(mut self) -> Vec<String> {
        self.child.kill().expect("SIGKILL the harness");
        let _ = self.child.wait();
        drop(self.stdin.take());
        // The reader ends at end of file: the harness's stdout is a pipe only it held.
        self.log.extend(self.lines.iter());
        self.log
    }
}

/// One kill: starts a harness, lets it run to the `k`-th start of `phase` (for `create`: of a
/// create that provisions a new session), kills it after a random delay. Applies the harness's
/// report to `model` and returns it, with whether the kill landed inside `phase`.
fn one_kill(
    setup: &Setup,
    phase: &str,
    rng: &mut StdRng,
    durations: &mut Durations,
    model: &mut Model,
) -> (Vec<String>, bool) {
    let mut harness = Harness::start(setup, phase, rng.random::<u64>());
    let occurrence = 1 + rng.random_range(0..3);
    let start = format!("{phase} start ");
    let done = format!("{phase} done ");
    let mut seen = 0;
    loop {
        let line = harness.next_line();
        model.apply(&line);
        if let Some(rest) = line.strip_prefix(&done) {
            let words: Vec<&str> = rest.split_whitespace().collect();
            let counts = phase != "create" || words.get(2) == Some(&"fresh");
            if let (true, Some(micros)) = (counts, words.get(1).and_then(|m| m.parse().ok())) {
                durations.0.push(micros);
            }
        }
        if let Some(thread) = line.strip_prefix(&start) {
            let thread: u64 = thread
                .trim_start_matches('t')
                .split_whitespace()
                .next()
                .and_then(|t| t.parse().ok())
                .expect("thread");
            if phase != "create" || !model.session(thread).open {
                seen += 1;
            }
            if seen == occurrence {
                // Up to 1.2 times the typical duration: most kills land inside the operation.
                let delay = rng.random_range(0..durations.typical_micros() * 6 / 5 + 1);
                harness.go();
                std::thread::sleep(Duration::from_micros(delay));
                break;
            }
            harness.go();
        }
    }
    let read = harness.log.len();
    let log = harness.kill();
    for line in &log[read..] {
        model.apply(line);
    }
    let last = log.last().cloned().unwrap_or_default();
    (log, last.starts_with(&start))
}

/// Every `fault-keep` token under `dir`, with where it was found.
fn tokens_under(dir: &Path, found: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            tokens_under(&path, found);
        } else if entry.file_name() == "fault-keep" {
            found.push((std::fs::read_to_string(&path).expect("token"), path));
        }
    }
}

/// The checks after one kill (see the module documentation).
async fn recover_and_check(
    setup: &Setup,
    model: &mut Model,
    stats: &mut Stats,
    rng: &mut StdRng,
    context: &str,
) {
    let root = setup.root.as_path();
    let scope = setup.scope();
    // 1. Never two generations of one session alive, even right after the crash.
    let before = workers(&scope);
    let mut generations: BTreeMap<&str, BTreeSet<u64>> = BTreeMap::new();
    for (_, id, generation) in &before {
        generations.entry(id).or_default().insert(*generation);
    }
    for (id, found) in &generations {
        assert!(
            found.len() <= 1,
            "session {id} has workers of generations {found:?} alive at once:\n{context}"
        );
    }
    stats.orphans_before_reconcile += generations.len();

    // 2. Reconcile, twice.
    let runtime = setup.runtime();
    let report = runtime.reconcile().await.expect("reconcile");
    assert!(report.errors.is_empty(), "{report:?}\n{context}");
    stats.killed_by_reconcile += report.killed_workers.len();
    stats.finished_closes += report.finished_closes.len();
    let left = wait_workers_gone(&scope, None);
    assert!(
        left.is_empty(),
        "orphaned workers survived reconcile: {left:?}\n{report:?}\n{context}"
    );
    let again = runtime.reconcile().await.expect("second reconcile");
    assert!(
        again.is_clean(),
        "a second pass must find nothing: {again:?}\n{context}"
    );

    // Interrupted operations either took effect or did not; find out which.
    for thread in 0..THREADS {
        let id = setup.identity(thread).id();
        let known = model.session(thread).clone();
        if let Some(token) = known.pending_keep {
            let written = std::fs::read_to_string(root.join(id.as_str()).join("workspace/fault-keep"));
            let known = model.session(thread);
            known.pending_keep = None;
            if written.is_ok_and(|found| found == token) {
                known.keep = Some(token);
            }
        }
        if let Some(reason) = known.pending_close {
            match runtime.status(&id).await {
                Ok(status) if status.state != SessionState::Closed && root.join(id.as_str()).exists() => {
                    // The close was never recorded: the session stays open.
                    model.session(thread).pending_close = None;
                }
                _ => model.finish_close(thread, reason),
            }
        }
        if known.pending_create {
            let handle = runtime
                .create(&setup.identity(thread), &CreateOptions::new())
                .await
                .unwrap_or_else(|e| panic!("create must complete an interrupted create: {e}\n{context}"));
            assert!(
                matches!(handle.state, SessionState::Created | SessionState::Suspended),
                "{handle:?}"
            );
            let known = model.session(thread);
            if handle.created || !known.open {
                known.keep = None;
            }
            known.open = true;
            known.pending_create = false;
            stats.completed_creates += 1;
        }
    }

    // 3 and 4. Storage and records.
    // `list` names every session with a record: the open ones, and closed ones whose storage
    // (with its record) is retained.
    let mut expected_listed: BTreeSet<String> = BTreeSet::new();
    for thread in 0..THREADS {
        let id = setup.identity(thread).id();
        let known = model.session(thread).clone();
        let live = root.join(id.as_str());
        if known.open {
            expected_listed.insert(id.to_string());
            let status = runtime
                .status(&id)
                .await
                .unwrap_or_else(|e| panic!("status of open session t{thread}: {e}\n{context}"));
            assert!(
                matches!(status.state, SessionState::Created | SessionState::Suspended),
                "t{thread} after reconcile: {status:?}\n{context}"
            );
            assert!(status.worker.is_none(), "{status:?}");
            assert_eq!(status.storage, StorageState::Present);
            for dir in ["workspace", "home", "state", "tmp"] {
                assert!(live.join(dir).is_dir(), "t{thread} lost its {dir}:\n{context}");
            }
            if let Some(token) = &known.keep {
                let found = std::fs::read_to_string(live.join("workspace/fault-keep"));
                assert_eq!(
                    found.as_deref().ok(),
                    Some(token.as_str()),
                    "t{thread} lost its workspace file:\n{context}"
                );
            }
        } else {
            assert!(
                !live.exists(),
                "t{thread} was closed, yet its live storage remains:\n{context}"
            );
            match runtime.status(&id).await {
                Ok(status) => {
                    assert!(known.retained, "t{thread}: {status:?}\n{context}");
                    expected_listed.insert(id.to_string());
                    assert_eq!(status.state, SessionState::Closed);
                    assert!(
                        matches!(status.storage, StorageState::Retained { .. }),
                        "{status:?}"
                    );
                    assert_eq!(status.close_reason, Some(CloseReason::Ended));
                }
                Err(Error::NotFound { .. }) => {
                    assert!(
                        !known.retained,
                        "t{thread}'s retained storage is gone:\n{context}"
                    )
                }
                Err(error) => panic!("status of closed t{thread}: {error}\n{context}"),
            }
        }
    }
    let listed: BTreeSet<String> = runtime
        .list()
        .await
        .expect("list")
        .into_iter()
        .map(|s| s.id.to_string())
        .collect();
    assert_eq!(
        listed, expected_listed,
        "list must name exactly the open and the retained sessions:\n{context}"
    );

    let mut tokens = Vec::new();
    tokens_under(root, &mut tokens);
    let retained_dir = root.join(".retained");
    for (token, path) in &tokens {
        assert!(
            !model.deleted.contains(token),
            "storage deleted by a reset close survives at {}:\n{context}",
            path.display()
        );
        if model.retained.contains(token) {
            assert!(path.starts_with(&retained_dir), "{}", path.display());
        }
    }
    let found: BTreeSet<&String> = tokens.iter().map(|(t, _)| t).collect();
    assert_eq!(found.len(), tokens.len(), "a token exists twice: {tokens:?}");
    for token in &model.retained {
        assert!(
            found.contains(token),
            "retained storage with token {token} is lost:\n{context}"
        );
    }
    let live_tokens: BTreeSet<&String> = model.sessions.values().filter_map(|k| k.keep.as_ref()).collect();
    let expected: BTreeSet<&String> = model.retained.iter().chain(live_tokens).collect();
    assert_eq!(
        found, expected,
        "storage that no session accounts for:\n{context}"
    );
    if let Ok(entries) = std::fs::read_dir(root.join(".trash")) {
        let left: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "trash left behind: {left:?}");
    }
    // Every retained record parses and names its own session.
    if let Ok(entries) = std::fs::read_dir(&retained_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let (id, _) = name.split_once('.').expect("<id>.<incarnation>");
            let text = std::fs::read_to_string(entry.path().join("record.json")).expect("retained record");
            let record: serde_json::Value = serde_json::from_str(&text).expect("a retained record parses");
            assert_eq!(record["id"], id, "{name}");
        }
    }
    // Every uid claim belongs to storage that still exists.
    if let Ok(entries) = std::fs::read_dir(root.join(".uids")) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.parse::<u32>().is_err() {
                continue;
            }
            let holder = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let has_storage = root.join(&holder).exists()
                || std::fs::read_dir(&retained_dir).is_ok_and(|mut e| {
                    e.any(|e| {
                        e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with(&format!("{holder}.")))
                    })
                });
            assert!(
                has_storage,
                "uid {name} is still claimed by {holder}, which has no storage:\n{context}"
            );
        }
    }

    // 5. One open session is usable: one worker, of a new generation, then gone again.
    let open: Vec<u64> = (0..THREADS).filter(|t| model.session(*t).open).collect();
    if !open.is_empty() {
        let thread = open[rng.random_range(0..open.len())];
        let id = setup.identity(thread).id();
        let before = runtime.status(&id).await.expect("status").generation;
        let attachment = runtime
            .attach(&id)
            .await
            .unwrap_or_else(|e| panic!("attach t{thread} after the crash: {e}\n{context}"));
        assert!(attachment.generation() > before);
        let generation = attachment.generation();
        let client = AcpClient::new(attachment);
        client.initialize().await.expect("initialize after the crash");
        let running: BTreeSet<u64> = workers(&scope)
            .into_iter()
            .filter(|(_, found, _)| found == id.as_str())
            .map(|(_, _, g)| g)
            .collect();
        assert_eq!(
            running,
            BTreeSet::from([generation]),
            "one worker, of the new generation"
        );
        runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
        drop(client);
        let left = wait_workers_gone(&scope, Some(&id));
        assert!(left.is_empty(), "suspend left {left:?}");
    }
    // No session runs now, so no session's cgroup may be left (every worker has cgroups where
    // the broker can make them, with limits or without).
    let left = session_cgroups(setup);
    assert!(
        left.is_empty(),
        "cgroups of stopped workers left behind: {left:?}\n{context}"
    );
}

/// Runs one phase with `setup` until `kills` kills landed inside the phase.
fn phase(phase: &str, mode: SandboxMode, kills: usize, pids_limit: Option<u32>) {
    let root_dir = tempfile::tempdir().expect("root");
    let setup = Setup {
        root: root_dir.path().join("sessions"),
        mode,
        installation: format!(
            "faults-{phase}-{mode}{}",
            if pids_limit.is_some() { "-limits" } else { "" }
        ),
        pids_limit,
    };
    let root = setup.root.clone();
    let seed = seed(&setup.installation, mode);
    println!(
        "fault test {}: seed {seed} (OAB_FAULT_SEED to replay)",
        setup.installation
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio");
    // The marker scan must see a worker of this root, or every "no orphan" check is vacuous.
    let usable = tokio.block_on(async {
        let runtime = setup.runtime();
        let probe =
            SessionIdentity::new(setup.installation.as_str(), "agent", "probe", "scan").expect("identity");
        let id = runtime
            .create(&probe, &CreateOptions::new())
            .await
            .expect("create")
            .id;
        let attachment = match runtime.attach(&id).await {
            Ok(attachment) => attachment,
            Err(Error::InvalidConfig { key, reason }) if pids_limit.is_some() => {
                assert_eq!(key, "session_runtime.local.limits", "{reason}");
                eprintln!("skipping: cgroup limits do not work here: {reason}");
                return false;
            }
            Err(error) => panic!("attach: {error}"),
        };
        // A process that is still exec'ing shows an empty environment for a moment.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let seen = loop {
            let seen = workers(&setup.scope());
            let found = seen
                .iter()
                .any(|(_, found, g)| found == id.as_str() && *g == attachment.generation());
            if found || std::time::Instant::now() >= deadline {
                break (found, seen);
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(seen.0, "the marker scan does not see the worker: {:?}", seen.1);
        runtime.close(&id, CloseReason::Reset).await.expect("close");
        assert!(wait_workers_gone(&setup.scope(), None).is_empty());
        true
    });
    if !usable {
        return;
    }
    // Cgroup names are the session ids of this test's own installation: an empty one left by an
    // earlier, failed run of this test is stale (a live one would fail the checks below, as it
    // should).
    for group in session_cgroups(&setup) {
        let _ = std::fs::remove_dir(group);
    }

    let mut model = Model::default();
    let mut stats = Stats::default();
    let mut durations = Durations::default();
    let started = Instant::now();
    while stats.inside < kills {
        assert!(
            stats.attempts < kills * MAX_ATTEMPTS_PER_KILL,
            "only {} of {} kills landed inside {phase} in {} attempts (typical {phase}: {} µs)",
            stats.inside,
            kills,
            stats.attempts,
            durations.typical_micros()
        );
        stats.attempts += 1;
        let (log, inside) = one_kill(&setup, phase, &mut rng, &mut durations, &mut model);
        if inside {
            stats.inside += 1;
        }
        let tail = log.len().saturating_sub(25);
        let context = format!(
            "seed {seed}, attempt {}, killed {} {phase}; last lines:\n{}",
            stats.attempts,
            if inside { "inside" } else { "outside" },
            log[tail..].join("\n")
        );
        tokio.block_on(recover_and_check(
            &setup, &mut model, &mut stats, &mut rng, &context,
        ));
    }

    // Finally everything is closed, and the root holds only bookkeeping and retained storage.
    tokio.block_on(async {
        let runtime = setup.runtime();
        for thread in 0..THREADS {
            runtime
                .close(&setup.identity(thread).id(), CloseReason::Reset)
                .await
                .expect("close");
        }
        let report = runtime.reconcile().await.expect("reconcile");
        assert!(report.errors.is_empty(), "{report:?}");
    });
    let mut entries: Vec<String> = std::fs::read_dir(&root)
        .expect("root")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    for entry in &entries {
        assert!(
            [".counters", ".reconcile.lock", ".retained", ".trash", ".uids"].contains(&entry.as_str()),
            "unexpected entry {entry} in the root: {entries:?}"
        );
    }
    assert!(wait_workers_gone(&setup.scope(), None).is_empty());
    assert_eq!(
        session_cgroups(&setup),
        Vec::<PathBuf>::new(),
        "cgroups left behind"
    );
    println!(
        "fault test {}: {} kills inside {phase} in {} attempts, {:.1} s; typical {phase} {} µs; \
         sessions with orphaned workers before reconcile: {}, workers killed by reconcile: {}, \
         closes it finished: {}, interrupted creates completed: {}, retained storages: {}, deleted: {}",
        setup.installation,
        stats.inside,
        stats.attempts,
        started.elapsed().as_secs_f64(),
        durations.typical_micros(),
        stats.orphans_before_reconcile,
        stats.killed_by_reconcile,
        stats.finished_closes,
        stats.completed_creates,
        model.retained.len(),
        model.deleted.len(),
    );
}

/// Whether bubblewrap works here; if not, the runtime must refuse it as a configuration error.
fn bubblewrap_works() -> bool {
    let root = tempfile::tempdir().expect("root");
    match LocalRuntime::builder(AgentCommand::new(agent_path()))
        .root(root.path())
        .sandbox(SandboxMode::Bubblewrap)
        .build()
    {
        Ok(_) => true,
        Err(Error::InvalidConfig { key, .. }) => {
            assert_eq!(key, "session_runtime.local.sandbox");
            eprintln!("skipping: bubblewrap does not work here");
            false
        }
        Err(error) => panic!("{error}"),
    }
}

#[test]
fn broker_killed_during_create() {
    phase("create", SandboxMode::None, KILLS, None);
}

#[test]
fn broker_killed_during_attach() {
    phase("attach", SandboxMode::None, KILLS, None);
}

#[test]
fn broker_killed_during_close() {
    phase("close", SandboxMode::None, KILLS, None);
}

#[test]
fn bubblewrap_broker_killed_during_create() {
    if bubblewrap_works() {
        phase("create", SandboxMode::Bubblewrap, BUBBLEWRAP_KILLS, None);
    }
}

#[test]
fn bubblewrap_broker_killed_during_attach() {
    if bubblewrap_works() {
        phase("attach", SandboxMode::Bubblewrap, BUBBLEWRAP_KILLS, None);
    }
}

#[test]
fn bubblewrap_broker_killed_during_close() {
    if bubblewrap_works() {
        phase("close", SandboxMode::Bubblewrap, BUBBLEWRAP_KILLS, None);
    }
}

/// With per-session cgroups (a pids limit): the cgroup a killed broker leaves is removed once
/// its worker is gone (checked after every kill, and at the end).
#[test]
fn broker_with_limits_killed_during_attach() {
    phase("attach", SandboxMode::None, LIMITS_KILLS, Some(512));
}
