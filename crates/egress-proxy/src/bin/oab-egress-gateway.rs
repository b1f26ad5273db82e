//! `oab-egress-gateway`: the egress gateway of the Kubernetes runtime's worker Pods (see the
//! `gateway` module of the `egress-proxy` crate).
//!
//! A binary of its own rather than a subcommand of `oab-runtime`: it goes into a minimal image
//! of its own beside the workers, and holds none of the runtime backends, so what a worker can
//! reach through the network is this proxy only. Its one client of the API server reads the
//! worker profiles (`--profiles-from`, with a token that may only get, list and watch
//! OabProfiles): the administrator's objects are the one source of what each profile may reach.
//!
//! ```text
//! oab-egress-gateway --key-file /etc/oab-gateway/key --profiles-from openab-sessions \
//!     [--secrets /etc/oab-gateway/secrets] [--listen 0.0.0.0:3128] [--metrics-listen 0.0.0.0:9090]
//! oab-egress-gateway --key-file KEY --profiles DIR ...   (profiles as NAME.toml files)
//! ```
//!
//! It serves until SIGTERM or SIGINT. Exit codes: 0 after a signal, 2 for bad arguments or
//! files (the message names the file and the key), 1 if it cannot listen.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use egress_proxy::gateway::{load_profiles, profile_egress_from_spec, Gateway, GatewayKey};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
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
    /// `model_routes` are read), read once at start.
    #[arg(
        long,
        conflicts_with = "profiles_from",
        required_unless_present = "profiles_from"
    )]
    profiles: Option<PathBuf>,
    /// The namespace whose OabProfiles are the worker profiles (the sessions namespace), read
    /// from the API server with the Pod's token and followed as they change.
    #[arg(long)]
    profiles_from: Option<String>,
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
    let profiles = match &args.profiles {
        Some(dir) => match load_profiles(dir) {
            Ok(profiles) => profiles,
            Err(error) => {
                eprintln!("oab-egress-gateway: {}: {error}", dir.display());
                return ExitCode::from(2);
            }
        },
        // Filled from the API server before the gateway reports ready.
        None => Default::default(),
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
        let serving = tokio::spawn(Arc::clone(&gateway).serve(listener, stop.clone()));
        let following = match args.profiles_from {
            Some(namespace) => {
                let client = match kube::Client::try_default().await {
                    Ok(client) => client,
                    Err(error) => {
                        eprintln!(
                            "oab-egress-gateway: no client of the API server for --profiles-from: {error}"
                        );
                        stop.cancel();
                        return ExitCode::from(1);
                    }
                };
                Some(tokio::spawn(follow_profiles(
                    client,
                    namespace,
                    gateway,
                    readiness.clone(),
                )))
            }
            None => {
                readiness.set(true);
                None
            }
        };
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        if let Some(following) = following {
            following.abort();
        }
        stop.cancel();
        let _ = serving.await;
        tracing::info!("egress gateway stopped");
        ExitCode::SUCCESS
    })
}

/// Serves the OabProfiles of `namespace` as they are: the first list, then every change (a
/// watch, resumed with backoff when it breaks), each replacing the gateway's profiles whole. The
/// gateway reports ready once the first list is in. A profile whose `egress_hosts` or
/// `model_routes` are refused is left out (its sessions reach nothing) and logged with the key.
async fn follow_profiles(
    client: kube::Client,
    namespace: String,
    gateway: Arc<Gateway>,
    readiness: ops_http::Readiness,
) {
    use futures_util::StreamExt;
    use kube::runtime::{watcher, WatchStreamExt};
    use session_runtime::config::profile_resource;

    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            profile_resource::GROUP,
            profile_resource::VERSION,
            profile_resource::KIND,
        ),
        profile_resource::PLURAL,
    );
    let api: kube::Api<DynamicObject> = kube::Api::namespaced_with(client, &namespace, &resource);
    let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
    let mut profiles: HashMap<String, DynamicObject> = HashMap::new();
    // The objects of a list in progress (the first, or a relist after a broken watch).
    let mut listing: Option<HashMap<String, DynamicObject>> = None;
    while let Some(event) = events.next().await {
        match event {
            Err(error) => {
                tracing::warn!(namespace, %error, "watching OabProfiles; retrying");
                continue;
            }
            Ok(watcher::Event::Init) => listing = Some(Default::default()),
            Ok(watcher::Event::InitApply(object)) => {
                if let Some(listed) = listing.as_mut() {
                    listed.insert(object.metadata.name.clone().unwrap_or_default(), object);
                }
            }
            Ok(watcher::Event::InitDone) => {
                profiles = listing.take().unwrap_or_default();
            }
            Ok(watcher::Event::Apply(object)) => {
                profiles.insert(object.metadata.name.clone().unwrap_or_default(), object);
            }
            Ok(watcher::Event::Delete(object)) => {
                profiles.remove(object.metadata.name.as_deref().unwrap_or_default());
            }
        }
        if listing.is_some() {
            continue;
        }
        let mut served = HashMap::new();
        for (name, object) in &profiles {
            let spec = object.data.get("spec").cloned().unwrap_or_default();
            match profile_egress_from_spec(name, &spec) {
                Ok(egress) => {
                    served.insert(name.clone(), egress);
                }
                Err(error) => {
                    tracing::warn!(key = %error.key, problem = %error.problem, "profile refused; its sessions reach nothing")
                }
            }
        }
        let routes: usize = served.values().map(|profile| profile.model_routes.len()).sum();
        tracing::info!(namespace, profiles = served.len(), routes, "serving the profiles");
        gateway.replace_profiles(served);
        readiness.set(true);
    }
}
