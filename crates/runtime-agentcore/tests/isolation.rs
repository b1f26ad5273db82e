//! The RFC's isolation acceptance test between two AgentCore sessions, against the emulator:
//! sentinel files in A's session storage and HOME and a local-only git ref, probed from a shell
//! inside B's worker (and the reverse), and writes to a read-only input both share refused.
//!
//! The emulator stands a bubblewrap sandbox in for the microVM, so this proves the backend keeps
//! sessions apart end to end (distinct runtime session ids, storage, workers, tokens), not
//! AgentCore's own isolation, which only a live account can show.

mod common;

use isolation_suite::{SharedInput, SuiteOptions};
use session_runtime::IsolationLevel;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agentcore_sessions_cannot_touch_each_other() {
    // Read-only inputs baked into the worker image stand for skills every session shares. Under
    // /var/tmp: the sandbox gives every worker a private /tmp.
    let skills = tempfile::Builder::new()
        .prefix("oab-agentcore-skills-")
        .tempdir_in("/var/tmp")
        .expect("a skills directory");
    let skill = skills.path().join("SKILL.md");
    std::fs::write(&skill, "# A shared skill\nRead-only for every session.\n").expect("a skill");
    let input = skills.path().to_owned();
    let harness = common::start_with(move |mut setup| {
        setup.worker = setup.worker.input(&input);
        setup
    })
    .await;
    let sandbox = harness.emulator.sandbox();
    assert_eq!(
        sandbox.isolation,
        IsolationLevel::Namespaces,
        "the emulator must sandbox its workers (install bubblewrap): it reports {sandbox}"
    );
    let options = SuiteOptions::new(common::INSTALLATION)
        .with_shared_input(SharedInput::new(skill.to_string_lossy()))
        .without_channel_probes(
            "the emulator runs each microVM as a local sandbox on the host's network, so that it \
             can reach the worker's relay; a real AgentCore microVM has a network of its own",
        );
    let report = isolation_suite::run(
        std::sync::Arc::clone(&harness.runtime) as std::sync::Arc<_>,
        &options,
    )
    .await
    .expect("the suite runs");
    println!("{report}");
    let skipped: Vec<u8> = report.skipped.iter().map(|s| s.step).collect();
    assert_eq!(
        skipped,
        [8],
        "every step but the network's runs: {:?}",
        report.skipped
    );
    let problems: Vec<_> = report.problems().collect();
    assert!(
        report.passed(),
        "isolation must hold between sessions: {problems:#?}"
    );
    harness.emulator.shutdown().await.expect("the emulator stops");
}
