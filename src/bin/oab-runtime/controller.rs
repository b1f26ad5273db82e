//! `oab-runtime controller`: the Kubernetes installation's reconciler, while it holds the
//! installation's leader Lease.

use std::time::Duration;

use crate::commands::Outcome;
use crate::settings::Settings;

/// How `controller` was asked to run.
// Read only by a build with the `kubernetes` feature.
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
#[derive(Debug)]
pub(crate) struct ControllerArgs {
    pub(crate) holder: Option<String>,
    pub(crate) resync: Duration,
    pub(crate) lease_duration: Duration,
    /// Where to serve the operational endpoints (ops-http), if anywhere.
    pub(crate) metrics_listen: Option<std::net::SocketAddr>,
}

#[cfg(feature = "kubernetes")]
pub(crate) async fn run(settings: Settings, args: ControllerArgs) -> Outcome {
    use std::process::ExitCode;
    use std::sync::Arc;

    use openab_runtime::config::RuntimeKind;
    use openab_runtime::{Error, KubernetesRuntime};
    use runtime_kubernetes::{kube, Controller, ControllerEvent, LeaderElection};

    if settings.runtime.runtime != RuntimeKind::Kubernetes {
        return Err(Box::new(Error::InvalidConfig {
            key: "session_runtime.type".into(),
            reason: "`oab-runtime controller` reconciles a Kubernetes installation: set type = \"kubernetes\" and a [session_runtime.kubernetes] table".into(),
        }));
    }
    // The endpoints first, so a probe sees the process alive (and not ready) while it connects.
    let readiness = ops_http::Readiness::new();
    let endpoints = ops_http::CancellationToken::new();
    if let Some(address) = args.metrics_listen {
        ops_http::start(address, readiness.clone(), endpoints.clone())
            .await
            .map_err(|reason| Error::InvalidConfig {
                key: "--metrics-listen".into(),
                reason,
            })?;
    }
    let config = kube::Config::infer().await.map_err(|error| {
        Error::backend(
            "kubernetes",
            false,
            "no Kubernetes client (KUBECONFIG, ~/.kube/config or an in-cluster service account)",
            error,
        )
    })?;
    let client = runtime_kubernetes::metered_client(config)
        .map_err(|error| Error::backend("kubernetes", false, "building the Kubernetes client", error))?;
    let runtime = KubernetesRuntime::builder_from_config(&settings.runtime)?
        .client(client.clone())
        .build()?;
    let namespace = settings
        .runtime
        .kubernetes
        .as_ref()
        .map(|k| k.namespace.clone())
        .unwrap_or_default();
    // A Deployment's Pod name is unique per replica; elsewhere host and pid are.
    let holder = args.holder.unwrap_or_else(default_holder);
    let election = LeaderElection::new(client, &namespace, &settings.runtime.installation, holder)
        .with_duration(args.lease_duration);
    eprintln!(
        "oab-runtime controller: installation {}, namespace {namespace}, Lease {} as {}",
        settings.runtime.installation,
        election.lease_name(),
        election.holder()
    );
    let stop = shutdown();
    let mut controller = Controller::new(Arc::new(runtime), election).resync(args.resync);
    let mut events = controller.subscribe();
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            match event {
                ControllerEvent::Leading(term) => eprintln!("leading (epoch {})", term.epoch),
                ControllerEvent::Following => eprintln!("lost the Lease; following"),
                ControllerEvent::Pass(report)
                    if !report.is_clean() || !report.orphaned_storage.is_empty() =>
                {
                    eprintln!("pass: {report:?}")
                }
                ControllerEvent::Session(id, report) => eprintln!("session {id}: {report:?}"),
                _ => {}
            }
        }
    });
    readiness.set(true);
    let ran = controller.run(stop).await;
    readiness.set(false);
    endpoints.cancel();
    ran?;
    eprintln!("oab-runtime controller: stopped, Lease released");
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "kubernetes"))]
pub(crate) async fn run(_settings: Settings, _args: ControllerArgs) -> Outcome {
    Err(Box::new(openab_runtime::Error::Unsupported {
        runtime: "kubernetes",
        operation: "controller (this oab-runtime was built without the `kubernetes` feature: cargo build --release --features kubernetes --bin oab-runtime)",
    }))
}

#[cfg(feature = "kubernetes")]
fn default_holder() -> String {
    let host = std::env::var("POD_NAME")
        .or_else(|_| std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()))
        .unwrap_or_else(|_| "oab-runtime".to_owned());
    format!("{host}-{}", std::process::id())
}

/// Resolves at SIGTERM (a Pod's stop), SIGINT or SIGHUP. The handlers are installed when this is
/// called, not when the future is first polled: a signal that arrives while the controller takes
/// the Lease must stop it cleanly, not kill it with the Lease still held.
#[cfg(feature = "kubernetes")]
fn shutdown() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut streams = Vec::new();
    for kind in [
        SignalKind::terminate(),
        SignalKind::interrupt(),
        SignalKind::hangup(),
    ] {
        match signal(kind) {
            Ok(stream) => streams.push(stream),
            Err(error) => eprintln!("oab-runtime controller: cannot handle a signal: {error}"),
        }
    }
    async move {
        if streams.is_empty() {
            // No signal can stop it: it runs until it is killed.
            return std::future::pending().await;
        }
        let waits = streams.iter_mut().map(|s| Box::pin(s.recv()));
        futures_util::future::select_all(waits).await;
    }
}
