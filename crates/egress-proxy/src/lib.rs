//! The HTTP proxy between a session and the destinations its egress allowlist names.
//!
//! A session's agent reaches the network only through this proxy (the local runtime's
//! `network = "allowlist"` mode puts it behind each session's network namespace): `CONNECT
//! host:port` (a tunnel, for HTTPS) and absolute-form plain HTTP (`GET http://host:port/path`)
//! to a listed destination are connected; anything else is answered with a status and a reason
//! (`403` for a destination not listed) and logged as `egress refused` with the session, the
//! destination and the reason ([`SessionBounds::refuse`]).
//!
//! The HTTP is hyper's HTTP/1 server (and, for plain HTTP, its client): a request head is
//! parsed by hyper, bounded to [`bounds::MAX_HEAD`] bytes and [`bounds::HEAD_TIMEOUT`], and one
//! request is served per connection. A name is resolved once, and only the addresses of the
//! kind its entry allows ([`session_runtime::config::EgressTarget::reach`]) are connected to,
//! so a listed name cannot be pointed at a private, loopback, link-local or metadata address.
//!
//! Who a request comes from is an [`Admission`]'s to say: [`OneSession`] for a socket that only
//! one session reaches (the local runtime's), [`gateway::Gateway`] for the Kubernetes workers'
//! shared gateway, which reads each request's proxy credential.

use http::StatusCode;

pub mod accept;
pub mod allowlist;
pub mod bounds;
pub mod gateway;
mod proxy;
pub mod routes;
mod upstream;

pub use allowlist::Allowlist;
pub use bounds::{ConnectionSlot, LogSafe, SessionBounds};
pub use proxy::serve_connection;

/// Who a request to the proxy comes from: the session whose allowlist and bounds apply to it.
pub trait Admission: Send + Sync + 'static {
    /// The session `request` comes from and its place among the session's connections, or why
    /// it is not served (`407` for a missing or wrong
    /// credential, `503` over the session's limits).
    ///
    /// # Errors
    ///
    /// The [`Refusal`] to answer; the caller logs it through [`refused`](Self::refused).
    fn admit(&self, request: &http::Request<hyper::body::Incoming>) -> Result<Admitted, Refusal>;

    /// Counts and logs a refusal of a request that was not admitted (`reason` may hold
    /// client-chosen text: escape it, as [`SessionBounds::refuse`] does).
    fn refused(&self, reason: &str);
}

/// An admitted request's session: what it may reach and the bounds it is served within.
#[derive(Debug)]
pub struct Admitted {
    /// The destinations the session may reach.
    pub allowlist: std::sync::Arc<Allowlist>,
    /// The model route a request for the proxy's own paths is for (none for a proxied request).
    pub route: Option<std::sync::Arc<gateway::ServedRoute>>,
    /// The session's bounds and refusal log.
    pub bounds: std::sync::Arc<SessionBounds>,
    /// The request's place among the session's connections, held until it (or the tunnel it
    /// became) ends.
    pub slot: std::sync::Arc<ConnectionSlot>,
}

/// The admission of a proxy that serves one session only (its socket is the session's own):
/// every request is that session's, within the place the accept loop took for its connection.
#[derive(Debug)]
pub struct OneSession {
    allowlist: std::sync::Arc<Allowlist>,
    bounds: std::sync::Arc<SessionBounds>,
    slot: std::sync::Arc<ConnectionSlot>,
}

impl OneSession {
    /// Admits every request on a connection of the session whose `bounds` and `allowlist` are
    /// given, holding `slot` until the connection and any tunnel it became have ended.
    pub fn new(
        allowlist: std::sync::Arc<Allowlist>,
        bounds: std::sync::Arc<SessionBounds>,
        slot: ConnectionSlot,
    ) -> Self {
        OneSession {
            allowlist,
            bounds,
            slot: std::sync::Arc::new(slot),
        }
    }
}

impl Admission for OneSession {
    fn admit(&self, _request: &http::Request<hyper::body::Incoming>) -> Result<Admitted, Refusal> {
        Ok(Admitted {
            allowlist: std::sync::Arc::clone(&self.allowlist),
            route: None,
            bounds: std::sync::Arc::clone(&self.bounds),
            slot: std::sync::Arc::clone(&self.slot),
        })
    }

    fn refused(&self, reason: &str) {
        self.bounds.refuse(None, reason);
    }
}

/// Why the proxy does not serve a request: the status it answers, and why (the answer's body
/// and the log line's `reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The status answered.
    pub status: StatusCode,
    /// Why, in words.
    pub reason: String,
}

impl Refusal {
    pub(crate) fn new(status: StatusCode, reason: impl Into<String>) -> Self {
        Refusal {
            status,
            reason: reason.into(),
        }
    }

    pub(crate) fn bad_request(reason: impl Into<String>) -> Self {
        Refusal::new(StatusCode::BAD_REQUEST, reason)
    }

    pub(crate) fn forbidden(reason: impl Into<String>) -> Self {
        Refusal::new(StatusCode::FORBIDDEN, reason)
    }

    pub(crate) fn bad_gateway(reason: impl Into<String>) -> Self {
        Refusal::new(StatusCode::BAD_GATEWAY, reason)
    }
}
