//! `oab-egress-gateway`: the egress gateway of the Kubernetes runtime's worker Pods (see the
//! `gateway` module of the `egress-proxy` crate).
//!
//! A binary of its own rather than a subcommand of `oab-runtime`: it goes into a minimal image
//! of its own beside the workers, and holds none of the runtime backends (nor their clients of
//! the API server), so what a worker can reach through the network is this proxy only.
//!
//! ```text
//! oab-egress-gateway --key-file /etc/oab-gateway/key --profiles /etc/oab-gateway/profiles \
//!     [--secrets /etc/oab-gateway/secrets] [--listen 0.0.0.0:3128] [--metrics-listen 0.0.0.0:9090]
//! ```
//!
//! It serves until SIGTERM or SIGINT. Exit codes: 0 after a signal, 2 for bad arguments or
//! files (the message names the file and the key), 1 if it cannot listen.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use egress_proxy::gateway::{load_profiles, Gateway, GatewayKey};
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "oab-egress-gateway",
    about = "The egress gateway of the Kubernetes runtime's workers"
)]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "0.0.0.0:3128")]
    listen: SocketAddr,
    /// The file holding the key that proxy credentials are derived with (at least 32 bytes).
    #[arg(long)]
    key_file: PathBuf,
    /// The directory of worker profiles, `NAME.toml` each (their `egress_hosts` and
    /// `model_routes` are read).
    #[arg(long)]
    profiles: PathBuf,
    /// Where the model routes' Secrets are mounted: the credential of `secret = {name, key}`
    /// is the file `SECRETS/NAME/KEY`, read at each request.
    #[arg(long, default_value = egress_proxy::gateway::DEFAULT_SECRETS_DIR)]
    secrets: PathBuf,
    /// Where to serve /metrics (Prometheus text format), /healthz and /readyz, e.g.
    /// `0.0.0.0:9090`: a port of its own, which workers cannot reach (default: not served).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(false)
        .init();
    let args = Args::parse();
    let key = match GatewayKey::read(&args.key_file) {
        Ok(key) => key,
        Err(error) => {
            eprintln!("oab-egress-gateway: {error}");
            return ExitCode::from(2);
        }
    };
    let profiles = match load_profiles(&args.profiles) {
        Ok(profiles) => profiles,
        Err(error) => {
            eprintln!("oab-egress-gateway: {}: {error}", args.profiles.display());
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("oab-egress-gateway: starting: {error}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("oab-egress-gateway: listening on {}: {error}", args.listen);
                return ExitCode::from(1);
            }
        };
        let stop = CancellationToken::new();
        let readiness = ops_http::Readiness::new();
        if let Some(address) = args.metrics_listen {
            if let Err(error) = ops_http::start(address, readiness.clone(), stop.clone()).await {
                eprintln!("oab-egress-gateway: {error}");
                return ExitCode::from(1);
            }
        }
        let (Ok(mut terminate), Ok(mut interrupt)) =
            (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
        else {
            eprintln!("oab-egress-gateway: cannot handle signals");
            return ExitCode::from(1);
        };
        let routes: usize = profiles.values().map(|profile| profile.model_routes.len()).sum();
        tracing::info!(listen = %args.listen, profiles = profiles.len(), routes, "egress gateway serving");
        let gateway = Arc::new(Gateway::new(key, profiles, &args.secrets));
        let serving = tokio::spawn(gateway.serve(listener, stop.clone()));
        readiness.set(true);
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        stop.cancel();
        let _ = serving.await;
        tracing::info!("egress gateway stopped");
        ExitCode::SUCCESS
    })
}
