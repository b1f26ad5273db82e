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

use http::StatusCode;

pub mod allowlist;
pub mod bounds;
mod proxy;

pub use allowlist::Allowlist;
pub use bounds::{ConnectionSlot, LogSafe, SessionBounds};
pub use proxy::serve_connection;

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
