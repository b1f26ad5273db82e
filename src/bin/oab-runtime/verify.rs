//! `oab-runtime verify`: the isolation acceptance suite against the configured runtime.

use std::path::PathBuf;
use std::process::ExitCode;

use isolation_suite::{SharedInput, SuiteOptions};
use openab_runtime::config::SandboxMode;
use openab_runtime::IsolationLevel;

use crate::commands::{bundled_test_agent, Outcome};
use crate::settings::Settings;

pub(crate) async fn run(mut settings: Settings, root: Option<PathBuf>) -> Outcome {
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
    // cannot mount one, so it has none.
    if local.sandbox != SandboxMode::None {
        let skills = scratch.path().join("skills");
        std::fs::create_dir_all(&skills)?;
        std::fs::write(
            skills.join("SKILL.md"),
            "# shared skill\nread-only for every session\n",
        )?;
        let mount = openab_runtime::config::ReadonlyMount::new(skills, "/opt/openab-verify/skills")?;
        local.readonly.push(mount);
        options = options.with_shared_input(SharedInput::new("/opt/openab-verify/skills/SKILL.md"));
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
    }
    eprintln!(
        "oab-runtime verify: running the acceptance test: two sessions, sentinels, probes from each side..."
    );
    let started = std::time::Instant::now();
    let report = isolation_suite::run(runtime, &options).await?;
    println!("{report}");
    eprintln!(
        "oab-runtime verify: finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
