//! `network = "allowlist"`: the proxy a session's only way out of its network namespace leads to.
//!
//! A session of this mode runs in a network namespace of its own (bubblewrap `--unshare-net`),
//! which has nothing but loopback. Inside it, the `oab-egress-forward` helper listens on
//! loopback and forwards each connection to a Unix socket in the session's directory
//! ([`SessionDirs::egress`](crate::layout::SessionDirs::egress)), bound into the sandbox. Behind
//! the sockets, this module runs, per worker:
//!
//! - the **HTTP proxy** (at `127.0.0.1:3128` inside, or the next port no forward takes; named by the agent's `HTTPS_PROXY` and
//!   `HTTP_PROXY`): `CONNECT host:port` and plain `GET http://host:port/...` requests to a listed
//!   destination are connected; anything else is answered `403` and logged with the session id;
//! - one **forward** per listed loopback destination: `127.0.0.1:8080` inside the session is
//!   `127.0.0.1:8080` of the host, and only the listed ports are (any other loopback port inside
//!   is the session's own, empty loopback).
//!
//! The sockets of one session are reachable only from its own sandbox (the session's directory
//! is private to the broker and the session's user), so one session's allowlist opens nothing
//! for another. The proxy ends with its worker ([`EgressProxy`] is dropped).
//!
//! The HTTP proxy is the [`egress_proxy`] crate's: it runs in the broker's process, so each
//! session's use of it is bounded ([`egress_proxy::bounds`]): connections, request-head bytes
//! and time, memory; its refusals are counted and logged at a bounded rate, with every
//! agent-chosen value escaped. A name is resolved once, and only the addresses of the kind its
//! entry allows ([`EgressTarget::reach`]) are connected to.
//!
//! It stays in the broker's process rather than a helper per session: the bounds make one
//! session's share of it small and fixed (about 2 MiB and [`bounds::MAX_CONNECTIONS`]
//! descriptors), while a helper per session would cost a process per session and a second
//! hop for every byte.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use egress_proxy::accept::{accept_loop, Limits};
use egress_proxy::bounds;
use egress_proxy::{Allowlist, ConnectionSlot, OneSession, SessionBounds};
use session_runtime::config::EgressTarget;
use session_runtime::{Error, SessionId};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::sandbox::EgressLaunch;

/// The first port tried for the proxy inside a session (the conventional proxy port); the
/// next free one is used if a loopback forward takes it.
const FIRST_PROXY_PORT: u16 = 3128;
/// The proxy's socket file in the session's egress directory.
pub(crate) const PROXY_SOCKET: &str = "proxy.sock";
/// What `NO_PROXY` says: loopback is reached directly (the forwards listen there).
const NO_PROXY: &str = "localhost,127.0.0.1,::1";

/// The `oab-egress-forward` helper's file name.
pub(crate) const FORWARDER_NAME: &str = "oab-egress-forward";
/// The environment variable that names the helper explicitly.
pub(crate) const FORWARDER_ENV: &str = "OAB_EGRESS_FORWARD";

/// What a session of `network = "allowlist"` may reach, and where it finds it inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EgressPlan {
    /// The configured destinations.
    allowlist: Arc<Allowlist>,
    /// Where the HTTP proxy listens inside the session.
    proxy: SocketAddr,
    /// The listed loopback destinations: each is the same address inside and on the host.
    forwards: Vec<SocketAddr>,
}

impl EgressPlan {
    /// The plan for `targets` (checked by the configuration: no duplicates, valid ports).
    pub(crate) fn new(targets: &[EgressTarget]) -> Self {
        let mut forwards: Vec<SocketAddr> = Vec::new();
        for target in targets {
            if let Some(ip) = target.loopback_ip() {
                let address = SocketAddr::new(ip, target.port());
                if !forwards.contains(&address) {
                    forwards.push(address);
                }
            }
        }
        let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let port = (FIRST_PROXY_PORT..=u16::MAX)
            .find(|port| !forwards.contains(&SocketAddr::new(localhost, *port)))
            .unwrap_or(FIRST_PROXY_PORT);
        EgressPlan {
            allowlist: Arc::new(Allowlist::new(targets.to_vec())),
            proxy: SocketAddr::new(localhost, port),
            forwards,
        }
    }

    /// The variables the agent gets: `HTTPS_PROXY`, `HTTP_PROXY` (and their lower-case forms,
    /// which some clients read instead) naming the proxy, and `NO_PROXY` for loopback.
    pub(crate) fn environment(&self) -> Vec<(String, String)> {
        let proxy = format!("http://{}", self.proxy);
        let mut env = Vec::new();
        for name in ["HTTPS_PROXY", "HTTP_PROXY"] {
            env.push((name.to_owned(), proxy.clone()));
            env.push((name.to_ascii_lowercase(), proxy.clone()));
        }
        env.push(("NO_PROXY".to_owned(), NO_PROXY.to_owned()));
        env.push(("no_proxy".to_owned(), NO_PROXY.to_owned()));
        env
    }

    /// How the sandbox starts the forwarder at `forwarder` for a session whose proxy sockets are
    /// in `socket_dir`.
    pub(crate) fn launch(&self, forwarder: &Path, socket_dir: &Path) -> EgressLaunch {
        let mut listens = vec![(self.proxy, PROXY_SOCKET.to_owned())];
        listens.extend(
            self.forwards
                .iter()
                .enumerate()
                .map(|(index, address)| (*address, forward_socket(index))),
        );
        EgressLaunch {
            forwarder: forwarder.to_path_buf(),
            socket_dir: socket_dir.to_path_buf(),
            listens,
        }
    }
}

/// The socket file of the `index`th loopback forward.
fn forward_socket(index: usize) -> String {
    format!("fwd-{index}.sock")
}

/// The proxy of one worker: its sockets listen until it is dropped, which stops every
/// connection through it and removes the sockets.
#[derive(Debug)]
pub(crate) struct EgressProxy {
    stop: CancellationToken,
    sockets: Vec<PathBuf>,
    bounds: Arc<SessionBounds>,
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        for socket in &self.sockets {
            let _ = std::fs::remove_file(socket);
        }
    }
}

impl EgressProxy {
    /// Listens on the sockets of `plan` in `socket_dir` (created if needed) for session `id`,
    /// whose agent runs as `uid` (the sockets are made its own) or as the broker's user. Must
    /// be called within a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Backend`] if the directory or a socket cannot be made (e.g. a path longer than
    /// a Unix socket address allows: choose a shorter `root`).
    pub(crate) fn start(
        id: SessionId,
        plan: &Arc<EgressPlan>,
        socket_dir: &Path,
        uid: Option<u32>,
    ) -> Result<Self, Error> {
        let failed = |what: String, e: std::io::Error| crate::backend_error(false, what, e);
        std::fs::create_dir_all(socket_dir)
            .map_err(|e| failed(format!("creating {}", socket_dir.display()), e))?;
        // Passable (not listable) for the session's user, whose sandbox binds it.
        std::fs::set_permissions(socket_dir, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| failed(format!("securing {}", socket_dir.display()), e))?;
        let mut proxy = EgressProxy {
            stop: CancellationToken::new(),
            sockets: Vec::new(),
            bounds: SessionBounds::new(id),
        };
        let bind = |proxy: &mut EgressProxy, name: &str| -> Result<UnixListener, Error> {
            let path = socket_dir.join(name);
            // A socket left by an earlier worker of the session.
            let _ = std::fs::remove_file(&path);
            let listener = UnixListener::bind(&path)
                .map_err(|e| failed(format!("listening on {}", path.display()), e))?;
            proxy.sockets.push(path.clone());
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| failed(format!("securing {}", path.display()), e))?;
            if let Some(uid) = uid {
                std::os::unix::fs::chown(&path, Some(uid), Some(uid))
                    .map_err(|e| failed(format!("handing {} to uid {uid}", path.display()), e))?;
            }
            Ok(listener)
        };
        let listener = bind(&mut proxy, PROXY_SOCKET)?;
        tokio::spawn(serve(
            listener,
            proxy.stop.clone(),
            Arc::clone(&proxy.bounds),
            true,
            {
                let allowlist = Arc::clone(&plan.allowlist);
                let bounds = Arc::clone(&proxy.bounds);
                move |stream, slot, stop| {
                    let admission = OneSession::new(Arc::clone(&allowlist), Arc::clone(&bounds), slot);
                    egress_proxy::serve_connection(stream, Arc::new(admission), stop)
                }
            },
        ));
        for (index, address) in plan.forwards.iter().enumerate() {
            let listener = bind(&mut proxy, &forward_socket(index))?;
            let address = *address;
            let bounds = Arc::clone(&proxy.bounds);
            tokio::spawn(serve(
                listener,
                proxy.stop.clone(),
                Arc::clone(&proxy.bounds),
                false,
                move |stream, slot, stop| forward(Arc::clone(&bounds), address, stream, slot, stop),
            ));
        }
        Ok(proxy)
    }

    /// How many connections and requests the proxy has refused (for tests).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn refused(&self) -> u64 {
        self.bounds.refused()
    }

    /// How many connections the proxy holds now (for tests).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn open_connections(&self) -> usize {
        self.bounds.open_connections()
    }
}

/// Accepts connections on `listener` until `stop`, handing each to `handle` with its place
/// among the session's connections, within the session's `bounds` (a connection beyond them is
/// answered `503` first when `http`).
async fn serve<F, Fut>(
    listener: UnixListener,
    stop: CancellationToken,
    bounds: Arc<SessionBounds>,
    http: bool,
    handle: F,
) where
    F: Fn(UnixStream, ConnectionSlot, CancellationToken) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let limits = Limits {
        take: {
            let bounds = Arc::clone(&bounds);
            move || {
                bounds.connection().ok_or_else(|| {
                    format!(
                        "the session has {} connections open through its proxy, its limit",
                        bounds::MAX_CONNECTIONS
                    )
                })
            }
        },
        refused: move |reason: &str| bounds.refuse(None, reason),
        answer_http: http,
    };
    accept_loop(listener, stop, limits, handle).await;
}

/// Joins a connection of the session's to the listed loopback destination `address` on the
/// host, holding its `slot` until it ends or `stop`.
async fn forward(
    bounds: Arc<SessionBounds>,
    address: SocketAddr,
    mut inside: UnixStream,
    slot: ConnectionSlot,
    stop: CancellationToken,
) {
    let _slot = slot;
    let connected = tokio::select! {
        () = stop.cancelled() => return,
        connected = TcpStream::connect(address) => connected,
    };
    match connected {
        Ok(mut outside) => {
            tokio::select! {
                () = stop.cancelled() => {}
                _ = tokio::io::copy_bidirectional(&mut inside, &mut outside) => {}
            }
        }
        Err(error) => {
            bounds.note(
                &address.to_string(),
                &format!("forward could not connect: {error}"),
            );
        }
    }
}
