//! The isolation acceptance suite: the RFC's seven-step test that one session cannot reach
//! another session's files, plus an eighth step for the channels a shared network namespace
//! opens between sessions (abstract UNIX sockets, loopback ports), as library code any
//! [`SessionRuntime`] can run.
//!
//! Nothing here trusts the runtime's word. Every attempt is a real shell command run inside a
//! session's own worker, through the ACP test agent's exec probe (`/bin/sh -c` in the agent's
//! environment, uid and namespaces), so the runtime under test must run the ACP test agent
//! (`acp-test-agent`) as its agent.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use isolation_suite::SuiteOptions;
//! use session_runtime::testing::FakeRuntime;
//!
//! let runtime = Arc::new(FakeRuntime::builder().installation("verify").build()?);
//! let report = isolation_suite::run(runtime, &SuiteOptions::new("verify")).await?;
//! println!("{report}");
//! // FakeRuntime isolates nothing, so the suite finds leaks.
//! assert!(!report.passed());
//! assert!(report.leaks().count() > 0);
//! # Ok(()) }
//! ```
//!
//! A backend runs it from its own tests, with the ACP test agent as the agent, e.g. a
//! `tests/isolation.rs`:
//!
//! ```ignore
//! #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//! async fn sandboxed_sessions_are_isolated() {
//!     let runtime: Arc<dyn SessionRuntime> = Arc::new(/* the backend, serving "verify" */);
//!     let options = SuiteOptions::new("verify").with_shared_input(SharedInput::new("/skills/SKILL.md"));
//!     let report = isolation_suite::run(runtime, &options).await.expect("report");
//!     assert!(report.passed(), "{report:#}");
//! }
//! ```
//!
//! and, for a mode that isolates nothing, asserts the opposite and names the leaks it expects
//! (`report.leaks()`, each [`Probe`] with its step, [`Action`], target and evidence).
//!
//! # The steps
//!
//! 1. Sessions A and B are created under [`SuiteOptions::installation`] with fresh, unique thread
//!    ids, attached, and their agents initialized; their workers must differ
//!    ([`Action::DistinctWorkers`]).
//! 2. A writes two sentinel files whose names carry a random token (`oab-sentinel-<token>-workspace`
//!    in the attachment's working directory, `oab-sentinel-<token>-home` in `$HOME` as A's shell
//!    sees it) and hashes them with `sha256sum` inside A. The suite then looks for each on its own
//!    host, at the in-worker path itself and by name below every absolute directory among
//!    `status(A).storage_refs`, and records the host path when it finds a file there with the
//!    same SHA-256 (see [`Sentinel::host_path`]).
//! 3. A makes a git repository `oab-sentinel-<token>-repo` in its workspace, commits a file and
//!    points the local-only branch `refs/heads/oab-sentinel-<token>` at the commit (never pushed:
//!    there is no remote). Without git in the worker this probe is inconclusive.
//! 4. From B: scan every writable mount of B's own mount table for the token; `stat` and `cat`
//!    every recorded path of A's (in-worker and host); list the refs of A's repository; then
//!    overwrite and delete A's files and delete A's ref.
//! 5. A re-hashes its sentinels (and the suite its host copies) and re-reads its ref: a changed
//!    or missing sentinel or ref is a leak, whatever B's commands printed.
//! 6. Steps 2 to 5 again with the roles reversed and a fresh token (all reported as step 6).
//! 7. With a [`SharedInput`] configured, both sessions read it and must see the same content
//!    (and [`SharedInput::expected_sha256`] if set); creating a file next to it and opening it
//!    for writing must fail with `EROFS` or `EACCES` (or `EPERM`) in both. Without one, step 7
//!    is reported as skipped, never as passed.
//! 8. Each session in turn (A, then B) listens, from inside its worker, on an abstract UNIX socket
//!    `@oab-sentinel-<token>-<side>` and on a free TCP port of `127.0.0.1`, each answering with a
//!    secret, and must reach both itself (the positive control, [`Action::Listen`]; a failed
//!    control makes the other session's probe inconclusive). The other session then connects to
//!    both ([`Action::ConnectAbstract`], [`Action::ConnectLoopback`]): reading the secret is a
//!    leak; `ECONNREFUSED` (nothing listens there: another network namespace), `EPERM`
//!    (Landlock's scope), `EACCES` or `ENETUNREACH` is a denial. This uses the ACP test agent's
//!    listen and connect probes (`_openab/listen`, `_openab/connect`) rather than a shell tool,
//!    which a worker may lack. [`SuiteOptions::without_channel_probes`] skips it, with a reason
//!    the report shows.
//!
//! The listeners of step 8 live in the agents' processes and end with them.
//!
//! At the end each session removes what the suite created in it, and both sessions are closed
//! with [`CloseReason::Ended`](session_runtime::CloseReason::Ended), also when the run failed.
//!
//! # The commands
//!
//! `'P'` is a path quoted for the shell, `T` the owner's token, `R` a repository path, `REF` the
//! ref, `C` its commit.
//!
//! | probe | runs in | command |
//! |---|---|---|
//! | HOME | owner | `printf '%s' "$HOME"` |
//! | [`CreateSentinel`](Action::CreateSentinel) | owner | `printf '%s\n' '<content>' > 'P' && sha256sum -- 'P'` |
//! | [`CreateRef`](Action::CreateRef) | owner | `git -c init.defaultBranch=main init -q 'R' && cd 'R' && printf ... > sentinel.txt && git add sentinel.txt && git -c user.name=.. -c user.email=.. -c commit.gpgsign=false commit -q -m .. && git update-ref REF HEAD && git rev-parse --verify REF` (after checking `command -v git`) |
//! | mount table | attacker | `cat /proc/self/mounts` |
//! | [`Scan`](Action::Scan) | attacker | `timeout S find 'M' -xdev -name '*T*' -exec printf '%s\n' {} \; 2>/dev/null` (without `timeout` where it is missing) |
//! | [`Stat`](Action::Stat) | attacker | `stat -- 'P'` |
//! | [`Read`](Action::Read) | attacker | `cat -- 'P'` |
//! | [`ListRef`](Action::ListRef) | attacker | `git -c safe.directory='*' -C 'R' for-each-ref --format='%(refname) %(objectname)'` |
//! | [`Overwrite`](Action::Overwrite) | attacker | `ls -d -- 'P' >/dev/null && printf 'overwritten by session B\n' > 'P'` |
//! | [`Delete`](Action::Delete) | attacker | `rm -- 'P'` |
//! | [`UpdateRef`](Action::UpdateRef) | attacker | `git -c safe.directory='*' -C 'R' update-ref -d REF C` |
//! | [`VerifyHash`](Action::VerifyHash) | owner | `sha256sum -- 'P'` (and SHA-256 of the host copy) |
//! | [`VerifyRef`](Action::VerifyRef) | owner | `git -C 'R' rev-parse --verify -q REF` |
//! | [`ReadShared`](Action::ReadShared) | both | `sha256sum -- 'F'` |
//! | [`WriteShared`](Action::WriteShared) | both | `printf 'written by session A\n' > 'DIR/oab-sentinel-T-shared-a'` |
//! | [`OverwriteShared`](Action::OverwriteShared) | both | `: >> 'F'` (opens for writing, writes nothing) |
//! | [`Listen`](Action::Listen) | owner | `_openab/listen` on `@oab-sentinel-T-<side>` and `127.0.0.1:0`, then `_openab/connect` to each |
//! | [`ConnectAbstract`](Action::ConnectAbstract) | attacker | `_openab/connect` to the owner's `@oab-sentinel-T-<side>` |
//! | [`ConnectLoopback`](Action::ConnectLoopback) | attacker | `_openab/connect` to the owner's `127.0.0.1:PORT` |
//! | clean-up | owner | `rm -f -- 'P'...; rm -rf -- 'R'` |
//!
//! Choices worth knowing:
//! - The scan matches names only, so it finds A's files, its repository directory and its ref
//!   files (`refs/heads/oab-sentinel-T`, and its reflog) wherever a mount exposes them. Found
//!   paths are printed by `-exec printf` as they are found, so hits made before a timeout are
//!   kept. `find`'s own errors (unreadable directories) are discarded; a scan that ends within
//!   its time without a hit is [`Denied`](Verdict::Denied), one that is cut short is
//!   inconclusive.
//! - Read-only mounts are not scanned (they are typically system directories and can be large);
//!   `stat`/`cat` of A's host paths catch a read-only exposure of A's storage, and
//!   [`SuiteOptions::extra_scan_paths`] scans more.
//! - `rm` runs without `-f`, which would hide `ENOENT`; stdin is `/dev/null`, so it never prompts.
//! - The overwrite checks with `ls -d` that the path exists for the attacker first: in two
//!   sandboxes with the same in-worker layout (`/workspace`), a bare redirection would create a
//!   new file in the attacker's own workspace, which proves nothing; `ls -d` reports the real
//!   `ENOENT` or `EACCES` instead.
//! - git runs with `safe.directory='*'` so that git's own ownership check cannot pass for an
//!   operating-system denial; `update-ref -d` names the old value, so it only succeeds by really
//!   deleting A's ref.
//! - Every command is bounded: the exec request carries a time limit
//!   ([`SuiteOptions::command_timeout`], [`SuiteOptions::scan_timeout`], at most 25 s since the
//!   ACP test client gives up after 30 s).
//!
//! # Verdicts and errno
//!
//! A probe's [`Errno`] is read from its standard error ([`Errno::from_stderr`]), which
//! understands the wording of coreutils, busybox, git, bash, dash and busybox ash; its exit code
//! is kept too. An attempt that succeeds is [`Leaked`](Verdict::Leaked). One that fails with
//! `ENOENT` or `EACCES` is [`Denied`](Verdict::Denied); `EPERM` counts as a denial too (seccomp
//! filters, LSMs and the sticky bit refuse with it), and so does `EROFS` for writes. Anything
//! else (another error, a missing program, a timeout, a failed exec request) is
//! [`Inconclusive`](Verdict::Inconclusive): the suite does not know, so it does not pass.
//! A `cat` whose output holds the sentinel's secret content is a leak whatever its exit code.
//!
//! [`IsolationReport::passed`] requires every probe to be [`Denied`](Verdict::Denied) or
//! [`Held`](Verdict::Held); a skipped step 7 or 8 is allowed and shown in the report.
//!
//! # HOME on runtimes that isolate nothing
//!
//! A runtime that isolates nothing (plain local mode, [`FakeRuntime`]) gives its sessions the
//! broker's own HOME. The suite still writes its HOME sentinel there (that is exactly the leak it
//! must show), and removes every file it created at the end, from inside the session that
//! created it. If the run is cancelled midway, files named `oab-sentinel-<token>-*` may remain.
//!
//! [`FakeRuntime`]: session_runtime::testing::FakeRuntime
//!
//! # Cancellation
//!
//! Dropping the future of [`run`] skips the clean-up and the closing of both sessions; the
//! runtime's `reconcile` (or a later `close`) reclaims them.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod errno;
mod error;
mod host;
mod mounts;
mod options;
mod report;
mod shell;
mod suite;

use std::sync::Arc;

use session_runtime::SessionRuntime;

pub use errno::Errno;
pub use error::SuiteError;
pub use options::{SharedInput, SuiteOptions};
pub use report::{
    Action, GitSentinel, IsolationReport, Probe, Sentinel, SentinelKind, SessionSummary, Side, Skipped,
    Verdict,
};

/// Runs the seven steps against `runtime` and reports every probe.
///
/// The runtime must serve [`SuiteOptions::installation`] and run the ACP test agent. A report is
/// returned whether isolation held or not: check [`IsolationReport::passed`] and print the report
/// (its `Display` is meant for operators).
///
/// # Errors
/// [`SuiteError`] only when no report can be made: invalid options, a failed or hung `create`,
/// `attach` or `status`, or an agent that does not answer `initialize`. Both sessions are closed
/// before it returns, also then.
///
/// # Cancellation
/// See [the crate documentation](crate#cancellation).
pub async fn run(
    runtime: Arc<dyn SessionRuntime>,
    options: &SuiteOptions,
) -> Result<IsolationReport, SuiteError> {
    suite::run(runtime, options).await
}
