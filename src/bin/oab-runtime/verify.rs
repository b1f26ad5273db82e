//! `oab-runtime verify`: the isolation acceptance suite against the configured runtime.

use std::path::PathBuf;
use std::process::ExitCode;

use isolation_suite::{SharedInput, SuiteOptions};
use openab_runtime::config::{NetworkMode, RuntimeKind, SandboxMode, StorageMode};
use openab_runtime::{Error, IsolationLevel};

use crate::commands::{bundled_test_agent, Outcome};
use crate::settings::Settings;

pub(crate) async fn run(
    mut settings: Settings,
    root: Option<PathBuf>,
    shared_input: Option<String>,
) -> Outcome {
    if settings.runtime.runtime == RuntimeKind::Kubernetes {
        return kubernetes(settings, shared_input).await;
    }
    if settings.runtime.runtime == RuntimeKind::Local && settings.runtime.local.storage == StorageMode::Shared
    {
        // Nothing to probe, and probing would plant sentinels in the broker's own HOME.
        eprintln!(
            "oab-runtime verify: isolation level none. storage = \"shared\" (upstream OpenAB's \
             behaviour, the default) isolates nothing: every session's agent runs in the same \
             working directory with the broker's HOME, user and network, so every session can \
             read, change and delete every other's files. No probe was run. To isolate sessions, \
             set storage = \"per-session\" and sandbox = \"auto\" in [session_runtime.local]."
        );
        return Ok(ExitCode::from(1));
    }
    // The suite drives the bundled test agent: its exec probe is the shell inside each session.
    let agent = bundled_test_agent()?;
    let scratch = tempfile::Builder::new().prefix("oab-runtime-verify-").tempdir()?;
    let local = &mut settings.runtime.local;
    if local.root.is_none() {
        local.root = Some(root.unwrap_or_else(|| scratch.path().join("sessions")));
    }
    let mut options = SuiteOptions::new(settings.runtime.installation.as_str());
    if let Some(root) = &local.root {
        options = options.with_extra_scan_path(root.display().to_string());
    }
    // A shared read-only input, as centrally managed skills would be, for step 7. Plain mode
    // cannot mount one, so it has none. It is shown at its own host path, since Landlock can
    // only grant access where a file is, not move it; and not under /tmp, which bubblewrap
    // replaces with the session's own.
    let shared = tempfile::Builder::new()
        .prefix("oab-runtime-verify-")
        .tempdir_in("/var/tmp")?;
    if local.sandbox != SandboxMode::None {
        let skills = shared.path().join("skills");
        std::fs::create_dir_all(&skills)?;
        std::fs::write(
            skills.join("SKILL.md"),
            "# shared skill\nread-only for every session\n",
        )?;
        let shown = skills.display().to_string();
        let mount = openab_runtime::config::ReadonlyMount::new(skills.clone(), shown.as_str())?;
        local.readonly.push(mount);
        options = options.with_shared_input(SharedInput::new(format!("{shown}/SKILL.md")));
    }
    eprintln!(
        "oab-runtime verify: building the {} runtime (sandbox {})...",
        settings.runtime.runtime, local.sandbox
    );
    let runtime = openab_runtime::from_config(&settings.runtime, &agent)?;
    let capabilities = runtime.capabilities();
    eprintln!("oab-runtime verify: isolation level {}", capabilities.isolation);
    if capabilities.isolation == IsolationLevel::None {
        eprintln!("oab-runtime verify: this runtime declares that it isolates nothing; expect leaks");
    } else if let Some(shared) = shared_network(&settings.runtime.local, capabilities.isolation) {
        eprintln!("oab-runtime verify: {shared}");
    }
    if capabilities.isolation == IsolationLevel::AccessControl {
        eprintln!("oab-runtime verify: {}", landlock_processes());
    }
    exit(suite(runtime, &options).await?)
}

/// Two sessions in worker Pods of the configured profile. The profile's agent must be the ACP
/// test agent (the e2e worker image ships it): its exec probe is the shell inside each Pod.
async fn kubernetes(settings: Settings, shared_input: Option<String>) -> Outcome {
    let kubernetes = settings
        .runtime
        .kubernetes
        .clone()
        .ok_or_else(|| Error::InvalidConfig {
            key: "session_runtime.kubernetes".into(),
            reason: "type = \"kubernetes\" needs a [session_runtime.kubernetes] table".into(),
        })?;
    let mut options = SuiteOptions::new(settings.runtime.installation.as_str());
    if let Some(path) = &shared_input {
        options = options.with_shared_input(SharedInput::new(path.as_str()));
    }
    eprintln!(
        "oab-runtime verify: the kubernetes runtime, namespace {}, profile {}, reach {} (the profile's agent must be acp-test-agent)",
        kubernetes.namespace, kubernetes.profile, kubernetes.reach
    );
    let runtime = openab_runtime::from_config(&settings.runtime, &bundled_test_agent()?)?;
    let passed = suite(runtime, &options).await?;
    if !passed {
        return exit(passed);
    }
    println!(
        "Proved: two sessions' worker Pods of profile {} cannot list, read, change or delete each other's workspace, HOME or git data from a shell inside either{}.\n\
         Not proved here: network isolation between Pods (the NetworkPolicy needs a CNI that enforces it), \
         isolation from the node's kernel (a runtimeClassName such as gVisor or Kata), or what another namespace's workloads can reach.",
        kubernetes.profile,
        if shared_input.is_some() { ", and that the shared input is readable and read-only in both" } else { "" }
    );
    exit(passed)
}

/// What sandboxed sessions share through the network, when they share the host's: `network =
/// "host"` chosen, or Landlock (isolation by access control), which has no network namespace to
/// give a session and applies `host` for an unset key.
fn shared_network(local: &openab_runtime::config::LocalConfig, isolation: IsolationLevel) -> Option<String> {
    let chosen = local.network == Some(NetworkMode::Host);
    let landlock = isolation == IsolationLevel::AccessControl && local.network.is_none();
    let why = match (chosen, landlock) {
        (true, _) => "chosen",
        (false, true) => "landlock gives a session no network namespace of its own",
        (false, false) => return None,
    };
    Some(format!(
        "network = \"host\" ({why}): the sessions share the host's network namespace, so every \
         loopback port one session's agent listens on is open to the other (step 8 probes it), and \
         so is every abstract UNIX socket unless landlock scopes them (Linux 6.12 or later, with the \
         oab-landlock-exec helper); leave network unset with bubblewrap for a network of each \
         session's own"
    ))
}

/// What a Landlock session's agent sees of other processes: Landlock restricts paths, not
/// processes, so only a private `/proc` (which needs a broker running as root) hides them.
fn landlock_processes() -> &'static str {
    if rustix::process::geteuid().is_root() {
        "landlock, broker running as root: each session's agent gets a /proc of its own \
         (hidepid=invisible, in a mount namespace of its own; needs util-linux unshare and mount, \
         else the runtime warns at startup): it sees only its own session user's processes, not \
         the broker's command line nor other sessions' processes"
    } else {
        "landlock, broker not running as root: no /proc of each session's own can be mounted, so \
         every session's agent can list the host's processes and read each one's command line \
         (the broker's and other sessions' agents' included; their files stay hidden); use \
         bubblewrap, or run the broker as root, to hide them"
    }
}

fn exit(passed: bool) -> Outcome {
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs the suite and prints its report; whether every probe was denied.
async fn suite(
    runtime: std::sync::Arc<dyn openab_runtime::SessionRuntime>,
    options: &SuiteOptions,
) -> Result<bool, Box<dyn std::error::Error>> {
    eprintln!(
        "oab-runtime verify: running the acceptance test: two sessions, sentinels, probes from each side..."
    );
    let started = std::time::Instant::now();
    let report = isolation_suite::run(runtime, options).await?;
    println!("{report}");
    eprintln!(
        "oab-runtime verify: finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(report.passed())
}
