//! The egress gateway: one proxy for the workers of many sessions (a Deployment beside the
//! Kubernetes runtime's worker Pods), which knows the session of each request by the proxy
//! credential the runtime derived for it, never by its source address alone.
//!
//! A worker is given only its own credential, in its proxy URL
//! (`http://SESSION.PROFILE:TOKEN@gateway:3128`): `TOKEN = HMAC-SHA256(gateway key, u8 len(SESSION)
//! ‖ SESSION ‖ u8 len(PROFILE) ‖ PROFILE)` in hex ([`GatewayKey::credential`]). The gateway holds
//! the key (not the broker's relay key: a gateway that leaks it opens no relay) and each
//! profile's allowlist, so a worker can name neither another session nor another profile's
//! destinations: either changes the token it would need.
//!
//! A profile's model routes ([`crate::routes`]) are served on the gateway's own paths: there the
//! same credential is the agent's API key ([`ProxyCredential::route_key`]), sent in the route's
//! credential header, and the gateway sends the route's Secret in its place.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use data_encoding::{BASE64, HEXLOWER};
use hmac::{Hmac, Mac};
use http::{header, Request, StatusCode};
use hyper::body::Incoming;
use parking_lot::Mutex;
use session_runtime::SessionId;
use sha2::Sha256;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use session_runtime::config::AddressKind;

use crate::accept::{accept_loop, Limits};
use crate::bounds::{self, SessionBounds};
use crate::routes::{check_routes, ModelRoute, Upstream};
use crate::{Admission, Admitted, Allowlist, LogSafe, Refusal};

/// Connections the gateway holds at once over all sessions (each session also has its own
/// [`bounds::MAX_CONNECTIONS`]): one more is answered `503` and closed.
pub const MAX_GATEWAY_CONNECTIONS: usize = 4096;
/// How long a session with no open connection keeps its bounds (its refusal log's state).
const IDLE_SESSION: Duration = Duration::from_secs(600);
/// Where the gateway's Pod mounts the Secrets of its model routes, one directory per Secret.
pub const DEFAULT_SECRETS_DIR: &str = "/etc/oab-gateway/secrets";

/// The gateway's secret for proxy credentials. Its `Debug` output never shows it.
#[derive(Clone)]
pub struct GatewayKey(Vec<u8>);

impl fmt::Debug for GatewayKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GatewayKey(<redacted>)")
    }
}

impl GatewayKey {
    /// The shortest key [`read`](Self::read) accepts, in bytes.
    pub const MIN_LEN: usize = 32;

    /// Wraps a secret key (use at least [`MIN_LEN`](Self::MIN_LEN) random bytes).
    pub fn new(key: impl Into<Vec<u8>>) -> Self {
        GatewayKey(key.into())
    }

    /// Reads the key from the file at `path`, which the gateway and the broker share.
    ///
    /// # Errors
    ///
    /// A message naming the file when it cannot be read or holds fewer than
    /// [`MIN_LEN`](Self::MIN_LEN) bytes.
    pub fn read(path: &std::path::Path) -> Result<Self, String> {
        match std::fs::read(path) {
            Ok(key) if key.len() >= Self::MIN_LEN => Ok(GatewayKey(key)),
            Ok(key) => Err(format!(
                "{} holds {} bytes; the key must be at least {}",
                path.display(),
                key.len(),
                Self::MIN_LEN
            )),
            Err(error) => Err(format!("cannot read {}: {error}", path.display())),
        }
    }

    /// The proxy credential of session `id` under worker profile `profile`.
    pub fn credential(&self, id: SessionId, profile: &str) -> ProxyCredential {
        ProxyCredential {
            user: format!("{id}.{profile}"),
            token: HEXLOWER.encode(&self.token(id, profile)),
        }
    }

    fn token(&self, id: SessionId, profile: &str) -> [u8; 32] {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC accepts keys of any length");
        // Length prefixes keep (session, profile) pairs unambiguous.
        for part in [id.as_ref(), profile] {
            mac.update(&[u8::try_from(part.len()).unwrap_or(u8::MAX)]);
            mac.update(part.as_bytes());
        }
        mac.finalize().into_bytes().into()
    }
}

/// A session's proxy credential: the user `SESSION.PROFILE` and its token. Its `Debug` output
/// never shows the token.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyCredential {
    user: String,
    token: String,
}

impl fmt::Debug for ProxyCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyCredential")
            .field("user", &self.user)
            .field("token", &"<redacted>")
            .finish()
    }
}

impl ProxyCredential {
    /// The proxy URL a worker is given: `http://USER:TOKEN@AUTHORITY` for the gateway at
    /// `authority` (`host:port`).
    pub fn proxy_url(&self, authority: &str) -> String {
        format!("http://{}:{}@{authority}", self.user, self.token)
    }

    /// The `Proxy-Authorization` header value a client sends for it.
    pub fn header_value(&self) -> String {
        format!("Basic {}", BASE64.encode(self.route_key().as_bytes()))
    }

    /// The API key an agent sends on the profile's model routes (`USER:TOKEN`): the gateway
    /// accepts it in place of the provider's key, and sends the provider's key instead.
    pub fn route_key(&self) -> String {
        format!("{}:{}", self.user, self.token)
    }
}

/// What a profile's sessions may reach through the gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProfileEgress {
    /// The destinations of its `egress_hosts`, for `CONNECT` and plain-HTTP proxying.
    pub allowlist: Allowlist,
    /// Its `model_routes`.
    pub model_routes: Vec<ModelRoute>,
}

/// A model route as the gateway serves it: its upstream parsed, its credential's file and
/// header known.
#[derive(Debug)]
pub struct ServedRoute {
    pub(crate) route: ModelRoute,
    /// Its upstream, or why it has none usable (a route not checked by [`check_routes`]
    /// refuses every request, never guesses).
    pub(crate) upstream: Result<Upstream, String>,
    pub(crate) header: http::HeaderName,
    pub(crate) secret_file: std::path::PathBuf,
}

impl ServedRoute {
    fn new(route: ModelRoute, secrets: &std::path::Path) -> Self {
        ServedRoute {
            upstream: Upstream::parse(&route.upstream),
            header: route.header_name(),
            secret_file: route.secret_file(secrets),
            route,
        }
    }
}

/// A profile as the gateway serves it.
#[derive(Debug)]
struct ServedProfile {
    allowlist: Arc<Allowlist>,
    routes: Vec<Arc<ServedRoute>>,
}

/// A session's bounds at the gateway, and when it last had a request.
#[derive(Debug)]
struct SessionEntry {
    bounds: Arc<SessionBounds>,
    used: Instant,
}

/// The profiles a gateway serves, replaced whole when they change.
#[derive(Debug)]
struct Served {
    profiles: HashMap<String, ServedProfile>,
    /// Every model route's credential header, where a route's request carries its key.
    route_headers: Vec<http::HeaderName>,
}

impl Served {
    fn new(profiles: HashMap<String, ProfileEgress>, secrets: &std::path::Path) -> Served {
        let mut route_headers: Vec<http::HeaderName> = Vec::new();
        let profiles = profiles
            .into_iter()
            .map(|(name, egress)| {
                let routes: Vec<Arc<ServedRoute>> = egress
                    .model_routes
                    .into_iter()
                    .map(|route| Arc::new(ServedRoute::new(route, secrets)))
                    .collect();
                for route in &routes {
                    if !route_headers.contains(&route.header) {
                        route_headers.push(route.header.clone());
                    }
                }
                let served = ServedProfile {
                    allowlist: Arc::new(egress.allowlist),
                    routes,
                };
                (name, served)
            })
            .collect();
        Served {
            profiles,
            route_headers,
        }
    }
}

/// The gateway's admission: the session of a request from its `Proxy-Authorization`.
#[derive(Debug)]
pub struct Gateway {
    key: GatewayKey,
    /// Where the model routes' credentials are read (`SECRETS/NAME/KEY`).
    secrets: std::path::PathBuf,
    /// Each request reads the profiles as they were when it arrived.
    served: parking_lot::RwLock<Arc<Served>>,
    sessions: Mutex<HashMap<SessionId, SessionEntry>>,
    /// Refusals of requests no session is known for: counted and logged at the same bounded
    /// rate as a session's, as session `-`.
    unknown: Arc<SessionBounds>,
}

impl Gateway {
    /// A gateway that verifies credentials with `key` and serves each profile of `profiles`
    /// (profile name to what it may reach), reading its model routes' credentials under
    /// `secrets` (`SECRETS/NAME/KEY`; [`DEFAULT_SECRETS_DIR`] in its Deployment).
    pub fn new(key: GatewayKey, profiles: HashMap<String, ProfileEgress>, secrets: &std::path::Path) -> Self {
        Gateway {
            key,
            secrets: secrets.to_owned(),
            served: parking_lot::RwLock::new(Arc::new(Served::new(profiles, secrets))),
            sessions: Mutex::new(HashMap::new()),
            unknown: SessionBounds::unattributed(),
        }
    }

    /// Serves `profiles` from now on, in place of those it served: a request admitted before
    /// keeps what it was admitted with; the next one sees the new profiles.
    pub fn replace_profiles(&self, profiles: HashMap<String, ProfileEgress>) {
        let served = Arc::new(Served::new(profiles, &self.secrets));
        *self.served.write() = served;
    }

    /// Accepts connections on `listener` until `stop`, serving each until it ends or `stop`,
    /// at most [`MAX_GATEWAY_CONNECTIONS`] at once.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, stop: CancellationToken) {
        let open = Arc::new(Semaphore::new(MAX_GATEWAY_CONNECTIONS));
        let limits = Limits {
            take: move || {
                Arc::clone(&open).try_acquire_owned().map_err(|_| {
                    format!("the gateway has {MAX_GATEWAY_CONNECTIONS} connections open, its limit")
                })
            },
            refused: {
                let gateway = Arc::clone(&self);
                move |reason: &str| gateway.refused(reason)
            },
            answer_http: true,
        };
        accept_loop(listener, stop, limits, move |stream, permit, stop| {
            let admission: Arc<dyn Admission> = Arc::clone(&self) as Arc<dyn Admission>;
            async move {
                let _permit = permit;
                crate::serve_connection(stream, admission, stop).await;
            }
        })
        .await;
    }

    /// The session `request`'s credential names, if its token is the one the key gives it: a
    /// proxied request's `Proxy-Authorization`, or, on a model route's path, the route key in
    /// a route's credential header.
    fn authenticate(&self, request: &Request<Incoming>) -> Result<(SessionId, String), Refusal> {
        let denied = |reason: &str| Refusal::new(StatusCode::PROXY_AUTHENTICATION_REQUIRED, reason);
        let credential = if let Some(value) = request.headers().get(header::PROXY_AUTHORIZATION) {
            let encoded = value
                .to_str()
                .ok()
                .and_then(|value| value.strip_prefix("Basic "))
                .ok_or_else(|| denied("a proxy credential that is not Basic"))?;
            BASE64
                .decode(encoded.trim().as_bytes())
                .ok()
                .and_then(|bytes| String::from_utf8(bytes).ok())
                .ok_or_else(|| denied("a proxy credential that is not base64 of user:token"))?
        } else if is_route_request(request) {
            let served = Arc::clone(&*self.served.read());
            served
                .route_headers
                .iter()
                .find_map(|name| route_key(name, request.headers().get(name)?))
                .ok_or_else(|| denied("no route key in the route's credential header"))?
        } else {
            return Err(denied("no proxy credential (Proxy-Authorization)"));
        };
        let (user, token) = credential
            .split_once(':')
            .ok_or_else(|| denied("a proxy credential without a token"))?;
        let (session, profile) = user
            .split_once('.')
            .ok_or_else(|| denied("a proxy credential whose user is not SESSION.PROFILE"))?;
        let id = SessionId::parse(session).map_err(|_| denied("a proxy credential naming no session"))?;
        let expected = HEXLOWER.encode(&self.key.token(id, profile));
        if !bool::from(expected.as_bytes().ct_eq(token.as_bytes())) {
            return Err(denied("a proxy credential whose token is not its session's"));
        }
        Ok((id, profile.to_owned()))
    }

    /// The bounds of session `id`, made on its first request; sessions idle for
    /// [`IDLE_SESSION`] with nothing open are forgotten meanwhile.
    fn bounds(&self, id: SessionId) -> Arc<SessionBounds> {
        let mut sessions = self.sessions.lock();
        let now = Instant::now();
        if let Some(entry) = sessions.get_mut(&id) {
            entry.used = now;
            return Arc::clone(&entry.bounds);
        }
        sessions.retain(|_, entry| {
            entry.bounds.open_connections() > 0 || now.duration_since(entry.used) < IDLE_SESSION
        });
        let bounds = SessionBounds::new(id);
        sessions.insert(
            id,
            SessionEntry {
                bounds: Arc::clone(&bounds),
                used: now,
            },
        );
        bounds
    }
}

impl Admission for Gateway {
    fn admit(&self, request: &Request<Incoming>) -> Result<Admitted, Refusal> {
        let (id, profile) = self.authenticate(request)?;
        let bounds = self.bounds(id);
        let profiles = Arc::clone(&*self.served.read());
        let Some(served) = profiles.profiles.get(&profile) else {
            let reason = format!("profile {profile} has no egress at this gateway");
            bounds.refuse(None, &reason);
            return Err(Refusal::forbidden(reason));
        };
        let route = if is_route_request(request) {
            let path = request.uri().path();
            let Some(route) = served
                .routes
                .iter()
                .find(|route| route.route.rest(path).is_some())
            else {
                let reason = format!("no model route of profile {profile} serves {}", LogSafe(path));
                bounds.refuse(None, &reason);
                return Err(Refusal::new(StatusCode::NOT_FOUND, reason));
            };
            Some(Arc::clone(route))
        } else {
            None
        };
        let Some(slot) = bounds.connection() else {
            let reason = format!(
                "the session has {} connections open through the gateway, its limit",
                bounds::MAX_CONNECTIONS
            );
            bounds.refuse(None, &reason);
            return Err(Refusal::new(StatusCode::SERVICE_UNAVAILABLE, reason));
        };
        Ok(Admitted {
            allowlist: Arc::clone(&served.allowlist),
            route,
            bounds,
            slot: Arc::new(slot),
        })
    }

    fn refused(&self, reason: &str) {
        self.unknown.refuse(None, reason);
    }
}

/// Whether `request` is for the gateway's own paths (a model route) rather than a proxied
/// destination: origin form (`POST /openai/v1/responses`), not `CONNECT`.
pub(crate) fn is_route_request(request: &Request<Incoming>) -> bool {
    request.method() != http::Method::CONNECT && request.uri().authority().is_none()
}

/// The route key in credential header `name`'s `value` (`Authorization` carries it as
/// `Bearer KEY`), if it looks like one.
fn route_key(name: &http::HeaderName, value: &http::HeaderValue) -> Option<String> {
    let value = value.to_str().ok()?;
    let key = if name == header::AUTHORIZATION {
        value.strip_prefix("Bearer ")?
    } else {
        value
    };
    key.contains(':').then(|| key.trim().to_owned())
}

/// Why a worker profile's `egress_hosts` or `model_routes` were refused: the key, and what is
/// wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct ProfilesError {
    /// The key, as the Kubernetes runtime names it (`profile/NAME.egress_hosts`,
    /// `profile/NAME.model_routes`).
    pub key: String,
    /// What is wrong.
    pub problem: String,
}

/// What worker profile `name` may reach: the `egress_hosts` and `model_routes` of its TOML
/// document (the ConfigMap's `profile.toml`, which the runtime validates as a whole; the gateway
/// reads these two keys and leaves the rest to it).
///
/// # Errors
///
/// [`ProfilesError`] when the document is not TOML, `egress_hosts` is not an array of
/// destinations [`EgressTarget::parse`](session_runtime::config::EgressTarget::parse) accepts,
/// each listed once and none of them loopback (the gateway's loopback is its own), or
/// `model_routes` are not routes [`check_routes`] accepts.
pub fn profile_egress(name: &str, document: &str) -> Result<ProfileEgress, ProfilesError> {
    let document: toml::Table = document.parse().map_err(|e: toml::de::Error| ProfilesError {
        key: format!("profile/{name}"),
        problem: e.to_string(),
    })?;
    profile_egress_of(name, document)
}

/// What worker profile `name` may reach, from its `OabProfile`'s `spec` (the same keys as the
/// TOML document [`profile_egress`] reads, as JSON).
///
/// # Errors
///
/// As [`profile_egress`]; key `profile/NAME` when `spec` is not an object of TOML-expressible
/// values.
pub fn profile_egress_from_spec(
    name: &str,
    spec: &impl serde::Serialize,
) -> Result<ProfileEgress, ProfilesError> {
    let document = toml::Table::try_from(spec).map_err(|e| ProfilesError {
        key: format!("profile/{name}"),
        problem: format!("not a profile's keys: {e}"),
    })?;
    profile_egress_of(name, document)
}

fn profile_egress_of(name: &str, mut document: toml::Table) -> Result<ProfileEgress, ProfilesError> {
    let error = |key: &str, problem: String| ProfilesError {
        key: format!("profile/{name}{key}"),
        problem,
    };
    let model_routes: Vec<ModelRoute> = match document.remove("model_routes") {
        None => Vec::new(),
        Some(value) => value
            .try_into()
            .map_err(|e: toml::de::Error| error(".model_routes", e.message().to_owned()))?,
    };
    check_routes(&model_routes).map_err(|e| error(".model_routes", e.to_string()))?;
    let Some(value) = document.get("egress_hosts") else {
        return Ok(ProfileEgress {
            allowlist: Allowlist::default(),
            model_routes,
        });
    };
    let toml::Value::Array(entries) = value else {
        return Err(error(
            ".egress_hosts",
            "must be an array of \"HOST:PORT\" strings".to_owned(),
        ));
    };
    let mut targets = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let entry_error = |problem: String| error(".egress_hosts", format!("entry {}: {problem}", index + 1));
        let toml::Value::String(entry) = entry else {
            return Err(entry_error("must be a \"HOST:PORT\" string".to_owned()));
        };
        let target =
            session_runtime::config::EgressTarget::parse(entry).map_err(|e| entry_error(e.to_string()))?;
        if targets.contains(&target) {
            return Err(entry_error(format!("{entry:?} is listed twice")));
        }
        if target.reach() == AddressKind::Loopback {
            return Err(entry_error(format!(
                "{entry:?} is a loopback destination, which at the gateway is the gateway's own"
            )));
        }
        targets.push(target);
    }
    Ok(ProfileEgress {
        allowlist: Allowlist::new(targets),
        model_routes,
    })
}

/// What the worker profiles in `dir` may reach: one file `NAME.toml` per profile (the
/// gateway's Deployment projects each profile ConfigMap's `profile.toml` there); other files
/// are ignored.
///
/// # Errors
///
/// [`ProfilesError`] for a file that cannot be read (key `profile/NAME`) or whose
/// keys are refused ([`profile_egress`]).
pub fn load_profiles(dir: &std::path::Path) -> Result<HashMap<String, ProfileEgress>, ProfilesError> {
    let unreadable = |key: String, problem: String| ProfilesError { key, problem };
    let entries = std::fs::read_dir(dir).map_err(|e| unreadable(dir.display().to_string(), e.to_string()))?;
    let mut profiles = HashMap::new();
    for entry in entries {
        let path = entry
            .map_err(|e| unreadable(dir.display().to_string(), e.to_string()))?
            .path();
        let (Some(name), Some("toml")) = (
            path.file_stem().and_then(|stem| stem.to_str()),
            path.extension().and_then(|extension| extension.to_str()),
        ) else {
            continue;
        };
        let document = std::fs::read_to_string(&path)
            .map_err(|e| unreadable(format!("profile/{name}"), e.to_string()))?;
        profiles.insert(name.to_owned(), profile_egress(name, &document)?);
    }
    Ok(profiles)
}
