//! Session overlays in the shared runtime: the conformance suite's overlay behaviours with a host
//! directory the configuration allows, and the overlay's variables winning over the agent's
//! configured ones.
#![cfg(unix)]

use std::sync::Arc;

use runtime_shared::SharedRuntime;
use session_runtime::conformance::{self, Target, Verdict};
use session_runtime::testing::{acp_test_agent_binary, AcpClient};
use session_runtime::{AgentCommand, CreateOptions, SessionIdentity, SessionOverlay, SessionRuntime};

fn test_agent() -> AgentCommand {
    AgentCommand::new(
        acp_test_agent_binary()
            .expect("acp-test-agent")
            .display()
            .to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlays_pass_the_conformance_behaviours_in_an_allowed_host_directory() {
    let agent_dir = tempfile::tempdir().expect("agent working directory");
    let allowed = tempfile::tempdir().expect("allowed directory");
    let runtime = SharedRuntime::builder(test_agent().working_dir(agent_dir.path()))
        .installation("conformance")
        .allow_working_dir(allowed.path())
        .build()
        .expect("shared runtime");
    let target = Target::new(Arc::new(runtime), "conformance").with_overlay_host_dir(allowed.path());
    assert_eq!(
        conformance::overlay_is_applied_at_every_attach(&target).await,
        Verdict::Passed
    );
    assert_eq!(
        conformance::invalid_overlays_are_rejected(&target).await,
        Verdict::Passed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_only_the_agents_working_directory_and_beneath_are_allowed() {
    let agent_dir = tempfile::tempdir().expect("agent working directory");
    let elsewhere = tempfile::tempdir().expect("a directory outside");
    std::fs::create_dir(agent_dir.path().join("project")).expect("project directory");
    let runtime = SharedRuntime::builder(test_agent().working_dir(agent_dir.path()))
        .build()
        .expect("shared runtime");
    let identity = SessionIdentity::new("openab", "default", "discord", "1").expect("identity");
    let outside = CreateOptions::new().with_overlay(SessionOverlay::new().working_dir(elsewhere.path()));
    assert!(
        matches!(
            runtime.create(&identity, &outside).await,
            Err(session_runtime::Error::InvalidOverlay { .. })
        ),
        "a directory outside [agent].working_dir is refused by default"
    );
    let inside = CreateOptions::new().with_overlay(
        SessionOverlay::new()
            .working_dir(agent_dir.path().join("project"))
            .env("OAB_SAME", "from-the-overlay"),
    );
    runtime.create(&identity, &inside).await.expect("create inside");
    let client = AcpClient::new(runtime.attach(&identity.id()).await.expect("attach"));
    let probe = client.exec("printf '%s' \"$OAB_SAME\"").await.expect("probe");
    assert_eq!(probe.stdout, "from-the-overlay");
    drop(client);
    runtime
        .close(&identity.id(), session_runtime::CloseReason::Ended)
        .await
        .expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overlay_wins_over_the_agents_configured_environment() {
    let agent_dir = tempfile::tempdir().expect("agent working directory");
    let runtime = SharedRuntime::builder(
        test_agent()
            .working_dir(agent_dir.path())
            .env("OAB_SAME", "configured"),
    )
    .build()
    .expect("shared runtime");
    let identity = SessionIdentity::new("openab", "default", "discord", "2").expect("identity");
    let options = CreateOptions::new().with_overlay(SessionOverlay::new().env("OAB_SAME", "overlay"));
    runtime.create(&identity, &options).await.expect("create");
    let client = AcpClient::new(runtime.attach(&identity.id()).await.expect("attach"));
    let probe = client.exec("printf '%s' \"$OAB_SAME\"").await.expect("probe");
    assert_eq!(probe.stdout, "overlay");
    drop(client);
    runtime
        .close(&identity.id(), session_runtime::CloseReason::Ended)
        .await
        .expect("close");
}
