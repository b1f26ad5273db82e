//! `RelayLauncher`: starts each worker of a `FakeRuntime` as a real `oab-relay serve --
//! acp-test-agent` process and attaches through [`RelayClient`] over loopback TCP, so the
//! conformance suite runs with the relay in the path. Records and lifecycle are the fake's.

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use session_runtime::testing::{FakeRuntime, LaunchRequest, WorkerLauncher};
use session_runtime::{Attachment, Error, Fence, Result};
use worker_relay::{ClientConfig, RelayClient};

use super::{key, RelayOptions, RelayProcess};

/// How long a relay may take to exit once its agent ended, before it is killed.
const RELAY_EXIT_WAIT: Duration = Duration::from_secs(10);

/// Starts workers behind the relay.
#[derive(Debug)]
pub struct RelayLauncher {
    agent: PathBuf,
    epoch: u64,
}

impl RelayLauncher {
    /// A launcher running the workspace's ACP test agent behind `oab-relay`.
    pub fn new() -> Self {
        Self {
            agent: super::acp_test_agent(),
            epoch: 1,
        }
    }
}

/// A fake runtime for `installation` whose workers run behind the relay.
pub fn relay_runtime(installation: &str) -> FakeRuntime {
    FakeRuntime::builder()
        .installation(installation)
        .launcher(RelayLauncher::new())
        .build()
        .expect("runtime")
}

#[async_trait]
impl WorkerLauncher for RelayLauncher {
    async fn launch(&self, request: LaunchRequest, fence: Fence) -> Result<Attachment> {
        let (id, generation) = (request.id, request.generation);
        std::fs::create_dir_all(&request.state_dir)
            .map_err(|e| Error::backend("relay-test", true, "agent state dir", e))?;
        let relay = RelayProcess::start(
            id,
            &[
                self.agent.clone().into(),
                "--exec-dir".into(),
                request.workspace.clone().into(),
                "--state-dir".into(),
                request.state_dir.into(),
            ],
            RelayOptions {
                generation,
                workdir: Some(request.workspace),
                ..RelayOptions::default()
            },
        )
        .await;
        let config = ClientConfig::with_key(id, generation, self.epoch, &key())
            .heartbeat(Duration::from_secs(5))
            .backoff(Duration::from_millis(10), Duration::from_millis(200))
            .give_up_after(Duration::from_secs(10));
        let attachment = RelayClient::new(config, relay.connector()).attach(fence).await?;
        // The relay ends with its agent; reap it then (or kill a relay that lingers).
        let control = attachment.control();
        let mut child = relay.child;
        tokio::spawn(async move {
            let _ = control.wait().await;
            if tokio::time::timeout(RELAY_EXIT_WAIT, child.wait()).await.is_err() {
                let _ = child.kill().await;
            }
        });
        Ok(attachment)
    }
}
